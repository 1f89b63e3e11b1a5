"""A flow store that answers but refuses writes: out of memory under noeviction (OOM), a
read-only replica (READONLY), a failed RDB save (MISCONF), too few replicas (NOREPLICAS); and
one that is out of reach.

Each refusal is made for real on a private redis-server the test owns: no body runs without
its claim (a refused claim defers the body to recovery), a body that ran records its outcome
once the store heals (retried while its worker holds the lease), and a producer is told what
refused, and that nothing was written. Bodies are counted from the workers' logs, never on the
server that is full.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult

import celery_echomq
from celery_echomq import StoreWriteRefusedError, flow
from celery_echomq.config import Settings
from celery_echomq.embedded import RedisServer, wait_replicated
from celery_echomq.store.connection import make_client
from celery_echomq.store.keyspace import new_job_id
from celery_echomq.store.loader import load_source
from celery_echomq.store.scripts import Scripts
from tests.helpers import (
    KEYS,
    Env,
    Worker,
    logged,
    row,
    runs_in_log,
    snapshot,
    store_of,
    wait_for,
)

STALL = "6"  # the workers' stall timeout (s): two thirds of it outlast every refusal here


def ran_once(worker: Worker, *ids: str) -> None:
    """Each of ``ids`` ran once: its "succeeded" line, written just after its result, is
    waited for; none twice."""
    wait_for(lambda: all(runs_in_log(worker.log)[i] for i in ids), timeout=10)
    runs = runs_in_log(worker.log)
    assert [runs[i] for i in ids] == [1] * len(ids), runs


def fill(client: redis.Redis) -> None:
    """The server is full: maxmemory below what it uses, under noeviction."""
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", str(int(client.info("memory")["used_memory"]) // 2))


def drain(client: redis.Redis) -> None:
    client.config_set("maxmemory", "0")


def refuse(kind: str, store: RedisServer, spare: RedisServer, where: str) -> None:
    """``store`` refuses writes for real, for ``kind``'s reason (``spare``: a server to make
    it the replica of; ``where``: a directory for its failed save)."""
    client = store.client()
    if kind == "OOM":
        fill(client)
    elif kind == "READONLY":
        # The store becomes a replica of a copy of itself: its rows stay, its writes go.
        other = spare.client()
        other.replicaof("127.0.0.1", str(store.port))
        wait_replicated(client, 1)
        other.replicaof("NO", "ONE")
        client.replicaof("127.0.0.1", str(spare.port))
        wait_for(lambda: client.info("replication")["master_link_status"] == "up")
    elif kind == "MISCONF":
        # A save that fails (its dir is gone), under stop-writes-on-bgsave-error.
        client.config_set("save", "3600 1")
        client.config_set("stop-writes-on-bgsave-error", "yes")
        os.makedirs(where, exist_ok=True)
        client.config_set("dir", where)
        shutil.rmtree(where)
        client.bgsave()
        wait_for(lambda: client.info("persistence")["rdb_last_bgsave_status"] == "err")
    else:
        client.config_set("min-replicas-to-write", "1")


def heal(kind: str, store: RedisServer, where: str) -> None:
    client = store.client()
    if kind == "OOM":
        drain(client)
    elif kind == "READONLY":
        client.replicaof("NO", "ONE")
    elif kind == "MISCONF":
        os.makedirs(where, exist_ok=True)
        client.config_set("dir", where)  # the server's cwd was the removed one

        def saved() -> bool:
            with contextlib.suppress(redis.ResponseError):  # a save already under way
                client.bgsave()
            time.sleep(0.2)
            return bool(client.info("persistence")["rdb_last_bgsave_status"] == "ok")

        wait_for(saved, timeout=10)
        client.config_set("save", "")
    else:
        client.config_set("min-replicas-to-write", "0")


KINDS = ["OOM", "READONLY", "MISCONF", "NOREPLICAS"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_script_the_store_refuses_writes_nothing_and_names_the_refusal(
    kind: str, tmp_path: Path
) -> None:
    """Refused at its first write, a transition wrote nothing (Redis lets a script that has
    written finish, so it is all or nothing), and the error names the store and the cause."""
    with RedisServer() as server, RedisServer() as spare:
        settings = Settings(redis_url=server.url(0), store_retry_timeout=0.3)
        scripts = Scripts(make_client(settings), KEYS, retry_timeout=0.3, store=server.url(0))
        server.client().set("ballast", "x" * 100_000)
        before = snapshot(server.client())
        refuse(kind, server, spare, str(tmp_path / "rdb"))
        try:
            with pytest.raises(StoreWriteRefusedError) as caught:
                scripts.enqueue_flow("q", new_job_id(), b"p", [(new_job_id(), b"c")])
            assert snapshot(server.client()) == before
            assert caught.value.code == kind
            assert str(caught.value).startswith(f"the flow store {server.url(0)} refuses writes")
            assert f"(Redis: {kind} " in str(caught.value)
        finally:
            heal(kind, server, str(tmp_path / "rdb"))
        assert scripts.enqueue_flow("q", new_job_id(), b"p", [(new_job_id(), b"c")]) == 1


# --- the producer -------------------------------------------------------------------------------


def test_a_flow_sent_to_a_full_store_is_refused_naming_it_and_writes_and_publishes_nothing(
    env: Env, proj: Any
) -> None:
    queue = f"full-{uuid.uuid4().hex[:6]}"
    broker = redis.Redis.from_url(env.broker)
    with RedisServer() as server, store_of(proj.app, redis_url=server.url(0)):
        direct = server.client()
        direct.set("ballast", "x" * 100_000)
        fill(direct)
        before = sorted(direct.keys("*"))
        parent = new_job_id()
        sig = flow(proj.tsum.s().set(task_id=parent), [proj.add.s(1, 2), proj.add.s(3, 4)])
        with pytest.raises(StoreWriteRefusedError) as caught:
            sig.apply_async(queue=queue)
        said = str(caught.value)
        assert said.startswith(f"the flow store {server.url(0)} refuses writes: it is out of")
        assert "noeviction" in said and "memory is freed or maxmemory raised" in said
        assert f"flow {parent} was not started: nothing of it was written or published" in said
        assert "(Redis: OOM command not allowed" in said
        assert caught.value.code == "OOM" and caught.value.store == server.url(0)
        # Also the redis-py error it was: code that catches one still does.
        assert isinstance(caught.value, redis.ResponseError)
        assert sorted(direct.keys("*")) == before
        assert broker.keys(f"{queue}*") == []

        drain(direct)  # healed: the same flow starts
        assert sig.apply_async(queue=queue).id == parent


@pytest.mark.e2e
def test_a_flow_whose_messages_the_broker_refused_is_published_by_recovery_once_it_heals(
    env: Env,
) -> None:
    """The store took the flow, the broker (a Redis out of memory) refused its messages: the
    error names the broker and says the flow is in the store; once the broker takes writes,
    recovery publishes the children and the flow runs, each body once."""
    with RedisServer() as store, RedisServer() as broker:
        producer = Celery(f"full-{uuid.uuid4().hex[:6]}", set_as_current=False)
        producer.conf.update(broker_url=broker.url(0), result_backend=env.backend)
        producer.conf.echomq_redis_url = store.url(0)
        celery_echomq.install(producer)
        full = broker.client()
        full.set("ballast", "x" * 100_000)
        fill(full)
        parent = new_job_id()
        kids = [producer.signature("tests.proj.add", (1, 2), task_id=new_job_id()) for _ in "ab"]
        sig = flow(producer.signature("tests.proj.tsum", task_id=parent), kids, app=producer)
        with pytest.raises(StoreWriteRefusedError) as caught:
            sig.apply_async(queue="q")
        said = str(caught.value)
        assert said.startswith(f"the broker {broker.url(0)} refuses writes: it is out of memory")
        assert f"flow {parent} was written to the store, but not every message" in said
        assert row(store.client(), "q", parent)["state"] == "awaiting_children"

        drain(full)
        worker = Worker(
            env,
            queues="q",
            name=f"broker-{uuid.uuid4().hex[:6]}",
            extra_env={
                "ECHOMQ_T_BROKER": broker.url(0),
                "ECHOMQ_T_STORE": store.url(0),
                "ECHOMQ_T_STALL": "2",
                "ECHOMQ_T_RECOVERY_INTERVAL": "0.5",
            },
        )
        try:
            assert AsyncResult(parent, app=producer).get(timeout=30) == 6
            ran_once(worker, parent, *(k.id for k in kids))
            assert "re-published" in worker.output()
        finally:
            worker.stop()
            producer.close()


# --- a claim refused: the body waits, then runs once ---------------------------------------------


class Cut:
    """A TCP proxy on loopback in front of a real redis-server that can be cut: every
    connection through it closed and new ones refused, as when the network to the store goes;
    ``lose_reply_to``: the next command that carries those bytes reaches the server, and the
    proxy is cut before its reply comes back (a claim that landed, its answer lost)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cut = threading.Event()
        self.trigger: bytes | None = None
        self.lost = threading.Event()
        self.socks: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                if self.cut.is_set():
                    client.close()
                    continue
                server = socket.create_connection(("127.0.0.1", self.target))
                with self.lock:
                    self.socks += [client, server]
                armed = threading.Event()
                for src, dst, up in ((client, server, True), (server, client, False)):
                    threading.Thread(
                        target=self._pump, args=(src, dst, armed, up), daemon=True
                    ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, armed: Any, up: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if up and self.trigger is not None and self.trigger in data:
                    self.trigger = None
                    armed.set()
                if not up and armed.is_set():
                    self.lost.set()
                    self.sever()  # the command ran; its reply goes nowhere
                    break
                dst.sendall(data)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def sever(self) -> None:
        self.cut.set()
        with self.lock:
            socks, self.socks = self.socks, []
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def lose_reply_to(self, marker: bytes) -> None:
        self.trigger = marker

    def heal(self) -> None:
        self.cut.clear()

    def close(self) -> None:
        self.sever()
        self.listener.close()


class Claims:
    """One private store (behind a :class:`Cut`), a spare server for READONLY, and a worker of
    concurrency 1 on its own queue whose store is the proxy."""

    def __init__(self, env: Env, store: RedisServer, spare: RedisServer, cut: Cut) -> None:
        self.store, self.spare, self.cut = store, spare, cut
        self.queue = f"claims-{uuid.uuid4().hex[:6]}"
        self.worker = Worker(
            env,
            queues=self.queue,
            concurrency=1,
            name=f"claims-{uuid.uuid4().hex[:6]}",
            extra_env={
                "ECHOMQ_T_STORE": cut.url(0),
                "ECHOMQ_T_STALL": STALL,
                "ECHOMQ_T_RECOVERY_INTERVAL": "0.5",
                "ECHOMQ_T_STORE_RETRY": "1",
            },
        )
        self.dir = tempfile.mkdtemp(prefix="echomq-misconf-")

    def refuse(self, kind: str) -> None:
        if kind == "connection":
            self.cut.sever()
        else:
            refuse(kind, self.store, self.spare, self.dir)

    def heal(self, kind: str) -> None:
        if kind == "connection":
            self.cut.heal()
        else:
            heal(kind, self.store, self.dir)


@pytest.fixture(scope="module")
def claims(env: Env) -> Iterator[Claims]:
    with RedisServer() as store, RedisServer() as spare:
        # Loaded up front: the claim's first EVALSHA runs it (lose_reply_to looks for its sha).
        store.client().script_load(load_source("claim"))
        cut = Cut(store.port)
        fixture = Claims(env, store, spare, cut)
        try:
            yield fixture
        finally:
            fixture.worker.stop()
            cut.close()


def _flow_behind_a_busy_worker(claims: Claims, proj: Any) -> tuple[Any, str, str]:
    """A one-child flow whose child's message waits behind a task that keeps the worker's one
    pool process busy for three seconds: the refusal is in place before its claim."""
    busy = proj.sleep_then.apply_async((0, 3.0), queue=claims.queue)
    logged(claims.worker, f"Task tests.proj.sleep_then[{busy.id}] received")
    parent, child = new_job_id(), new_job_id()
    with store_of(proj.app, redis_url=claims.store.url(0)):
        res = flow(proj.tsum.s().set(task_id=parent), [proj.add.s(1, 2).set(task_id=child)])
        res = res.apply_async(queue=claims.queue)
    return res, parent, child


@pytest.mark.e2e
@pytest.mark.parametrize("kind", [*KINDS, "connection"])
def test_a_refused_claim_runs_no_body_and_the_job_runs_once_when_the_store_heals(
    claims: Claims, proj: Any, kind: str
) -> None:
    res, parent, child = _flow_behind_a_busy_worker(claims, proj)
    claims.refuse(kind)
    try:
        if kind == "connection":
            logged(claims.worker, f"the claim of {child} on {claims.queue} failed against the")
            logged(claims.worker, "StoreConnectionError")
        else:
            logged(claims.worker, f"The claim of {child} on {claims.queue} wrote nothing")
            assert f"{claims.cut.url(0)} refuses writes: " in claims.worker.output()
        assert "its body does not run here: it is deferred to recovery" in claims.worker.output()
        time.sleep(1)  # recovery's passes go on meanwhile, and run nothing
        assert runs_in_log(claims.worker.log)[child] == 0
    finally:
        claims.heal(kind)
    assert res.get(timeout=30) == 3
    ran_once(claims.worker, child, parent)
    assert f"re-published {child}" in claims.worker.output()


@pytest.mark.e2e
def test_a_claim_that_landed_with_its_reply_lost_is_taken_back_once_its_lease_lapses(
    claims: Claims, proj: Any
) -> None:
    """The claim reached the server, its reply did not, and the store stayed out of reach past
    the retry: the row is active under a token no process holds. Nothing renews its lease;
    recovery takes the job back when it lapses, and its body runs once."""
    claim_sha = claims.store.client().script_load(load_source("claim")).encode()
    claims.cut.lose_reply_to(claim_sha)
    res, parent, child = _flow_behind_a_busy_worker(claims, proj)
    try:
        logged(claims.worker, f"the claim of {child} on {claims.queue} failed against the")
        assert claims.cut.lost.is_set()
        assert row(claims.store.client(), claims.queue, child)["state"] == "active"
        assert runs_in_log(claims.worker.log)[child] == 0
    finally:
        claims.cut.heal()
    assert res.get(timeout=30) == 3
    ran_once(claims.worker, child, parent)


# --- a full store mid-flows ----------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("where", ["results_in_the_store", "results_elsewhere"])
def test_flows_under_a_store_that_fills_up_mid_flight_run_each_body_once(
    env: Env, where: str
) -> None:
    """Flows in flight when the store runs out of memory for a few seconds: claims made then
    defer their bodies; bodies that ran keep their outcomes until it lands. Where the store
    writes the jobs' results (the result backend on its database), nothing else records an
    outcome, so one dropped would have its body run again."""
    with RedisServer() as server:
        store = server.url(0)
        backend = store if where == "results_in_the_store" else env.backend
        producer = Celery(f"full-{uuid.uuid4().hex[:6]}", set_as_current=False)
        producer.conf.update(broker_url=env.broker, result_backend=backend)
        producer.conf.echomq_redis_url = store
        celery_echomq.install(producer)
        queue = f"full-{uuid.uuid4().hex[:6]}"
        worker = Worker(
            env,
            queues=queue,
            concurrency=2,
            name=queue,
            extra_env={
                "ECHOMQ_T_STORE": store,
                "ECHOMQ_T_BACKEND": backend,
                "ECHOMQ_T_STALL": STALL,
                "ECHOMQ_T_RECOVERY_INTERVAL": "0.5",
            },
        )
        try:
            sent = []
            for f in range(6):
                ids = [new_job_id() for _ in range(4)]
                kids = [
                    producer.signature("tests.proj.sleep_then", (f * 10 + i, 0.3), task_id=cid)
                    for i, cid in enumerate(ids)
                ]
                parent = producer.signature("tests.proj.tsum", task_id=new_job_id())
                sent.append((flow(parent, kids, app=producer).apply_async(queue=queue), ids))
            logged(worker, "succeeded")  # flows are in flight
            fill(server.client())
            time.sleep(3)  # well within two thirds of the stall timeout
            drain(server.client())
            for f, (res, _) in enumerate(sent):
                assert res.get(timeout=60) == sum(f * 10 + i for i in range(4))
            ran_once(worker, *(i for res, ids in sent for i in (res.id, *ids)))
            assert "its body does not run here: it is deferred to recovery" in worker.output()
        finally:
            worker.stop()
            producer.close()


@pytest.mark.e2e
def test_an_outcome_refused_while_the_lease_holds_lands_once_the_store_heals(
    env: Env, proj: Any
) -> None:
    """A body that ran while the store stopped taking writes (too few replicas): its
    completion is refused, retried with backoff while its worker holds the lease, and lands
    once the store heals: the body ran once, and the parent once. (Under OOM alone a
    completion may land: its first write frees memory, and Redis lets the script finish.)"""
    with RedisServer() as server:
        queue = f"outcome-{uuid.uuid4().hex[:6]}"
        worker = Worker(
            env,
            queues=queue,
            concurrency=1,
            name=queue,
            extra_env={
                "ECHOMQ_T_STORE": server.url(0),
                "ECHOMQ_T_STALL": STALL,
                "ECHOMQ_T_RECOVERY_INTERVAL": "0.5",
            },
        )
        try:
            child, parent = new_job_id(), new_job_id()
            with store_of(proj.app, redis_url=server.url(0)):
                kid = proj.sleep_then.s(7, 1.0).set(task_id=child)
                res = flow(proj.tsum.s().set(task_id=parent), [kid]).apply_async(queue=queue)
            client = server.client()
            wait_for(lambda: row(client, queue, child).get("state") == "active")
            client.config_set("min-replicas-to-write", "1")
            logged(worker, f"The completion of {child} on {queue} is retried until it lands")
            time.sleep(1)
            assert row(client, queue, child)["state"] == "active"
            client.config_set("min-replicas-to-write", "0")
            logged(worker, f"the completion of {child} on {queue} landed, after")
            assert res.get(timeout=30) == 7
            ran_once(worker, child, parent)
        finally:
            worker.stop()
