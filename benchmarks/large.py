"""One flow of 100,000 children, enqueued and run to completion by a real prefork worker.

    python3 dev.py bench large                          # 100,000 children, chunk size 1000
    python3 dev.py bench large --children 20000 --concurrency 2 --chunk-size 500

Two private redis-servers on loopback (never the machine's 6379): one is the flow store and
nothing else, so its SLOWLOG and its memory show the flow's own cost; the other is broker and
result backend. The run reports:

- enqueue: the wall time of ``flow(...).apply_async()`` (every script of the chunked path and
  the publish of every child's message), and the scripts' calls and server time in it
  (INFO commandstats);
- the longest store commands while enqueuing and while the worker runs (SLOWLOG, every
  command of 1 ms or more): how long one command kept Redis from serving anyone else;
- memory per held child: the store's ``used_memory`` growth from before the enqueue to the
  held flow (no worker started yet), divided by N, and what one child's row takes;
- the run: worker ready -> the parent's value, and end to end: apply_async -> the value.

Results also go to benchmarks/results/large-<time>.json. This file is also the worker's Celery
app (``celery -A large worker``), configured from the environment the driver sets.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
from app_setup import announce_ready, configure_app
from celery import Celery

from celery_echomq import flow
from celery_echomq.embedded import RedisServer, WorkerProcess
from celery_echomq.store.loader import TRANSITIONS, load_source

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

ENV_STORE = "ECHOMQ_LARGE_STORE"
ENV_BROKER = "ECHOMQ_LARGE_BROKER"
ENV_BACKEND = "ECHOMQ_LARGE_BACKEND"
ENV_CHUNK = "ECHOMQ_LARGE_CHUNK"
ENV_READY = "ECHOMQ_LARGE_READY"
QUEUE = "large"

app = Celery("large")


def configure(store: str, broker: str, backend: str, chunk_size: int) -> Celery:
    return configure_app(
        app,
        broker=broker,
        backend=backend,
        store=store,
        echomq_chunk_size=chunk_size,
        # Children wait their turn in the queue for minutes: not lost, so recovery must not
        # re-publish them (it would cost duplicate work, never a wrong count).
        echomq_stall_timeout=3600,
        task_default_queue=QUEUE,
    )


# The worker imports this module as ``large`` with the driver's environment.
if os.environ.get(ENV_STORE):
    configure(
        os.environ[ENV_STORE],
        os.environ[ENV_BROKER],
        os.environ[ENV_BACKEND],
        int(os.environ.get(ENV_CHUNK, "1000")),
    )


@app.task(name="large.child")  # type: ignore[untyped-decorator]
def child(i: int) -> int:
    return i


@app.task(name="large.parent")  # type: ignore[untyped-decorator]
def parent(values: list[int]) -> list[int]:
    return [len(values), sum(values)]


announce_ready(ENV_READY)


# --- measuring ---------------------------------------------------------------------------


@dataclass
class Command:
    """One SLOWLOG entry: how long one command held the server."""

    ms: float
    command: str  # the command, or "EVALSHA <script>" for one of ours


@dataclass
class Report:
    children: int
    chunk_size: int
    concurrency: int
    build_s: float = 0.0
    enqueue_s: float = 0.0
    enqueue_script_calls: int = 0
    enqueue_script_server_ms: float = 0.0
    enqueue_script_median_ms: float = 0.0  # of the calls of 1 ms or more (the chunks)
    enqueue_longest: list[Command] = field(default_factory=list)
    store_bytes_before: int = 0
    store_bytes_held: int = 0
    bytes_per_held_child: float = 0.0
    store_keys_held: int = 0
    child_row_bytes: int = 0  # MEMORY USAGE of one child's row
    child_payload_bytes: int = 0  # the stored message inside it
    broker_bytes_per_message: float = 0.0
    worker_ready_s: float = 0.0
    run_s: float = 0.0
    end_to_end_s: float = 0.0
    run_longest: list[Command] = field(default_factory=list)
    value: list[int] = field(default_factory=list)
    dependencies: list[int] = field(default_factory=list)
    redis_version: str = ""
    machine: str = field(default_factory=lambda: f"{platform.machine()}, {os.cpu_count()} cpus")


def scripts(entries: list[Command]) -> list[Command]:
    return [c for c in entries if c.command.startswith("EVALSHA ")]


def script_stats(client: redis.Redis) -> tuple[int, float]:  # type: ignore[type-arg]
    """(calls, server ms) of EVALSHA and EVAL since the last CONFIG RESETSTAT."""
    stats = client.info("commandstats")
    calls, usec = 0, 0
    for name in ("cmdstat_evalsha", "cmdstat_eval"):
        calls += int(stats.get(name, {}).get("calls", 0))
        usec += int(stats.get(name, {}).get("usec", 0))
    return calls, usec / 1000


def used_memory(client: redis.Redis) -> int:  # type: ignore[type-arg]
    return int(client.info("memory")["used_memory"])


# The driver's own reads of the store: not the flow's cost.
OWN_COMMANDS = frozenset({"INFO", "SLOWLOG", "CONFIG", "DBSIZE", "SCRIPT"})


def slowlog(client: redis.Redis, names: dict[str, str]) -> list[Command]:  # type: ignore[type-arg]
    """The SLOWLOG's entries, longest first, without the driver's own; an EVALSHA is named
    after its script.

    Redis before 7 also logs each command a script runs, as an entry of its own: at a 1 ms
    threshold those (microseconds each) stay out, and none is longer than its script anyway.
    """
    count = int(client.slowlog_len())
    out = []
    for entry in client.slowlog_get(count) if count else []:
        raw = entry["command"]
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        words = text.split(" ")
        name = words[0].upper()
        if name == "EVALSHA" and len(words) > 1:
            name = f"EVALSHA {names.get(words[1], words[1][:12])}"
        if name in OWN_COMMANDS:
            continue
        out.append(Command(entry["duration"] / 1000, name))
    return sorted(out, key=lambda c: c.ms, reverse=True)


def run(children: int, chunk_size: int, concurrency: int, timeout: float) -> Report:
    report = Report(children, chunk_size, concurrency)
    logdir = Path(tempfile.mkdtemp(prefix="echomq-large-"))
    with RedisServer() as store_server, RedisServer() as broker_server:
        env = {
            **os.environ,
            ENV_STORE: store_server.url(0),
            ENV_BROKER: broker_server.url(0),
            ENV_BACKEND: broker_server.url(1),
            ENV_CHUNK: str(chunk_size),
        }
        configure(env[ENV_STORE], env[ENV_BROKER], env[ENV_BACKEND], chunk_size)
        store = redis.Redis.from_url(env[ENV_STORE])
        broker = redis.Redis.from_url(env[ENV_BROKER])
        report.redis_version = str(store.info("server")["redis_version"])
        # Scripts loaded up front: their cache is not the flow's memory, nor its first call's.
        names = {
            str(store.script_load(load_source(name))): name  # type: ignore[no-untyped-call]
            for name in TRANSITIONS
        }
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=3)

        started = time.perf_counter()
        sigs = [child.s(i) for i in range(children)]
        report.build_s = time.perf_counter() - started

        store.config_set("slowlog-max-len", 10_000)
        store.config_set("slowlog-log-slower-than", 1000)
        store.slowlog_reset()
        store.config_resetstat()
        report.store_bytes_before = used_memory(store)
        broker_before = used_memory(broker)
        started = time.perf_counter()
        res = flow(parent.s(), sigs).apply_async(queue=QUEUE)
        enqueued = time.perf_counter()
        report.enqueue_s = enqueued - started
        calls, server_ms = script_stats(store)
        entries = slowlog(store, names)
        # Emptied before the memory is read: the log's own entries are not the flow's.
        store.slowlog_reset()
        report.enqueue_script_calls = calls
        report.enqueue_script_server_ms = round(server_ms, 3)
        chunks = sorted(c.ms for c in scripts(entries))
        report.enqueue_script_median_ms = chunks[len(chunks) // 2] if chunks else 0.0
        report.enqueue_longest = entries[:5]
        report.store_bytes_held = used_memory(store)
        report.bytes_per_held_child = round(
            (report.store_bytes_held - report.store_bytes_before) / children, 1
        )
        report.store_keys_held = int(store.dbsize())
        sample = store.zrange(f"emq:{{{QUEUE}}}:pending", 0, 0)[0].decode()
        row = f"emq:{{{QUEUE}}}:{sample}"
        report.child_row_bytes = int(store.memory_usage(row) or 0)
        report.child_payload_bytes = len(store.hget(row, "payload") or b"")
        report.broker_bytes_per_message = round((used_memory(broker) - broker_before) / children, 1)
        print_enqueue(report)

        worker = WorkerProcess(
            "large",
            log=logdir / "worker.log",
            cwd=HERE,
            env={
                **env,
                ENV_READY: str(logdir / "ready"),
                "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), env.get("PYTHONPATH", "")]),
            },
            queues=QUEUE,
            concurrency=concurrency,
            name=f"large-{os.getpid()}",
            loglevel="WARNING",
            ready_file=logdir / "ready",
            ready_timeout=120,
        )
        try:
            worker.start()
            ready = time.perf_counter()
            report.worker_ready_s = round(ready - enqueued, 3)
            report.value = wait_value(res, children, timeout)
            done = time.perf_counter()
            report.run_s = round(done - ready, 3)
            report.end_to_end_s = round(done - started, 3)
            report.dependencies = list(res.dependencies())
            report.run_longest = slowlog(store, names)[:5]
        finally:
            worker.stop()
    report.build_s = round(report.build_s, 3)
    report.enqueue_s = round(report.enqueue_s, 3)
    return report


def wait_value(res: Any, children: int, timeout: float) -> list[int]:
    """The parent's value, printing the fan-in's progress every few seconds meanwhile."""
    deadline = time.monotonic() + timeout
    last = (time.monotonic(), 0)
    while time.monotonic() < deadline:
        if res.ready():
            return list(res.get(timeout=30))
        processed = res.dependencies().done
        now = time.monotonic()
        if now - last[0] >= 10:
            rate = (processed - last[1]) / (now - last[0])
            print(f"  ... {processed:>7} / {children} credited ({rate:.0f}/s)", flush=True)
            last = (now, processed)
        time.sleep(0.5)
    raise TimeoutError(f"the parent did not finish within {timeout:.0f} s")


def print_enqueue(r: Report) -> None:
    longest = r.enqueue_longest[0] if r.enqueue_longest else Command(0.0, "-")
    print(f"flow of {r.children} children, chunk size {r.chunk_size} (Redis {r.redis_version})")
    print(f"  build signatures        {r.build_s:8.2f} s")
    print(f"  enqueue (apply_async)   {r.enqueue_s:8.2f} s   incl. publishing every message")
    print(
        f"  script calls            {r.enqueue_script_calls:8d}     "
        f"{r.enqueue_script_server_ms:.1f} ms of server time in all, "
        f"median chunk {r.enqueue_script_median_ms:.1f} ms"
    )
    print(f"  longest store command   {longest.ms:8.2f} ms  {longest.command}")
    print(
        f"  memory per held child   {r.bytes_per_held_child:8.1f} B   "
        f"({r.store_keys_held} keys; one child's row {r.child_row_bytes} B, of which "
        f"{r.child_payload_bytes} B its message)"
    )
    print(f"  broker, per message     {r.broker_bytes_per_message:8.1f} B")


def print_run(r: Report) -> None:
    print(f"  worker ready            {r.worker_ready_s:8.2f} s after the enqueue")
    print(f"  run (ready -> value)    {r.run_s:8.2f} s   {r.children / r.run_s:.0f} children/s")
    print(f"  end to end              {r.end_to_end_s:8.2f} s   apply_async -> value")
    for c in r.run_longest[:3]:
        print(f"  slow while running      {c.ms:8.2f} ms  {c.command}")
    if not r.run_longest:
        print("  slow while running      none over 1 ms")
    print(f"  parent value            {r.value}; dependencies {tuple(r.dependencies)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--children", type=int, default=100_000)
    parser.add_argument("--chunk-size", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the run")
    parser.add_argument("--out", type=Path, default=None, help="the JSON report's path")
    args = parser.parse_args(argv)
    report = run(args.children, args.chunk_size, args.concurrency, args.timeout)
    print_run(report)
    expected = [args.children, sum(range(args.children))]
    # Dependencies: outstanding, done, failed, ignored.
    settled = [0, args.children, 0, 0]
    ok = report.value == expected and report.dependencies == settled
    out = args.out or HERE / "results" / f"large-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**asdict(report), "ok": ok}, indent=2))
    print(f"  report                  {out}")
    if not ok:
        print(
            f"UNEXPECTED: value {report.value}, dependencies {tuple(report.dependencies)} "
            f"(want {expected}, {tuple(settled)})",
            file=sys.stderr,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
