"""The repair scripts (retry_flow, retry_children, release) on a real Redis, without Celery."""

from __future__ import annotations

import uuid

import pytest
import redis

from celery_echomq import KindError
from celery_echomq.store.codec import Delta
from celery_echomq.store.keyspace import new_job_id
from celery_echomq.store.replies import Status
from celery_echomq.store.scripts import ParentRef, Scripts
from tests.helpers import KEYS, LEASE, TTL, enqueue, run_child, snapshot


@pytest.fixture
def queue() -> str:
    return "q" + uuid.uuid4().hex[:8]


def fail_child(scripts: Scripts, queue: str, parent: str, child: str, policy: str = "") -> Status:
    token = uuid.uuid4().hex
    assert scripts.claim(queue, child, token, LEASE)[0] == "claimed"
    if policy:
        scripts.client.hset(KEYS.job_key(queue, child), "parent_policy", policy)
    status, _ = scripts.fail(
        queue, child, token, "ValueError: x", ttl=TTL, is_parent=False,
        parent=ParentRef(parent, queue),
    )  # fmt: skip
    return status


def test_retry_flow_reholds_the_parent_and_makes_only_its_failed_children_pending(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, (bad, good, waiting, ignored) = enqueue(scripts, queue, 4)
    assert fail_child(scripts, queue, parent, ignored, policy="ignore") == "credited"
    assert fail_child(scripts, queue, parent, bad) == "parent_failed"
    assert run_child(scripts, queue, parent, good, b"7") == "credited"
    row = KEYS.job_key(queue, parent)
    assert db.hget(row, "state") == b"failed" and db.ttl(row) > 0
    # Outstanding: bad (failed under fail: never counted) and waiting (never run).
    assert db.get(f"{row}:dependencies") == b"2"

    status, pairs = scripts.retry_flow(queue, parent, [bad, good, waiting, ignored])
    assert status is Status.RETRIED
    assert pairs == [(bad, f"payload-{bad}".encode())]
    assert db.hget(row, "state") == b"awaiting_children"
    assert db.hget(row, "failed_child") is None and db.hget(row, "error") is None
    assert db.get(f"{row}:dependencies") == b"2"  # unchanged: it was right
    assert db.hgetall(f"{row}:processed") == {good.encode(): b"7"}
    for key in (row, f"{row}:dependencies", f"{row}:processed", f"{row}:ignored"):
        assert db.ttl(key) == -1  # no longer expiring with the failure
    bad_row = KEYS.job_key(queue, bad)
    assert db.hget(bad_row, "state") == b"pending" and db.ttl(bad_row) == -1
    pending = {m.decode() for m in db.zrange(KEYS.queue_key(queue, "pending"), 0, -1)}
    assert pending == {bad, waiting}
    failed = {m.decode() for m in db.zrange(KEYS.queue_key(queue, "failed"), 0, -1)}
    assert failed == {ignored}  # the parent and the retried child left the failed set
    assert db.hget(KEYS.job_key(queue, ignored), "state") == b"failed"

    # The same retry again changes nothing and says the flow is held.
    before = snapshot(db)
    assert scripts.retry_flow(queue, parent, [bad, good, waiting, ignored]) == (
        Status.AWAITING_CHILDREN,
        [],
    )
    assert snapshot(db) == before

    # The new attempt counts once and the last child releases the parent.
    assert run_child(scripts, queue, parent, bad, b"1") == "credited"
    assert run_child(scripts, queue, parent, waiting, b"2") == "released"


def test_retry_flow_counts_back_the_children_failed_under_fail_at_end(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    # A chord's policy: each failure is counted as resolved, and the parent fails once the
    # last child has settled. A retry makes the failed ones outstanding again.
    parent, (first, second, good) = enqueue(scripts, queue, 3)
    row = KEYS.job_key(queue, parent)
    db.hset(row, "policy", "fail_at_end")
    assert fail_child(scripts, queue, parent, first) == "credited"
    assert fail_child(scripts, queue, parent, second) == "credited"
    assert db.hget(row, "state") == b"awaiting_children"
    assert run_child(scripts, queue, parent, good, b"7") == "parent_failed"
    assert db.hget(row, "state") == b"failed" and db.hget(row, "failed_child") == first.encode()
    assert db.get(f"{row}:dependencies") == b"0"

    status, pairs = scripts.retry_flow(queue, parent, [first, second, good])
    assert status is Status.RETRIED
    assert sorted(cid for cid, _ in pairs) == sorted([first, second])
    assert db.get(f"{row}:dependencies") == b"2"
    assert db.hget(row, "late_failed") == b"0" and db.hget(row, "credited_failed") == b"0"
    assert db.hget(row, "failed_children") == b"0"

    # The second fails again and the first succeeds: the parent fails with the second's error.
    assert fail_child(scripts, queue, parent, second) == "credited"
    assert run_child(scripts, queue, parent, first, b"1") == "parent_failed"
    assert db.hget(row, "failed_child") == second.encode()
    assert db.hget(row, "error") == f"child {second} failed: ValueError: x".encode()

    # Retried again, both succeed: the parent is released with every value.
    assert scripts.retry_flow(queue, parent, [second])[0] is Status.RETRIED
    assert run_child(scripts, queue, parent, second, b"2") == "released"
    assert db.hgetall(f"{row}:processed") == {
        first.encode(): b"1",
        second.encode(): b"2",
        good.encode(): b"7",
    }


def test_retry_flow_hands_out_a_childs_delta_with_its_parent(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    # A child stored as a delta against its flow's template is handed out as one.
    parent, bad, whole = new_job_id(), new_job_id(), new_job_id()
    scripts.enqueue_flow(
        queue, parent, b"parent", [(bad, b"d"), (whole, b"w")], template=b"t", kinds="dp"
    )
    assert fail_child(scripts, queue, parent, bad) == "parent_failed"
    assert scripts.retry_flow(queue, parent, [bad]) == (
        Status.RETRIED,
        [(bad, Delta(b"d", parent))],
    )


def test_retry_flow_releases_a_parent_whose_children_all_settled_meanwhile(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, (bad,) = enqueue(scripts, queue, 1)
    assert fail_child(scripts, queue, parent, bad) == "parent_failed"
    # As when a nested flow (this child) finished after its outer flow failed: counted.
    db.decr(f"{KEYS.job_key(queue, parent)}:dependencies")
    status, pairs = scripts.retry_flow(queue, parent, [], [bad])
    assert status is Status.RELEASED and pairs == []
    assert db.hget(KEYS.job_key(queue, parent), "state") == b"pending"
    assert db.zscore(KEYS.queue_key(queue, "pending"), parent) is not None


@pytest.mark.parametrize("state", ["awaiting_children", "pending", "done", "missing", "own_body"])
def test_retry_flow_refuses_a_flow_not_failed_by_a_child_and_changes_nothing(
    db: redis.Redis, scripts: Scripts, queue: str, state: str
) -> None:
    parent, (child,) = enqueue(scripts, queue, 1)
    row = KEYS.job_key(queue, parent)
    if state == "missing":
        parent = new_job_id()
    elif state == "own_body":
        db.hset(row, "state", "failed")  # its body failed: no failed_child
    elif state != "awaiting_children":
        db.hset(row, "state", state)
    before = snapshot(db)
    want = "failed" if state == "own_body" else state
    assert scripts.retry_flow(queue, parent, [child]) == (Status(want), [])
    assert snapshot(db) == before


def test_retry_children_resets_failed_rows_of_that_parent_only(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, (a, b) = enqueue(scripts, queue, 2)
    other, (c,) = enqueue(scripts, queue, 1)
    for p, child in ((parent, a), (other, c)):
        fail_child(scripts, queue, p, child)
    assert scripts.retry_children(queue, parent, [a, b, c]) == [(a, f"payload-{a}".encode())]
    assert db.hget(KEYS.job_key(queue, a), "state") == b"pending"
    assert db.hget(KEYS.job_key(queue, b), "state") == b"pending"  # was pending: untouched
    assert db.hget(KEYS.job_key(queue, c), "state") == b"failed"  # another flow's
    assert scripts.retry_children(queue, parent, [a]) == []


def test_release_runs_a_held_parent_once_and_later_completions_are_only_recorded(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, (done, late) = enqueue(scripts, queue, 2)
    assert run_child(scripts, queue, parent, done, b"1") == "credited"
    assert scripts.release(queue, parent, [late], revoke=False, ttl=TTL) == (
        Status.RELEASED,
        [],
    )
    row = KEYS.job_key(queue, parent)
    assert db.hget(row, "state") == b"pending"
    assert db.hget(KEYS.job_key(queue, late), "state") == b"pending"
    # Released once: a second release is refused; the late child is recorded, not releasing.
    before = snapshot(db)
    assert scripts.release(queue, parent, [late], revoke=False, ttl=TTL) == (
        Status.PENDING,
        [],
    )
    assert snapshot(db) == before
    assert scripts.dispatch(queue, parent) is not None
    assert run_child(scripts, queue, parent, late, b"2") == "credited"
    assert db.hgetall(f"{row}:processed") == {done.encode(): b"1", late.encode(): b"2"}
    assert scripts.dispatch(queue, parent) is None


def test_release_with_revoke_cancels_the_children_not_started(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, (done, running, waiting) = enqueue(scripts, queue, 3)
    assert run_child(scripts, queue, parent, done, b"1") == "credited"
    token = uuid.uuid4().hex
    assert scripts.claim(queue, running, token, LEASE)[0] == "claimed"
    status, cancelled = scripts.release(
        queue, parent, [done, running, waiting], revoke=True, ttl=TTL
    )
    assert status is Status.RELEASED and cancelled == [waiting]
    assert db.hget(KEYS.job_key(queue, waiting), "state") == b"cancelled"
    assert db.hget(KEYS.job_key(queue, running), "state") == b"active"
    assert {m.decode() for m in db.zrange(KEYS.queue_key(queue, "pending"), 0, -1)} == {parent}
    # The running child finishes and is recorded; the released parent is not released again.
    assert (
        scripts.complete(
            queue, running, token, ttl=TTL, is_parent=False, parent=ParentRef(parent, queue),
            value=b"9",
        )
        == "credited"
    )  # fmt: skip
    assert sorted(db.hkeys(f"{KEYS.job_key(queue, parent)}:processed")) == sorted(
        [done.encode(), running.encode()]
    )


def test_a_forged_parent_changes_nothing_in_claim_complete_and_fail(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, (child,) = enqueue(scripts, queue, 1)
    other = ParentRef("JOB" + uuid.uuid4().hex, queue)
    token = uuid.uuid4().hex
    assert scripts.claim(queue, child, token, LEASE, parent=other.id)[0] == "forged"
    assert db.hget(KEYS.job_key(queue, child), "state") == b"pending"
    assert scripts.claim(queue, child, token, LEASE, parent=parent)[0] == "claimed"
    done = scripts.complete(queue, child, token, ttl=TTL, is_parent=False, parent=other, value=b"1")
    assert done == "forged"
    failed = scripts.fail(queue, child, token, "X: y", ttl=TTL, is_parent=False, parent=other)
    assert failed[0] == "forged"
    assert db.hget(KEYS.job_key(queue, child), "state") == b"active"
    assert db.get(f"{KEYS.job_key(queue, parent)}:dependencies") == b"1"


def test_the_repair_scripts_repeat_the_kind_gate(scripts: Scripts, db: redis.Redis) -> None:
    for name, argv in [
        ("retry_flow", ["BAD", "0"]),
        ("retry_flow", ["JOBok", "1", "BAD"]),
        ("retry_children", ["JOBok", "BAD"]),
        ("release", ["BAD", "10", "0"]),
        ("release", ["JOBok", "10", "1", "BAD"]),
    ]:
        with pytest.raises(KindError):
            scripts._run(name, ["emq:{q}:x"] * 8, argv)
    assert db.dbsize() == 0
