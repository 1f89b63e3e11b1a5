"""What the benchmarks measure with, at the bottom of their imports (it imports none of them):
the sizes they take (KxN), the server's counters (``INFO commandstats``, ``INFO cpu``), the
wait until the server is quiet, medians and spreads, the rounds' rotation, the machine and
commit a run was made on, and a time limit on a whole run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
# What a benchmark itself sends to read the counters, never part of a mode's cost.
OWN_COMMANDS = frozenset({"info", "memory", "scan", "flushdb"})


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- sizes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Size:
    flows: int
    children: int
    steps: int = 1  # tasks per child: > 1 makes each child a chain (the ``-chain`` modes)

    @property
    def total(self) -> int:
        """Tasks the children run (a chain child counts each of its steps)."""
        return self.flows * self.children * self.steps

    @property
    def label(self) -> str:
        tail = f"x{self.steps}" if self.steps > 1 else ""
        return f"{self.flows}x{self.children}{tail}"


def parse_sizes(text: str) -> list[Size]:
    sizes = []
    for part in text.split(","):
        flows, _, children = part.strip().lower().partition("x")
        if not flows.isdigit() or not children.isdigit() or int(flows) < 1 or int(children) < 1:
            raise argparse.ArgumentTypeError(f"size {part!r} is not KxN (e.g. 20x50)")
        sizes.append(Size(int(flows), int(children)))
    return sizes


def parse_chain_sizes(text: str) -> list[Size]:
    """``NxS,...``: one parent over N chains of S steps each (S >= 2)."""
    sizes = []
    for size in parse_sizes(text):
        if size.children < 2:
            raise argparse.ArgumentTypeError(f"chain size {size.label}: a chain has 2+ steps")
        sizes.append(Size(1, size.flows, size.children))
    return sizes


def rotated(items: Sequence[str], rnd: int) -> list[str]:
    """Round r starts at item r, so no mode always runs first (or last) after a quiet spell."""
    k = rnd % len(items)
    return [*items[k:], *items[:k]]


# --- the server's counters ----------------------------------------------------------------


def command_counts(admin: Any) -> dict[str, int]:
    stats = admin.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def redis_cpu(admin: Any) -> float:
    """The server's CPU seconds so far (``INFO cpu``: used_cpu_user + used_cpu_sys)."""
    cpu = admin.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def command_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    delta = {k: v - before.get(k, 0) for k, v in after.items() if k not in OWN_COMMANDS}
    return {k: v for k, v in sorted(delta.items()) if v}


def settle(admin: Any, quiet: float = 0.3, limit: float = 3.0) -> None:
    """Wait until the workers stop issuing commands: the work after a result is ready (the
    flow parent's own completion, acks) belongs to the run that caused it."""
    start = last_change = time.monotonic()
    last = sum(command_delta({}, command_counts(admin)).values())
    while time.monotonic() - start < limit:
        time.sleep(0.05)
        now = sum(command_delta({}, command_counts(admin)).values())
        if now != last:
            last, last_change = now, time.monotonic()
        elif time.monotonic() - last_change >= quiet:
            return


# --- statistics ---------------------------------------------------------------------------


def med(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0], values[0]) if values else (float("nan"), float("nan"))
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": med(values), "min": min(values), "max": max(values)}


# --- the run ------------------------------------------------------------------------------


class Deadline(BaseException):
    """Like KeyboardInterrupt: library code that retries on Exception must not swallow it."""


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    raise Deadline(f"stopped by signal {signum}")


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """SIGTERM, SIGINT, and SIGALRM after ``seconds``, raised as :class:`Deadline` inside the
    block, so that its ``with`` blocks stop the workers and redis-server they started."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):
        signal.signal(sig, _on_signal)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)


def machine() -> dict[str, Any]:
    import celery
    import kombu
    import redis

    mem = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = int(Path("/proc/meminfo").read_text().split()[1]) * 1024
    # The library is installed editable: the commit (and whether the tree had local changes)
    # says which code was measured.
    git = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--", "celery_echomq"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "commit": f"{git}{'+local changes' if dirty else ''}",
        "cpus": os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "celery": celery.__version__,
        "kombu": kombu.__version__,
        "redis_py": redis.__version__,
    }
