"""`echomq forget` leaves no key of a flow behind, whatever the flow used: real flows run by a
real worker, one for each feature that makes a key of its own, each forgotten once it has
finished; then the store's database is listed (SCAN) and nothing of them may remain but the
keys of their queues, named below with why they stay."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
from celery import chain

from celery_echomq import flow
from tests.helpers import KEYS, echomq, wait_for

pytestmark = pytest.mark.e2e

# What a queue keeps whatever flows it held: not a flow's, so no forget deletes it.
QUEUE_KEYS = {
    "counters": "the queue's counts (releases, failures per policy, ...) the dashboard samples",
    "marks": "the queue's claim marks: how far its deliveries have reached, per priority",
    "minutes": "the queue's counts sampled once a minute, what the dashboard charts",
}
# Keys of the store, of no queue: the registry of queues (recovery and stats read it) and the
# store's own leases (recovery's).
STORE_KEYS = (b"emq:queues",)


def store_keys(store: redis.Redis) -> set[bytes]:
    # Celery's own result keys (there when the result backend shares the store's database)
    # are the backend's, not the flow's.
    return {
        k for k in store.scan_iter(count=1000) if not k.startswith((b"celery-task-meta-", b"test:"))
    }


def finished(store: redis.Redis, queues: list[str]) -> bool:
    """Nothing of ``queues`` is pending, active, staged, open or joined to credit: every job
    has settled, the children that ended after their flow too."""
    names = ("pending", "active", "outbox", "open", "adding", "joined", "reserved")
    return not any(store.zcard(KEYS.queue_key(q, name)) for q in queues for name in names)


def test_forget_leaves_no_key_of_any_kind_of_flow(
    proj: Any, start_worker: Any, store: redis.Redis
) -> None:
    home, other = (f"{name}{uuid.uuid4().hex[:6]}" for name in ("home", "other"))
    start_worker(queues=f"{home},{other}")
    before = store_keys(store)
    tag = uuid.uuid4().hex[:8]

    def kids(n: int, queue: str = "") -> list[Any]:
        return [proj.add.s(i, 1).set(**({"queue": queue} if queue else {})) for i in range(n)]

    shared = proj.add.s(20, 22).set(task_id=f"JOB{uuid.uuid4().hex}")
    sent = {
        # :quorum, children finished after the quorum (counted as cut)
        "quorum": flow(proj.collect.s(tag=f"{tag}q"), kids(4), quorum=2),
        # the reducer's accumulator (on the row), :processed
        "reduce": flow(proj.collect.s(tag=f"{tag}r"), kids(3), reduce="sum"),
        # :window and :slots, on the parent's slot and on its children's other one
        "window": flow(proj.collect.s(tag=f"{tag}w"), kids(4), max_active=2),
        "window_elsewhere": flow(proj.collect.s(tag=f"{tag}v"), kids(4, other), max_active=2),
        # an armed deadline (its index), and one that fires and cuts the children
        "deadline": flow(proj.collect.s(tag=f"{tag}d"), kids(2), deadline=600),
        "deadline_fired": flow(
            proj.collect.s(tag=f"{tag}f"),
            [proj.sleep_then.s(1, 3), proj.sleep_then.s(2, 3)],
            deadline=1,
        ),
        # :ignored, :failures under each policy
        "ignore": flow(proj.collect.s(tag=f"{tag}i"), [*kids(1), proj.boom.s()], policy="ignore"),
        "remove": flow(proj.collect.s(tag=f"{tag}m"), [*kids(1), proj.boom.s()], policy="remove"),
        "continue": flow(
            proj.collect.s(tag=f"{tag}c"), [*kids(1), proj.boom.s()], policy="continue"
        ),
        "fail_at_end": flow(
            proj.collect.s(tag=f"{tag}e"), [*kids(1), proj.boom.s()], policy="fail_at_end"
        ),
        "fail": flow(proj.collect.s(tag=f"{tag}x"), [*kids(1), proj.boom.s()]),
        # children on another slot: :settled, the outbox
        "elsewhere": flow(proj.collect.s(tag=f"{tag}o"), kids(2, other) + kids(1)),
        # children added by a child (add_children): :adding on the chunked path
        "grown": flow(
            proj.collect.s(tag=f"{tag}g"),
            [proj.spawner.s(1, [2, 3]), proj.spawner.s(4, [5], other)],
        ),
        # nested flows, one on the other queue, and a chain child
        "nested": flow(
            proj.collect.s(tag=f"{tag}n"),
            [
                flow(proj.tsum.s(), kids(2)),
                flow(proj.tsum.s(), kids(2, other)).set(queue=other),
                chain(proj.add.s(1, 1), proj.add.s(1), proj.add.s(1)),
            ],
        ),
        # a job shared by two flows (on_exists="join"): its :parents
        "shared1": flow(proj.collect.s(tag=f"{tag}s1"), [shared, *kids(1)]),
        "shared2": flow(proj.collect.s(tag=f"{tag}s2"), [shared, *kids(1)]),
    }
    results = {
        name: f.apply_async(queue=home, on_exists="join" if name == "shared2" else "raise")
        for name, f in sent.items()
    }
    for res in results.values():
        res.get(timeout=90, propagate=False)
    # Every job settled, those that ended after their flow too (a quorum's, a deadline's).
    wait_for(lambda: finished(store, [home, other]), timeout=60)
    made = store_keys(store) - before
    assert any(b":quorum" in k for k in made) and any(b":slots" in k for k in made)
    assert any(b":parents" in k for k in made) and any(b":ignored" in k for k in made)

    for name, res in results.items():
        out = echomq("forget", res.id, "--force")
        assert out.exit_code == 0, (name, out.output)

    allowed = {KEYS.queue_key(q, name).encode() for q in (home, other) for name in QUEUE_KEYS}
    left = [k for k in store_keys(store) - before if k not in allowed | set(STORE_KEYS)]
    # A cancelled child's row (a deadline cut it while its message was queued: none when the
    # worker had taken both children by then) is cut down to what turns its queued message away,
    # and expires when the row would have (ops/forget.py): that is all that stays of it.
    kept = [k for k in left if store.type(k) == b"hash" and store.hkeys(k) == [b"state", b"parent"]]
    assert all(store.hget(k, "state") == b"cancelled" and store.ttl(k) > 0 for k in kept)
    left = sorted(set(left) - set(kept))
    assert left == [], "\n".join(f"{k.decode()} {store.type(k)!r}" for k in left)
