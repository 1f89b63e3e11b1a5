"""Bad children and arguments are refused plainly, before anything is written or published.

A child that is not a signature raises ``TypeError`` naming its position when the flow is
made; an argument the app's serializer (json) cannot encode raises kombu's ``EncodeError``
naming its job when the flow is sent. Either way the store and the broker are untouched:
the flow's queue has no key, no message, and ``emq:queues`` does not name it.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import redis
from celery import group
from kombu.exceptions import EncodeError

from celery_echomq import FlowExistsError, flow
from tests.helpers import run, ways

NOT_SIGNATURES = [
    pytest.param("tests.proj.add", "a str", id="str"),
    pytest.param(len, "a builtin_function_or_method", id="builtin"),
    pytest.param(lambda x: x, "a function", id="function"),
    pytest.param(None, "None", id="None"),
    pytest.param(42, "an int", id="int"),
]


def untouched(store: redis.Redis, broker: redis.Redis, queue: str, ids: list[str]) -> None:
    """Nothing of the flow in the store, nothing in its queue on the broker."""
    assert store.keys(f"emq:{{{queue}}}:*") == []
    assert not store.sismember("emq:queues", queue)
    for job_id in ids:
        assert store.keys(f"*{job_id}*") == []
    assert broker.llen(queue) == 0 and not broker.exists(queue)


@pytest.mark.parametrize(("bad", "what"), NOT_SIGNATURES)
def test_a_child_that_is_not_a_signature_is_refused_naming_its_position(
    proj: Any, own_queue: Any, env: Any, store: redis.Redis, bad: Any, what: str
) -> None:
    queue = own_queue("refused")
    broker = redis.Redis.from_url(env.broker)
    good = proj.add.s(1, 1).set(task_id="JOB" + uuid.uuid4().hex)
    with pytest.raises(TypeError) as info:
        flow(proj.tsum.s(), [good, bad, proj.add.s(2, 2)], queue=queue)
    message = str(info.value)
    assert message.startswith(f"flow child 2 is {what}, not a Signature")
    assert "allowed: a task signature" in message
    # Inside a group, and as a nested flow's child, the same.
    with pytest.raises(TypeError, match=r"flow child 1 is "):
        flow(proj.tsum.s(), group([bad]))
    with pytest.raises(TypeError, match=r"flow child 3 is "):
        flow(proj.tsum.s(), [proj.add.s(1, 1), flow(proj.tsum.s(), [proj.add.s(0, 0)]), bad])
    untouched(store, broker, queue, [good.options["task_id"]])


def test_children_that_are_not_a_list_are_refused(proj: Any) -> None:
    with pytest.raises(TypeError, match="a list or a group of signatures, got an int"):
        flow(proj.tsum.s(), 3)
    with pytest.raises(TypeError, match="a list or a group of signatures, got a str"):
        flow(proj.tsum.s(), "tests.proj.add")


@pytest.mark.parametrize("where", ["child", "nested", "parent", "other-queue"])
def test_an_argument_the_serializer_cannot_encode_is_refused_before_any_write(
    proj: Any, own_queue: Any, env: Any, store: redis.Redis, where: str
) -> None:
    queue, other = own_queue("unencodable"), own_queue("unencodable-other")
    broker = redis.Redis.from_url(env.broker)
    bad_id = "JOB" + uuid.uuid4().hex
    bad = proj.add.s(object(), 1).set(task_id=bad_id)
    ok = [proj.add.s(i, i).set(task_id="JOB" + uuid.uuid4().hex) for i in range(2)]
    parent = proj.tsum.s()
    children: list[Any] = [*ok, bad]
    if where == "nested":
        children = [*ok, flow(proj.tsum.s(), [proj.add.s(5, 5), bad])]
    elif where == "parent":
        parent, children = proj.collect.s(tag=object()), ok
    elif where == "other-queue":
        # A child routed to another queue: the chunked path, which writes per step.
        children = [ok[0], ok[1].set(queue=other), bad]
    f = flow(parent, children)
    f.freeze()
    ids = [f.parent.options["task_id"], *(c.options["task_id"] for c in ok)]
    with pytest.raises(EncodeError) as info:
        f.apply_async(queue=queue)
    message = str(info.value)
    assert "cannot be encoded with the 'json' serializer (task_serializer)" in message
    assert "nothing was written or published" in message
    assert "Object of type object is not JSON serializable" in message
    if where == "parent":
        assert "the parent (tests.proj.collect)" in message
    else:
        assert f"(tests.proj.add, {bad_id})" in message
    untouched(store, broker, queue, ids)
    untouched(store, broker, other, ids)


def test_a_nested_flow_refused_inside_takes_back_its_outer_level_and_locator(
    proj: Any, own_queue: Any, env: Any, store: redis.Redis
) -> None:
    """An outer level lands (its script writes its locator too), then the nested level is
    refused for a child id another flow holds: both are taken back, locators included, and
    nothing of the refused flow is published."""
    queue = own_queue("refused-nested")
    broker = redis.Redis.from_url(env.broker)
    taken = "JOB" + uuid.uuid4().hex
    first = flow(proj.tsum.s(), [proj.add.s(1, 1).set(task_id=taken)]).apply_async(queue=queue)
    held = store.hgetall(f"emq:{{{queue}}}:{taken}")
    published = broker.llen(queue)
    assert store.get(f"emq:loc:{{{first.id}}}") == queue.encode()

    ok = proj.add.s(2, 2).set(task_id="JOB" + uuid.uuid4().hex)
    inner = flow(proj.tsum.s(), [proj.add.s(3, 3).set(task_id=taken)])
    f = flow(proj.tsum.s(), [ok, inner])
    f.freeze()
    outer_id, inner_id = f.parent.options["task_id"], inner.parent.options["task_id"]
    with pytest.raises(FlowExistsError, match=taken):
        f.apply_async(queue=queue)
    for job_id in (outer_id, inner_id, ok.options["task_id"]):
        assert store.keys(f"*{job_id}*") == []
    assert broker.llen(queue) == published
    # The other flow is untouched.
    assert store.hgetall(f"emq:{{{queue}}}:{taken}") == held
    assert store.get(f"emq:loc:{{{first.id}}}") == queue.encode()


@pytest.mark.parametrize("keyword", ["max_activ", "polcy", "deadlines"])
def test_an_unknown_keyword_is_refused_naming_it_and_the_allowed_ones(
    proj: Any, own_queue: Any, env: Any, store: redis.Redis, keyword: str
) -> None:
    queue = own_queue("unknown-keyword")
    broker = redis.Redis.from_url(env.broker)
    child_id = "JOB" + uuid.uuid4().hex
    with pytest.raises(TypeError) as info:
        flow(proj.tsum.s(), [proj.add.s(1, 1).set(task_id=child_id)], queue=queue, **{keyword: 10})
    message = str(info.value)
    assert f"unknown keyword argument(s) {keyword!r}" in message
    for allowed in ("max_active", "policy", "deadline", "queue", "countdown", "options={...}"):
        assert allowed in message
    untouched(store, broker, queue, [child_id])
    # Celery's message options and its own copies (clone, JSON) are still taken.
    made = flow(proj.tsum.s(), [proj.add.s(1, 1)], queue=queue, countdown=1, max_active=2)
    assert made.clone().options == {"queue": queue, "countdown": 1}
    assert made.clone().max_active == 2
    assert flow.from_dict(json.loads(json.dumps(made))).options == made.options


def test_a_misspelt_flow_keyword_is_refused_with_the_one_meant(proj: Any) -> None:
    with pytest.raises(TypeError) as info:
        flow(proj.tsum.s(), [proj.add.s(1, 1)], quorom=1)
    assert "unknown keyword argument(s) 'quorom'; did you mean 'quorum' for 'quorom'?" in str(
        info.value
    )


@pytest.mark.parametrize("how", ways(worker_for_both=False))
def test_a_misspelt_send_option_is_refused_naming_the_one_meant(
    proj: Any, own_queue: Any, env: Any, store: redis.Redis, how: str
) -> None:
    # on_exists is the option a flow's send reads: a close misspelling would be carried as a
    # message option, and the flow would raise where join was meant. Nothing is sent.
    queue = own_queue("misspelt-send")
    broker = redis.Redis.from_url(env.broker)
    child_id = "JOB" + uuid.uuid4().hex
    sig = flow(proj.tsum.s(), [proj.add.s(1, 1).set(task_id=child_id)], queue=queue)
    with pytest.raises(TypeError) as info:
        run(sig, how, on_exist="join")
    assert str(info.value) == (
        f"{how}() of a flow got an unknown option 'on_exist'; did you mean 'on_exists'? "
        "the options it reads: on_exists; nothing was sent"
    )
    untouched(store, broker, queue, [child_id])


@pytest.mark.parametrize("how", ways(worker_for_both=False))
def test_a_misspelt_child_option_is_refused_and_others_pass_as_celerys_do(
    proj: Any, own_queue: Any, env: Any, store: redis.Redis, how: str
) -> None:
    # .set() takes any option (Celery carries an unknown one in the message): only a close
    # misspelling of one the extension reads of a child is refused, when the flow is made.
    queue = own_queue("misspelt-child")
    broker = redis.Redis.from_url(env.broker)
    child = proj.add.s(1, 1).set(task_id="JOB" + uuid.uuid4().hex, parent_polciy="ignore")
    with pytest.raises(TypeError) as info:
        flow(proj.tsum.s(), [child], queue=queue)
    assert str(info.value) == (
        "flow child 'tests.proj.add': .set() got an unknown option 'parent_polciy'; did you "
        "mean 'parent_policy'? the options it reads: parent_policy; nothing was sent"
    )
    untouched(store, broker, queue, [child.options["task_id"]])
    if how == "apply_async":
        return  # what a worker does with an option of Celery's is Celery's
    other = proj.add.s(1, 1).set(my_header="x", policy_note="y")
    assert run(flow(proj.tsum.s(), [other]), how).get() == 2


@pytest.mark.parametrize("header", ["group", "list", "tuple"])
def test_a_chords_order_of_arguments_is_refused_saying_the_parent_comes_first(
    proj: Any, header: str
) -> None:
    tasks = [proj.add.s(1, 1), proj.add.s(2, 2)]
    first: Any = {"group": group(tasks), "list": tasks, "tuple": tuple(tasks)}[header]
    with pytest.raises(TypeError) as info:
        flow(first, proj.tsum.s())
    message = str(info.value)
    assert "takes the parent first" in message
    assert "reverse of chord(header, body)" in message
    assert "wrap it in a list" not in message
    # One signature as the children of a signature parent still gets the list hint.
    with pytest.raises(TypeError, match="wrap it in a list"):
        flow(proj.tsum.s(), proj.add.s(1, 1))


def test_a_flow_sent_again_is_refused_naming_its_queue(
    proj: Any, own_queue: Any, store: redis.Redis
) -> None:
    queue = own_queue("exists")
    sig = flow(proj.tsum.s(), [proj.add.s(1, 2)], queue=queue)
    sig.freeze()
    sig.apply_async()
    before = sorted(store.keys(f"emq:{{{queue}}}:*"))
    with pytest.raises(FlowExistsError) as info:
        sig.apply_async()
    assert f"already exists in Redis, on queue {queue!r}" in str(info.value)
    assert "'?'" not in str(info.value)
    assert sorted(store.keys(f"emq:{{{queue}}}:*")) == before
