#!/usr/bin/env python3
"""One entry point for a fresh machine with only Python 3: makes .venv, installs, runs.

python3 dev.py quickstart   # a real flow on an embedded redis-server and a real worker
python3 dev.py test [ARGS]  # the test suite (ARGS go to pytest)
python3 dev.py test --fast  # the fast tier: no worker subprocess (canvas and policies on an
                            # in-process worker), under two minutes
python3 dev.py bench [ARGS] # the flow vs chord vs group benchmark
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("ECHOMQ_VENV", ROOT / ".venv"))
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / "python"
EXTRAS = {
    "quickstart": "embedded",
    "test": "test,lint",
    "bench": "test",
    "lint": "test,lint,dashboard",
}


def ensure(extras: str) -> None:
    if not PY.exists():
        print(f"dev.py: creating {VENV}", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    stamp = VENV / f".installed-{extras.replace(',', '-')}"
    sources = [ROOT / "pyproject.toml"]
    if stamp.exists() and all(stamp.stat().st_mtime >= s.stat().st_mtime for s in sources):
        return
    print(f"dev.py: installing celery-echomq[{extras}] into {VENV}", flush=True)
    subprocess.run(
        [
            str(PY),
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "-e",
            f"{ROOT}[{extras}]",
        ],
        check=True,
    )
    stamp.touch()


def run(args: list[str]) -> int:
    return subprocess.run(args, cwd=ROOT).returncode


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in EXTRAS:
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    ensure(EXTRAS[command])
    if command == "quickstart":
        return run([str(PY), "examples/quickstart.py", *rest])
    if command == "test":
        if "--fast" in rest:
            rest = [arg for arg in rest if arg != "--fast"]
            os.environ["ECHOMQ_TEST_WORKER"] = "inprocess"
            return run([str(PY), "-m", "pytest", "-m", "not e2e", *rest])
        return run([str(PY), "-m", "pytest", *rest])
    if command == "bench":
        return run([str(PY), "benchmarks/bench.py", *rest])
    code = run([str(PY), "-m", "ruff", "check", "."])
    code |= run([str(PY), "-m", "ruff", "format", "--check", "."])
    return code | run([str(PY), "-m", "mypy"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
