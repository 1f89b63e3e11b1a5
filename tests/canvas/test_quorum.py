"""A flow released by a quorum of its children, ``flow(parent, children, quorum=K)``: the
parent runs once, at the K-th success, with the K values in the order they succeeded; the
children not started are cancelled and never run; a quorum that can no longer be met fails
the flow at once (send/quorum.py, store/lua/includes/quorum.lua), on a worker and eagerly."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import redis
from celery.result import AsyncResult

from celery_echomq import FlowDeadlineExceeded, FlowFailed, flow
from tests.helpers import KEYS, echomq, run, state_of, wait_for

TIMEOUT = 60


def ran(store: redis.Redis, tag: str, x: int) -> int:
    return int(store.get(f"test:ran:hedge:{tag}:{x}") or 0)


def finished(store: redis.Redis, tag: str) -> list[int]:
    return [int(v) for v in store.lrange(f"test:hedge:{tag}", 0, -1)]


def test_ten_children_three_needed(proj: Any, how: str, store: redis.Redis) -> None:
    """3 of 10 succeed fast, 7 sleep: the parent runs once with the first 3 values in the order
    they succeeded; the children not started never run; one already running finishes and is
    not counted."""
    tag = uuid.uuid4().hex
    # The three fast ones finish ~0.3 s apart (in an order of their own on two processes).
    kids = [proj.hedge.s(i, tag, (0.6, 0.3, 0.0)[i] if i < 3 else 2.0) for i in range(10)]
    res = run(flow(proj.collect.s(tag=tag), kids, quorum=3), how)
    got = res.get(timeout=TIMEOUT)
    assert got["tag"] == tag
    assert got["values"] == finished(store, tag)[:3]
    assert sorted(got["values"]) == [0, 1, 2]
    assert int(store.get(f"test:ran:collect:{tag}") or 0) == 1
    if how == "apply":
        assert [ran(store, tag, i) for i in range(10)] == [1, 1, 1] + [0] * 7
        return
    time.sleep(2.5)  # any slow child that was running finishes meanwhile
    runs = [ran(store, tag, i) for i in range(10)]
    assert runs[:3] == [1, 1, 1]
    assert sum(runs[3:]) <= 2  # at most the worker's two processes' worth started
    assert max(runs) == 1
    assert int(store.get(f"test:ran:collect:{tag}") or 0) == 1
    assert res.children_values() is not None
    # The cancelled ones are cancelled on their rows; none is pending any more.
    parent = res.id
    children = [
        x.decode() for x in store.lrange(KEYS.job_key("celery", parent) + ":children", 0, -1)
    ]
    states = [
        (store.hget(KEYS.job_key("celery", cid), "state") or b"").decode() for cid in children
    ]
    assert states[:3] == ["done"] * 3
    assert states[3:].count("cancelled") == 7 - sum(runs[3:])
    assert set(states[3:]) <= {"done", "cancelled"}
    shown = echomq("show", parent).output
    assert "quorum=3" in shown and "done=3/10" in shown


def test_quorum_impossible_fails_at_once(proj: Any, how: str, store: redis.Redis) -> None:
    """4 children, 3 needed, 2 fail: at the second failure the flow fails, saying how many
    succeeded and how many were needed; the parent never runs."""
    tag = uuid.uuid4().hex
    kids = [proj.boom.s("no"), proj.hedge.s(1, tag), proj.boom.s("no"), proj.hedge.s(3, tag)]
    res = run(flow(proj.collect.s(tag=tag), kids, quorum=3), how)
    with pytest.raises(FlowFailed) as err:
        res.get(timeout=TIMEOUT)
    assert "quorum not met" in str(err.value)
    assert "of 4 children succeeded, 3 needed (2 failed" in str(err.value)
    assert int(store.get(f"test:ran:collect:{tag}") or 0) == 0


def test_quorum_lost_then_retried(proj: Any, worker: Any, store: redis.Redis) -> None:
    """Two of three fail: the quorum of 2 is lost; retried with the fault gone, the failed
    children run again and the parent runs once with 2 values."""
    flag, tag = f"test:flag:{uuid.uuid4().hex}", uuid.uuid4().hex
    kids = [proj.flaky.s(1, flag), proj.flaky.s(2, flag), proj.add.s(3, 0)]
    res = flow(proj.collect.s(tag=tag), kids, quorum=2).apply_async()
    with pytest.raises(FlowFailed, match="quorum not met"):
        res.get(timeout=TIMEOUT)
    store.set(flag, 1)
    res.retry()
    got = res.get(timeout=TIMEOUT)
    assert len(got["values"]) == 2 and 3 in got["values"]
    assert int(store.get(f"test:ran:collect:{tag}") or 0) == 1


def test_quorum_with_policy_ignore(proj: Any, how: str, store: redis.Redis) -> None:
    """Failures under ignore shrink what can still succeed; the quorum is met by the rest."""
    tag = uuid.uuid4().hex
    kids = [proj.boom.s("a"), proj.hedge.s(1, tag), proj.boom.s("b"), proj.hedge.s(3, tag)]
    res = run(flow(proj.collect.s(tag=tag), kids, quorum=2, policy="ignore"), how)
    got = res.get(timeout=TIMEOUT)
    assert sorted(got["values"]) == [1, 3]
    assert int(store.get(f"test:ran:collect:{tag}") or 0) == 1


def test_quorum_refusals(proj: Any) -> None:
    with pytest.raises(ValueError, match="quorum"):
        flow(proj.tsum.s(), [proj.add.s(1, 1)], quorum=0)
    with pytest.raises(ValueError, match="can never be met"):
        flow(proj.tsum.s(), [proj.add.s(1, 1)], quorum=2).apply()
    sig = flow(proj.tsum.s(), [proj.add.s(1, 1), proj.add.s(2, 2)], quorum=1)
    assert flow.from_dict(dict(sig)).kwargs["quorum"] == 1
    assert sig.clone().kwargs["quorum"] == 1


def test_quorum_of_all_is_a_plain_flow(proj: Any, how: str) -> None:
    res = run(flow(proj.tsum.s(), [proj.add.s(i, 0) for i in range(4)], quorum=4), how)
    assert res.get(timeout=TIMEOUT) == 6


def test_a_quorum_flow_takes_no_added_children(proj: Any, worker: Any, store: redis.Redis) -> None:
    gate = f"test:gate:{uuid.uuid4().hex}"
    res = flow(proj.tsum.s(), [proj.gated.s(1, gate), proj.gated.s(2, gate)], quorum=1)
    res = res.apply_async()
    with pytest.raises(ValueError, match="takes no added children"):
        res.add_children([proj.add.s(1, 1)])
    store.set(gate, 1)
    assert res.get(timeout=TIMEOUT) in (1, 2)


def test_a_nested_flow_is_one_child_of_a_quorum(proj: Any, how: str) -> None:
    kids = [flow(proj.tsum.s(), [proj.add.s(1, 1), proj.add.s(2, 2)]), proj.boom.s("no")]
    kids.append(proj.add.s(10, 0))
    res = run(flow(proj.tsum.s(), kids, quorum=2), how)
    assert res.get(timeout=TIMEOUT) == 16


def test_a_quorum_with_a_window(proj: Any, how: str, store: redis.Redis) -> None:
    """One child out at a time: the quorum met at the second, the eight waiting never run."""
    tag = uuid.uuid4().hex
    kids = [proj.hedge.s(i, tag) for i in range(10)]
    res = run(flow(proj.collect.s(tag=tag), kids, quorum=2, max_active=1), how)
    assert res.get(timeout=TIMEOUT)["values"] == [0, 1]
    time.sleep(0.5)
    assert [ran(store, tag, i) for i in range(10)] == [1, 1] + [0] * 8


def _deadline_flow(proj: Any, tag: str, on_deadline: str) -> Any:
    """quorum=3 of 4: two quick children, two still running when the 1 s deadline passes
    (they hold both of the worker's processes, as eagerly the first of them holds the run)."""
    kids = [proj.add.s(1, 1), proj.add.s(2, 2), proj.sleep_then.s(3, 2.5)]
    kids.append(proj.sleep_then.s(4, 2.5))
    return flow(proj.collect.s(tag=tag), kids, quorum=3, deadline=1, on_deadline=on_deadline)


def test_a_deadline_continue_releases_with_fewer_than_k(
    proj: Any, how: str, store: redis.Redis
) -> None:
    """on_deadline="continue": the parent runs once with the 2 successes so far, in the order
    they succeeded; the children that finish after are recorded, not counted."""
    tag = uuid.uuid4().hex
    res = run(_deadline_flow(proj, tag, "continue"), how)
    got = res.get(timeout=TIMEOUT)
    assert sorted(got["values"]) == [2, 4]
    if how == "apply_async":
        order = store.lrange(KEYS.job_key("celery", res.id) + ":quorum", 0, -1)
        values = res.children_values()
        assert got["values"] == [values[cid.decode()] for cid in order]
        time.sleep(2.5)  # the running children finish meanwhile
    else:
        assert got["values"] == [2, 4]  # eagerly, they succeed in the children's order
    assert sorted(res.children_values().values()) == [2, 4]
    assert res.dependencies().done == 2
    assert int(store.get(f"test:ran:collect:{tag}") or 0) == 1


def test_a_deadline_fail_fails_a_quorum_not_met(proj: Any, how: str, store: redis.Redis) -> None:
    """on_deadline="fail" (the default too): the flow fails with the deadline's error, naming
    the children outstanding; the parent never runs."""
    tag = uuid.uuid4().hex
    res = run(_deadline_flow(proj, tag, "fail"), how)
    with pytest.raises(FlowDeadlineExceeded) as err:
        res.get(timeout=TIMEOUT)
    assert "passed its deadline with 2 children outstanding" in str(err.value)
    assert err.value.count == 2
    time.sleep(0.5 if how == "apply" else 2.5)
    assert int(store.get(f"test:ran:collect:{tag}") or 0) == 0


def test_a_quorum_with_a_reducer_folds_the_k_successes(
    proj: Any, how: str, store: redis.Redis
) -> None:
    """quorum=2, reduce="sum": the parent gets the sum of the two values that met the quorum
    (one child at a time: the first two)."""
    tag = uuid.uuid4().hex
    kids = [proj.hedge.s(i, tag) for i in (1, 10, 100, 1000)]
    res = run(flow(proj.collect.s(tag=tag), kids, quorum=2, reduce="sum", max_active=1), how)
    assert res.get(timeout=TIMEOUT)["values"] == 11
    time.sleep(0.5)
    assert [ran(store, tag, i) for i in (1, 10, 100, 1000)] == [1, 1, 0, 0]


def test_a_quorum_across_queues(
    proj: Any, store: redis.Redis, own_queue: Any, start_worker: Any
) -> None:
    """Children on other queues than the parent's: their successes are counted on the
    parent's slot (credit.lua, passed the quorum), the K-th releases the parent, and the
    children not started are cancelled on their own slots; a quorum lost there fails the
    flow at once."""
    main, side, idle = own_queue("quorum"), own_queue("side"), own_queue("idle")
    start_worker(queues=f"{main},{side}")  # nothing consumes idle: its children never start
    tag = uuid.uuid4().hex
    kids = [proj.add.s(1, 1).set(queue=side), proj.add.s(2, 2).set(queue=side)]
    kids += [proj.add.s(3, 3).set(queue=idle), proj.add.s(4, 4).set(queue=idle)]
    ids = [kid.freeze().id for kid in kids]
    res = flow(proj.collect.s(tag=tag), kids, quorum=2).apply_async(queue=main)
    assert sorted(res.get(timeout=TIMEOUT)["values"]) == [2, 4]
    wait_for(lambda: [state_of(store, cid, idle) for cid in ids[2:]] == ["cancelled"] * 2)
    assert [state_of(store, cid, side) for cid in ids[:2]] == ["done", "done"]
    wait_for(lambda: AsyncResult(ids[2], app=proj.app).state == "REVOKED")

    lost = [proj.boom.s("a").set(queue=side), proj.boom.s("b").set(queue=side)]
    lost.append(proj.add.s(5, 5).set(queue=main))
    failed = flow(proj.collect.s(tag=tag), lost, quorum=2).apply_async(queue=main)
    with pytest.raises(FlowFailed, match=r"quorum not met: .* of 3 children succeeded, 2 needed"):
        failed.get(timeout=TIMEOUT)
    assert int(store.get(f"test:ran:collect:{tag}") or 0) == 1

    # Retried with the fault gone, the failed children of the other queue count again.
    flag = f"test:flag:{uuid.uuid4().hex}"
    again = [proj.flaky.s(1, flag).set(queue=side), proj.flaky.s(2, flag).set(queue=side)]
    again.append(proj.add.s(3, 0).set(queue=main))
    retried = flow(proj.collect.s(tag=tag), again, quorum=2).apply_async(queue=main)
    with pytest.raises(FlowFailed, match="quorum not met"):
        retried.get(timeout=TIMEOUT)
    store.set(flag, 1)
    retried.retry()
    got = retried.get(timeout=TIMEOUT)["values"]
    assert len(got) == 2 and 3 in got
    assert int(store.get(f"test:ran:collect:{tag}") or 0) == 2


def test_a_quorum_met_after_its_deadline_failed_it_is_released_by_a_retry(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    """Failed by its deadline with 1 of 2 successes, a child not started cut; both running
    children succeed after it (counted for a retry); retried with a new deadline, the parent
    runs at once (the cut child, pending again, still blocked) with the first 2 in order of
    success, not 3."""
    from celery_echomq import get_state, retry_flow

    tag, gate, late = uuid.uuid4().hex, f"test:gate:{uuid.uuid4().hex}", uuid.uuid4().hex
    try:
        try:
            kids = [proj.add.s(1, 1), proj.gated.s(5, gate), proj.gated.s(7, gate)]
            kids.append(proj.gated.s(9, f"test:gate:{late}"))  # waits: both processes busy
            res = flow(proj.collect.s(tag=tag), kids, quorum=2, deadline=1).apply_async()
            with pytest.raises(FlowDeadlineExceeded):
                res.get(timeout=TIMEOUT)
        finally:
            store.set(gate, 1)
        wait_for(lambda: len(res.children_values()) == 3)
        retry_flow(get_state(proj.app), res.id, deadline=30)
        got = type(res)(res.id, app=proj.app).get(timeout=TIMEOUT)["values"]
    finally:
        store.set(f"test:gate:{late}", 1)
    assert got[0] == 2 and got[1] in (5, 7) and len(got) == 2
    assert int(store.get(f"test:ran:collect:{tag}") or 0) == 1
