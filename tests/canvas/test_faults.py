"""The guarantees inside canvases, against real workers: a chain among a flow's children (and a
chain as its parent) is a nest of held flows, one per step, and each step is claimed,
completed, counted and recovered like any flow job.

Duplicate and broker redeliveries of a step, a worker SIGKILLed mid-step, a step's message
lost between two steps, a failing step's errback, and a cancel while steps are held or running.
Every test runs its flows on queues of its own, consumed by workers of its own (started with a
short stall timeout where recovery is involved), never the session worker's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import uuid
from typing import Any

import pytest
import redis
from celery import chain
from celery.result import AsyncResult

import celery_echomq
from celery_echomq import FlowCancelled, FlowFailed, flow
from tests.helpers import (
    KEYS,
    RECOVERY_STALL,
    Env,
    counters,
    echomq,
    fast_recovery,
    jobs,
    logged,
    quiet,
    row,
    wait_for,
)

pytestmark = pytest.mark.e2e

STALL = RECOVERY_STALL  # the stall timeout of the recovering workers, in seconds


@pytest.fixture
def queue(own_queue: Any) -> str:
    """A queue of this test's own (removed afterwards)."""
    return str(own_queue("cf"))


@pytest.fixture
def side(own_queue: Any) -> str:
    """A second queue of this test's own: one step is routed there."""
    return str(own_queue("cf-side"))


def state_of(client: Any, queue: str, job_id: str) -> str | None:
    return row(client, queue, job_id).get("state")


def runs(client: Any, name: str) -> int:
    """How many times ``mark(name)`` ran (``collect:<tag>`` for a collect body)."""
    return int(client.get(f"test:ran:{name}") or 0)


def deliveries(client: Any, job_id: str) -> int:
    """How many deliveries of ``job_id`` ran their body (redeliver, hang_first)."""
    return int(client.get(f"test:delivery:{job_id}") or 0)


def skipped(worker: Any, job_id: str, *why: str) -> bool:
    out = worker.output()
    return any(f"skip duplicate delivery of {job_id} ({w})" in out for w in why)


def given(store: Any, queue: str, step: str) -> Any:
    """The value a linked chain's step was given by the step before it (its row's input)."""
    raw = store.hget(KEYS.job_key(queue, step), "input")
    return None if raw is None else json.loads(raw)


def fan_in(proj: Any, queue: str, step: str) -> tuple[Any, dict[str, Any]]:
    """What a step's own held row counted: its dependencies and the values it got."""
    return (
        celery_echomq.dependencies(step, app=proj.app, queue=queue),
        celery_echomq.children_values(step, app=proj.app, queue=queue),
    )


def show_json(job_id: str) -> dict[str, Any]:
    """``show --json`` of ``job_id``, each nested flow (one line with its counts in its outer
    flow's page) opened with a ``show --json`` of its own, as a person would."""
    out = echomq("show", "--json", job_id)
    assert out.exit_code == 0, out.output
    node = dict(json.loads(out.stdout))
    node["children"] = [show_json(c["id"]) if c["flow"] else c for c in node["children"]]
    return node


def shape(node: dict[str, Any]) -> Any:
    """``(id, state, [children...])`` of a shown tree: what it nests, and where each job is; a
    linked chain child is ``(id, [(step id, state), ...])``."""
    if node.get("steps"):
        return (node["id"], [(step["id"], step["state"]) for step in node["steps"]])
    return (node["id"], node["state"], [shape(c) for c in node["children"]])


# --- 1. each step counted once, whatever the broker redelivers --------------------------------


