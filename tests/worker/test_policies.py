"""Per-child failure policies, revoked and timed-out children, cancelling a flow (real worker)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import redis
from celery.exceptions import TaskRevokedError

from celery_echomq import FlowCancelled, FlowFailed, flow
from tests.helpers import wait_for


def tag() -> str:
    return uuid.uuid4().hex


def ran(store: redis.Redis, name: str) -> int:
    return int(store.get(f"test:ran:{name}") or 0)


def test_fail_policy_fails_the_parent_names_the_child_and_runs_error_callbacks(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    t, gate = tag(), f"gate:{tag()}"
    bad = proj.boom.s("disk full")
    f = flow(proj.collect.s(tag=t), [proj.add.s(1, 1), bad, proj.gated.s(3, gate)])
    f.on_error(proj.errback.s())
    res = f.freeze()
    bad_id = bad.options["task_id"]
    f.apply_async()
    with pytest.raises(FlowFailed) as info:
        res.get(timeout=60)
    assert info.value.child_id == bad_id and info.value.flow_id == res.id
    assert "ValueError: disk full" in str(info.value)
    assert res.state == "FAILURE"
    wait_for(lambda: res.id.encode() in store.lrange("test:errback", 0, -1))
    # A child still running finishes and is recorded; nothing more is released.
    store.set(gate, 1)
    wait_for(lambda: 3 in res.children_values().values())
    assert sorted(res.children_values().values()) == [2, 3]
    assert store.hget(f"emq:{{celery}}:{res.id}", "state") == b"failed"
    assert ran(store, f"collect:{t}") == 0
    # Every child finished: the counts add up, and the failure is the flow's to read.
    assert res.dependencies() == (0, 2, 1, 0)
    assert res.failed_children() == {bad_id: "ValueError: disk full"}


def test_ignore_policy_resolves_the_child_and_records_its_error(proj: Any, worker: Any) -> None:
    bad = proj.boom.s("bad page").set(parent_policy="ignore")
    f = flow(proj.reads_own.s(), [proj.add.s(1, 1), bad, proj.add.s(2, 2)])
    f.freeze()  # assigns every job id, so the test knows the bad child's
    res = f.apply_async()
    value = res.get(timeout=60)
    bad_id = bad.options["task_id"]
    assert value["values"] == [2, 4]  # the failed child is left out of the list
    assert value["ignored"] == {bad_id: "ValueError: bad page"}
    assert sorted(value["children"].values()) == [2, 4]
    assert value["dependencies"] == [0, 2, 0, 1]
    assert res.ignored_failures() == {bad_id: "ValueError: bad page"}
    assert res.failed_children() == {bad_id: "ValueError: bad page"}


def test_flow_default_policy_applies_to_children_that_set_none(proj: Any, worker: Any) -> None:
    res = flow(proj.tsum.s(), [proj.boom.s(), proj.add.s(2, 2), proj.boom.s()], policy="ignore")()
    assert res.get(timeout=60) == 4
    assert len(res.ignored_failures()) == 2


def test_remove_policy_resolves_the_child_and_keeps_its_error_out_of_the_values(
    proj: Any, worker: Any
) -> None:
    bad = proj.boom.s("gone").set(parent_policy="remove")
    f = flow(proj.reads_own.s(), [proj.add.s(1, 1), bad, proj.add.s(2, 2)])
    res = f.freeze()
    f.apply_async()
    value = res.get(timeout=60)
    assert value["values"] == [2, 4]
    assert value["ignored"] == {}
    assert res.ignored_failures() == {}
    assert res.dependencies() == (0, 2, 1, 0)
    assert res.failed_children() == {bad.options["task_id"]: "ValueError: gone"}


def test_continue_policy_releases_the_parent_at_once_and_never_again(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    t, gate = tag(), f"gate:{tag()}"
    slow = proj.gated.s(7, gate)
    bad = proj.boom.s("late").set(parent_policy="continue")
    f = flow(proj.collect.s(tag=t), [proj.add.s(1, 1), slow, bad])
    res = f.freeze()
    f.apply_async()
    # The parent ran with what had completed when the failure came: the fast child at most.
    value = res.get(timeout=60)
    assert value["values"] in ([], [2])
    store.set(gate, 1)
    wait_for(lambda: 7 in res.children_values().values())
    assert res.dependencies() == (0, 2, 1, 0)
    assert res.failed_children() == {bad.options["task_id"]: "ValueError: late"}
    assert ran(store, f"collect:{t}") == 1


def test_fail_at_end_policy_fails_the_parent_once_every_child_has_settled(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    # A chord's way: the first failure is kept, the other children run on, and the last to
    # settle fails the parent with it. Until then the flow is held, not failed.
    t, gate = tag(), f"gate:{tag()}"
    bad, later = proj.boom.s("first"), proj.gated_boom.s(gate, "second")
    f = flow(proj.collect.s(tag=t), [bad, proj.gated.s(3, gate), later], policy="fail_at_end")
    f.on_error(proj.errback.s())
    res = f.freeze()
    f.apply_async()
    wait_for(lambda: bad.options["task_id"] in res.failed_children())
    row = f"emq:{{celery}}:{res.id}"
    assert store.hget(row, "state") == b"awaiting_children"
    assert res.state == "PENDING" and res.dependencies().outstanding == 2
    store.set(gate, 1)
    with pytest.raises(FlowFailed) as info:
        res.get(timeout=60)
    assert info.value.child_id == bad.options["task_id"]
    assert "ValueError: first" in str(info.value)
    # Every child had settled: the value is recorded, both failures are the flow's to read.
    assert res.children_values() == {f.children[1].options["task_id"]: 3}
    assert res.dependencies() == (0, 1, 2, 0)
    wait_for(lambda: res.id.encode() in store.lrange("test:errback", 0, -1))
    assert store.lrange("test:errback", 0, -1).count(res.id.encode()) == 1
    assert ran(store, f"collect:{t}") == 0


@pytest.mark.parametrize("how", ["eager", "worker"])
def test_fail_at_end_gives_the_same_error_eagerly_and_on_a_worker(
    proj: Any, worker: Any, how: str
) -> None:
    bad = proj.boom.s("first")
    f = flow(
        proj.tsum.s(),
        [proj.add.s(1, 1), bad, proj.sleep_then.s(5, 0.3).set(parent_policy="fail_at_end")],
        policy="fail_at_end",
    )
    f.freeze()
    res = f.apply() if how == "eager" else f.apply_async()
    with pytest.raises(FlowFailed, match="ValueError: first") as info:
        res.get(timeout=60)
    assert info.value.child_id == bad.options["task_id"]
    # The slow child settled before the parent failed: its value is the flow's.
    assert sorted(res.children_values().values()) == [2, 5]


@pytest.mark.e2e  # a retry runs while its sender finishes: one task per process
def test_retries_that_end_in_success_count_the_child_once(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    child = proj.retry_until.s(5, 3)
    f = flow(proj.tsum.s(), [child, proj.add.s(1, 1)])
    f.freeze()
    res = f.apply_async()
    assert res.get(timeout=60) == 7
    cid = child.options["task_id"]
    assert ran(store, f"retry_until:{cid}") == 3
    assert store.hget(f"emq:{{celery}}:{cid}", "attempts") == b"3"
    assert res.dependencies() == (0, 2, 0, 0)


@pytest.mark.e2e  # a retry runs while its sender finishes: one task per process
def test_retries_that_end_in_failure_apply_the_policy(proj: Any, worker: Any) -> None:
    child = proj.retry_until.s(5, 99)  # max_retries=3: the fourth attempt fails for good
    f = flow(proj.tsum.s(), [child, proj.add.s(1, 1)])
    f.freeze()
    res = f.apply_async()
    with pytest.raises(FlowFailed) as info:
        res.get(timeout=60)
    assert info.value.child_id == child.options["task_id"]
    assert "RuntimeError: attempt 4" in info.value.error


def test_a_revoked_child_is_a_failure_under_its_policy(proj: Any, worker: Any) -> None:
    late = proj.add.s(5, 5).set(countdown=2, parent_policy="ignore")
    f = flow(proj.tsum.s(), [proj.add.s(1, 1), late])
    res = f.freeze()
    f.apply_async()
    late_id = late.options["task_id"]
    proj.app.control.revoke(late_id)
    assert res.get(timeout=60) == 2
    assert res.ignored_failures() == {late_id: "TaskRevokedError: revoked"}


@pytest.mark.e2e  # a hard time limit needs the prefork pool, in a worker subprocess
def test_a_child_past_its_hard_time_limit_is_a_failure_under_its_policy(
    proj: Any, worker: Any
) -> None:
    slow = proj.too_slow.s(5).set(parent_policy="ignore")
    res = flow(proj.tsum.s(), [proj.add.s(2, 2), slow]).apply_async()
    assert res.get(timeout=60) == 4
    (error,) = res.ignored_failures().values()
    assert error.startswith("TimeLimitExceeded")


def test_cancel_revokes_outstanding_children_and_the_parent_never_runs(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    t, gate = tag(), f"gate:{tag()}"
    res = flow(proj.collect.s(tag=t), [proj.add.s(1, 1), proj.gated.s(2, gate)]).apply_async()
    wait_for(lambda: res.dependencies().done == 1)
    res.revoke()
    with pytest.raises(FlowCancelled, match="cancelled") as info:
        res.get(timeout=30)
    # Celery's names: a revoked task's state, and its error type.
    assert res.state == "REVOKED"
    assert isinstance(info.value, TaskRevokedError) and info.value.flow_id == res.id
    assert store.hget(f"emq:{{celery}}:{res.id}", "state") == b"cancelled"
    store.set(gate, 1)
    # The gated child was running: it may still finish, but nothing is released.
    time.sleep(1)
    assert store.hget(f"emq:{{celery}}:{res.id}", "state") == b"cancelled"
    assert ran(store, f"collect:{t}") == 0
