"""A small flow in one round trip: where the broker is a database of the store's own server,
its enqueue script pushes the children's messages itself (wire/publish.py). The messages are
those the producer would have published, they carry the time the script read, and a refused
flow still publishes nothing."""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import chord

from celery_echomq import flow, get_state
from celery_echomq.embedded import RedisServer
from celery_echomq.errors import FlowExistsError
from celery_echomq.wire import publish
from celery_echomq.wire.results import database_on_store_server
from tests.helpers import KEYS, Env, needs_batching

pytestmark = needs_batching


def _send(proj: Any, queue: str, n: int, **child: Any) -> Any:
    kids = [proj.add.s(i, i).set(**child) for i in range(n)]
    return flow(proj.tsum.s(), kids).apply_async(queue=queue)


def _messages(broker: redis.Redis, queue: str) -> list[dict[str, Any]]:
    return [json.loads(m) for m in reversed(broker.lrange(queue, 0, -1))]


def _watch(env: Env) -> tuple[list[dict[str, Any]], Callable[[], None]]:
    """Every command the server runs from now on (MONITOR), until the returned stop()."""
    seen: list[dict[str, Any]] = []
    monitor = redis.Redis.from_url(env.store).monitor()
    connection = monitor.__enter__()
    marker = f"end-{uuid.uuid4().hex}"

    def read() -> None:
        for command in connection.listen():
            if marker in command["command"]:
                return  # everything before it has been read
            seen.append(command)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.2)

    def stop() -> None:
        redis.Redis.from_url(env.store).echo(marker)
        reader.join(10)
        monitor.__exit__(None, None, None)

    return seen, stop


@pytest.fixture
def where(env: Env, own_queue: Any) -> tuple[str, redis.Redis, redis.Redis]:
    """A queue of the test's own, the broker and the store."""
    return own_queue("fused"), redis.Redis.from_url(env.broker), redis.Redis.from_url(env.store)


def test_a_flow_after_the_first_of_its_shape_is_pushed_by_its_enqueue(
    proj: Any, env: Env, where: tuple[str, redis.Redis, redis.Redis]
) -> None:
    queue, broker, store = where
    first = _send(proj, queue, 3)  # the first of its shape: published by the producer
    seen, stop = _watch(env)
    try:
        second = _send(proj, queue, 3)
    finally:
        stop()
    pushes = [c for c in seen if c["command"].startswith("LPUSH")]
    assert pushes and all(c["client_type"] == "lua" for c in pushes), pushes
    messages = _messages(broker, queue)
    assert len(messages) == 6
    by_flow: dict[str, list[dict[str, Any]]] = {}
    for message in messages:
        by_flow.setdefault(message["headers"]["echomq_p"], []).append(message)
    assert sorted(by_flow) == sorted([first.id, second.id])
    for message in by_flow[second.id]:
        headers = message["headers"]
        # The time the script read, exactly the child's pending score.
        pending = store.zscore(KEYS.queue_key(queue, "pending"), headers["id"])
        assert pending is not None and headers["echomq_t"] == int(pending)
    # Alike but for the values each message carries of its own.
    own = {"id", "root_id", "echomq_p", "echomq_t", "argsrepr", "correlation_id", "delivery_tag"}

    def shape(message: dict[str, Any]) -> Any:
        return (
            {k: v for k, v in message["headers"].items() if k not in own},
            {k: v for k, v in message["properties"].items() if k not in own},
            sorted(message),
        )

    assert [shape(m) for m in by_flow[second.id]] == [shape(m) for m in by_flow[first.id]]


