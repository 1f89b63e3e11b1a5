"""A flow's messages are what Celery and kombu would publish: the argsrepr/kwargsrepr
Celery would give them, and on kombu's Redis transport the same message bytes (delivery tag
aside) without going through the producer per message."""

from __future__ import annotations

import base64
import itertools
import json
import re
import uuid
from datetime import datetime, timezone
from typing import Any

import pytest
import redis
from celery import signals, signature
from celery.utils.saferepr import saferepr

from celery_echomq import flow, get_state
from celery_echomq.send.plan import plan_flow
from celery_echomq.send.start import with_since
from celery_echomq.store.planned import PlannedJob
from celery_echomq.wire import publish
from celery_echomq.wire.envelope import fast_repr
from tests.helpers import needs_batching, new_job_id

VALUES: list[Any] = [
    0, -5, 2**40, 10**30, 1.5, -0.0, float("inf"), float("nan"), True, None,
    "", "a", 'a"b', "x y", "é", "a\\b", "a'b", "\t", "x" * 41, [1, 2], {"a": 1}, b"ab",
]  # fmt: skip


def test_plain_arguments_get_exactly_saferepr_and_others_are_left_to_celery() -> None:
    fast = 0
    for a, b in itertools.product(VALUES, repeat=2):
        args, kwargs = (a, b), {"k": a, "z": b}
        got = fast_repr(args, kwargs)
        if got is None:
            continue
        fast += 1
        assert got == (saferepr(args, 1024), saferepr(kwargs, 1024)), (args, kwargs)
    assert fast > 100  # the common case (numbers, short plain strings) takes the fast path
    # Quotes, backslashes, non-ASCII, long strings, huge ints, containers: Celery's saferepr.
    for odd in ("a'b", "a\\b", "é", "x" * 41, 10**30, [1], {"a": 1}, b"ab"):
        assert fast_repr((odd,), {}) is None
    assert fast_repr(tuple(range(17)), {}) is None


# --- The Redis fast path: each message as the producer would have published it -------------

DELIVERY_TAG = re.compile(rb'"delivery_tag": "[0-9a-f-]{36}"')
PRIORITY_SUFFIXES = ["", *(f"\x06\x16{p}" for p in (3, 6, 9))]


