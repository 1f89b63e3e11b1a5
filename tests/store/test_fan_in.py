"""The fan-in, table-driven: what a failed child does to its parent, called script by script.

Every failure policy, with the policy set on the child or as the flow's default, for a child
on its parent's slot (``fail`` applies the policy at once) and for a child on another slot
(``fail`` stages it in its queue's outbox, ``credit`` applies it on the parent's slot), and
for three deliveries: the first, a stale one (its token superseded), and a second completion
of a child already settled. The flow has two children; the other one completes afterwards, to
show what the policy left for it. A real Redis, no worker, no Celery.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest
import redis

from celery_echomq.store.keyspace import new_job_id
from celery_echomq.store.replies import Status
from celery_echomq.store.scripts import ParentRef, Scripts
from tests.helpers import KEYS

TTL = 600
LEASE = 60_000
ERROR = "ValueError: boom"


@dataclass(frozen=True)
class Expect:
    """What the failing child's settlement makes of its parent, then of the other child."""

    status: Status  # the failed child's fan-in reply
    parent_state: str  # the parent's state after it
    outstanding: int  # the parent's counter after it
    ignored: bool  # the error is kept in the parent's :ignored
    other: Status  # the other child's completion reply
    final_state: str  # the parent's state after the other child


POLICIES = {
    # the parent fails at once; the other child is still recorded, never releases it
    "fail": Expect(Status.PARENT_FAILED, "failed", 2, False, Status.CREDITED, "failed"),
    # the child is resolved; the last one releases the parent
    "ignore": Expect(Status.CREDITED, "awaiting_children", 1, True, Status.RELEASED, "pending"),
    "remove": Expect(Status.CREDITED, "awaiting_children", 1, False, Status.RELEASED, "pending"),
    # the parent is released at once; a later completion never releases it again
    "continue": Expect(Status.RELEASED, "pending", 1, False, Status.CREDITED, "pending"),
    # the child is resolved; the last one to settle fails the parent with the child's error
    "fail_at_end": Expect(
        Status.CREDITED, "awaiting_children", 1, False, Status.PARENT_FAILED, "failed"
    ),
}


@dataclass
class Flow:
    """A flow of two children: ``failing`` (on ``child_queue``) and ``other`` (on the
    parent's queue)."""

    parent: ParentRef
    failing: str
    other: str
    child_queue: str

    def key(self, queue: str, suffix: str) -> str:
        return KEYS.queue_key(queue, suffix)

    def parent_key(self, suffix: str = "") -> str:
        return self.key(self.parent.queue, self.parent.id + suffix)


def start_flow(db: redis.Redis, scripts: Scripts, policy: str, where: str, slot: str) -> Flow:
    """Write the flow as the host does: enqueue_flow on one slot, else open, add, seal."""
    queue = "p" + uuid.uuid4().hex[:8]
    child_queue = queue if slot == "same" else "c" + uuid.uuid4().hex[:8]
    parent, failing, other = new_job_id(), new_job_id(), new_job_id()
    default = policy if where == "flow" else "fail"
    own = policy if where == "child" else ""
    ref = ParentRef(parent, queue)
    if slot == "same":
        scripts.enqueue_flow(queue, parent, b"p", [(failing, b"f"), (other, b"o")])
        # After the enqueue the host writes the default policy and a child's own policy.
        db.hset(KEYS.job_key(queue, parent), "policy", default)
        if own:
            db.hset(KEYS.job_key(queue, failing), "parent_policy", own)
    else:
        scripts.open_flow(queue, parent, b"p", 2, default)
        scripts.add_children(child_queue, ref, [(failing, b"f", own)])
        scripts.add_children(queue, ref, [(other, b"o", "")])
        assert scripts.seal_flow(queue, parent) is Status.SEALED
    return Flow(ref, failing, other, child_queue)


def fail_child(scripts: Scripts, flow: Flow, token: str) -> Status:
    """The failing child's transition and, on another slot, its credit (as the host runs them)."""
    status, policy = scripts.fail(
        flow.child_queue, flow.failing, token, ERROR, ttl=TTL, is_parent=False, parent=flow.parent
    )
    if status is Status.STAGED:
        status, _ = scripts.credit(flow.parent, flow.failing, Status.FAILED, ERROR, policy, ttl=TTL)
    return status


def snapshot(db: redis.Redis) -> dict[bytes, object]:
    # A hash by its fields: a read of a large hash (a format check's HGET) may move a rehash
    # on, which changes the order its DUMP lists its fields in, not what it holds.
    return {k: db.hgetall(k) if db.type(k) == b"hash" else db.dump(k) for k in db.keys("*")}


def check_parent(db: redis.Redis, flow: Flow, state: str, outstanding: int) -> None:
    assert db.hget(flow.parent_key(), "state") == state.encode()
    assert db.get(flow.parent_key(":dependencies")) == str(outstanding).encode()
    released = db.zscore(flow.key(flow.parent.queue, "pending"), flow.parent.id) is not None
    assert released == (state == "pending")
    failed = db.zscore(flow.key(flow.parent.queue, "failed"), flow.parent.id) is not None
    assert failed == (state == "failed")


