"""What a replicated flow store costs, and what one Redis master sustains.

    python benchmarks/ha.py                 # both parts
    python benchmarks/ha.py --part wait     # echomq_min_replicas 0 vs 1, end to end
    python benchmarks/ha.py --part master   # children/s one redis-server takes

``wait``: a primary and a replica (the flow store), a third redis-server (broker and result
backend), and two real prefork workers, one with ``echomq_min_replicas=0`` and one with
``echomq_min_replicas=1`` on queues of their own. Each round runs one flow of ``--children``
trivial children end to end (``apply_async`` -> the parent's value) in each mode, the order
alternating; the ratio is the median of per-round ratios. WAIT calls per child are counted
on the primary (INFO commandstats).

``master``: no Celery, only the transition scripts, from ``--clients`` processes against one
redis-server: each client enqueues flows of ``--flow-size`` children and claims, completes
and dispatches them. Reported: the wall-clock children/s, and the server's CPU seconds per
child (INFO used_cpu_sys + used_cpu_user), whose inverse is what one fully busy master core
would take. Redis runs scripts on one thread, so that is the ceiling of one master.

Results also go to benchmarks/results/ha-<time>.json. This file is also the workers' Celery
app (``celery -A ha worker``), configured from the environment the driver sets.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from celery import Celery, signals

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import celery_echomq  # noqa: E402 - needs the path above
from celery_echomq import flow  # noqa: E402
from celery_echomq.embedded import RedisServer, WorkerProcess, wait_replicated  # noqa: E402
from celery_echomq.store.keyspace import Keyspace  # noqa: E402
from celery_echomq.store.scripts import ParentRef, Scripts  # noqa: E402
from celery_echomq.store.state import _ATTR, EchoMQ, get_state  # noqa: E402

ENV_STORE = "ECHOMQ_HA_STORE"
ENV_BROKER = "ECHOMQ_HA_BROKER"
ENV_REPLICAS = "ECHOMQ_HA_MIN_REPLICAS"
ENV_READY = "ECHOMQ_HA_READY"

app = Celery("ha")


def configure(store: str, broker: str, min_replicas: int) -> Celery:
    app.conf.update(
        broker_url=f"{broker}/0",
        result_backend=f"{broker}/1",
        echomq_redis_url=store,
        echomq_min_replicas=min_replicas,
        echomq_stall_timeout=3600,
        broker_connection_retry_on_startup=True,
    )
    celery_echomq.install(app)
    return app


if os.environ.get(ENV_STORE):
    configure(os.environ[ENV_STORE], os.environ[ENV_BROKER], int(os.environ[ENV_REPLICAS]))


@app.task(name="ha.add")  # type: ignore[untyped-decorator]
def add(x: int, y: int) -> int:
    return x + y


@app.task(name="ha.tsum")  # type: ignore[untyped-decorator]
def tsum(values: list[int]) -> int:
    return sum(values)


@signals.worker_ready.connect  # type: ignore[untyped-decorator]
def _announce_ready(**_: Any) -> None:
    path = os.environ.get(ENV_READY)
    if path:
        Path(path).write_text(str(os.getpid()))


# --- part 1: WAIT per child ----------------------------------------------------------------


def start_worker(store: str, broker: str, min_replicas: int, queue: str, log: Path) -> Any:
    ready = Path(tempfile.mkdtemp(prefix="echomq-ha-")) / "ready"
    env = dict(
        os.environ,
        **{
            ENV_STORE: store,
            ENV_BROKER: broker,
            ENV_REPLICAS: str(min_replicas),
            ENV_READY: str(ready),
            "PYTHONPATH": f"{HERE}{os.pathsep}{ROOT}",
        },
    )
    worker = WorkerProcess(
        "ha",
        log=log,
        cwd=HERE,
        env=env,
        queues=queue,
        name=queue,
        loglevel="WARNING",
        ready_file=ready,
    )
    return worker.start()


def with_replicas(min_replicas: int) -> EchoMQ:
    """This process's state for one mode (the producer WAITs too)."""
    saved = get_state(app)
    state = EchoMQ(app, dataclasses.replace(saved.settings, min_replicas=min_replicas))
    setattr(app, _ATTR, state)
    return state


def transitions_us(url: str, min_replicas: int, children: int) -> float:
    """Microseconds per child of its claim and completion alone, from this process."""
    scripts = Scripts(redis.Redis.from_url(url), Keyspace("emq"), min_replicas=min_replicas)
    queue, parent = f"t{min_replicas}", "JOB" + uuid.uuid4().hex
    kids = ["JOB" + uuid.uuid4().hex for _ in range(children)]
    scripts.enqueue_flow(queue, parent, b"p", [(k, b"c" * 300) for k in kids])
    ref = ParentRef(parent, queue)
    started = time.perf_counter()
    for k in kids:
        scripts.claim(queue, k, "t", 60_000)
        scripts.complete(queue, k, "t", ttl=60, is_parent=False, parent=ref, value=b"1")
    return (time.perf_counter() - started) / children * 1e6