@pytest.mark.parametrize("when", ["after", "racing"])
def test_each_step_of_a_chain_child_is_counted_once_despite_duplicate_deliveries(
    proj: Any, store: Any, queue: str, start_worker: Any, when: str
) -> None:
    # Every step sends its own message again once (same id, same headers): the copy arrives
    # after the step completed ("after": a second later), or while it may still run
    # ("racing"). The copy's body never runs, and the step's row makes the next one pending
    # once.
    tag, (s1, s2, s3, other) = uuid.uuid4().hex, jobs(4)
    countdown = 1.0 if when == "after" else 0.0
    w = start_worker(queues=queue, concurrency=2 if when == "after" else 3)
    steps = chain(
        proj.redeliver.s(1, countdown=countdown).set(task_id=s1),
        proj.redeliver.s(countdown=countdown).set(task_id=s2),
        proj.redeliver.s(countdown=countdown).set(task_id=s3),
    )
    kids = [steps, proj.add.s(1, 1).set(task_id=other)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)

    # Each delivery that runs returns x * 10 + its delivery number: 1 -> 11 -> 111 -> 1111
    # only if every step ran once, as its first delivery, and got its step's value as is.
    assert res.get(timeout=90) == {"values": [1111, 2], "tag": tag}
    for step in (s1, s2, s3):
        wait_for(lambda step=step: skipped(w, step, "done", "busy"), timeout=60)
        assert deliveries(store, step) == 1  # the copy's body did not run
        assert row(store, queue, step)["attempts"] == "1"
        assert state_of(store, queue, step) == "done"
    assert counters(store, queue).get("duplicates_skipped") == 3
    assert counters(store, queue).get("republished", 0) == 0

    # The flow counted its two children once; each step was given its step's value once.
    assert res.dependencies() == (0, 2, 0, 0)
    assert res.children_values() == {s3: 1111, other: 2}
    assert given(store, queue, s2) == 11
    assert given(store, queue, s3) == 111
    assert runs(store, f"collect:{tag}") == 1


