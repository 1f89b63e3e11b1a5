"""A store that refuses writes, made so for real on a private redis-server, as an operator sees
it: ``doctor``'s ``writes`` line (wrong, with what heals it), the last line of ``show``, and a
banner on the dashboard's pages over HTTP. Each state is undone after and the server accepts
writes again.

The four states: out of memory under ``noeviction`` (``maxmemory`` set below ``used_memory``),
a read-only replica (``REPLICAOF`` another private server), a failed RDB snapshot with
``stop-writes-on-bgsave-error yes`` (``dir`` set to a directory then removed, and ``BGSAVE``),
and too few replicas for ``min-replicas-to-write``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import redis
from celery import Celery
from click.testing import CliRunner

import celery_echomq
from celery_echomq import flow
from celery_echomq.embedded import RedisServer
from celery_echomq.ops.cli import echomq
from tests.helpers import Served, wait_for

Undo = Callable[[], None]


def _oom(server: RedisServer, client: Any) -> Undo:
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", used // 2)
    return lambda: client.config_set("maxmemory", 0)


def _replica(server: RedisServer, client: Any) -> Undo:
    # Another private server: its (empty) dataset replaces this one's, as a replica's does.
    primary = RedisServer().start()
    client.replicaof("127.0.0.1", primary.port)
    wait_for(lambda: client.info("replication").get("master_link_status") == "up")

    def undo() -> None:
        client.replicaof("NO", "ONE")
        primary.stop()

    return undo


def _failed_save(server: RedisServer, client: Any) -> Undo:
    dir_before = client.config_get("dir")["dir"]
    gone = tempfile.mkdtemp(prefix="echomq-gone-")
    client.config_set("save", "3600 1")  # snapshots on: a failed one stops writes
    client.config_set("dir", gone)
    shutil.rmtree(gone)
    client.bgsave()
    wait_for(lambda: client.info("persistence")["rdb_last_bgsave_status"] == "err")

    def undo() -> None:
        client.config_set("dir", dir_before)
        client.bgsave()
        wait_for(lambda: client.info("persistence")["rdb_last_bgsave_status"] == "ok")
        client.config_set("save", "")

    return undo


def _no_replica(server: RedisServer, client: Any) -> Undo:
    client.config_set("min-replicas-to-write", 1)
    return lambda: client.config_set("min-replicas-to-write", 0)


# (state, make it, what Redis answers a write, what doctor's line says, what heals it)
STATES: list[tuple[str, Callable[[RedisServer, Any], Undo], str, str, str]] = [
    ("oom", _oom, "OOM", "out of memory (used_memory ", "raise maxmemory"),
    ("replica", _replica, "READONLY", "a read-only replica of 127.0.0.1:", "REPLICAOF NO ONE"),
    ("failed-save", _failed_save, "MISCONF", "its last RDB snapshot failed (MISCONF)", "BGSAVE"),
    (
        "min-replicas",
        _no_replica,
        "NOREPLICAS",
        "0 replica(s) in sync, fewer than min-replicas-to-write=1 (NOREPLICAS)",
        "lower min-replicas-to-write",
    ),
]


# What redis-py's error says of each refusal (it keeps some of Redis's error codes as classes).
ANSWERS = {
    "OOM": "used memory > 'maxmemory'",
    "READONLY": "read only replica",
    "MISCONF": "MISCONF",
    "NOREPLICAS": "NOREPLICAS",
}


@pytest.fixture
def deployment() -> Iterator[tuple[RedisServer, Any, str]]:
    """A private server as broker, backend and store, an app on it, and a flow held there."""
    with RedisServer() as server:
        name = f"refusing{uuid.uuid4().hex[:8]}"
        app = Celery(name, broker=server.url(0), backend=server.url(1), set_as_current=False)
        app.conf.echomq_redis_url = server.url(1)

        @app.task(name=f"{name}.add")
        def add(a: int, b: int) -> int:
            return a + b

        celery_echomq.install(app)
        held = flow(add.s(0, 0), [add.s(1, 1), add.s(2, 2)]).apply_async()
        yield server, app, held.id


def _cli(app: Any, *args: str) -> Any:
    return CliRunner().invoke(echomq, list(args), obj=SimpleNamespace(app=app))


def _writes(app: Any) -> dict[str, str]:
    out = _cli(app, "doctor", "--json")
    findings = {f["check"]: f for f in json.loads(out.stdout)["findings"]}
    return dict(findings["writes"], exit=str(out.exit_code))


@pytest.mark.parametrize(
    ("make", "answer", "why", "heals"), [s[1:] for s in STATES], ids=[s[0] for s in STATES]
)
def test_doctor_show_and_the_dashboard_say_the_store_refuses_writes_and_what_heals_it(
    deployment: tuple[RedisServer, Any, str],
    make: Callable[[RedisServer, Any], Undo],
    answer: str,
    why: str,
    heals: str,
) -> None:
    server, app, held = deployment
    client = server.client()
    assert _writes(app)["status"] == "ok"
    shown = _cli(app, "show", held)
    assert shown.exit_code == 0, shown.output
    assert "refuses writes" not in shown.output
    undo = make(server, client)
    try:
        # The state is real: the server refuses a write.
        with pytest.raises(redis.RedisError, match=ANSWERS[answer]):
            server.client(db=1).set("refused?", "yes")
        writes = _writes(app)
        print(f"WRONG  writes: {writes['detail']} -> change: {writes['change']}")  # -s
        assert writes["status"] == "wrong" and writes["exit"] == "1"
        assert why in writes["detail"]
        assert "every transition is refused, so no flow starts or moves" in writes["detail"]
        assert heals in writes["change"]
        if answer != "READONLY":  # a replica's dataset is its primary's: the flow is not there
            shown = _cli(app, "show", held)
            assert shown.exit_code == 0, shown.output
            last = shown.output.splitlines()[-1]
            assert last.startswith(f"the flow store refuses writes: 127.0.0.1:{server.port} is ")
            assert why in last and "; heals: " in last and heals in last
            # The same line in show --json, for scripts.
            as_json = json.loads(_cli(app, "show", held, "--json").stdout)
            said = as_json["store_refuses_writes"]  # read again: used_memory may have moved
            assert said.startswith("the flow store refuses writes: ") and why in said
        dashboard = Served(app, allow_actions=False)
        try:
            for page in ("/", "/workers", f"/flows/{held}"):
                if answer == "READONLY" and page.startswith("/flows/"):
                    continue
                body = httpx.get(dashboard.url + page, timeout=30).text
                assert body.count('id="refusing"') == 1, page
                assert why in body.replace("&gt;", ">").replace("&#39;", "'"), page
        finally:
            dashboard.stop()
    finally:
        undo()
    # Healed: the server accepts writes again, and doctor says so.
    wait_for(lambda: server.client(db=1).set("refused?", "no"))
    assert _writes(app)["status"] == "ok"
    if answer != "READONLY":
        assert "refuses writes" not in _cli(app, "show", held).output
        assert json.loads(_cli(app, "show", held, "--json").stdout)["store_refuses_writes"] == ""


def test_a_commands_plain_write_that_the_store_refuses_names_the_store_and_the_remedy(
    deployment: tuple[RedisServer, Any, str],
) -> None:
    """A write the command makes outside the scripts (here a plain SET, through the CLI's own
    error handling) that a full store refuses: one line naming the store, why and what heals
    it, exit status 1."""
    import click

    from celery_echomq.ops.cli_common import cli_state, plain_errors

    server, app, _ = deployment

    @click.command()
    @click.pass_context
    @plain_errors
    def mark(ctx: click.Context) -> None:
        cli_state(ctx).client.set("emq:marked", "x" * 1000)

    undo = _oom(server, server.client())
    try:
        out = CliRunner().invoke(mark, [], obj=SimpleNamespace(app=app))
    finally:
        undo()
    assert out.exit_code == 1
    line = out.output.strip().splitlines()[-1]
    assert line.startswith(
        f"Error: the flow store redis://127.0.0.1:{server.port}/1 refuses writes"
    )
    assert "out of memory" in line and "maxmemory raised" in line
    assert "the command stopped at that write and did nothing after it" in line
    assert server.client(db=1).get("emq:marked") is None