def part_wait(children: int, rounds: int) -> dict[str, Any]:
    with (
        RedisServer() as broker,
        RedisServer() as primary,
        RedisServer(None, "--replicaof", "127.0.0.1", str(primary.port)) as replica,
    ):
        wait_replicated(primary.client(), 1)
        store = primary.url(0)
        micro: dict[int, list[float]] = {0: [], 1: []}
        for r in range(rounds):
            for n in (0, 1) if r % 2 else (1, 0):
                micro[n].append(transitions_us(store, n, 1000))
        configure(store, broker.url().rsplit("/", 1)[0], 0)
        logs = Path(tempfile.mkdtemp(prefix="echomq-ha-logs-"))
        workers = {
            n: start_worker(store, broker.url().rsplit("/", 1)[0], n, f"r{n}", logs / f"r{n}.log")
            for n in (0, 1)
        }
        times: dict[int, list[float]] = {0: [], 1: []}
        waits: dict[int, list[float]] = {0: [], 1: []}
        try:
            for r in range(rounds + 1):  # round 0 warms up both workers
                for n in (0, 1) if r % 2 else (1, 0):
                    with_replicas(n)
                    before = primary.client().info("commandstats").get("cmdstat_wait", {})
                    started = time.perf_counter()
                    res = flow(tsum.s(), [add.s(i, i) for i in range(children)]).apply_async(
                        queue=f"r{n}"
                    )
                    assert res.get(timeout=300) == children * (children - 1)
                    took = time.perf_counter() - started
                    after = primary.client().info("commandstats").get("cmdstat_wait", {})
                    if r:
                        times[n].append(took)
                        waits[n].append((after.get("calls", 0) - before.get("calls", 0)) / children)
        finally:
            for worker in workers.values():
                worker.stop()
        assert replica.client().dbsize() > 0
    ratios = [b / a for a, b in zip(times[0], times[1], strict=True)]
    return {
        "children": children,
        "rounds": rounds,
        "end_to_end_s": {str(n): [round(t, 3) for t in times[n]] for n in times},
        "per_child_ms": {
            str(n): round(statistics.median(times[n]) / children * 1000, 3) for n in times
        },
        "wait_calls_per_child": {str(n): round(statistics.median(waits[n]), 2) for n in waits},
        "ratio_min_replicas_1_over_0": round(statistics.median(ratios), 3),
        "claim_and_complete_us_per_child": {
            str(n): round(statistics.median(micro[n]), 1) for n in micro
        },
        "ratios": [round(x, 3) for x in ratios],
    }


# --- part 2: one master --------------------------------------------------------------------


def _client_loop(url: str, seconds: float, flow_size: int, out: Any) -> None:
    scripts = Scripts(redis.Redis.from_url(url), Keyspace("emq"))
    queue = f"m{os.getpid()}"
    done = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        parent = "JOB" + uuid.uuid4().hex
        kids = ["JOB" + uuid.uuid4().hex for _ in range(flow_size)]
        scripts.enqueue_flow(queue, parent, b"p" * 300, [(k, b"c" * 300) for k in kids])
        ref = ParentRef(parent, queue)
        for k in kids:
            scripts.claim(queue, k, "t", 60_000)
            scripts.complete(queue, k, "t", ttl=60, is_parent=False, parent=ref, value=b"1")
        scripts.dispatch(queue, parent)
        done += flow_size
    out.put(done)


def part_master(clients: int, seconds: float, flow_size: int) -> dict[str, Any]:
    with RedisServer() as server:
        client = server.client()
        cpu0 = client.info("cpu")
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        procs = [
            ctx.Process(target=_client_loop, args=(server.url(0), seconds, flow_size, out))
            for _ in range(clients)
        ]
        started = time.perf_counter()
        for p in procs:
            p.start()
        done = sum(out.get(timeout=seconds + 60) for _ in procs)
        for p in procs:
            p.join(30)
        wall = time.perf_counter() - started
        cpu1 = client.info("cpu")
        stats = client.info("commandstats")
    cpu = sum(cpu1[k] - cpu0[k] for k in ("used_cpu_sys", "used_cpu_user"))
    return {
        "clients": clients,
        "flow_size": flow_size,
        "children": done,
        "wall_s": round(wall, 2),
        "children_per_s": round(done / wall),
        "server_cpu_us_per_child": round(cpu / done * 1e6, 1),
        "one_busy_core_children_per_s": round(done / cpu),
        "evalsha_us_per_call": round(stats["cmdstat_evalsha"]["usec_per_call"], 1),
        "evalsha_calls_per_child": round(stats["cmdstat_evalsha"]["calls"] / done, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["wait", "master", "all"], default="all")
    parser.add_argument("--children", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--flow-size", type=int, default=10)
    args = parser.parse_args()
    result: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    if args.part in ("wait", "all"):
        result["wait"] = part_wait(args.children, args.rounds)
    if args.part in ("master", "all"):
        result["master"] = part_master(args.clients, args.seconds, args.flow_size)
    print(json.dumps(result, indent=2))
    out = HERE / "results" / f"ha-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
