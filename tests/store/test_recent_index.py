"""The recent-flow index and the per-queue counters the scripts keep for the dashboard and
/metrics, script by script on a real Redis (no Celery): what each transition adds, and that
the index stays bounded by age and by length."""

from __future__ import annotations

import time
import uuid

import pytest
import redis

from celery_echomq.store.keyspace import new_job_id
from celery_echomq.store.replies import Status
from celery_echomq.store.scripts import ParentRef, Scripts
from tests.helpers import KEYS

TTL = 600
LEASE = 60_000


@pytest.fixture
def queue() -> str:
    return "q" + uuid.uuid4().hex[:8]


def counters(db: redis.Redis, queue: str) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in db.hgetall(KEYS.queue_key(queue, "counters")).items()}


def recent(db: redis.Redis, queue: str) -> list[str]:
    return [m.decode() for m in db.zrevrange(KEYS.queue_key(queue, "recent"), 0, -1)]


def enqueue(scripts: Scripts, queue: str, n: int, **bounds: int) -> tuple[str, list[str]]:
    parent, children = new_job_id(), [new_job_id() for _ in range(n)]
    scripts.enqueue_flow(queue, parent, b"p", [(c, b"c") for c in children], **bounds)
    return parent, children


def finish(scripts: Scripts, queue: str, parent: str, child: str, *, error: str = "") -> Status:
    token = uuid.uuid4().hex
    assert scripts.claim(queue, child, token, LEASE)[0] == "claimed"
    ref = ParentRef(parent, queue)
    if error:
        return scripts.fail(queue, child, token, error, ttl=TTL, is_parent=False, parent=ref)[0]
    return scripts.complete(queue, child, token, ttl=TTL, is_parent=False, parent=ref, value=b"1")


def test_enqueue_indexes_the_parent_and_counts_it_held(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, children = enqueue(scripts, queue, 2)
    assert recent(db, queue) == [parent]  # the parent only: children are not flows
    assert counters(db, queue) == {"held": 1}
    # The index is an index, not a state set: the held parent is still in none.
    for name in ("pending", "active", "failed"):
        assert db.zscore(KEYS.queue_key(queue, name), parent) is None

    assert finish(scripts, queue, parent, children[0]) is Status.CREDITED
    assert counters(db, queue) == {"held": 1}  # a credited child costs no counter
    assert finish(scripts, queue, parent, children[1]) is Status.RELEASED
    assert counters(db, queue) == {"held": 0, "released": 1}
    assert scripts.dispatch(queue, parent) is not None
    assert scripts.dispatch(queue, parent) is None  # handed out once: counted once
    assert counters(db, queue) == {"held": 0, "released": 1, "dispatched": 1}
    assert recent(db, queue) == [parent]  # still listed once it ran


def test_an_empty_flow_is_released_at_once_and_counted_so(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, _ = enqueue(scripts, queue, 0)
    assert recent(db, queue) == [parent]
    assert counters(db, queue) == {"released": 1}


@pytest.mark.parametrize("policy", ["fail", "ignore", "remove", "continue"])
def test_a_failed_child_is_counted_under_its_policy(
    db: redis.Redis, scripts: Scripts, queue: str, policy: str
) -> None:
    parent, (bad, good) = enqueue(scripts, queue, 2)
    db.hset(KEYS.job_key(queue, parent), "policy", policy)
    finish(scripts, queue, parent, bad, error="ValueError: no")
    got = counters(db, queue)
    assert got[f"failed_{policy}"] == 1
    # fail fails the parent, continue releases it: either way it is held no more.
    assert got["held"] == (1 if policy in ("ignore", "remove") else 0)
    assert got.get("released", 0) == (1 if policy == "continue" else 0)
    finish(scripts, queue, parent, good)
    assert counters(db, queue)["held"] == 0
    assert sum(v for k, v in counters(db, queue).items() if k.startswith("failed_")) == 1


def test_cancel_of_a_held_flow_counts_it_held_no_more(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, children = enqueue(scripts, queue, 2)
    status, was, _ = scripts.cancel(queue, parent, children, ttl=TTL)
    assert (status, was) == (Status.CANCELLED, Status.AWAITING_CHILDREN)
    # Its two children cut: counted as such, on the queue as on the flow.
    assert counters(db, queue) == {"held": 0, "children_cut": 2}
    scripts.cancel(queue, parent, children, ttl=TTL)  # a second cancel changes nothing
    assert counters(db, queue) == {"held": 0, "children_cut": 2}


def test_the_chunked_path_counts_like_the_one_script_path(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, child = new_job_id(), new_job_id()
    scripts.open_flow(queue, parent, b"p", 1, "fail")
    assert recent(db, queue) == [parent]
    assert counters(db, queue) == {"held": 1}
    scripts.add_children(queue, ParentRef(parent, queue), [(child, b"c", "")])
    assert scripts.seal_flow(queue, parent) is Status.SEALED
    assert finish(scripts, queue, parent, child) is Status.RELEASED
    assert counters(db, queue) == {"held": 0, "released": 1}

    # A flow whose producer died before sealing it: recovery abandons it.
    stuck = new_job_id()
    scripts.open_flow(queue, stuck, b"p", 3, "fail")
    assert counters(db, queue)["held"] == 1
    assert scripts.abandon_flow(queue, stuck, 0, "producer gone", ttl=TTL) is Status.ABANDONED
    assert counters(db, queue)["held"] == 0


def test_the_repairs_count_like_the_transitions_they_stand_for(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    # release: a held parent released by an operator.
    parent, children = enqueue(scripts, queue, 2)
    assert scripts.release(queue, parent, children, revoke=False, ttl=TTL)[0] is Status.RELEASED
    assert counters(db, queue) == {"held": 0, "released": 1}

    # retry_flow: a flow failed by its child is held again, then released by the retried child.
    parent, (child,) = enqueue(scripts, queue, 1)
    finish(scripts, queue, parent, child, error="ValueError: once")
    assert counters(db, queue) == {"held": 0, "released": 1, "failed_fail": 1}
    status, again = scripts.retry_flow(queue, parent, [child])
    assert status is Status.RETRIED and [cid for cid, _ in again] == [child]
    assert counters(db, queue)["held"] == 1
    assert scripts.retry_flow(queue, parent, [child])[0] is Status.AWAITING_CHILDREN  # no-op
    assert counters(db, queue)["held"] == 1
    assert finish(scripts, queue, parent, child) is Status.RELEASED
    assert counters(db, queue) == {"held": 0, "released": 2, "failed_fail": 1}


def test_the_index_keeps_the_newest_flows_up_to_its_length(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parents = [enqueue(scripts, queue, 1, recent_max=3)[0] for _ in range(5)]
    assert recent(db, queue) == parents[:1:-1]  # the newest three, newest first
    assert counters(db, queue)["held"] == 5  # trimming the index touches no flow


def test_the_index_forgets_flows_older_than_the_result_ttl(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    old, _ = enqueue(scripts, queue, 1, recent_ttl_ms=200)
    time.sleep(0.3)
    new, _ = enqueue(scripts, queue, 1, recent_ttl_ms=200)
    assert recent(db, queue) == [new]
    assert db.hget(KEYS.job_key(queue, old), "state") == b"awaiting_children"  # only unlisted
