"""Recovery by evidence, measured: a backlog of ten stall timeouts and more, and the time from a
pool process SIGKILLed with acks early to its flow's failure.

    python3 dev.py bench evidence                # on a private redis-server (and RabbitMQ
                                                 # at 127.0.0.1:5672 when one answers)
    python3 dev.py bench evidence --rounds 10

It runs the test suite's app (tests/proj.py) in real ``celery worker`` subprocesses:

- backlog: 4 flows of 28 children of 0.1 s each on one pool process with a stall timeout of
  1 s (about 12 s to drain, 12 stall timeouts); it reports how many messages recovery
  re-published and how many child and parent bodies ran twice (targets: 0 and 0);
- acks-early kill: a flow whose child hangs; its pool process is SIGKILLed and the time to the
  flow's ``FlowFailed`` is taken, over ``--rounds`` rounds, with the stall timeout at 300 s (so
  nothing but the worker's own report can fail it in time; target: under 2 s).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from celery_echomq.embedded import RedisServer, WorkerProcess

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

RABBIT = "amqp://guest:guest@127.0.0.1:5672//"


def rabbit_answers() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=2):
            return True
    except OSError:
        return False


def worker(queue: str, logdir: Path, **env: str) -> WorkerProcess:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    name = f"ev{uuid.uuid4().hex[:6]}"
    return WorkerProcess(
        "tests.proj",
        log=logdir / f"{name}.log",
        cwd=ROOT,
        env=environ,
        queues=queue,
        concurrency=1,
        name=name,
    ).start()


def backlog(proj: Any, store: Any, logdir: Path, broker: str, app: Any = None) -> dict[str, Any]:
    from tests.helpers import send_flows

    queue = f"ev-backlog-{uuid.uuid4().hex[:8]}"
    stall = 1.0
    started = time.monotonic()
    sent = send_flows(proj, queue, flows=4, size=28, seconds=0.1, app=app)
    w = worker(
        queue,
        logdir,
        ECHOMQ_T_BROKER=broker,
        ECHOMQ_T_STALL=str(stall),
        ECHOMQ_T_RECOVERY_INTERVAL="0.5",
    )
    try:
        for res, _, _ in sent:
            res.get(timeout=300)
        drained = time.monotonic() - started
    finally:
        w.stop()
        if broker.startswith("amqp"):
            from kombu import Connection

            with Connection(broker, connect_timeout=5) as conn:  # type: ignore[no-untyped-call]
                conn.channel().queue_delete(queue)
    twice = sum(
        int(store.get(f"test:ran:slow:{cid}") or 0) > 1 for _, _, ids in sent for cid in ids
    )
    parents = sum(int(store.get(f"test:ran:collect:{tag}") or 0) > 1 for _, tag, _ in sent)
    counters = store.hgetall(f"emq:{{{queue}}}:counters")
    return {
        "children": sum(len(ids) for _, _, ids in sent),
        "drain_s": round(drained, 1),
        "stall_timeouts": round(drained / stall, 1),
        "republished": int(counters.get(b"republished", 0)),
        "children_twice": twice,
        "parents_twice": parents,
    }


def acks_early_kill(proj: Any, store: Any, logdir: Path, rounds: int) -> list[float]:
    from celery_echomq import FlowFailed, flow
    from celery_echomq.store.keyspace import new_job_id

    queue = f"ev-kill-{uuid.uuid4().hex[:8]}"
    w = worker(queue, logdir, ECHOMQ_T_STALL="300")
    took = []
    try:
        for _ in range(rounds):
            hung = new_job_id()
            res = flow(proj.collect.s(), [proj.hang_first.s(1).set(task_id=hung)]).apply_async(
                queue=queue
            )
            deadline = time.monotonic() + 60
            while not store.exists(f"test:pid:{hung}"):
                if time.monotonic() > deadline:
                    raise TimeoutError("the child never started")
                time.sleep(0.01)
            killed = time.monotonic()
            os.kill(int(store.get(f"test:pid:{hung}")), signal.SIGKILL)
            try:
                res.get(timeout=60)
            except FlowFailed:
                took.append(time.monotonic() - killed)
            else:
                raise AssertionError("the flow did not fail")
            time.sleep(0.5)  # the pool replaces its process
    finally:
        w.stop()
    return took


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    logdir = Path(tempfile.mkdtemp(prefix="echomq-evidence-"))
    with RedisServer() as server:
        base = f"redis://127.0.0.1:{server.port}"
        os.environ.update(
            ECHOMQ_T_BROKER=f"{base}/11", ECHOMQ_T_BACKEND=f"{base}/12", ECHOMQ_T_STORE=f"{base}/13"
        )
        import redis

        from tests import proj

        store = redis.Redis.from_url(f"{base}/13")
        print(
            "backlog of >= 10 stall timeouts, Redis broker:",
            backlog(proj, store, logdir, f"{base}/11"),
        )
        if rabbit_answers():
            from celery import Celery

            import celery_echomq

            side = Celery("evidence", set_as_current=False)
            side.conf.update(
                broker_url=RABBIT,
                result_backend=f"{base}/12",
                echomq_redis_url=f"{base}/13",
                broker_connection_retry_on_startup=True,
            )
            celery_echomq.install(side)
            found = backlog(proj, store, logdir, RABBIT, app=side)
            print("backlog of >= 10 stall timeouts, RabbitMQ:", found)
        took = acks_early_kill(proj, store, logdir, args.rounds)
        print(
            f"acks-early kill -> FlowFailed over {len(took)} rounds: median "
            f"{statistics.median(took):.2f} s, max {max(took):.2f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
