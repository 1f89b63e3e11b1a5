"""A flow obeys only its own jobs and its operators: the job rows in the store decide, not a
message's headers. Forged messages here are real messages on the broker, published with kombu."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
import redis
from celery import chain

from celery_echomq import DepthError, FlowExistsError, FlowFailed, InvalidIdError, flow
from tests.helpers import KEYS, echomq, wait_for


def job_id() -> str:
    return "JOB" + uuid.uuid4().hex


def gate_name() -> str:
    return f"test:gate:{uuid.uuid4().hex}"


def row(store: redis.Redis, jid: str, field: str, queue: str = "celery") -> str | None:
    value = store.hget(KEYS.job_key(queue, jid), field)
    return value.decode() if value is not None else None


def forge(app: Any, task: str, task_id: str, args: tuple[Any, ...], **headers: Any) -> None:
    """Publish a task message for ``task_id`` with ``headers`` added, straight through kombu:
    what anyone with access to the broker can send."""
    message = app.amqp.create_task_message(task_id, task, args, {})
    with app.connection_for_write() as conn:
        producer = conn.Producer()
        producer.publish(
            message.body,
            exchange="",
            routing_key="celery",
            headers={**message.headers, **headers},
            serializer="json",
            **message.properties,
        )


def test_a_signatures_own_flow_headers_cannot_credit_another_flow(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    gate = gate_name()
    held = flow(proj.tsum.s(), [proj.gated.s(5, gate)])
    held.freeze()
    try:
        victim = held.apply_async()
        # A parent signature that names the held flow in the flow's own header names.
        sneaky = proj.tsum.s().set(headers={"echomq_p": victim.id, "echomq_pq": "celery"})
        assert flow(sneaky, [proj.add.s(1, 1)]).apply_async().get(timeout=60) == 2
        time.sleep(0.5)
        assert row(store, victim.id, "state") == "awaiting_children"
        assert victim.children_values() == {}
    finally:
        store.set(gate, 1)
    assert victim.get(timeout=60) == 5


def test_a_forged_message_for_another_flows_child_changes_neither_flow(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    gate_t = gate_name()
    # V's child waits in the worker's timer, not in a pool process: the forged message
    # finds a free one.
    t_child, v_child = proj.gated.s(3, gate_t), proj.add.s(2, 2).set(countdown=6)
    t, v = flow(proj.tsum.s(), [t_child]), flow(proj.tsum.s(), [v_child])
    t.freeze()
    v.freeze()
    before = int(store.hget("emq:{celery}:counters", "forged_refused") or 0)
    try:
        t_res, v_res = t.apply_async(), v.apply_async()
        forged_id = t_child.options["task_id"]
        # T's child id, V named as its parent, other arguments: what a forger would send.
        forge(
            proj.app, "tests.proj.add", forged_id, (100, 100), echomq_q="celery", echomq_p=v_res.id
        )
        wait_for(lambda: int(store.hget("emq:{celery}:counters", "forged_refused") or 0) > before)
        assert row(store, v_res.id, "state") == "awaiting_children"
        assert row(store, t_res.id, "state") == "awaiting_children"

        stats = json.loads(echomq("stats", "--json").stdout)["queues"]
        assert next(q for q in stats if q["queue"] == "celery")["forged_messages"] > before
    finally:
        store.set(gate_t, 1)
    assert t_res.get(timeout=60) == 3
    assert v_res.get(timeout=60) == 4


def test_a_forged_expired_copy_does_not_fail_the_flow(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    gate = gate_name()
    child = proj.gated.s(6, gate)
    sig = flow(proj.tsum.s(), [child])
    sig.freeze()
    try:
        res = sig.apply_async()
        cid = child.options["task_id"]
        wait_for(lambda: row(store, cid, "state") == "active")
        message = proj.app.amqp.create_task_message(
            cid, "tests.proj.gated", (6, gate), {}, expires="2000-01-01T00:00:00+00:00"
        )
        with proj.app.connection_for_write() as conn:
            conn.Producer().publish(
                message.body,
                exchange="",
                routing_key="celery",
                headers={**message.headers, "echomq_q": "celery", "echomq_p": res.id},
                serializer="json",
                **message.properties,
            )
        time.sleep(1.5)  # the worker takes the copy, finds it expired, and revokes it
        assert row(store, cid, "state") == "active"
        assert row(store, res.id, "state") == "awaiting_children"
    finally:
        store.set(gate, 1)
    assert res.get(timeout=60) == 6


@pytest.mark.parametrize("where", ["child", "inside a chain child"])
def test_a_task_no_worker_registered_fails_its_flow_at_once(
    proj: Any, worker: Any, where: str
) -> None:
    missing = proj.app.signature("tests.proj.not_a_task", args=(1,))
    child = missing if where == "child" else chain(proj.add.s(1, 1), missing)
    started = time.monotonic()
    with pytest.raises(FlowFailed, match=r"NotRegistered: task 'tests\.proj\.not_a_task'"):
        flow(proj.tsum.s(), [child, proj.add.s(1, 1)]).apply_async().get(timeout=60)
    # Long before the stall timeout (300 s in these tests) would let recovery look.
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("bad", ["JOB\u200babc", "JOB\u202eabc", "JOB\u00a0abc"])
def test_the_id_gate_refuses_invisible_characters(proj: Any, bad: str) -> None:
    with pytest.raises(InvalidIdError, match="forbidden character"):
        flow(proj.tsum.s().set(task_id=bad), [proj.add.s(1, 1)]).apply_async()


def nested(proj: Any, depth: int) -> Any:
    sig = flow(proj.tsum.s(), [proj.add.s(1, 1)])
    for _ in range(depth - 1):
        sig = flow(proj.tsum.s(), [sig])
    return sig


@pytest.mark.parametrize("how", ["eager", "worker"])
@pytest.mark.parametrize("depth", [33, 1000])
def test_one_depth_limit_refuses_a_deeper_flow_before_anything_is_sent(
    proj: Any, worker: Any, store: redis.Redis, how: str, depth: int
) -> None:
    sig = nested(proj, depth)
    top = sig.parent.set(task_id=job_id())
    with pytest.raises(DepthError, match="at most 32"):
        sig.apply() if how == "eager" else sig.apply_async()
    assert store.keys(f"*{top.options['task_id']}*") == []


@pytest.mark.parametrize("how", ["eager", "worker"])
def test_a_flow_at_the_depth_limit_runs(proj: Any, worker: Any, how: str) -> None:
    sig = nested(proj, 32)
    res = sig.apply() if how == "eager" else sig.apply_async()
    assert res.get(timeout=60) == 2


def test_a_chain_child_of_tasks_counts_as_no_level(proj: Any, worker: Any) -> None:
    # echomq_max_depth counts flow nesting: a chain of tasks of any length is one child.
    steps = chain(proj.add.s(0, 1), *[proj.add.s(1) for _ in range(40)])
    assert flow(proj.tsum.s(), [steps]).apply_async().get(timeout=60) == 41


def test_a_chain_child_with_a_flow_among_its_steps_counts_flow_levels_not_steps(
    proj: Any, worker: Any
) -> None:
    # A flow then 40 tasks: the flow is a level, the tasks linked behind it none.
    inner = flow(proj.tsum.s(), [proj.add.s(1, 1)])
    steps = chain(inner, *[proj.add.s(1) for _ in range(40)])
    assert flow(proj.tsum.s(), [steps]).apply_async().get(timeout=60) == 42
    # Flows nested in flows still count, one level each, however they are chained.
    deep: Any = proj.add.s(1, 1)
    for _ in range(33):
        deep = chain(flow(proj.tsum.s(), [deep]), proj.add.s(1))
    with pytest.raises(DepthError, match="levels deep"):
        flow(proj.tsum.s(), [deep]).apply_async()


@pytest.mark.parametrize("policy", ["ignore", "remove", "continue"])
def test_retry_child_takes_a_child_failed_under_any_policy_while_held(
    proj: Any, worker: Any, store: redis.Redis, policy: str
) -> None:
    flag, gate = f"test:flag:{uuid.uuid4().hex}", gate_name()
    bad = proj.flaky.s(5, flag).set(parent_policy=policy, task_id=job_id())
    sig = flow(proj.tsum.s(), [bad, proj.gated.s(1, gate)])
    sig.freeze()
    try:
        res = sig.apply_async()
        wait_for(lambda: row(store, bad.options["task_id"], "state") == "failed")
        if policy == "continue":
            # Released at once with no value: the retried child is recorded, not waited for.
            assert res.get(timeout=60) == 0
        store.set(flag, 1)

        out = echomq("retry", res.id, "--child", bad.options["task_id"])
        assert out.exit_code == 0, out.output
    finally:
        store.set(gate, 1)
    if policy != "continue":
        assert res.get(timeout=60) == 6  # the retried child's value counts again
    wait_for(lambda: res.children_values().get(bad.options["task_id"]) == 5)
    assert res.ignored_failures() == {}
    wait_for(lambda: res.dependencies().outstanding == 0)


def test_retry_child_after_the_parent_ran_records_the_new_value(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    flag = f"test:flag:{uuid.uuid4().hex}"
    bad = proj.flaky.s(5, flag).set(parent_policy="ignore", task_id=job_id())
    res = flow(proj.tsum.s(), [bad, proj.add.s(1, 1)]).apply_async()
    assert res.get(timeout=60) == 2
    store.set(flag, 1)
    res.retry(child=bad.options["task_id"])
    wait_for(lambda: res.children_values().get(bad.options["task_id"]) == 5)
    assert res.ignored_failures() == {}
    assert res.dependencies().outstanding == 0
    assert res.get(timeout=60) == 2  # the parent ran once; it does not run again


@pytest.mark.parametrize("policy", ["remove", "fail"])
def test_a_nested_flow_cancelled_on_its_own_settles_against_its_outer_flow(
    proj: Any, worker: Any, store: redis.Redis, policy: str
) -> None:
    gate = gate_name()
    inner = flow(proj.tsum.s(), [proj.gated.s(5, gate)]).set(parent_policy=policy)
    outer = flow(proj.tsum.s(), [proj.add.s(1, 1), inner])
    outer.freeze()
    inner_id = inner.parent.options["task_id"]
    try:
        res = outer.apply_async()
        wait_for(lambda: row(store, inner_id, "state") == "awaiting_children")
        from celery_echomq import FlowResult

        FlowResult(inner_id, app=proj.app).revoke()
        if policy == "remove":
            assert res.get(timeout=60) == 2
        else:
            with pytest.raises(FlowFailed, match="FlowCancelled"):
                res.get(timeout=60)
    finally:
        store.set(gate, 1)
    assert row(store, inner_id, "state") == "cancelled"


def test_revoke_after_a_continue_release_stops_the_children_still_outstanding(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    tag, late_tag = uuid.uuid4().hex, uuid.uuid4().hex
    late = proj.collect.s([], tag=late_tag).set(countdown=4, task_id=job_id())
    res = flow(
        proj.collect.s(tag=tag), [proj.boom.s("x").set(parent_policy="continue"), late]
    ).apply_async()
    assert res.get(timeout=60) == {"values": [], "tag": tag}  # released at once by continue
    res.revoke()
    assert row(store, late.options["task_id"], "state") == "cancelled"
    time.sleep(5)  # past the countdown: the revoked message never runs
    assert not store.exists(f"test:ran:collect:{late_tag}")


@pytest.mark.parametrize("how", ["apply_async", "add_children"])
def test_an_id_names_one_job_across_queues(
    proj: Any, worker: Any, store: redis.Redis, own_queue: Any, how: str
) -> None:
    other = own_queue("ids")
    taken = job_id()
    first = flow(proj.tsum.s(), [proj.add.s(1, 1).set(task_id=taken)])
    assert first.apply_async().get(timeout=60) == 2
    again = proj.add.s(2, 2).set(task_id=taken, queue=other)
    if how == "apply_async":
        parent = proj.tsum.s().set(task_id=job_id(), queue=other)
        with pytest.raises(FlowExistsError, match="already exists in Redis, on queue 'celery'"):
            flow(parent, [again]).apply_async()
        assert store.keys(f"*{parent.options['task_id']}*") == []
    else:
        gate = gate_name()
        try:
            held = flow(proj.tsum.s(), [proj.gated.s(1, gate)]).apply_async()
            with pytest.raises(FlowExistsError, match="on queue 'celery'"):
                held.add_children([again])
            assert held.dependencies().outstanding == 1
        finally:
            store.set(gate, 1)
    assert not store.exists(KEYS.job_key(other, taken))


@pytest.mark.parametrize("path", ["one_step", "chunked", "wide"])
def test_two_flows_made_at_once_on_two_new_queues_never_share_an_id(
    proj: Any, store: redis.Redis, own_queue: Any, path: str
) -> None:
    """Back to back, on two queues the store has never seen: the second flow naming a child
    id of the first is refused, whichever path it takes (its enqueue script checks every
    queue itself, or its ids are claimed first), and writes nothing."""
    first_q, second_q = own_queue("new-a"), own_queue("new-b")
    shared = job_id()
    first = flow(proj.tsum.s(), [proj.add.s(1, 1).set(task_id=shared)]).apply_async(queue=first_q)
    kids = [proj.add.s(2, 2).set(task_id=shared)]
    if path == "chunked":  # a child on a third queue: open_flow, add_children, seal_flow
        kids.append(proj.add.s(3, 3).set(task_id=job_id(), queue=own_queue("new-c")))
    if path == "wide":  # too many ids x queues for its script to check: the host checks
        kids += [proj.add.s(i, i) for i in range(999)]  # 1000 children, one enqueue_flow
        store.sadd("emq:queues", *(own_queue(f"wide-{i}") for i in range(5)))  # > 4 others
    parent = proj.tsum.s().set(task_id=job_id(), queue=second_q)
    with pytest.raises(FlowExistsError, match=f"already exists in Redis, on queue '{first_q}'"):
        flow(parent, kids).apply_async(queue=second_q)
    assert store.keys(f"*{parent.options['task_id']}*") == []
    assert not store.exists(KEYS.job_key(second_q, shared))
    assert not store.exists(f"emq:id:{{{shared}}}")  # no claim left behind
    # The first flow keeps its child.
    assert store.hget(KEYS.job_key(first_q, shared), "parent") == first.id.encode()
    # The same flow without the shared id lands, and leaves no claim behind.
    again = flow(proj.tsum.s(), [*kids[1:], proj.add.s(5, 5)]).apply_async(queue=second_q)
    assert store.hget(KEYS.job_key(second_q, again.id), "state") == b"awaiting_children"
    landed = json.loads(store.hget(KEYS.job_key(second_q, again.id), "payload"))["children"]
    assert len(landed) == len(kids)
    assert not any(store.exists(f"emq:id:{{{i}}}") for i in [again.id, *landed])


@pytest.mark.parametrize("path", ["one_step", "chunked"])
def test_an_id_claimed_by_an_enqueue_in_flight_on_another_queue_is_refused(
    proj: Any, store: redis.Redis, own_queue: Any, path: str
) -> None:
    """Another producer has claimed an id for its queue and not landed yet (its claim key,
    as send/ids.py sets it): a flow on another queue naming that id is refused."""
    elsewhere, queue = own_queue("inflight-a"), own_queue("inflight-b")
    shared = job_id()
    store.set(f"emq:id:{{{shared}}}", elsewhere, ex=60)
    kids = [proj.add.s(2, 2).set(task_id=shared)]
    if path == "chunked":
        kids.append(proj.add.s(3, 3).set(task_id=job_id(), queue=own_queue("inflight-c")))
    parent = proj.tsum.s().set(task_id=job_id(), queue=queue)
    try:
        with pytest.raises(FlowExistsError, match=f"on queue '{elsewhere}'"):
            flow(parent, kids).apply_async(queue=queue)
        assert store.keys(f"*{parent.options['task_id']}*") == []
        assert not store.exists(KEYS.job_key(queue, shared))
        assert store.get(f"emq:id:{{{shared}}}") == elsewhere.encode()  # not ours to drop
    finally:
        store.delete(f"emq:id:{{{shared}}}")


def test_a_worker_reading_another_store_says_so(
    proj: Any, env: Any, start_worker: Any, own_queue: Any
) -> None:
    queue = own_queue("elsewhere")
    elsewhere = env.store.rsplit("/", 1)[0] + "/9"
    worker = start_worker(queues=queue, extra_env={"ECHOMQ_T_STORE": elsewhere})
    flow(proj.tsum.s(), [proj.add.s(1, 1)]).apply_async(queue=queue)
    wait_for(lambda: "has no row in this worker's store" in worker.output(), timeout=60)
    line = next(x for x in worker.output().splitlines() if "has no row in this worker" in x)
    # Both stores: the one it reads, and the one the producer wrote the flow to.
    assert f"store {elsewhere}" in line and f"its producer wrote it to {env.store}" in line