def test_a_chord_on_the_engine_after_the_first_of_its_shape_is_pushed_by_its_enqueue(
    proj: Any, env: Env, where: tuple[str, redis.Redis, redis.Redis]
) -> None:
    """A chord's header tasks each carry their place in it (``group_index``): a template
    sets it per message, so a later chord takes the one round trip too (more header tasks
    than a task keeps templates: one template for all of them)."""
    queue, broker, _ = where
    proj.app.conf.echomq_chords = True
    try:
        header = [proj.add.s(i, i).set(queue=queue) for i in range(6)]
        first = chord(header, proj.tsum.s().set(queue=queue)).apply_async()
        seen, stop = _watch(env)
        try:
            header = [proj.add.s(i, i).set(queue=queue) for i in range(6)]
            second = chord(header, proj.tsum.s().set(queue=queue)).apply_async()
        finally:
            stop()
    finally:
        proj.app.conf.echomq_chords = False
    pushes = [c for c in seen if c["command"].startswith("LPUSH")]
    assert pushes and all(c["client_type"] == "lua" for c in pushes), pushes
    by_chord: dict[str, list[Any]] = {}
    for message in _messages(broker, queue):
        headers = message["headers"]
        by_chord.setdefault(headers["echomq_p"], []).append(headers["group_index"])
    assert by_chord == {first.id: list(range(6)), second.id: list(range(6))}


def test_a_refused_flow_on_the_one_step_path_publishes_nothing(
    proj: Any, where: tuple[str, redis.Redis, redis.Redis]
) -> None:
    queue, broker, store = where
    taken = _send(proj, queue, 2)
    held = _messages(broker, queue)
    rows = sorted(store.scan_iter(match=f"emq:{{{queue}}}:*"))
    used = held[0]["headers"]["id"]
    kids = [proj.add.s(0, 0), proj.add.s(1, 1).set(task_id=used)]
    with pytest.raises(FlowExistsError, match=used):
        flow(proj.tsum.s(), kids).apply_async(queue=queue)
    assert _messages(broker, queue) == held
    assert sorted(store.scan_iter(match=f"emq:{{{queue}}}:*")) == rows
    assert taken.id in {m["headers"]["echomq_p"] for m in held}


def test_the_broker_must_share_the_store_server(proj: Any, env: Env) -> None:
    state = get_state(proj.app)
    same_server = redis.Redis.from_url(env.broker)
    db = int(env.broker.rsplit("/", 1)[1])
    assert database_on_store_server(state, same_server) == db
    with RedisServer() as other:
        elsewhere = redis.Redis.from_url(other.url(int(env.store.rsplit("/", 1)[1])))
        assert database_on_store_server(state, elsewhere) is None
    assert publish.SINCE_MARK < 0  # never a time the store's clock gives


def test_children_of_other_options_among_alike_ones_keep_their_own_messages(
    proj: Any, env: Env, where: tuple[str, redis.Redis, redis.Redis]
) -> None:
    """Children whose options differ from their siblings' (a time limit of their own), in
    among alike ones: pushed by the enqueue too, each message with its own options and
    arguments, never those of the child before it."""
    queue, broker, _ = where
    limited = {2, 4, 5}

    def send() -> Any:
        kids = [
            proj.add.s(i, i).set(time_limit=30) if i in limited else proj.add.s(i, i)
            for i in range(7)
        ]
        return flow(proj.tsum.s(), kids).apply_async(queue=queue)

    send()  # the first of its shape: teaches both kinds of message
    broker.delete(queue)
    seen, stop = _watch(env)
    try:
        second = send()
    finally:
        stop()
    pushes = [c for c in seen if c["command"].startswith("LPUSH")]
    assert pushes and all(c["client_type"] == "lua" for c in pushes), pushes
    messages = _messages(broker, queue)
    assert [m["headers"]["argsrepr"] for m in messages] == [f"({i}, {i})" for i in range(7)]
    bodies = [json.loads(base64.b64decode(m["body"])) for m in messages]
    assert [body[0] for body in bodies] == [[i, i] for i in range(7)]
    assert len({m["headers"]["id"] for m in messages}) == 7
    assert all(m["headers"]["id"] == m["properties"]["correlation_id"] for m in messages)
    assert [m["headers"]["timelimit"] for m in messages] == [
        [30, None] if i in limited else [None, None] for i in range(7)
    ]
    assert {m["headers"]["echomq_p"] for m in messages} == {second.id}
    assert {m["headers"]["root_id"] for m in messages} == {second.id}
