"""What every read of one flow costs, at 100, 100,000 and 1,000,000 children.

    python3 dev.py bench flow-pages                        # 100, 100,000 and 1,000,000
    python3 dev.py bench flow-pages --sizes 100 100000 --requests 10

A private redis-server is the flow store and nothing else (the broker and result backend are
another), with SLOWLOG logging every command, so the slowest command any read sends is
measured, not guessed. Flows of 100 and 100,000 children are sent with ``apply_async`` (the
path a producer takes); then, through the scripts a worker runs, every child but one is
claimed and completed, ten fail (policy ``remove``: the flow goes on) and one stays running.
The flow of 1,000,000 children is built on the store without running anything: the chunked
path's scripts (open_flow, add_children per chunk, seal_flow) and the index, with a small
payload per child, nothing published; ten of them fail. Each dashboard route for the flow
(served by uvicorn in a thread, asked over HTTP with one keep-alive client), ``show`` (the
click command, in process), ``watch``'s read, ``read_flow`` (a page: what replaced
``read_tree``), a page of ``failed_children`` and the paging reads are asked ``--requests``
times: the report gives the median and worst milliseconds, the size of a response, and the
slowest Redis command while it ran. Targets: every dashboard route at most 200 ms and 200 KB,
``show`` at most 300 ms, no command over 2 ms.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import uvicorn
from celery import Celery
from click.testing import CliRunner

import celery_echomq
from celery_echomq import flow
from celery_echomq.embedded import RedisServer
from celery_echomq.ops.cli import echomq
from celery_echomq.ops.dashboard import make_app
from celery_echomq.ops.progress import read_progress
from celery_echomq.send.chunked import index_children
from celery_echomq.store.scripts import ParentRef
from celery_echomq.store.state import EchoMQ, get_state

QUEUE = "celery"
FAILED = 10  # children failed in each flow


def leaf(x: int) -> int:
    return x


def merge(values: list[int]) -> int:
    return sum(values)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def jid() -> str:
    return f"JOB{uuid.uuid4().hex}"


def settle_all(state: EchoMQ, parent_id: str, ids: list[str]) -> None:
    """Every child but the last claimed and completed (FAILED of them failed), through the
    scripts a worker runs; the last one claimed and left running."""
    scripts, parent = state.scripts, ParentRef(parent_id, QUEUE)
    for i, cid in enumerate(ids):
        token = uuid.uuid4().hex
        scripts.claim(QUEUE, cid, token, 3_600_000)
        if i == len(ids) - 1:
            return  # running
        if i % max(1, len(ids) // FAILED) == 1:
            scripts.fail(
                QUEUE, cid, token, "ValueError: benchmark", ttl=86400, is_parent=False,
                parent=parent,
            )  # fmt: skip
        else:
            scripts.complete(
                QUEUE, cid, token, ttl=86400, is_parent=False, parent=parent,
                value=state.dumps(i),
            )  # fmt: skip


def sent_flow(app: Celery, n: int) -> str:
    leaf, merge = app.tasks["bench.leaf"], app.tasks["bench.merge"]
    children = [leaf.s(i).set(task_id=jid()) for i in range(n)]
    started = time.perf_counter()
    parent_id = str(flow(merge.s(), children, policy="remove").apply_async().id)
    print(f"  sent {n:,} children in {time.perf_counter() - started:.1f} s")
    started = time.perf_counter()
    settle_all(get_state(app), parent_id, [c.options["task_id"] for c in children])
    print(f"  settled {n - 1:,} of them in {time.perf_counter() - started:.1f} s")
    return parent_id


def built_flow(app: Celery, n: int, chunk: int = 1000) -> str:
    """A flow of ``n`` children written on the store by the chunked path's scripts, nothing
    published or run; FAILED of them failed."""
    state = get_state(app)
    scripts = state.scripts
    parent_id = jid()
    started = time.perf_counter()
    ids = [jid() for _ in range(n)]
    parent = {
        "task": "bench.merge",
        "args": [],
        "kwargs": {},
        "options": {"task_id": parent_id, "queue": QUEUE},
        "children": ids,
    }
    scripts.open_flow(QUEUE, parent_id, state.dumps(parent), n, "remove")
    index_children(state, QUEUE, parent_id, parent, ids, chunk)
    ref = ParentRef(parent_id, QUEUE)
    for start in range(0, n, chunk):
        rows = [
            (cid, state.dumps({"task": "bench.leaf", "args": [start + i], "kwargs": {},
                               "options": {"task_id": cid, "queue": QUEUE}}), "")
            for i, cid in enumerate(ids[start : start + chunk])
        ]  # fmt: skip
        scripts.add_children(QUEUE, ref, rows)
    scripts.seal_flow(QUEUE, parent_id)
    # What start_flow writes beside the scripts: where the flow lives, and its queue.
    state.client.set(state.keys.locator_key(parent_id), QUEUE)
    state.client.sadd(state.keys.queues_key(), QUEUE)
    print(f"  built {n:,} children in {time.perf_counter() - started:.1f} s")
    for cid in ids[1 :: max(1, n // FAILED)][:FAILED]:
        token = uuid.uuid4().hex
        scripts.claim(QUEUE, cid, token, 3_600_000)
        scripts.fail(QUEUE, cid, token, "ValueError: benchmark", ttl=86400, is_parent=False,
                     parent=ref)  # fmt: skip
    return parent_id


class Slowlog:
    """The slowest command the store ran since the last reset (every command is logged)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        client.config_set("slowlog-log-slower-than", 0)
        client.config_set("slowlog-max-len", 200_000)

    def reset(self) -> None:
        self.client.slowlog_reset()

    def worst(self) -> tuple[int, str]:
        entries = self.client.slowlog_get(200_000)
        ours = [
            e for e in entries
            if not e["command"].upper().startswith((b"SLOWLOG", b"CONFIG"))
        ]  # fmt: skip
        if not ours:
            return 0, ""
        top = max(ours, key=lambda e: e["duration"])
        return int(top["duration"]), top["command"][:60].decode(errors="replace")