def _varied_flow(proj: Any, q1: str, q2: str) -> Any:
    """Children of every kind a flow sends: several tasks interleaved (so the batch has
    several groups of alike jobs), arguments saferepr writes its own way, options that
    change the message (eta, expires, countdown, priority, routing, links, headers, a
    shadow), and a nested flow whose leaves go in the same batch."""
    eta = datetime(2031, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    children: list[Any] = []
    for i in range(4):
        children += [
            proj.add.s(i, i),
            proj.square.s(i).set(queue=q2),
            proj.collect.s([i, "x'y"], tag="é" * 50),
            proj.add.s(i, True).set(priority=6),
            proj.add.s(i, 1.0).set(priority=True),
            proj.noargs.si().set(headers={"custom": i % 2}, eta=eta),
            proj.square.s(i).set(link=proj.errback.s(), link_error=proj.errback.s()),
            signature("proj.unregistered", args=(i,), kwargs={"k": None}),
            proj.add.s(i, i).set(expires=eta, shadow="renamed"),
        ]
    children.append(proj.add.s(1, 2).set(countdown=30))
    children.append(proj.add.s(1, 2).set(expires=600))
    children.append(flow(proj.tsum.s(), [proj.add.s(7, 7), proj.add.s(8, 8).set(queue=q2)]))
    return flow(proj.tsum.s().set(queue=q1), children).set(queue=q1)


def _leaves(proj: Any, canvas: Any) -> list[dict[str, Any]]:
    plan = plan_flow(
        proj.app,
        canvas.parent,
        canvas.children,
        policy="fail",
        args=(),
        kwargs=None,
        options=dict(canvas.options),
    )
    leaves = [
        node.message for level in plan.levels() for node in level.children
        if isinstance(node, PlannedJob)
    ]  # fmt: skip
    return [with_since(job, 1_700_000_000_000, "redis://127.0.0.1:6379/0") for job in leaves]


def _drain(broker: Any, queues: list[str]) -> dict[str, list[bytes]]:
    """Every message on the queues' lists, oldest first, with its delivery tag blanked."""
    out = {}
    for queue in queues:
        for suffix in PRIORITY_SUFFIXES:
            raw = broker.lrange(queue + suffix, 0, -1)[::-1]
            broker.delete(queue + suffix)
            out[queue + suffix] = [DELIVERY_TAG.sub(b'"delivery_tag": ""', m) for m in raw]
    return out


def _timeless(raw: bytes) -> dict[str, Any]:
    """A message decoded, with what is read from the clock per message (eta from a
    countdown, expires from seconds, the broker TTL) blanked."""
    message = json.loads(raw)
    headers = message["headers"]
    headers["eta"] = headers["expires"] = "timed" if headers["eta"] or headers["expires"] else None
    message["properties"].pop("expiration", None)
    message["body"] = json.loads(base64.b64decode(message["body"]))
    return dict(message)


def count_templated(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Records, per message published from here on, whether it was built from a template."""
    templated: list[bool] = []
    push, find = publish.Templates.push, publish.Templates.find

    def counted(self: Any, *args: Any) -> bool:
        templated.append(push(self, *args))
        return templated[-1]

    def found(self: Any, key: Any) -> Any:
        template = find(self, key)
        if template is None:
            templated.append(False)  # built by Celery and kombu
        return template

    monkeypatch.setattr(publish.Templates, "push", counted)
    monkeypatch.setattr(publish.Templates, "find", found)
    return templated


@needs_batching
def test_fast_path_publishes_what_the_producer_would(
    proj: Any, env: Any, own_queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    q1, q2 = own_queue("fast1"), own_queue("fast2")
    broker = redis.Redis.from_url(env.broker)
    jobs = _leaves(proj, _varied_flow(proj, q1, q2))
    templated = count_templated(monkeypatch)
    get_state(proj.app).message_templates.clear()  # no template from an earlier test's batch
    publish.send_jobs(proj.app, jobs)
    fast = _drain(broker, [q1, q2])
    with monkeypatch.context() as m:
        m.setattr(publish.RedisPushes, "of", classmethod(lambda cls, app, producer: None))
        publish.send_jobs(proj.app, jobs)
    ordinary = _drain(broker, [q1, q2])

    assert sum(len(v) for v in ordinary.values()) == len(jobs) == 40
    by_id = {job["options"]["task_id"]: job for job in jobs}
    assert ordinary.keys() == fast.keys()
    for key in ordinary:
        assert len(ordinary[key]) == len(fast[key]), key
        for mine, theirs in zip(fast[key], ordinary[key], strict=True):
            options = by_id[json.loads(theirs)["headers"]["id"]]["options"]
            if "countdown" in options or "expires" in options:
                # Read from the clock per message on either path.
                assert _timeless(mine) == _timeless(theirs)
            else:
                assert json.loads(mine) == json.loads(theirs)
                assert mine == theirs  # byte for byte
    # Most jobs were built from the template of an alike job: all but the first of each
    # kind (nine kinds) and those whose expiry is read from the clock; a nested flow's leaf
    # on its outer flow's queue too (their own headers differ in value only).
    assert templated.count(True) == 3 * 9 - 3 + 1
    # The queues are bound as kombu binds them, for a consumer routing by exchange.
    bindings = broker.smembers(f"_kombu.binding.{q2}")
    assert bindings == {f"{q2}\x06\x16\x06\x16{q2}".encode()}


def test_fast_path_sends_the_publish_signals_per_message(
    proj: Any, env: Any, own_queue: Any
) -> None:
    """A before_task_publish receiver that adds a header (as tracing libraries do) sees
    every message and its header reaches each one."""
    queue = own_queue("fastsig")
    broker = redis.Redis.from_url(env.broker)
    seen: list[str] = []

    def stamp(headers: dict[str, Any], **_: Any) -> None:
        seen.append(headers["id"])
        headers["traced"] = headers["id"][-4:]

    signals.before_task_publish.connect(stamp, weak=False)
    try:
        jobs = _leaves(
            proj, flow(proj.tsum.s(), [proj.add.s(i, i) for i in range(5)]).set(queue=queue)
        )
        publish.send_jobs(proj.app, jobs)
    finally:
        signals.before_task_publish.disconnect(stamp)
    messages = [json.loads(m) for m in broker.lrange(queue, 0, -1)[::-1]]
    assert seen == [job["options"]["task_id"] for job in jobs]
    assert [m["headers"]["traced"] for m in messages] == [i[-4:] for i in seen]


def _alike(proj: Any, queue: str, n: int) -> Any:
    return flow(proj.tsum.s(), [proj.add.s(i, i) for i in range(n)]).set(queue=queue)


def _sent_as_the_producer_would(
    proj: Any, monkeypatch: pytest.MonkeyPatch, broker: Any, queue: str, batches: list[Any]
) -> dict[str, list[bytes]]:
    """The same batches sent again without the fast path (Celery and kombu build every
    message), drained as :func:`_drain` does."""
    with monkeypatch.context() as m:
        m.setattr(publish.RedisPushes, "of", classmethod(lambda cls, app, producer: None))
        for jobs in batches:
            publish.send_jobs(proj.app, jobs)
    return _drain(broker, [queue])


@needs_batching
def test_a_later_batch_is_built_from_the_templates_an_earlier_one_learnt(
    proj: Any, env: Any, own_queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flows of alike children, one batch each: after the first, every message comes from
    a template (their parent and enqueue time differ in value only), and is the message the
    producer would have published."""
    queue = own_queue("fastlater")
    broker = redis.Redis.from_url(env.broker)
    templated = count_templated(monkeypatch)
    get_state(proj.app).message_templates.clear()
    batches = [_leaves(proj, _alike(proj, queue, 3)) for _ in range(3)]
    for i, jobs in enumerate(batches):
        for job in jobs:
            job["options"]["headers"]["echomq_t"] += i  # read per flow
        publish.send_jobs(proj.app, jobs)
    fast = _drain(broker, [queue])
    ordinary = _sent_as_the_producer_would(proj, monkeypatch, broker, queue, batches)
    assert templated == [False, True, True] + [True] * 6
    assert fast == ordinary and len(fast[queue]) == 9
    parents = {json.loads(m)["headers"]["echomq_p"] for m in fast[queue]}
    assert len(parents) == 3


@needs_batching
def test_the_jobs_of_one_template_may_each_name_their_own_parent_task(
    proj: Any, env: Any, own_queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chain's steps are sent one at a time, each naming the step before it as its parent
    (as a job sent from a task names that task): after the first, each message comes from
    the template, its own parent id in it (none where it names none), and is the message
    the producer would have published, byte for byte."""
    queue = own_queue("fastparent")
    broker = redis.Redis.from_url(env.broker)
    templated = count_templated(monkeypatch)
    get_state(proj.app).message_templates.clear()
    parents = [None, new_job_id(), new_job_id(), None, str(uuid.uuid4())]
    batches = [_leaves(proj, _alike(proj, queue, 1)) for _ in parents]
    for jobs, parent in zip(batches, parents, strict=True):
        if parent is not None:
            jobs[0]["options"]["parent_id"] = parent
        publish.send_jobs(proj.app, jobs)
    fast = _drain(broker, [queue])
    ordinary = _sent_as_the_producer_would(proj, monkeypatch, broker, queue, batches)
    assert templated == [False] + [True] * 4
    assert fast == ordinary and len(fast[queue]) == 5
    assert [json.loads(m)["headers"]["parent_id"] for m in fast[queue]] == parents


def test_a_template_is_not_used_where_kombu_would_declare_again(
    proj: Any, env: Any, own_queue: Any
) -> None:
    """kombu declares a queue once per connection, and again after a reconnect (which clears
    its cache of declared entities): a batch after that declares it again, as the producer
    would, rather than reuse a template."""
    queue = own_queue("fastdeclare")
    broker = redis.Redis.from_url(env.broker)
    get_state(proj.app).message_templates.clear()
    publish.send_jobs(proj.app, _leaves(proj, _alike(proj, queue, 2)))
    with proj.app.producer_or_acquire(None) as producer:
        declared = producer.channel.connection.client.declared_entities
        ident = hash(proj.app.amqp.queues[queue])
        assert ident in declared
        declared.clear()  # as a reconnect does
    publish.send_jobs(proj.app, _leaves(proj, _alike(proj, queue, 2)))
    assert ident in declared
    assert broker.llen(queue) == 4


@needs_batching
def test_a_chords_header_tasks_share_one_template_each_with_its_group_and_place(
    proj: Any, env: Any, own_queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chord's header tasks on the engine (celery_echomq/chords.py) name their chord's
    group and each its own place in it (``group_id``, ``group_index``): after the first,
    every message comes from the template, also in a later chord's batch, and is the message
    the producer would have published, byte for byte. A group index of a type Celery encodes
    its own way (a bool) is built by Celery."""
    queue = own_queue("fastgroup")
    broker = redis.Redis.from_url(env.broker)
    templated = count_templated(monkeypatch)
    get_state(proj.app).message_templates.clear()
    batches = [_leaves(proj, _alike(proj, queue, 3)) for _ in range(3)]
    for jobs in batches:
        group_id = str(uuid.uuid4())
        for index, job in enumerate(jobs):
            job["options"]["group_id"], job["options"]["group_index"] = group_id, index
        publish.send_jobs(proj.app, jobs)
    odd = _leaves(proj, _alike(proj, queue, 1))
    odd[0]["options"].update(group_id=str(uuid.uuid4()), group_index=True)
    publish.send_jobs(proj.app, odd)
    fast = _drain(broker, [queue])
    ordinary = _sent_as_the_producer_would(proj, monkeypatch, broker, queue, [*batches, odd])
    assert templated == [False, True, True] + [True] * 6 + [False]
    assert fast == ordinary and len(fast[queue]) == 10
    headers = [json.loads(m)["headers"] for m in fast[queue]]
    assert [h["group_index"] for h in headers] == [0, 1, 2] * 3 + [True]
    assert len({h["group"] for h in headers}) == 4


@needs_batching
def test_the_messages_built_for_an_enqueue_to_push_are_those_the_producer_would_publish(
    proj: Any, env: Any, own_queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A flow's alike children, built for its enqueue script to push (each after the first
    from the values bound for the one before it): byte for byte what the producer would
    have published, each with its own id, arguments and reprs."""
    queue = own_queue("fastbuilt")
    broker = redis.Redis.from_url(env.broker)
    get_state(proj.app).message_templates.clear()
    publish.send_jobs(proj.app, _leaves(proj, _alike(proj, queue, 2)))  # learns the template
    _drain(broker, [queue])
    jobs = _leaves(proj, _alike(proj, queue, 5))
    root = new_job_id()  # the flow's root, which every message names
    for job in jobs:
        job["options"]["root_id"] = root
    built = publish.built_pushes(proj.app, jobs, lambda channel: 0, [True] * len(jobs))
    assert built is not None
    fast = [DELIVERY_TAG.sub(b'"delivery_tag": ""', message.encode()) for _, message in built[1]]
    ordinary = _sent_as_the_producer_would(proj, monkeypatch, broker, queue, [jobs])
    assert fast == ordinary[queue] and len(fast) == 5
    headers = [json.loads(m)["headers"] for m in fast]
    assert [h["argsrepr"] for h in headers] == [f"({i}, {i})" for i in range(5)]
    assert {h["root_id"] for h in headers} == {root}
