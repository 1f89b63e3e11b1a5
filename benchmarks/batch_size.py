"""How big a batch is worth it for a child of a given cost: one flow of 200 children that
cost c ms each, sent unbatched and with ``batch`` 5, 20 and 100, end to end.

    python3 dev.py bench batch-size            # 5 rounds
    python3 dev.py bench batch-size --quick    # 3 rounds

One private redis-server (broker, result backend and flow store, as benchmarks/bench.py sets
them) and one real prefork ``celery worker`` (-c 2). The children are ``bench_app.nap(i, c)``
(a sleep of c ms: 0, 1 and 10), their parent ``tsum``. In every round, for each cost, the
flow goes out once per batch size, the order rotating from round to round, each timed from
``apply_async`` to the parent's result stored (as bench.py times a round), its value checked
after. Reported per cost: the median time per flow, and each batch size's time over the
unbatched flow's (the median of the rounds' own ratios, with their range). A batch runs its
children one after another in one pool process: at 200 children and 2 processes, a batch of
100 leaves each process one message. The load average is printed beside the times. Results
go to benchmarks/results/batch-size-<time>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any

import bench_app
import modes
import redis
from measure import HERE, machine, med, rotated, settle
from modes import Waiter, only_queue

from celery_echomq import flow

CHILDREN = 200
COSTS = (0, 1, 10)  # ms a child
BATCHES = {"unbatched": None, "batch=5": 5, "batch=20": 20, "batch=100": 100}


def timed(admin: Any, waiter: Waiter, cost: float, batch: int | None) -> float:
    """Seconds from the send to the parent's result stored, the value checked."""
    children = [bench_app.nap.s(i, cost) for i in range(CHILDREN)]
    canvas = flow(bench_app.tsum.s(), children, batch=batch)
    only_queue("celery")
    settle(admin)
    t0 = time.perf_counter()
    res = canvas.apply_async()
    waiter.wait([res.id], 120)
    took = time.perf_counter() - t0
    if res.get(timeout=60) != sum(range(CHILDREN)):
        raise AssertionError(f"{cost} ms, batch {batch}: wrong value")
    return took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 rounds")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 5, --quick 3)")
    args = p.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 5)
    times: dict[int, dict[str, list[float]]] = {c: {b: [] for b in BATCHES} for c in COSTS}
    load = [os.getloadavg()[0]]
    with contextlib.ExitStack() as stack:
        base = modes.private_worker(stack)
        admin = redis.Redis.from_url(f"{base}/0")
        waiter = Waiter(redis.Redis.from_url(f"{base}/{bench_app.BACKEND_DB}"))
        for batch in BATCHES.values():  # warm: script cache, templates, pool processes
            timed(admin, waiter, 0, batch)
        for rnd in range(rounds):
            for cost in COSTS:
                for label in rotated(list(BATCHES), rnd):
                    times[cost][label].append(timed(admin, waiter, cost, BATCHES[label]))
            load.append(os.getloadavg()[0])
            print(
                f"batch_size: round {rnd + 1}/{rounds} done, load {load[-1]:.2f}", file=sys.stderr
            )

    lines = [
        f"{CHILDREN} children a flow, rounds {rounds}, load average {min(load):.2f}-"
        f"{max(load):.2f} ({os.cpu_count()} cores); ms a flow, median (/ unbatched: the "
        "median of the rounds' ratios [min-max])",
        "",
        "| child cost | " + " | ".join(BATCHES) + " |",
        "|---" * (len(BATCHES) + 1) + "|",
    ]
    ratios: dict[int, dict[str, list[float]]] = {}
    for cost in COSTS:
        plain = times[cost]["unbatched"]
        ratios[cost] = {
            b: [t / u for t, u in zip(ts, plain, strict=True)] for b, ts in times[cost].items()
        }
        cells = [f"{med(plain) * 1000:,.0f}"]
        for label in list(BATCHES)[1:]:
            r = ratios[cost][label]
            cells.append(
                f"{med(times[cost][label]) * 1000:,.0f} ({med(r):.2f}x [{min(r):.2f}-{max(r):.2f}])"
            )
        lines.append(f"| {cost} ms | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    report = {
        "machine": machine(),
        "children": CHILDREN,
        "rounds": rounds,
        "load": load,
        "seconds": times,
        "ratio_to_unbatched": ratios,
        "table": lines,
    }
    out = HERE / "results" / f"batch-size-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nbatch_size: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
