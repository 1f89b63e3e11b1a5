"""What one ``list_flows`` page costs with 10 and with 100,000 flows in the store.

Starts a private redis-server, writes N flows of 2 children with the real enqueue script (one
in ten failed by a child, the rest held), then times pages of 10 and of 100: the recent
flows, the held ones, the failed ones and one task's. A page reads the store's indexes,
never a SCAN, so its cost must not grow with N.

    python3 dev.py bench list [--sizes 10,1000,100000] [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

from celery import Celery

import celery_echomq
from celery_echomq import list_flows
from celery_echomq.embedded import RedisServer
from celery_echomq.store.scripts import ParentRef

TTL = 86400


def jid() -> str:
    return "JOB" + uuid.uuid4().hex


def fill(state: celery_echomq.EchoMQ, queue: str, n: int) -> None:
    child = state.dumps({"task": "proj.fetch", "args": [1], "kwargs": {}, "options": {}})
    state.client.sadd(state.keys.queues_key(), queue)
    for i in range(n):
        parent, kids = jid(), [jid(), jid()]
        task = "proj.merge" if i % 2 else "proj.report"
        job = {"task": task, "args": [], "kwargs": {}, "options": {}, "children": kids}
        state.scripts.enqueue_flow(
            queue, parent, state.dumps(job), [(c, child) for c in kids], recent_max=10**6
        )
        if i % 10 == 0:  # one in ten fails: its first child fails under "fail"
            token = uuid.uuid4().hex
            state.scripts.claim(queue, kids[0], token, 60_000)
            state.scripts.fail(
                queue, kids[0], token, "ValueError: x", ttl=TTL, is_parent=False,
                parent=ParentRef(parent, queue),
            )  # fmt: skip


def timed(app: Celery, rounds: int, limit: int, **kwargs: object) -> tuple[float, int]:
    times, rows = [], 0
    for _ in range(rounds):
        started = time.perf_counter()
        found, _ = list_flows(app=app, limit=limit, **kwargs)  # type: ignore[arg-type]
        times.append(time.perf_counter() - started)
        rows = len(found)
    return statistics.median(times) * 1000, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,1000,100000")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    with RedisServer() as server:
        for n in (int(s) for s in args.sizes.split(",")):
            url = f"redis://127.0.0.1:{server.port}/0"
            app = Celery("bench", broker=url, backend=url, set_as_current=False)
            app.conf.update(echomq_redis_url=url, echomq_recent_flows=10**6)
            state = celery_echomq.install(app)
            state.client.flushdb()
            started = time.perf_counter()
            fill(state, "bench", n)
            print(f"{n:,} flows written in {time.perf_counter() - started:.1f} s", flush=True)
            for limit in (10, 100):
                for label, kwargs in (
                    ("recent", {"state": "recent"}),
                    ("held", {"state": "held"}),
                    ("failed", {"state": "failed"}),
                    ("recent --task proj.merge", {"state": "recent", "task": "proj.merge"}),
                ):
                    ms, rows = timed(app, args.rounds, limit, **kwargs)
                    print(
                        f"  list --limit {limit:<3} --state {label:<24} {ms:7.2f} ms median  "
                        f"({rows} rows)",
                        flush=True,
                    )
            app.close()


if __name__ == "__main__":
    main()
