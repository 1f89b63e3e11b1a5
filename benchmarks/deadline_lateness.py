"""How late a deadline is acted on: flows whose deadline passes while a child still runs, on a
private redis-server and real prefork workers (tests/proj.py's app), the flows sent from this
process (which runs no poller). Lateness is the store's own clock: the time deadline.lua fired
minus the time the deadline passed (both written on the parent's row), and, as a user sees it,
when the parent's FAILURE was stored in the result backend (its ``date_done``, the same
machine's clock), which is what ``get()`` waits for.

    python3 dev.py bench deadline-lateness                 # 50 flows, 2 workers
    python3 dev.py bench deadline-lateness --flows 100 --workers 3 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flows", type=int, default=50)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--deadline", type=float, default=1.0)
    parser.add_argument("--spacing", type=float, default=0.037, help="seconds between flows")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from celery_echomq.embedded import RedisServer, WorkerProcess

    logs = Path(tempfile.mkdtemp(prefix="echomq-lateness-"))
    with RedisServer() as server:
        env = {
            **os.environ,
            "ECHOMQ_T_BROKER": server.url(1),
            "ECHOMQ_T_BACKEND": server.url(2),
            "ECHOMQ_T_STORE": server.url(3),
            "PYTHONPATH": str(ROOT),
        }
        os.environ.update(
            {k: env[k] for k in ("ECHOMQ_T_BROKER", "ECHOMQ_T_BACKEND", "ECHOMQ_T_STORE")}
        )
        from celery_echomq import FlowDeadlineExceeded, flow
        from tests import proj

        workers = [
            WorkerProcess("tests.proj", log=logs / f"w{i}.log", cwd=ROOT, env=env,
                          concurrency=2, name=f"late{i}").start()
            for i in range(args.workers)
        ]  # fmt: skip
        try:
            import redis

            store = redis.Redis.from_url(server.url(3))
            gate = f"gate:{uuid.uuid4().hex}"
            sent = []
            for _ in range(args.flows):
                res = flow(proj.tsum.s(), [proj.gated.s(1, gate)], deadline=args.deadline)
                sent.append((time.time(), res.apply_async()))
                time.sleep(args.spacing)
            for _, res in sent:
                with contextlib.suppress(FlowDeadlineExceeded):
                    res.get(timeout=60)
            store.set(gate, 1)
            rows = [store.hmget(f"emq:{{celery}}:{r.id}", "deadline_at", "deadline_fired")
                    for _, r in sent]  # fmt: skip
            late = [int(f) - int(float(a)) for a, f in rows if a and f]
            seen = [
                r.date_done.timestamp() - int(float(a)) / 1000
                for (_, r), (a, _) in zip(sent, rows, strict=True)
                if a and r.date_done is not None
            ]
        finally:
            for w in workers:
                w.stop()
    report = {
        "flows": args.flows,
        "workers": args.workers,
        "fired": len(late),
        "store_ms": {
            "median": statistics.median(late),
            "p99": pct(late, 0.99),
            "max": max(late),
            "min": min(late),
        },
        "failure_stored_ms": {
            "median": round(statistics.median(seen) * 1000),
            "p99": round(pct(seen, 0.99) * 1000),
            "max": round(max(seen) * 1000),
        },
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if len(late) == args.flows else 1


if __name__ == "__main__":
    raise SystemExit(main())
