"""How long the test loop takes: each dev.py test command's wall time, the CPU time of it and
everything it started, and the machine's load before and after (on a shared machine the
load says how far the wall time is to be trusted; the CPU time hardly moves with it).

    python3 dev.py bench loop-times              # --fast, then the README's dev.py test
    python3 dev.py bench loop-times --all        # and dev.py test --all (minutes)

The targets (README "Development"): the fast tier under 60 s and the README's command under
5 minutes on 2 cores; --all well inside CI's budget (.ci/run, under 40 minutes in all).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"--fast": 60.0, "": 300.0, "--all": None}


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(flag: str) -> tuple[float, float, int, tuple[float, ...], tuple[float, ...]]:
    """(wall s, CPU s, exit status, load before, load after) of ``dev.py test FLAG``."""
    before, cpu, start = os.getloadavg(), children_cpu(), time.monotonic()
    code = subprocess.run(
        [sys.executable, str(ROOT / "dev.py"), "test", *([flag] if flag else [])],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    ).returncode
    return time.monotonic() - start, children_cpu() - cpu, code, before, os.getloadavg()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="also time dev.py test --all")
    flags = ["--fast", ""] + (["--all"] if parser.parse_args().all else [])
    print(f"{os.cpu_count()} cores")
    failed = 0
    for flag in flags:
        wall, cpu, code, before, after = measure(flag)
        target = TARGETS[flag]
        verdict = "" if target is None else (" met" if wall <= target else " MISSED")
        print(
            f"dev.py test {flag or '(README)':9} {wall:7.1f} s wall  {cpu:7.1f} s CPU  "
            f"exit {code}  load {before[0]:.2f} -> {after[0]:.2f}"
            + (f"  target {target:.0f} s{verdict}" if target else "")
        )
        failed |= code
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
