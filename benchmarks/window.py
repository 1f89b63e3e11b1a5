"""A flow of many children with and without a window (``max_active``), side by side in one run.

    python3 dev.py bench window                            # 100,000 children, max_active=100
    python3 dev.py bench window --children 20000 --rounds 2

Two private redis-servers on loopback (never the machine's 6379): one is the flow store and
nothing else, the other the broker and result backend; one prefork worker (``--concurrency``)
runs every flow. The run reports:

- the store's bytes per waiting child: a windowed flow enqueued on a queue no worker reads,
  its ``used_memory`` growth divided by its waiting children, and the MEMORY USAGE of a
  sample of their rows and of the window list (the same for a flow without a window, per held
  child, beside it);
- per round, the same flow without a window, then with one (the order alternating from one
  round to the next): the end-to-end time (``apply_async`` -> the parent's value) and rate,
  and the most child messages in the broker, sampled every 10 ms (the queue's list, and with
  the messages delivered and not yet acknowledged);
- the rate with a window over the rate without, per round and in all (the machine's load
  moves less within a round than across the run).

Results also go to benchmarks/results/window-<time>.json. This file is also the worker's
Celery app (``celery -A window worker``), configured from the environment the driver sets.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis
from app_setup import announce_ready, configure_app
from celery import Celery

from celery_echomq import flow
from celery_echomq.embedded import RedisServer, WorkerProcess
from celery_echomq.store.loader import TRANSITIONS, load_source
from celery_echomq.store.state import get_state

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

ENV_STORE = "ECHOMQ_WINDOW_STORE"
ENV_BROKER = "ECHOMQ_WINDOW_BROKER"
ENV_BACKEND = "ECHOMQ_WINDOW_BACKEND"
ENV_READY = "ECHOMQ_WINDOW_READY"
QUEUE = "window"
# No worker reads it: the memory of a flow at rest (a name as long as Celery's default queue's).
HELD = "parked"

app = Celery("window")


def configure(store: str, broker: str, backend: str) -> Celery:
    return configure_app(
        app,
        broker=broker,
        backend=backend,
        store=store,
        # Children wait their turn in the queue for minutes without a window: not lost.
        echomq_stall_timeout=3600,
        task_default_queue=QUEUE,
    )


if os.environ.get(ENV_STORE):  # the worker, importing this module as ``window``
    configure(os.environ[ENV_STORE], os.environ[ENV_BROKER], os.environ[ENV_BACKEND])


@app.task(name="window.child")  # type: ignore[untyped-decorator]
def child(i: int) -> int:
    return i


@app.task(name="window.parent")  # type: ignore[untyped-decorator]
def parent(values: list[int]) -> list[int]:
    return [len(values), sum(values)]


announce_ready(ENV_READY)


def used_memory(client: redis.Redis) -> int:  # type: ignore[type-arg]
    return int(client.info("memory")["used_memory"])


def memory(store: redis.Redis, children: int, size: int) -> dict[str, Any]:  # type: ignore[type-arg]
    """Bytes per waiting child of a windowed flow at rest, and per held child of one without."""
    out: dict[str, Any] = {}
    for window in (size, None):
        store.flushdb()
        before = used_memory(store)
        res = flow(parent.s(), [child.s(i) for i in range(children)], max_active=window)
        res = res.apply_async(queue=HELD)
        # The producer's connections closed first: their query buffers (a chunk's arguments)
        # are the server's, not the flow's.
        get_state(app).client.connection_pool.disconnect()
        grown = used_memory(store) - before
        if window is None:
            out["plain_bytes_per_child"] = round(grown / children, 1)
            continue
        waiting = children - size
        key = f"emq:{{{HELD}}}:{res.id}:window"
        sample = [x.decode() for x in store.lrange(key, 0, 999)]
        rows = sum(int(store.memory_usage(f"emq:{{{HELD}}}:{cid}") or 0) for cid in sample)
        # The window's list, and the flow's index of its children (every flow has one).
        listed = int(store.memory_usage(key, samples=0) or 0)
        index = int(store.memory_usage(f"emq:{{{HELD}}}:{res.id}:children", samples=0) or 0)
        out.update(
            waiting=waiting,
            used_memory_per_waiting_child=round(grown / waiting, 1),
            row_bytes=round(rows / len(sample), 1),
            window_list_bytes_per_child=round(listed / waiting, 1),
            children_index_bytes_per_child=round(index / children, 1),
            memory_usage_per_waiting_child=round(
                rows / len(sample) + listed / waiting + index / children, 1
            ),
        )
    store.flushdb()
    return out


class Sampler:
    """The most child messages in the broker, sampled every 10 ms on a thread."""

    def __init__(self, broker: redis.Redis) -> None:  # type: ignore[type-arg]
        self.broker = broker
        self.queued = self.with_unacked = self.samples = self.total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Both counts in one MULTI: a delivery moving a message from the list to the
        # unacknowledged hash between two reads would be counted twice.
        pipe = self.broker.pipeline(transaction=True)
        while not self._stop.is_set():
            pipe.llen(QUEUE)
            pipe.hlen("unacked")
            queued, unacked = pipe.execute()
            self.queued = max(self.queued, queued)
            self.total += queued
            self.with_unacked = max(self.with_unacked, queued + unacked)
            self.samples += 1
            time.sleep(0.01)

    def stop(self) -> Sampler:
        self._stop.set()
        self._thread.join()
        return self


def one_run(broker: Any, children: int, size: int | None, timeout: float) -> dict[str, Any]:
    sigs = [child.s(i) for i in range(children)]
    sampled = Sampler(broker)
    started = time.perf_counter()
    res = flow(parent.s(), sigs, max_active=size).apply_async(queue=QUEUE)
    value = res.get(timeout=timeout)
    took = time.perf_counter() - started
    sampled.stop()
    if value != [children, sum(range(children))]:
        raise AssertionError(f"flow of {children} (max_active={size}) gave {value}")
    return {
        "max_active": size,
        "end_to_end_s": round(took, 3),
        "children_per_s": round(children / took, 1),
        "peak_in_queue": sampled.queued,
        "peak_in_broker_with_unacked": sampled.with_unacked,
        "mean_in_queue": round(sampled.total / max(1, sampled.samples), 1),
        "samples": sampled.samples,
    }


def run(children: int, size: int, rounds: int, concurrency: int, timeout: float) -> dict[str, Any]:
    logdir = Path(tempfile.mkdtemp(prefix="echomq-window-"))
    report: dict[str, Any] = {
        "children": children,
        "max_active": size,
        "concurrency": concurrency,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
    }
    with RedisServer() as store_server, RedisServer() as broker_server:
        env = {
            **os.environ,
            ENV_STORE: store_server.url(0),
            ENV_BROKER: broker_server.url(0),
            ENV_BACKEND: broker_server.url(1),
        }
        configure(env[ENV_STORE], env[ENV_BROKER], env[ENV_BACKEND])
        store = redis.Redis.from_url(env[ENV_STORE])
        broker = redis.Redis.from_url(env[ENV_BROKER])
        report["redis_version"] = str(store.info("server")["redis_version"])
        # Scripts loaded and a flow of each kind run first: their cache and the first call's
        # allocations are not the flow's memory.
        for name in TRANSITIONS:
            store.script_load(load_source(name))  # type: ignore[no-untyped-call]
        memory(store, 2 * size, size)
        report["memory"] = memory(store, children, size)
        print_memory(report["memory"])
        worker = WorkerProcess(
            "window",
            log=logdir / "worker.log",
            cwd=HERE,
            env={
                **env,
                ENV_READY: str(logdir / "ready"),
                "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), env.get("PYTHONPATH", "")]),
            },
            queues=QUEUE,
            concurrency=concurrency,
            name=f"window-{os.getpid()}",
            loglevel="WARNING",
            ready_file=logdir / "ready",
            ready_timeout=120,
        )
        runs: list[dict[str, Any]] = []
        try:
            worker.start()
            one_run(broker, 100, size, timeout)  # warm: scripts loaded, templates learnt
            for number in range(rounds):
                order = (None, size) if number % 2 == 0 else (size, None)
                for window in order:
                    runs.append({"round": number + 1, **one_run(broker, children, window, timeout)})
                    print_run(runs[-1])
        finally:
            worker.stop()
    report["runs"] = runs
    plain = sum(r["end_to_end_s"] for r in runs if r["max_active"] is None)
    windowed = sum(r["end_to_end_s"] for r in runs if r["max_active"] is not None)
    report["rate_ratio"] = round(plain / windowed, 3) if windowed else None  # windowed / plain
    # Per round (its two runs back to back): the machine's load moves less within a round.
    report["round_ratios"] = [
        round(
            sum(r["end_to_end_s"] for r in runs if r["round"] == n and r["max_active"] is None)
            / sum(r["end_to_end_s"] for r in runs if r["round"] == n and r["max_active"]),
            3,
        )
        for n in range(1, rounds + 1)
    ]
    return report


def print_memory(m: dict[str, Any]) -> None:
    print(
        f"store bytes per waiting child  {m['used_memory_per_waiting_child']:7.1f} B (used_memory)"
        f"   {m['memory_usage_per_waiting_child']:.1f} B (MEMORY USAGE: row "
        f"{m['row_bytes']:.1f} + window list {m['window_list_bytes_per_child']:.1f} + index "
        f"{m['children_index_bytes_per_child']:.1f})"
    )
    print(f"  without a window, per held child  {m['plain_bytes_per_child']:7.1f} B")


def print_run(r: dict[str, Any]) -> None:
    label = "no window" if r["max_active"] is None else f"max_active={r['max_active']}"
    print(
        f"round {r['round']}  {label:16} {r['end_to_end_s']:8.2f} s  "
        f"{r['children_per_s']:7.0f} children/s   peak in broker {r['peak_in_queue']:6d} "
        f"({r['peak_in_broker_with_unacked']} with unacked; mean {r['mean_in_queue']}; "
        f"{r['samples']} samples)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--children", type=int, default=100_000)
    parser.add_argument("--max-active", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=1, help="pairs of runs, order alternating")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    parser.add_argument("--out", type=Path, default=None, help="the JSON report's path")
    args = parser.parse_args(argv)
    report = run(args.children, args.max_active, args.rounds, args.concurrency, args.timeout)
    if report["rate_ratio"] is not None:
        print(f"rate with a window / without   {report['rate_ratio']:.3f}x in all")
        ratios = ", ".join(f"{r:.3f}x" for r in report["round_ratios"])
        print(f"  per round                    {ratios}")
    out = args.out or HERE / "results" / f"window-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"report                         {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
