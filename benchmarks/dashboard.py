"""What one dashboard page costs with 10,000 flows in the recent-flow index.

    python3 dev.py bench dashboard                     # 10,000 flows of 2 children, 50 requests
    python3 dev.py bench dashboard --flows 2000 --requests 20

A private redis-server is the flow store and nothing else (the broker and result backend are
another), so INFO commandstats counts the dashboard's own commands. The flows are enqueued
with no worker (every one held), and a tenth of them are then failed by a child under policy
``fail``, through the scripts, so the held and failed lists both have rows to find. The
dashboard is served by uvicorn in a thread and asked over HTTP with one keep-alive client;
the report gives, for ``/``, ``/metrics`` and ``/api/flows/<id>``, milliseconds per request
(median and p95) and Redis commands per request, and for comparison what one
``celery echomq stats`` costs (it finds held parents with a SCAN of the keyspace).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time
import uuid
from typing import Any

import httpx
import uvicorn
from celery import Celery

import celery_echomq
from celery_echomq import flow
from celery_echomq.embedded import RedisServer
from celery_echomq.ops.dashboard import make_app
from celery_echomq.store.scripts import ParentRef
from celery_echomq.store.state import get_state


def commands(client: Any, what: str = "calls") -> int:
    """Commands Redis has executed since the last CONFIG RESETSTAT (INFO and CONFIG aside), or
    with ``what="usec"`` the server time they took in µs."""
    stats = client.info("commandstats")
    return sum(
        int(v[what]) for k, v in stats.items() if k not in ("cmdstat_info", "cmdstat_config")
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flows", type=int, default=10_000)
    parser.add_argument("--children", type=int, default=2)
    parser.add_argument("--requests", type=int, default=50)
    args = parser.parse_args()

    with RedisServer() as store_server, RedisServer() as broker_server:
        app = Celery("dashbench")
        app.conf.update(
            broker_url=f"redis://127.0.0.1:{broker_server.port}/0",
            result_backend=f"redis://127.0.0.1:{broker_server.port}/1",
            echomq_redis_url=f"redis://127.0.0.1:{store_server.port}/0",
            echomq_stall_timeout=3600,
            broker_connection_retry_on_startup=True,
        )
        celery_echomq.install(app)

        @app.task(name="dashbench.leaf")
        def leaf(x: int) -> int:
            return x

        @app.task(name="dashbench.merge")
        def merge(values: list[int]) -> int:
            return sum(values)

        state = get_state(app)
        client = state.client
        started = time.perf_counter()
        parents: list[str] = []
        for i in range(args.flows):
            children = [
                leaf.s(i).set(task_id=f"JOB{uuid.uuid4().hex}") for _ in range(args.children)
            ]
            parents.append(flow(merge.s(), children).apply_async().id)
            if i % 10 == 0:
                # Fail one child of every tenth flow (policy fail): its parent fails.
                token = uuid.uuid4().hex
                cid = children[0].options["task_id"]
                state.scripts.claim("celery", cid, token, 60_000)
                state.scripts.fail(
                    "celery", cid, token, "ValueError: benchmark", ttl=86400,
                    is_parent=False, parent=ParentRef(parents[-1], "celery"),
                )  # fmt: skip
        took = time.perf_counter() - started
        print(f"enqueued {args.flows} flows of {args.children} in {took:.1f} s")
        print(
            f"store: {client.dbsize()} keys, recent index {client.zcard('emq:{celery}:recent')}, "
            f"failed set {client.zcard('emq:{celery}:failed')}, "
            f"held counter {client.hget('emq:{celery}:counters', 'held').decode()}"
        )

        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(make_app(app), host="127.0.0.1", port=port, log_level="warning")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=60) as http:
            for path in ("/", "/metrics", f"/api/flows/{parents[-1]}"):
                assert http.get(path).status_code == 200  # warm up: templates, scripts
                times = []
                client.config_resetstat()
                for _ in range(args.requests):
                    t0 = time.perf_counter()
                    response = http.get(path)
                    times.append((time.perf_counter() - t0) * 1000)
                    assert response.status_code == 200, response.text
                per_request = commands(client) / args.requests
                usec = commands(client, "usec") / args.requests
                times.sort()
                p95 = times[max(0, int(len(times) * 0.95) - 1)]
                name = path if not path.startswith("/api/") else "/api/flows/<id>"
                print(
                    f"{name:<18} {statistics.median(times):7.1f} ms median  {p95:7.1f} ms p95  "
                    f"{per_request:7.1f} Redis commands/request, {usec:6.0f} µs of Redis time  "
                    f"({len(response.content)} bytes)"
                )
        # For comparison: `celery echomq stats`, which finds held parents with a SCAN.
        from celery_echomq.ops.views import queue_stats

        client.config_resetstat()
        t0 = time.perf_counter()
        queue_stats(state)
        print(
            f"{'echomq stats':<18} {(time.perf_counter() - t0) * 1000:7.1f} ms (one call, SCAN)"
            f"                {commands(client):7d} Redis commands, "
            f"{commands(client, 'usec'):6d} µs of Redis time"
        )
        server.should_exit = True
        thread.join(timeout=10)


if __name__ == "__main__":
    main()