@pytest.mark.parametrize("delivery", ["first", "stale", "second"])
@pytest.mark.parametrize("slot", ["same", "cross"])
@pytest.mark.parametrize("where", ["child", "flow"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_failed_child_under_each_policy(
    db: redis.Redis, scripts: Scripts, policy: str, where: str, slot: str, delivery: str
) -> None:
    expect = POLICIES[policy]
    flow = start_flow(db, scripts, policy, where, slot)
    token = "t-" + uuid.uuid4().hex
    assert scripts.claim(flow.child_queue, flow.failing, token, LEASE)[0] is Status.CLAIMED

    if delivery == "stale":
        # Another delivery took the job over: the first one's failure changes nothing.
        scripts.claim(flow.child_queue, flow.failing, "t-new", LEASE, force=True)
        before = snapshot(db)
        assert fail_child(scripts, flow, token) is Status.STALE
        assert snapshot(db) == before
        check_parent(db, flow, "awaiting_children", 2)
        token = "t-new"

    assert fail_child(scripts, flow, token) is expect.status
    check_parent(db, flow, expect.parent_state, expect.outstanding)
    ignored = db.hgetall(flow.parent_key(":ignored"))
    assert ignored == ({flow.failing.encode(): ERROR.encode()} if expect.ignored else {})
    if policy == "fail":
        assert db.hget(flow.parent_key(), "failed_child") == flow.failing.encode()
    assert db.zscore(flow.key(flow.child_queue, "failed"), flow.failing) is not None

    if delivery == "second":
        # The same child settled again (a redelivery, recovery's repeat): nothing changes.
        before = snapshot(db)
        assert fail_child(scripts, flow, token) is Status.FINISHED
        if slot == "cross":
            again, _ = scripts.credit(flow.parent, flow.failing, "failed", ERROR, "", ttl=TTL)
            assert again is Status.DUPLICATE
        assert snapshot(db) == before

    # The other child completes: what the policy left the parent waiting for.
    scripts.claim(flow.parent.queue, flow.other, "t-other", LEASE)
    assert (
        scripts.complete(
            flow.parent.queue,
            flow.other,
            "t-other",
            ttl=TTL,
            is_parent=False,
            parent=flow.parent,
            value=b"42",
        )
        is expect.other
    )
    check_parent(db, flow, expect.final_state, expect.outstanding - 1)
    assert db.hgetall(flow.parent_key(":processed")) == {flow.other.encode(): b"42"}
    # Credited: one :processed field per value, plus the failed children counted as resolved.
    credited = db.hlen(flow.parent_key(":processed")) + int(
        db.hget(flow.parent_key(), "credited_failed") or 0
    )
    assert credited == (2 if policy != "fail" else 1)
    if expect.final_state == "failed":
        # Whichever child settled last, the parent names the one that failed it.
        assert db.hget(flow.parent_key(), "failed_child") == flow.failing.encode()
        assert (
            db.hget(flow.parent_key(), "error") == f"child {flow.failing} failed: {ERROR}".encode()
        )
        assert db.ttl(flow.parent_key()) > 0 and db.ttl(flow.parent_key(":processed")) > 0


@pytest.mark.parametrize("delivery", ["first", "stale", "second"])
@pytest.mark.parametrize("slot", ["same", "cross"])
def test_a_completed_child(db: redis.Redis, scripts: Scripts, slot: str, delivery: str) -> None:
    flow = start_flow(db, scripts, "fail", "flow", slot)
    token = "t-" + uuid.uuid4().hex
    scripts.claim(flow.child_queue, flow.failing, token, LEASE)

    def complete(token: str, value: bytes) -> Status:
        status = scripts.complete(
            flow.child_queue,
            flow.failing,
            token,
            ttl=TTL,
            is_parent=False,
            parent=flow.parent,
            value=value,
        )
        if status is Status.STAGED:
            status, _ = scripts.credit(flow.parent, flow.failing, Status.DONE, value, "", ttl=TTL)
        return status

    if delivery == "stale":
        scripts.claim(flow.child_queue, flow.failing, "t-new", LEASE, force=True)
        before = snapshot(db)
        assert complete(token, b"1") is Status.STALE
        assert snapshot(db) == before
        token = "t-new"
    assert complete(token, b"1") is Status.CREDITED
    check_parent(db, flow, "awaiting_children", 1)
    if delivery == "second":
        before = snapshot(db)
        assert complete(token, b"2") is Status.DONE
        if slot == "cross":
            again, _ = scripts.credit(flow.parent, flow.failing, "done", b"2", "", ttl=TTL)
            assert again is Status.DUPLICATE
        assert snapshot(db) == before
    assert db.hgetall(flow.parent_key(":processed")) == {flow.failing.encode(): b"1"}
