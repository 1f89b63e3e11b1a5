"""RabbitMQ as the broker: the end-to-end basics with a real worker on amqp.

The flow store and the result backend stay on the test Redis; only the broker is the
machine's RabbitMQ, in the workers and in this process. Every queue is named for this run
alone (no other worker consumes it, nothing is left behind: the queues are deleted at the
end), and every flow is routed there.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import redis
from celery import chord
from kombu.connection import Connection
from kombu.pools import ProducerPool

from celery_echomq import FlowFailed, flow
from tests.helpers import (
    BACKLOG_STALL,
    BACKLOG_WORKER,
    KEYS,
    RABBIT,
    Env,
    Worker,
    check_each_ran_once,
    counters,
    rabbit_answers,
    send_flows,
    wait_for,
    worker_pair,
)

TIMEOUT = 90


class Queues(NamedTuple):
    main: str  # where the flows go
    a: str
    b: str


pytestmark = pytest.mark.skipif(
    not rabbit_answers(), reason="no RabbitMQ answers on 127.0.0.1:5672"
)


@pytest.fixture(scope="module")
def queues() -> Iterator[Queues]:
    run = uuid.uuid4().hex[:8]
    names = Queues(f"emqr{run}", f"emqr{run}a", f"emqr{run}b")
    yield names
    # Celery declares each queue durable, with a direct exchange of the same name.
    with Connection(RABBIT, connect_timeout=5) as conn:  # type: ignore[no-untyped-call]
        channel = conn.channel()
        for name in names:
            channel.queue_delete(name)
            channel.exchange_delete(name)


@pytest.fixture(scope="module")
def rabbit_workers(env: Env, proj: Any, queues: Queues) -> Iterator[tuple[Worker, Worker]]:
    # Named after this run's queues: the RabbitMQ is shared, and so are its pidbox queues.
    main, other = worker_pair(
        env, queues.main, f"{queues.a},{queues.b}", queues.main, {"ECHOMQ_T_BROKER": RABBIT}
    )
    assert "amqp://guest:**@127.0.0.1:5672//" in main.output()
    yield main, other
    other.stop()
    main.stop()


@pytest.fixture
def rabbit_app(proj: Any, rabbit_workers: Any) -> Iterator[Any]:
    """This process's app publishes to RabbitMQ for one test, then goes back to its broker.

    The app caches a connection pool and a producer pool (the two Celery itself drops after
    a fork). Both are replaced by pools of this test's own, outside kombu's global registry,
    so that closing them at the end leaves no closed pool behind for a later test to pick.
    """
    app = proj.app
    saved = (app.conf.broker_url, app._pool, app.amqp._producer_pool)
    app.conf.broker_url = RABBIT
    connections = app.connection_for_write().Pool(limit=4)
    producers = ProducerPool(connections, limit=4)  # type: ignore[no-untyped-call]
    app._pool, app.amqp._producer_pool = connections, producers
    try:
        with app.producer_or_acquire(None) as producer:
            assert producer.connection.transport.driver_type == "amqp"
        yield app
    finally:
        app.conf.broker_url, app._pool, app.amqp._producer_pool = saved
        producers.force_close_all()  # type: ignore[no-untyped-call]
        connections.force_close_all()


def test_rabbit_ten_child_flow_returns_what_the_equivalent_chord_returns(
    proj: Any, rabbit_app: Any, env: Env, queues: Queues
) -> None:
    q = queues.main
    chord_value = chord([proj.add.s(i, i).set(queue=q) for i in range(10)])(
        proj.tsum.s().set(queue=q)
    ).get(timeout=TIMEOUT)
    res = flow(proj.tsum.s(), [proj.add.s(i, i) for i in range(10)]).apply_async(queue=q)
    assert res.get(timeout=TIMEOUT) == chord_value == 90
    assert res.dependencies() == (0, 10, 0, 0)
    assert sorted(res.children_values().values()) == [2 * i for i in range(10)]
    # Nothing went through the Redis broker.
    assert not redis.Redis.from_url(env.broker).exists(q)


def test_rabbit_parent_is_held_while_gated_children_run(
    proj: Any,
    rabbit_app: Any,
    queues: Queues,
    store: redis.Redis,
) -> None:
    tag = uuid.uuid4().hex
    gates = [f"gate:{tag}:{i}" for i in range(3)]
    children = [proj.gated.s(i, g) for i, g in enumerate(gates)]
    res = flow(proj.collect.s(tag=tag), children).apply_async(queue=queues.main)
    row = KEYS.job_key(queues.main, res.id)
    for opened in range(3):
        wait_for(lambda n=opened: res.dependencies() == (3 - n, n, 0, 0), timeout=TIMEOUT)
        assert store.hget(row, "state") == b"awaiting_children"
        assert res.state == "PENDING"
        assert store.get(f"test:ran:collect:{tag}") is None
        store.set(gates[opened], 1)
    assert res.get(timeout=TIMEOUT) == {"values": [0, 1, 2], "tag": tag}
    assert store.get(f"test:ran:collect:{tag}") == b"1"


def test_rabbit_failure_policies(proj: Any, rabbit_app: Any, queues: Queues) -> None:
    bad = proj.boom.s("bad page").set(parent_policy="ignore")
    f = flow(proj.tsum.s(), [proj.add.s(1, 1), bad, proj.add.s(2, 2)])
    res = f.freeze()
    f.apply_async(queue=queues.main)
    assert res.get(timeout=TIMEOUT) == 6
    assert res.ignored_failures() == {bad.options["task_id"]: "ValueError: bad page"}
    assert res.dependencies() == (0, 2, 0, 1)  # two done, one failed under ignore

    fatal = proj.boom.s("disk full")
    f2 = flow(proj.tsum.s(), [proj.add.s(1, 1), fatal])
    res2 = f2.freeze()
    f2.apply_async(queue=queues.main)
    with pytest.raises(FlowFailed) as info:
        res2.get(timeout=TIMEOUT)
    assert info.value.child_id == fatal.options["task_id"]
    assert info.value.error == "ValueError: disk full"
    assert res2.state == "FAILURE"


def test_rabbit_nested_flow(proj: Any, rabbit_app: Any, queues: Queues) -> None:
    inner = flow(proj.tsum.s(), [proj.add.s(1, 1), proj.add.s(2, 2)])
    last = proj.add.s(5, 5)
    f = flow(proj.tsum.s(), [inner, last])
    res = f.freeze()
    f.apply_async(queue=queues.main)
    assert res.get(timeout=TIMEOUT) == 16
    inner_id = inner.parent.options["task_id"]
    assert res.children_values() == {inner_id: 6, last.options["task_id"]: 10}
    assert res.dependencies() == (0, 2, 0, 0)


def test_rabbit_cross_queue_children(
    proj: Any,
    rabbit_app: Any,
    queues: Queues,
    store: redis.Redis,
) -> None:
    a = proj.add.s(1, 1).set(queue=queues.a)
    b = proj.add.s(2, 2).set(queue=queues.b)
    c = proj.add.s(3, 3)
    f = flow(proj.tsum.s(), [a, b, c])
    res = f.freeze()
    f.apply_async(queue=queues.main)
    assert res.get(timeout=TIMEOUT) == 12
    assert res.dependencies() == (0, 3, 0, 0)
    ida, idb = a.options["task_id"], b.options["task_id"]
    assert store.hgetall(KEYS.settled_key(queues.main, res.id)) == {
        ida.encode(): b"done",
        idb.encode(): b"done",
    }
    assert store.hget(KEYS.job_key(queues.a, ida), "state") == b"done"


@pytest.mark.e2e
def test_rabbit_a_backlog_of_ten_stall_timeouts_republishes_nothing(
    proj: Any, rabbit_app: Any, env: Env, queues: Queues, store: redis.Redis, start_worker: Any
) -> None:

    # A queue of its own, consumed by one worker of one pool process with a stall timeout of
    # one second: recovery asks RabbitMQ how many messages wait (a passive declare).
    q = f"{queues.main}bl"
    try:
        started = time.monotonic()
        sent = send_flows(proj, q, flows=4, size=28, seconds=0.1)
        w = start_worker(
            queues=q,
            concurrency=1,
            name=f"{q}-w",
            extra_env={"ECHOMQ_T_BROKER": RABBIT, **BACKLOG_WORKER},
        )
        check_each_ran_once(store, sent, timeout=120)
        assert time.monotonic() - started > 10 * float(BACKLOG_STALL)
        assert counters(store, q).get("republished", 0) == 0
        assert "re-published" not in w.output()
    finally:
        with Connection(RABBIT, connect_timeout=5) as conn:  # type: ignore[no-untyped-call]
            channel = conn.channel()
            channel.queue_delete(q)
            channel.exchange_delete(q)


@pytest.mark.e2e
def test_rabbit_messages_purged_from_the_queue_are_republished_once(
    proj: Any, rabbit_app: Any, env: Env, queues: Queues, store: redis.Redis, start_worker: Any
) -> None:

    q = f"{queues.main}lost"
    try:
        sent = send_flows(proj, q, flows=1, size=5, seconds=0.0)
        with Connection(RABBIT, connect_timeout=5) as conn:  # type: ignore[no-untyped-call]
            assert conn.channel().queue_purge(q) == 5  # the broker lost every child
        w = start_worker(
            queues=q,
            concurrency=1,
            name=f"{q}-w",
            extra_env={"ECHOMQ_T_BROKER": RABBIT, **BACKLOG_WORKER},
        )
        # RabbitMQ reports the queue empty and no worker holds them: gone, re-published.
        check_each_ran_once(store, sent, timeout=90)
        assert counters(store, q).get("republished", 0) == 5
        assert w.output().count("re-published") == 5
    finally:
        with Connection(RABBIT, connect_timeout=5) as conn:  # type: ignore[no-untyped-call]
            channel = conn.channel()
            channel.queue_delete(q)
            channel.exchange_delete(q)