def test_a_chain_step_whose_pool_process_died_is_redelivered_and_counted_once(
    proj: Any, store: Any, queue: str, start_worker: Any
) -> None:
    # acks_late + reject_on_worker_lost: the broker redelivers the message of the step whose
    # pool process was SIGKILLed mid-body. The redelivery takes the step over; it is credited
    # once, and the next step runs once, with its value.
    tag, (s1, s2, s3, other) = uuid.uuid4().hex, jobs(4)
    w = start_worker(queues=queue, extra_env={"ECHOMQ_T_ACKS_LATE": "1", "ECHOMQ_T_STALL": "60"})
    steps = chain(
        proj.add.s(1, 2).set(task_id=s1),
        proj.hang_first.s().set(task_id=s2),
        proj.square.s().set(task_id=s3),
    )
    kids = [steps, proj.add.s(0, 1).set(task_id=other)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    wait_for(lambda: store.exists(f"test:pid:{s2}"), timeout=60)
    pid = int(store.get(f"test:pid:{s2}"))
    assert pid in w.pool_pids()
    assert state_of(store, queue, s2) == "active"
    assert state_of(store, queue, s3) == "waiting"  # until the step that hangs completes
    first_token = row(store, queue, s2)["token"]
    os.kill(pid, signal.SIGKILL)

    assert res.get(timeout=90) == {"values": [9, 1], "tag": tag}
    assert deliveries(store, s2) == 2  # the killed delivery, then the broker's redelivery
    after = row(store, queue, s2)
    assert after["attempts"] == "2"
    assert after["token"] != first_token
    assert [row(store, queue, s)["attempts"] for s in (s1, s3)] == ["1", "1"]
    assert res.dependencies() == (0, 2, 0, 0)
    assert res.children_values() == {s3: 9, other: 1}
    assert (given(store, queue, s2), given(store, queue, s3)) == (3, 3)
    assert runs(store, f"collect:{tag}") == 1


# --- 2. a worker SIGKILLed mid-step -------------------------------------------------------------


def test_worker_killed_mid_chain_step_the_step_is_republished(
    proj: Any, store: Any, queue: str, start_worker: Any
) -> None:
    tag, (s1, s2, s3, other) = uuid.uuid4().hex, jobs(4)
    first = start_worker(queues=queue, extra_env=fast_recovery())
    steps = chain(
        proj.add.s(1, 2).set(task_id=s1),
        proj.hang_first.s().set(task_id=s2),
        proj.square.s().set(task_id=s3),
    )
    kids = [steps, proj.add.s(0, 1).set(task_id=other)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    wait_for(lambda: store.exists(f"test:pid:{s2}"), timeout=60)
    assert state_of(store, queue, s2) == "active"
    assert state_of(store, queue, s3) == "waiting"
    # SIGKILL the whole worker: the step's message was acked on receipt, so it is gone.
    first.kill()

    second = start_worker(queues=queue, extra_env=fast_recovery())
    assert res.get(timeout=90) == {"values": [9, 1], "tag": tag}
    logged(second, f"re-published {s2} (its holder's lease lapsed; result backend: PENDING)")
    assert deliveries(store, s2) == 2
    assert row(store, queue, s2)["attempts"] == "2"
    # Re-published with its value: the first step's, kept on the step's row.
    assert (given(store, queue, s2), given(store, queue, s3)) == (3, 3)
    assert [row(store, queue, s)["attempts"] for s in (s1, s3)] == ["1", "1"]
    assert res.dependencies() == (0, 2, 0, 0)
    assert runs(store, f"collect:{tag}") == 1


# --- 3. and 4. a step's message lost between two steps ------------------------------------------


def released_ago(worker: Any, step: str) -> float:
    """How long ``step`` had been released when recovery dispatched it again (its log line)."""
    found = re.search(rf"dispatched parent {step} \(released ([0-9.]+)s ago", worker.output())
    assert found, worker.output()[-3000:]
    return float(found.group(1))


def _lose_the_message(broker: Any, store: Any, side: str, step: str) -> None:
    """Wait until ``step`` was released and its message sent to ``side`` (where no worker
    consumes), then delete that message: it is lost before any worker took it."""
    wait_for(lambda: row(store, side, step).get("dispatched"), timeout=60)
    wait_for(lambda: broker.llen(side) == 1, timeout=30)
    assert state_of(store, side, step) == "pending"
    broker.delete(side)


def test_a_lost_message_of_a_chain_childs_second_step_is_republished(
    proj: Any, env: Env, store: Any, queue: str, side: str, start_worker: Any
) -> None:
    # The second step is routed to ``side``: when the first completes, its message goes where
    # no worker consumes yet, and is lost there. The worker started on ``side`` later finds
    # the released step pending past the stall timeout with nothing in the broker, and
    # dispatches it again, with the first step's value.
    tag, (s1, s2, s3, other) = uuid.uuid4().hex, jobs(4)
    broker = redis.Redis.from_url(env.broker)
    start_worker(queues=queue, extra_env=fast_recovery())
    steps = chain(
        proj.add.s(1, 2).set(task_id=s1),
        proj.add.s(10).set(task_id=s2, queue=side),
        proj.square.s().set(task_id=s3),
    )
    kids = [steps, proj.add.s(0, 1).set(task_id=other)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    _lose_the_message(broker, store, side, s2)
    assert state_of(store, queue, s3) == "awaiting_children"

    rescuer = start_worker(queues=side, extra_env=fast_recovery())
    assert res.get(timeout=90) == {"values": [169, 1], "tag": tag}
    logged(rescuer, f"dispatched parent {s2} (released")
    assert "its message is gone" in rescuer.output()
    assert released_ago(rescuer, s2) >= STALL  # not before the stall timeout had passed
    assert counters(store, side).get("republished") == 1
    assert row(store, side, s2)["attempts"] == "1"  # never ran before the re-publish
    assert fan_in(proj, side, s2) == ((0, 1, 0, 0), {s1: 3})
    assert fan_in(proj, queue, s3) == ((0, 1, 0, 0), {s2: 13})
    assert res.dependencies() == (0, 2, 0, 0)
    assert res.children_values() == {s3: 169, other: 1}
    assert runs(store, f"collect:{tag}") == 1


def test_a_lost_message_inside_a_chain_parent_is_republished(
    proj: Any, env: Env, store: Any, queue: str, side: str, start_worker: Any
) -> None:
    # flow(chain(tsum, square, add(1)), children): the parent chain's second step is routed to
    # ``side`` and its message lost there once tsum released it.
    p1, p2, p3 = jobs(3)
    ids = jobs(2)
    broker = redis.Redis.from_url(env.broker)
    start_worker(queues=queue, extra_env=fast_recovery())
    parent = chain(
        proj.tsum.s().set(task_id=p1),
        proj.square.s().set(task_id=p2, queue=side),
        proj.add.s(1).set(task_id=p3),
    )
    kids = [proj.add.s(1, 1).set(task_id=ids[0]), proj.add.s(2, 2).set(task_id=ids[1])]
    res = flow(parent, kids).apply_async(queue=queue)
    assert res.id == p3  # the flow's value is its parent chain's last step's
    _lose_the_message(broker, store, side, p2)
    assert state_of(store, queue, p3) == "awaiting_children"

    rescuer = start_worker(queues=side, extra_env=fast_recovery())
    assert res.get(timeout=90) == (2 + 4) ** 2 + 1
    logged(rescuer, f"dispatched parent {p2} (released")
    assert released_ago(rescuer, p2) >= STALL
    assert counters(store, side).get("republished") == 1
    assert row(store, side, p2)["attempts"] == "1"
    # The flow's own children were counted once, by the chain's first step.
    assert res.dependencies() == (0, 2, 0, 0)
    assert res.children_values() == {ids[0]: 2, ids[1]: 4}
    assert fan_in(proj, side, p2) == ((0, 1, 0, 0), {p1: 6})
    assert fan_in(proj, queue, p3) == ((0, 1, 0, 0), {p2: 36})


def test_steps_made_pending_by_a_pool_process_that_died_before_publishing_them_run(
    proj: Any, store: Any, queue: str, start_worker: Any
) -> None:
    # ECHOMQ_T_DIE_AT=publish_step: each pool process whose step completion made the next step
    # pending SIGKILLs itself before publishing it. The worker's recovery re-publishes each
    # such step from its row, with its input, once its message is seen gone.
    tag, (s1, s2, s3, other) = uuid.uuid4().hex, jobs(4)
    w = start_worker(queues=queue, extra_env=fast_recovery(ECHOMQ_T_DIE_AT="publish_step"))
    steps = chain(
        proj.add.s(1, 2).set(task_id=s1),
        proj.add.s(10).set(task_id=s2),
        proj.square.s().set(task_id=s3),
    )
    kids = [steps, proj.add.s(0, 1).set(task_id=other)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    assert res.get(timeout=120) == {"values": [169, 1], "tag": tag}
    logged(w, "killed itself at publish_step")
    for step in (s2, s3):
        logged(w, f"re-published {step} of parent {res.id}")
        assert row(store, queue, step)["attempts"] == "1"
    assert (given(store, queue, s2), given(store, queue, s3)) == (3, 13)
    assert res.dependencies() == (0, 2, 0, 0)
    assert runs(store, f"collect:{tag}") == 1


# --- 5. link_error of a flow whose chain child fails --------------------------------------------


def errbacks(client: Any, job_id: str) -> int:
    """How many times ``proj.errback`` ran for ``job_id``."""
    return int(client.lrange("test:errback", 0, -1).count(job_id.encode()))


@pytest.mark.parametrize("fault", ["none", "duplicate", "killed_before_recording"])
def test_link_error_of_a_flow_whose_chain_child_fails_runs_once(
    proj: Any, store: Any, queue: str, start_worker: Any, fault: str
) -> None:
    # "duplicate": the failing step sends its own message again before it fails; the copy is
    # skipped. "killed_before_recording": the pool process dies between the step's failure
    # and recording its flow's FAILURE; recovery records it (and runs the errbacks) once.
    tag, (s1, s2, other) = uuid.uuid4().hex, jobs(3)
    extra = fast_recovery(ECHOMQ_T_DIE_AT="parent_failed" if fault.startswith("killed") else "")
    w = start_worker(queues=queue, extra_env=extra)
    failing = {
        "none": proj.boom.si("in chain"),
        "duplicate": proj.redeliver_boom.si("in chain", countdown=0.5),
        "killed_before_recording": proj.boom.si("in chain"),
    }[fault]
    steps = chain(proj.add.s(1, 1).set(task_id=s1), failing.set(task_id=s2))
    f = flow(proj.collect.s(tag=tag), [steps, proj.add.s(2, 2).set(task_id=other)])
    f.on_error(proj.errback.s().set(queue=queue))
    res = f.apply_async(queue=queue)

    with pytest.raises(FlowFailed) as failed:
        res.get(timeout=90)
    assert failed.value.child_id == s2
    assert failed.value.error == "ValueError: in chain"
    wait_for(lambda: errbacks(store, res.id) >= 1, timeout=60)
    if fault == "duplicate":
        wait_for(lambda: skipped(w, s2, "failed", "done", "busy"), timeout=60)
        assert deliveries(store, s2) == 1
    if fault.startswith("killed"):
        logged(w, "killed itself at parent_failed")
        logged(w, f"recorded FAILURE of parent {res.id} (child {s2} failed: ValueError: in chain)")
    # Recovery has looked at the failed flow since (its failed set is checked past the
    # failure): a second recording would have happened by now.
    failed_at = store.zscore(KEYS.queue_key(queue, "failed"), res.id)
    assert failed_at is not None
    checked = KEYS.queue_key(queue, "failed_checked")
    wait_for(lambda: float(store.get(checked) or 0) >= failed_at, timeout=60)
    assert quiet(lambda: errbacks(store, res.id)) == 1
    assert errbacks(store, s2) == errbacks(store, s1) == 0  # the flow's errback, not the steps'
    assert state_of(store, queue, res.id) == "failed"
    assert runs(store, f"collect:{tag}") == 0


# --- 6. cancel while chain steps are held or running --------------------------------------------


@pytest.mark.parametrize("layout", ["one_queue", "steps_on_two_queues"])
def test_revoke_a_flow_with_unfinished_chain_children_cancels_every_step(
    proj: Any, store: Any, queue: str, side: str, start_worker: Any, layout: str
) -> None:
    # Two chain children: in the first, its first step runs (blocked on a gate) and the two
    # after it wait; in the second, its first step is done, its second runs, blocked on the
    # gate, and the third waits. "steps_on_two_queues": each chain's
    # second step is routed to another queue (as chains route their steps), its row on that
    # queue's slot.
    t, gate = uuid.uuid4().hex, f"test:gate:{uuid.uuid4().hex}"
    a1, a2, a3, b1, b2, b3 = jobs(6)
    second_queue = side if layout == "steps_on_two_queues" else queue
    linked = layout == "one_queue"  # a chain of tasks on one queue's slot is linked
    w = start_worker(queues=f"{queue},{side}", concurrency=2)
    try:
        first = chain(
            proj.gated.s(1, gate).set(task_id=a1),
            proj.collect.s(tag=f"{t}-a2").set(task_id=a2, queue=second_queue),
            proj.collect.s(tag=f"{t}-a3").set(task_id=a3),
        )
        second = chain(
            proj.add.s(2, 2).set(task_id=b1),
            proj.gated.s(gate).set(task_id=b2, queue=second_queue),
            proj.collect.s(tag=f"{t}-b3").set(task_id=b3),
        )
        res = flow(proj.collect.s(tag=t), [first, second]).apply_async(queue=queue)
        names = {"flow": res.id, "a1": a1, "a2": a2, "a3": a3, "b1": b1, "b2": b2, "b3": b3}

        def states(*which: str) -> dict[str, str | None]:
            """The rows' states, each read on its queue's slot."""
            on = {n: second_queue if n in ("a2", "b2") else queue for n in which}
            return {n: state_of(store, on[n], names[n]) for n in which}

        def taken(name: str) -> bool:
            """Active under a delivery's token: running, not a chain's step handed out active
            that no delivery took yet (a revoke cancels that one before it runs)."""
            on = second_queue if name in ("a2", "b2") else queue
            return bool(store.hget(KEYS.job_key(on, names[name]), "token"))

        wait_for(lambda: states("a1", "b2") == {"a1": "active", "b2": "active"}, timeout=60)
        wait_for(lambda: taken("a1") and taken("b2"), timeout=60)

        tree = show_json(res.id)
        if linked:
            # show: each chain child lists its steps, in order, and where each stands.
            assert shape(tree) == (
                res.id,
                "awaiting_children",
                [
                    (a3, [(a1, "active"), (a2, "waiting"), (a3, "waiting")]),
                    (b3, [(b1, "done"), (b2, "active"), (b3, "waiting")]),
                ],
            )
            b_chain = tree["children"][1]
            assert b_chain["running_step"] == 2 and b_chain["chain_state"] == "active"
            assert b_chain["steps"][0]["value"] == 4  # b1's value, given to b2
        else:
            # Steps on two queues' slots: each chain child is a nest of its steps, the last
            # step outermost.
            assert shape(tree) == (
                res.id,
                "awaiting_children",
                [
                    (a3, "awaiting_children", [(a2, "awaiting_children", [(a1, "active", [])])]),
                    (b3, "awaiting_children", [(b2, "active", [(b1, "done", [])])]),
                ],
            )
            b2_node = tree["children"][1]["children"][0]
            assert b2_node["children"][0]["value"] == 4  # b2's own fan-in counted b1's value
            text = echomq("show", a3)
            assert text.exit_code == 0, text.output
            lines = text.stdout.splitlines()
            assert lines[0].startswith(f"flow {a3}  tests.proj.collect  awaiting_children")
            assert f"parent={res.id}" in lines[0]
            assert lines[1].startswith(f"└─ flow {a2}  tests.proj.collect  awaiting_children")
            assert len(lines) == 2  # a nested flow: one line with its counts until opened
            every = echomq("show", a3, "--all").stdout.splitlines()
            assert every[1].startswith(f"├─ flow {a2}  tests.proj.collect  awaiting_children")
            assert every[2].startswith(f"│  ├─ {a1}  tests.proj.gated  active  attempts=1")

        res.revoke()
        with pytest.raises(FlowCancelled):
            res.get(timeout=30)
        steps = ("flow", "a1", "a2", "a3", "b2", "b3")
        assert states(*steps, "b1") == {**dict.fromkeys(steps, "cancelled"), "b1": "done"}
        # A step that will never run (held, or waiting): cancelled, its get() says so too.
        for step in (a3, a2, b3):
            with pytest.raises(FlowCancelled):
                AsyncResult(step, app=proj.app).get(timeout=30)

        # The running steps finish once the gate opens; nothing after them runs.
        store.set(gate, 1)
        for step in (a1, b2):
            logged(w, f"[{step}] succeeded", timeout=60)
        assert quiet(lambda: states(*steps)) == dict.fromkeys(steps, "cancelled")
        for name in (t, f"{t}-a2", f"{t}-a3", f"{t}-b3"):
            assert runs(store, f"collect:{name}") == 0, name
        after = show_json(res.id)
        if linked:
            assert shape(after) == (
                res.id,
                "cancelled",
                [
                    (a3, [(a1, "cancelled"), (a2, "cancelled"), (a3, "cancelled")]),
                    (b3, [(b1, "done"), (b2, "cancelled"), (b3, "cancelled")]),
                ],
            )
        else:
            assert shape(after) == (
                res.id,
                "cancelled",
                [
                    (a3, "cancelled", [(a2, "cancelled", [(a1, "cancelled", [])])]),
                    (b3, "cancelled", [(b2, "cancelled", [(b1, "done", [])])]),
                ],
            )
    finally:
        store.set(gate, 1)
