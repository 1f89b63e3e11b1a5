"""The one entry to every benchmark: ``python3 dev.py bench [NAME] [ARGS]``.

    python3 dev.py bench --quick             # the flow vs chord vs group bench (bench.py)
    python3 dev.py bench peers --rounds 5    # a benchmark by name, with its own ARGS
    python3 dev.py bench NAME --help         # its options
    python3 dev.py bench --list              # every name, with what it measures

dev.py runs this file (``python benchmarks ...``) in the venv it makes. A name runs its
script in a process of its own, with this directory and the repository on PYTHONPATH (the
scripts import ``measure``, ``modes`` and ``bench_app`` from here, some ``tests`` from the
repository, and their workers inherit both). A new benchmark is a script with a ``main`` and a
line in BENCHMARKS, and a page that cites its command (tests/test_benchmarks.py checks both).
"""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT = "bench.py"  # what `dev.py bench` runs without a name, or with options first
# name -> script, relative to this directory; what each measures is its docstring's opening.
BENCHMARKS = {
    "peers": "peers/runner.py",
    "script-cost": "script_cost.py",
    "script-profile": "script_profile.py",
    "round-trip": "round_trip.py",
    "large": "large.py",
    "window": "window.py",
    "reduce": "reduce.py",
    "ha": "ha.py",
    "tracing-cost": "tracing_cost.py",
    "trace-picture": "trace_picture.py",
    "deadline-lateness": "deadline_lateness.py",
    "list": "list.py",
    "flow-pages": "flow_pages.py",
    "dashboard": "dashboard.py",
    "evidence": "evidence.py",
    "quorum-ten": "quorum_ten.py",
    "flow-path": "flow_path.py",
    "celery-canvas": "celery_canvas.py",
    "chord-cost": "chord_cost.py",
    "loop-times": "loop_times.py",
    "batch-size": "batch_size.py",
}


def summary(script: str) -> str:
    """What the script's docstring says first (to its first colon or full stop), read
    without importing it."""
    doc = ast.get_docstring(ast.parse((HERE / script).read_text(encoding="utf-8"))) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    said = re.split(r"[.:](?:\s|$)", first)[0]
    return said if len(said) <= 90 else said[:87] + "..."


def listing() -> str:
    rows = [("(no name)", DEFAULT), *BENCHMARKS.items()]
    width = max(len(name) for name, _ in rows) + 2
    lines = ["python3 dev.py bench [NAME] [ARGS]; NAME --help gives its options", ""]
    lines += [f"  {name:<{width}}{summary(script)}" for name, script in rows]
    return "\n".join(lines)


def command(argv: list[str]) -> list[str] | str:
    """The command line ``argv`` asks for, or why there is none."""
    if argv and argv[0] in ("--list", "-l"):
        return listing()
    if not argv or argv[0].startswith("-"):
        return [sys.executable, str(HERE / DEFAULT), *argv]
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        return f"dev.py bench: no benchmark named {name!r}; the names:\n\n{listing()}"
    return [sys.executable, str(HERE / BENCHMARKS[name]), *rest]


def main(argv: list[str]) -> int:
    chosen = command(argv)
    if isinstance(chosen, str):
        known = argv[0] in ("--list", "-l")
        print(chosen, file=sys.stdout if known else sys.stderr)
        return 0 if known else 2
    path = os.pathsep.join(p for p in (str(HERE), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    process = subprocess.Popen(chosen, cwd=ROOT, env={**os.environ, "PYTHONPATH": path})
    # Ctrl-C reaches the benchmark too (one process group): it stops its workers and servers,
    # and this process waits for it rather than leaving them behind. (Ignored here only once
    # the benchmark has started: it would inherit the ignoring.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return process.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
