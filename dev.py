#!/usr/bin/env python3
"""One entry point for a fresh machine with only Python 3: makes .venv, installs, runs.

python3 dev.py quickstart       # a real flow on an embedded redis-server and a real worker
python3 dev.py test             # the fast tier, then a smoke of each concern on real workers
python3 dev.py test --fast      # the fast tier alone: no worker subprocess, under a minute
python3 dev.py test --all       # everything: the fast tier, then every test that runs real
                                # worker subprocesses, the slow ones apart (what CI runs)
python3 dev.py test ARGS        # one pytest run of what ARGS select, on real workers
                                # (tests/ops/test_cli.py, -k policies, -m faults, -m "not slow")
python3 dev.py test --all ARGS  # ARGS added to each run of a tier (--fast ARGS too)
python3 dev.py lint             # ruff check, ruff format --check, mypy --strict
python3 dev.py bench [ARGS]     # the flow vs chord vs group benchmark (benchmarks/bench.py)
python3 dev.py bench NAME ARGS  # any other benchmark by name (bench --list: every name)
python3 dev.py wheel            # the sdist and wheel into dist/, checked, and the wheel (not an
                                # editable install) in a fresh venv with each extra, running
                                # the quickstart and the smoke (.ci/wheel)
python3 dev.py docs [ARGS]      # the documentation as a site in site/: mkdocs build --strict

The fast tier is every test not marked e2e, with the canvas and policy tests' worker on an
in-process worker (ECHOMQ_TEST_WORKER=inprocess). The smoke is the tests marked smoke: a few
per concern, each on real `celery worker` subprocesses. tests/conftest.py assigns the markers
(e2e, smoke, slow, faults, browser, result_path). A tier's runs are spread over pytest-xdist
processes, each with its own redis-server and workers (ECHOMQ_TEST_PROCESSES: how many, by
default two per core; the slow tests of --all, each a large flow, a soak or a failover, one
per core, in a run of their own, so that none of them starves a test that waits on a worker);
with ECHOMQ_TEST_REDIS_URL (one Redis for everything) they run in one process. A command that
runs no test at all fails (pytest's exit status 5).
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
    "wheel": "release,test",
    "docs": "docs",
}
NO_TESTS = 5  # pytest's exit status when it collected or selected nothing
# The tiers: (title, marker expression, the fast tier's in-process worker, xdist processes
# per core) for each run.
FAST = ("the fast tier: no worker subprocess", "not e2e", True, 2)
TIERS = {
    "": [FAST, ("a smoke of each concern on real workers", "e2e and smoke", False, 2)],
    "--fast": [FAST],
    "--all": [
        FAST,
        ("every test on real workers but the slow ones", "e2e and not slow", False, 2),
        ("the slow ones: large flows, soaks, failovers", "e2e and slow", False, 1),
    ],
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


def run(args: list[str], env: dict[str, str] | None = None) -> int:
    return subprocess.run(args, cwd=ROOT, env=env).returncode


def processes(args: list[str], per_core: int = 2) -> list[str]:
    """pytest-xdist's options for a tier's run: ``per_core`` processes per core (two where
    most of a real-worker test is waiting), unless ARGS choose (-n, -p no:xdist) or every test
    shares one Redis (ECHOMQ_TEST_REDIS_URL), where the processes would empty each other's
    databases."""
    chosen = any(a == "-n" or a.startswith(("-n", "--numprocesses")) for a in args)
    if chosen or "no:xdist" in args or os.environ.get("ECHOMQ_TEST_REDIS_URL"):
        return []
    count = os.environ.get("ECHOMQ_TEST_PROCESSES") or str(per_core * (os.cpu_count() or 1))
    # Tests of one module stay in one process: a module's fixtures (a cluster, a Sentinel
    # set-up, a pair of workers) start once.
    return ["-n", count, "--dist", "loadscope"]


def test(rest: list[str]) -> int:
    tier = next((flag for flag in TIERS if flag and flag in rest), "" if not rest else None)
    if tier is None:  # ARGS alone: one run of what they select, every tier
        return verdict([run([str(PY), "-m", "pytest", *rest])])
    args, own = marker_expression([a for a in rest if a not in TIERS])
    codes = []
    for title, marks, in_process, per_core in TIERS[tier]:
        if own:  # the tier's selection, narrowed by ARGS' own -m
            marks = f"({marks}) and ({own})"
        print(f"== {' '.join(['dev.py test', tier]).strip()}: {title}: -m '{marks}'", flush=True)
        env = dict(os.environ)
        if in_process:
            env["ECHOMQ_TEST_WORKER"] = "inprocess"
        command = [str(PY), "-m", "pytest", "-m", marks, *processes(args, per_core), *args]
        codes.append(run(command, env))
    return verdict(codes)


def marker_expression(args: list[str]) -> tuple[list[str], str]:
    """ARGS without their ``-m EXPR``, and EXPR ('' when none)."""
    rest, own = [], ""
    items = iter(args)
    for arg in items:
        if arg == "-m":
            own = next(items, "")
        elif arg.startswith("-m") and not arg.startswith("--"):
            own = arg[2:].lstrip("=")
        else:
            rest.append(arg)
    return rest, own


def verdict(codes: list[int]) -> int:
    """The first failure; a run that selected nothing counts only when no run ran a test."""
    if all(code == NO_TESTS for code in codes):
        print("dev.py: no test ran (pytest exit status 5): that is a failure", flush=True)
        return NO_TESTS
    return next((code for code in codes if code not in (0, NO_TESTS)), 0)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in EXTRAS:
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    ensure(EXTRAS[command])
    if command == "quickstart":
        return run([str(PY), "examples/quickstart.py", *rest])
    if command == "test":
        return test(rest)
    if command == "bench":
        return run([str(PY), "benchmarks", *rest])  # benchmarks/__main__.py
    if command == "wheel":
        return run(["bash", ".ci/wheel"], {**os.environ, "ECHOMQ_PYTHON": str(PY)})
    if command == "docs":
        # Without the theme's banner about MkDocs 2.0, which the docs extra keeps below.
        env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
        return run([str(PY), "-m", "mkdocs", "build", "--strict", *rest], env)
    code = run([str(PY), "-m", "ruff", "check", "."])
    code |= run([str(PY), "-m", "ruff", "format", "--check", "."])
    return code | run([str(PY), "-m", "mypy"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
