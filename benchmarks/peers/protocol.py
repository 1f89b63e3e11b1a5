"""The line protocol a peer's driver speaks to ``benchmarks/peers/runner.py`` (stdlib only: it
runs in the peers' own virtualenv, beside Dramatiq or RQ, not in the project's).

The driver prints ``{"ready": true, "version": V}`` (V: the peer's own version) once its
workers are up, then answers each line ``run K N`` on its stdin with one JSON line
``{"seconds": S}``: the time from its first enqueue to the moment it holds the last parent's
value (each value checked), or ``{"error": ...}``.
``quit`` stops its workers. The runner reads Redis's counters around each ``run`` line.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable


def expected_sum(children: int) -> int:
    """What each parent returns: the sum of its children's ``add(i, i)``."""
    return sum(2 * i for i in range(children))


def serve(run: Callable[[int, int], float], stop: Callable[[], None], version: str) -> None:
    """Answer ``run K N`` lines until ``quit`` or the end of stdin, then call ``stop``."""
    try:
        print(json.dumps({"ready": True, "version": version}), flush=True)
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "quit":
                break
            try:
                seconds = run(int(words[1]), int(words[2]))
                print(json.dumps({"seconds": seconds}), flush=True)
            except Exception:  # reported to the runner, which stops the bench with it
                print(json.dumps({"error": traceback.format_exc()[-2000:]}), flush=True)
    finally:
        stop()