def measure(
    name: str, ask: Callable[[], int], requests: int, slowlog: Slowlog, rows: list[list[str]]
) -> None:
    ask()  # warm: templates, scripts
    slowlog.reset()
    times, size = [], 0
    for _ in range(requests):
        t0 = time.perf_counter()
        size = ask()
        times.append((time.perf_counter() - t0) * 1000)
    usec, command = slowlog.worst()
    rows.append(
        [name, f"{statistics.median(times):.1f}", f"{max(times):.1f}", f"{size / 1000:.1f}",
         f"{usec / 1000:.2f}", command]
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 100_000, 1_000_000])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument(
        "--no-all", action="store_true", help="skip show --all's pages (11 min at 1,000,000)"
    )
    args = parser.parse_args()

    with RedisServer() as store_server, RedisServer() as broker_server:
        app = Celery("pagebench")
        app.conf.update(
            broker_url=f"redis://127.0.0.1:{broker_server.port}/0",
            result_backend=f"redis://127.0.0.1:{broker_server.port}/1",
            echomq_redis_url=f"redis://127.0.0.1:{store_server.port}/0",
            echomq_stall_timeout=3600,
            broker_connection_retry_on_startup=True,
        )
        celery_echomq.install(app)
        app.task(name="bench.leaf")(leaf)
        app.task(name="bench.merge")(merge)
        state = get_state(app)
        slowlog = Slowlog(state.client)

        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(make_app(app), host="127.0.0.1", port=port, log_level="warning")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        runner = CliRunner()
        app.set_current()  # what the `echomq` group reads outside `celery`
        print("the index of children, on enqueue:")
        index_cost(app, slowlog)
        table: dict[int, list[list[str]]] = {}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            for n in args.sizes:
                print(f"{n:,} children:")
                parent_id = built_flow(app, n) if n >= 1_000_000 else sent_flow(app, n)
                row = state.keys.job_key(QUEUE, parent_id)
                index = state.keys.children_key(QUEUE, parent_id)
                print(f"  the parent's row: {state.client.hlen(row):,} fields, a payload of "
                      f"{state.client.hstrlen(row, 'payload'):,} bytes; its index of children "
                      f"{state.client.memory_usage(index, samples=0) or 0:,} bytes")  # fmt: skip
                cursor = str(n // 2)  # a page in the middle

                rows: list[list[str]] = []
                page = f"/flows/{parent_id}"
                for name, ask in (
                    ("/flows/<id>", get(http, page)),
                    ("/flows/<id>/live", get(http, f"{page}/live")),
                    ("/api/flows/<id>", get(http, f"/api/flows/{parent_id}")),
                    ("/flows/<id>?cursor=<middle>", get(http, f"{page}?cursor={cursor}")),
                    ("/flows/<id>?state=failed", get(http, f"{page}?state=failed")),
                    ("/flows/<id>/live?state=active", get(http, f"{page}/live?state=active")),
                    ("/api/flows/<id>?state=done", get(http, f"/api/{page[1:]}?state=done")),
                    ("show <id>", cli(runner, "show", parent_id)),
                    ("show <id> --state failed", cli(runner, "show", parent_id, "--state=failed")),
                    ("watch's read", progress(state, parent_id)),
                    ("read_flow (a page)", page_read(state, parent_id)),
                    ("failed_children (a page)", failed_page(app, parent_id)),
                ):
                    measure(name, ask, args.requests, slowlog, rows)
                table[n] = rows
                for line in rows:
                    print(f"  {line[0]:<32} {line[1]:>7} ms median {line[2]:>7} ms worst "
                          f"{line[3]:>7} KB  slowest command {line[4]} ms ({line[5]})")  # fmt: skip
                if not args.no_all:
                    started = time.perf_counter()
                    lines = sum(1 for _ in iter_all(state, parent_id))
                    took = time.perf_counter() - started
                    print(f"  show --all's pages: {lines:,} children in {took:.1f} s")
                state.client.flushdb()
        server.should_exit = True
        thread.join(timeout=10)
    print("\n| route | " + " | ".join(f"{n:,} children" for n in table) + " |")
    print("|---|" + "---|" * len(table))
    names = [line[0] for line in next(iter(table.values()))]
    for i, name in enumerate(names):
        cells = [
            f"{rows[i][1]} ms, {rows[i][3]} KB, slowest {rows[i][4]} ms" for rows in table.values()
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")


def get(http: httpx.Client, path: str) -> Callable[[], int]:
    def ask() -> int:
        response = http.get(path)
        assert response.status_code == 200, (path, response.text[:200])
        return len(response.content)

    return ask


def cli(runner: CliRunner, *words: str) -> Callable[[], int]:
    def ask() -> int:
        out = runner.invoke(echomq, list(words), catch_exceptions=False)
        assert out.exit_code == 0, out.output
        return len(out.stdout.encode())

    return ask


def progress(state: EchoMQ, parent_id: str) -> Callable[[], int]:
    return lambda: len(repr(read_progress(state, parent_id)))


def page_read(state: EchoMQ, parent_id: str) -> Callable[[], int]:
    """``read_flow``: what replaced ``read_tree`` in every operator's read (its size: the
    repr of the node it returns)."""
    from celery_echomq.ops.pages import read_flow

    return lambda: len(repr(read_flow(state, parent_id)))


def failed_page(app: Celery, parent_id: str) -> Callable[[], int]:
    """``FlowResult.failed_children(count=50)``: one page of the flow's failed children."""
    from celery_echomq.result import FlowResult

    res = FlowResult(parent_id, app=app)
    return lambda: len(repr(res.failed_children(count=50)))


def index_cost(app: Celery, slowlog: Slowlog, flows: int = 200) -> None:
    """What the index adds to an enqueue: enqueue_flow's time (SLOWLOG, the server's own
    clock) for flows of 10 and 1,000 children, beside one RPUSH of the same ids (the
    index's own command, one per 500 children in the script), and its memory."""
    leaf, merge = app.tasks["bench.leaf"], app.tasks["bench.merge"]
    state = get_state(app)
    for n in (10, 1000):
        slowlog.reset()
        last = ""
        for _ in range(flows):
            last = flow(merge.s(), [leaf.s(i) for i in range(n)]).apply_async().id
        entries = [
            e for e in state.client.slowlog_get(200_000) if e["command"].startswith(b"EVALSHA")
        ]
        enqueue = statistics.median(e["duration"] for e in entries if e["duration"] > 0)
        index = state.keys.children_key(QUEUE, last)
        ids = state.client.lrange(index, 0, -1)
        slowlog.reset()
        for _ in range(flows):
            state.client.rpush("bench:index", *ids)
            state.client.delete("bench:index")
        pushes = [e["duration"] for e in state.client.slowlog_get(200_000)
                  if e["command"].startswith(b"RPUSH")]  # fmt: skip
        size = state.client.memory_usage(index, samples=0) or 0
        push = statistics.median(pushes)
        print(f"  enqueue_flow of {n:,} children: {enqueue:.0f} µs median, of which the "
              f"index's RPUSH ~{push:.0f} µs; the index holds {size:,} bytes")  # fmt: skip
    state.client.flushdb()


def iter_all(state: EchoMQ, parent_id: str) -> Any:
    from celery_echomq.ops.pages import iter_children

    return iter_children(state, parent_id, count=1000)


if __name__ == "__main__":
    main()
