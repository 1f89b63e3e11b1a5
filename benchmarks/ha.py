"""What a replicated flow store costs, and what one Redis master sustains.

    python3 dev.py bench ha                 # both parts
    python3 dev.py bench ha --part wait     # echomq_min_replicas 0 vs 1, end to end
    python3 dev.py bench ha --part master   # children/s one redis-server takes
    python3 dev.py bench ha --part failover --runs 10   # a Cluster master lost mid-flows

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

``failover``: a Redis Cluster of six nodes (3 masters x 1 replica, cluster-node-timeout
2000), a redis-server for the broker and result backend, one real prefork worker with
``echomq_min_replicas=1``. Flows of 3 children of 0.4 s each are sent every 0.5 s; 2.5 s in,
the replica of the master that owns the queue's slot (the cluster URL's first seed) stops
following it (it can no longer authenticate: a partition), 0.7 s later that master is
SIGKILLed, its replica is promoted and runs ``--rejoin-after`` s without a replica (its
transitions come back short of the WAIT), then the old master comes back as the new one's
replica. Every accepted flow is waited for (``--settle`` s). ``--seeds first``: the URL names
the lost master alone, not every node. Per run (each in a process of its own): flows sent,
accepted, refused (and why), completed, lost (an accepted flow whose parent never came, with
its parent's row), parents run twice, refused flows that ran, failed recovery passes.
Repeated ``--runs`` times.

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
from app_setup import announce_ready, configure_app
from celery import Celery

from celery_echomq import flow
from celery_echomq.embedded import RedisServer, WorkerProcess, wait_replicated
from celery_echomq.store.keyspace import Keyspace
from celery_echomq.store.scripts import ParentRef, Scripts
from celery_echomq.store.state import _ATTR, EchoMQ, get_state

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

ENV_STORE = "ECHOMQ_HA_STORE"
ENV_BROKER = "ECHOMQ_HA_BROKER"
ENV_REPLICAS = "ECHOMQ_HA_MIN_REPLICAS"
ENV_READY = "ECHOMQ_HA_READY"
ENV_STALL = "ECHOMQ_HA_STALL"

app = Celery("ha")


def configure(store: str, broker: str, min_replicas: int) -> Celery:
    return configure_app(
        app,
        broker=f"{broker}/0",
        backend=f"{broker}/1",
        store=store,
        echomq_min_replicas=min_replicas,
        echomq_stall_timeout=float(os.environ.get(ENV_STALL, "3600")),
        echomq_recovery_interval=1.0,
    )


if os.environ.get(ENV_STORE):
    configure(os.environ[ENV_STORE], os.environ[ENV_BROKER], int(os.environ[ENV_REPLICAS]))


@app.task(name="ha.add")  # type: ignore[untyped-decorator]
def add(x: int, y: int) -> int:
    return x + y


@app.task(name="ha.tsum")  # type: ignore[untyped-decorator]
def tsum(values: list[int]) -> int:
    return sum(values)


@app.task(name="ha.sleep_then")  # type: ignore[untyped-decorator]
def sleep_then(value: int, seconds: float) -> int:
    time.sleep(seconds)
    return value


announce_ready(ENV_READY)


# --- part 1: WAIT per child ----------------------------------------------------------------


def start_worker(
    store: str, broker: str, min_replicas: int, queue: str, log: Path, concurrency: int = 2
) -> Any:
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
        concurrency=concurrency,
        loglevel="INFO" if concurrency > 2 else "WARNING",
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


# --- part 3: a Cluster master lost mid-flows -----------------------------------------------


def _send_flows(queue: str, stop: Any, sent: list[dict[str, Any]]) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        values = [n * 100 + j for j in range(3)]
        sig = flow(tsum.s(), [sleep_then.s(v, 0.4) for v in values])
        record: dict[str, Any] = {"id": sig.freeze().id, "expected": sum(values), "error": None}
        started = time.monotonic()
        try:
            sig.apply_async(queue=queue)
        except Exception as exc:
            record["error"] = type(exc).__name__
        record["took"] = time.monotonic() - started
        sent.append(record)
        stop.wait(0.5)


def _rows_of(cluster: Any, queue: str, parent: str) -> dict[str, Any]:
    """What the store holds of a lost flow: its parent's row and its children's states."""
    client = redis.RedisCluster(host="127.0.0.1", port=cluster.master_of(0))
    keys = Keyspace("emq")
    row = {
        k.decode(): v.decode()[:60] for k, v in client.hgetall(keys.job_key(queue, parent)).items()
    }
    return {k: v for k, v in row.items() if k not in ("payload", "template")}


def failover_run(
    logs: Path, settle_for: float, rejoin_after: float, seeds: str = "all"
) -> dict[str, Any]:
    import threading

    from celery.result import AsyncResult

    from celery_echomq.embedded import RedisClusterServer

    with (
        RedisServer() as broker,
        RedisClusterServer(masters=3, replicas=1, node_timeout_ms=2000) as cluster,
    ):
        # The queue's slot on the first node: the master lost is the URL's first seed.
        first = redis.Redis(host="127.0.0.1", port=cluster.ports[0])
        queue = next(
            q
            for q in (f"fo-{uuid.uuid4().hex[:8]}" for _ in range(5000))
            if cluster.master_of(int(first.cluster("KEYSLOT", f"emq:{{{q}}}:pending")))
            == cluster.ports[0]
        )
        url = cluster.url() if seeds == "all" else f"redis+cluster://127.0.0.1:{cluster.ports[0]}"
        # Recovery repairs what a failover lost a stall timeout later (as in the tests).
        os.environ[ENV_STALL] = "15"
        base = broker.url().rsplit("/", 1)[0]
        configure(url, base, 1)
        with_replicas(1)
        worker = start_worker(url, base, 1, queue, logs / f"{queue}.log", concurrency=8)
        slot = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0]).keyslot(
            f"emq:{{{queue}}}:pending"
        )
        sent: list[dict[str, Any]] = []
        stop = threading.Event()
        sender = threading.Thread(target=_send_flows, args=(queue, stop, sent), daemon=True)
        try:
            sender.start()
            time.sleep(2.5)
            master = cluster.master_of(slot)
            primary = cluster.node(master).client()
            (replica_port,) = [int(port) for _, port, _ in primary.role()[2]]
            replica = cluster.node(replica_port).client()
            replica.config_set("masterauth", "partitioned")
            primary.client_kill_filter(_type="replica")
            time.sleep(0.7)
            cluster.node(master).kill()
            killed = time.monotonic()
            cluster.wait_failover(master, slot)
            failover_s = time.monotonic() - killed
            replica.config_set("masterauth", "")
            # The new master runs without a replica for a while (its writes are refused with
            # ReplicationError), then the old one comes back as its replica.
            time.sleep(rejoin_after)
            cluster.restart(master)
            time.sleep(3.0)
            stop.set()
            sender.join(60)
            deadline = time.monotonic() + settle_for
            outcome: dict[str, str] = {}
            for record in sent:
                if record["error"]:
                    continue
                res = AsyncResult(record["id"], app=app)
                try:
                    value = res.get(timeout=max(0.1, deadline - time.monotonic()), propagate=False)
                    outcome[record["id"]] = "ok" if value == record["expected"] else "wrong"
                except Exception:
                    outcome[record["id"]] = "lost"
            lost = [i for i, o in outcome.items() if o == "lost"]
            detail = [{"id": i, "parent": _rows_of(cluster, queue, i)} for i in lost[:3]]
        finally:
            stop.set()
            worker.stop()
    text = (logs / f"{queue}.log").read_text(errors="replace")
    ran: dict[str, int] = {}
    for line in text.splitlines():
        if "succeeded" in line and "ha.tsum[" in line:
            job = line.split("ha.tsum[", 1)[1].split("]", 1)[0]
            ran[job] = ran.get(job, 0) + 1
    refused = [r["error"] for r in sent if r["error"]]
    failed_passes = text.count("echomq recovery: pass failed")
    return {
        "queue": queue,
        "seeds": seeds,
        "recovery_passes_failed": failed_passes,
        "sent": len(sent),
        "accepted": len(sent) - len(refused),
        "refused": {e: refused.count(e) for e in sorted(set(refused))},
        "completed": sum(1 for o in outcome.values() if o == "ok"),
        "wrong_value": sum(1 for o in outcome.values() if o == "wrong"),
        "lost": len(lost),
        "lost_detail": detail,
        "parents_run_twice": sum(1 for n in ran.values() if n > 1),
        # A refused enqueue may still have landed on the primary: recovery then runs it.
        "refused_but_ran": sum(1 for r in sent if r["error"] and ran.get(r["id"])),
        "failover_s": round(failover_s, 1),
        "longest_apply_async_s": round(max((r["took"] for r in sent), default=0.0), 2),
    }


def part_failover(
    runs: int, settle_for: float, rejoin_after: float, seeds: str = "all"
) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="echomq-ha-failover-"))
    results = []
    for n in range(runs):
        # Each run in a process of its own: a fresh app, connected to that run's servers.
        import subprocess

        one = subprocess.run(
            [
                *(sys.executable, __file__, "--one-failover", str(logs)),
                *("--settle", str(settle_for), "--rejoin-after", str(rejoin_after)),
                *("--seeds", seeds),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        result = json.loads(one.stdout.strip().splitlines()[-1])
        print(f"run {n + 1}/{runs}: {json.dumps(result)}", flush=True)
        results.append(result)
    return {
        "runs": runs,
        "logs": str(logs),
        "lost_per_run": [r["lost"] for r in results],
        "lost": sum(r["lost"] for r in results),
        "accepted": sum(r["accepted"] for r in results),
        "refused": sum(sum(r["refused"].values()) for r in results),
        "parents_run_twice": sum(r["parents_run_twice"] for r in results),
        "refused_but_ran": sum(r.get("refused_but_ran", 0) for r in results),
        "failover_s": [r["failover_s"] for r in results],
        "each": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["wait", "master", "failover", "all"], default="all")
    parser.add_argument("--children", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--flow-size", type=int, default=10)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--settle", type=float, default=90.0)
    parser.add_argument("--rejoin-after", type=float, default=5.0)
    parser.add_argument(
        "--seeds",
        choices=["all", "first"],
        default="all",
        help="the cluster URL names every node, or only the first (the master that is lost)",
    )
    parser.add_argument("--one-failover", metavar="LOGS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_failover:
        print(
            json.dumps(
                failover_run(Path(args.one_failover), args.settle, args.rejoin_after, args.seeds)
            )
        )
        return
    result: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    if args.part in ("wait", "all"):
        result["wait"] = part_wait(args.children, args.rounds)
    if args.part in ("master", "all"):
        result["master"] = part_master(args.clients, args.seconds, args.flow_size)
    if args.part in ("failover", "all"):
        result["failover"] = part_failover(args.runs, args.settle, args.rejoin_after, args.seeds)
    print(json.dumps(result, indent=2))
    out = HERE / "results" / f"ha-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
