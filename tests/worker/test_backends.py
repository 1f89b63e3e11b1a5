"""Flows on any result backend: ``rpc://`` (replies to the caller, on a Redis and on a RabbitMQ
broker) and none at all, against real worker subprocesses.

The caller here is an app of its own (``caller``), configured like the workers: the same
broker and flow store, the backend under test. It sends the tests.proj tasks by name. The
workers run tests/proj.py with ``ECHOMQ_T_BACKEND`` set to the same backend, on a queue of
this test's own.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, chord
from kombu.connection import Connection

import celery_echomq
from celery_echomq import FlowCancelled, FlowFailed, NoResultBackendError, flow
from tests.helpers import KEYS, RABBIT, Env, rabbit_answers

TIMEOUT = 90


def caller(env: Env, broker: str, backend: str | None, chords: bool = False) -> Celery:
    app = Celery("caller", set_as_current=False)
    app.conf.update(
        broker_url=broker,
        result_backend=backend,
        echomq_redis_url=env.store,
        echomq_chords=chords,
        broker_connection_retry_on_startup=True,
    )
    celery_echomq.install(app)
    return app


def task(app: Celery, name: str, *args: Any, **kwargs: Any) -> Any:
    return app.signature(f"tests.proj.{name}", args, kwargs)


@pytest.fixture(params=["redis", "rabbitmq"])
def broker(request: Any, env: Env) -> Iterator[str]:
    if request.param == "redis":
        yield env.broker
        return
    if not rabbit_answers():
        pytest.skip("no RabbitMQ answers on 127.0.0.1:5672")
    yield RABBIT


@pytest.fixture
def rabbit_cleanup() -> Iterator[list[str]]:
    """Queues a test declared on RabbitMQ, deleted at the end."""
    names: list[str] = []
    yield names
    if names and rabbit_answers():
        with Connection(RABBIT, connect_timeout=5) as conn:  # type: ignore[no-untyped-call]
            channel = conn.channel()
            for name in names:
                channel.queue_delete(name)
                channel.exchange_delete(name)


def test_rpc_backend_get_returns_the_parent_value_to_the_caller(
    env: Env,
    broker: str,
    own_queue: Any,
    start_worker: Any,
    rabbit_cleanup: list[str],
    store: redis.Redis,
) -> None:
    q = own_queue("rpc")
    if broker == RABBIT:
        rabbit_cleanup.append(q)
    start_worker(queues=q, extra_env={"ECHOMQ_T_BACKEND": "rpc://", "ECHOMQ_T_BROKER": broker})
    app = caller(env, broker, "rpc://")
    try:
        res = flow(task(app, "tsum"), [task(app, "add", i, i) for i in range(5)]).apply_async(
            queue=q
        )
        assert res.get(timeout=TIMEOUT) == 20
        assert sorted(res.children_values().values()) == [0, 2, 4, 6, 8]
        assert res.dependencies() == (0, 5, 0, 0)
        # A nested flow, and a flow whose child fails under "fail": the FAILURE recorded for a
        # parent that never ran reaches this caller too.
        inner = flow(task(app, "tsum"), [task(app, "add", 1, 1), task(app, "add", 2, 2)])
        nested = flow(task(app, "tsum"), [inner, task(app, "add", 10, 10)])
        assert nested.apply_async(queue=q).get(timeout=TIMEOUT) == 26
        failing = flow(task(app, "tsum"), [task(app, "add", 1, 1), task(app, "boom", "rpc")])
        with pytest.raises(FlowFailed, match="ValueError: rpc"):
            failing.apply_async(queue=q).get(timeout=TIMEOUT)
        # A cancelled flow's REVOKED, recorded by the process that cancels it, too.
        gate = f"gate:{uuid.uuid4().hex}"
        held = flow(task(app, "tsum"), [task(app, "gated", 1, gate)]).apply_async(queue=q)
        try:
            held.revoke()
            with pytest.raises(FlowCancelled):
                held.get(timeout=TIMEOUT)
        finally:
            store.set(gate, 1)
        # Where a chord cannot go at all.
        with pytest.raises(NotImplementedError, match="rpc"):
            chord([task(app, "add", 1, 1)], task(app, "tsum")).apply_async(queue=q)
    finally:
        app.close()


@pytest.mark.parametrize("engine", [True, False], ids=["on", "off"])
def test_a_chord_on_a_backend_that_polls_runs_its_body_once(
    env: Env, own_queue: Any, start_worker: Any, store: redis.Redis, tmp_path: Any, engine: bool
) -> None:
    # A result backend without a counter of its own (the file system's) counts a chord by
    # polling: Celery sends celery.chord_unlock, which sends the body once the header is done.
    # On the engine the flow holds the body: no poller is sent, and the body runs once.
    q = own_queue("polls")
    backend = f"file://{tmp_path}"
    chords = "1" if engine else "0"
    start_worker(queues=q, extra_env={"ECHOMQ_T_BACKEND": backend, "ECHOMQ_T_CHORDS": chords})
    app = caller(env, env.broker, backend, chords=engine)
    key = f"test:count:{uuid.uuid4().hex}"
    try:
        body = task(app, "redis_count", key).set(immutable=True)
        res = chord([task(app, "add", 1, 2), task(app, "add", 3, 4)], body).apply_async(queue=q)
        assert res.get(timeout=TIMEOUT) is None
        assert store.get(key) == b"1"
        time.sleep(3)  # a poller polls every second: a second body would have run by now
        assert store.get(key) == b"1"
        if engine:  # the body was the parent of a flow of the header's two tasks
            assert celery_echomq.dependencies(res.id).done == 2
    finally:
        app.close()


def test_no_result_backend_flows_run_and_get_says_what_to_set(
    env: Env, own_queue: Any, start_worker: Any, store: redis.Redis
) -> None:
    q = own_queue("nobackend")
    start_worker(queues=q, extra_env={"ECHOMQ_T_BACKEND": "none"})
    app = caller(env, env.broker, None)
    try:
        res = flow(task(app, "tsum"), [task(app, "add", i, i) for i in range(4)]).apply_async(
            queue=q
        )
        started = time.monotonic()
        with pytest.raises(NoResultBackendError, match="result_backend") as info:
            res.get(timeout=TIMEOUT)
        assert time.monotonic() - started < 1
        assert isinstance(info.value, NotImplementedError)  # what Celery raises there
        # The flow ran all the same: every child credited, the parent done.
        row = KEYS.job_key(q, res.id)
        deadline = time.monotonic() + TIMEOUT
        while store.hget(row, "state") != b"done" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert store.hget(row, "state") == b"done"
        assert res.dependencies() == (0, 4, 0, 0)
        assert sorted(res.children_values().values()) == [0, 2, 4, 6]
    finally:
        app.close()


@pytest.mark.parametrize("backend", ["rpc://", "none"])
def test_a_replaced_child_without_a_readable_backend_fails_clearly_instead_of_waiting(
    env: Env, own_queue: Any, start_worker: Any, store: redis.Redis, backend: str
) -> None:
    """A child that replaces itself is settled from its replacement's result in the backend;
    where no process can read one (rpc://: replies go to their caller; none), recovery fails
    it once with an error naming the backend, instead of looking again every pass."""
    q = own_queue("replaced")
    start_worker(queues=q, extra_env={"ECHOMQ_T_BACKEND": backend})
    app = caller(env, env.broker, "rpc://" if backend == "rpc://" else None)
    try:
        replaced = task(app, "replaced_by", "task", 2).set(task_id="JOB" + uuid.uuid4().hex)
        f = flow(task(app, "tsum"), [task(app, "add", 1, 1), replaced])
        res = f.apply_async(queue=q)
        row = f"emq:{{{q}}}:{replaced.options['task_id']}"
        deadline = time.monotonic() + TIMEOUT
        while store.hget(row, "state") in (None, b"pending", b"active"):
            assert time.monotonic() < deadline, "the replaced child was never settled"
            time.sleep(0.2)
        if store.hget(row, "state") == b"failed":
            error = store.hget(row, "error") or b""
            assert b"HandOverError" in error and b"result_backend" in error
            assert store.hget(KEYS.job_key(q, res.id), "state") == b"failed"
            if backend == "rpc://":
                with pytest.raises(FlowFailed, match="HandOverError"):
                    res.get(timeout=TIMEOUT)
        else:
            # Settled from its replacement some other way: the flow's value is right.
            assert store.hget(row, "state") == b"done"
            assert res.children_values()[replaced.options["task_id"]] == 102
    finally:
        app.close()
