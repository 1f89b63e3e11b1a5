"""A chain's step handed out by the completion of the step before it (complete.lua, ARGV[13]):
active with no token, taken by its first delivery in one script of two commands
(``take_handed``) instead of the claim script, and made pending again by recovery when no
delivery took it within its lease (unhand.lua). Each crash window of the hand-off and the test
that covers it:

- the completing worker dies after the completion, before publishing the step: the step's
  lease lapses untaken, it is pending again, and (a) re-publishes it on evidence
  (test_chains: test_a_step_whose_message_was_never_published_is_recovered; test_canvas_faults:
  test_steps_made_pending_by_a_pool_process_that_died_before_publishing_them_run);
- its message is lost in the broker: the same path, on the same evidence;
- its message waits behind a backlog longer than the lease: pending again, nothing re-published,
  the message claimed when it comes (test_a_handed_step_behind_a_backlog_is_not_republished);
- the delivery that took it dies mid-body: the token is that pool process's own, so the worker
  ends its lease at once, or it lapses (test_canvas_faults: the two tests of a killed step);
- a duplicate delivery: its HSETNX finds the token written, so it claims, and is skipped
  (test_canvas_faults: test_each_step_of_a_chain_child_is_counted_once_despite_duplicate_...);
- a cancel, a forged header or a row gone before the take: the take fails and leaves nothing
  (the script-level tests below).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import redis
from celery import chain

from celery_echomq import flow
from celery_echomq.store.replies import Status
from celery_echomq.store.scripts import ParentRef
from celery_echomq.store.state import get_state
from tests.helpers import KEYS, counters, fast_recovery, jobs, logged, row, wait_for
from tests.helpers import RECOVERY_STALL as STALL

LEASE = 60_000


def _handed(proj: Any, store: redis.Redis, queue: str) -> tuple[Any, Any, list[str]]:
    """A flow with a chain child on ``queue`` (no worker): its first step claimed and completed
    through the scripts, which hands out the second. The scripts, the flow, the step ids."""
    steps = chain(proj.add.s(1, 1), proj.add.s(10), proj.add.s(100))
    sig = flow(proj.tsum.s(), [steps])
    sig.freeze()
    ids = [str(task.options["task_id"]) for task in steps.tasks]
    res = sig.apply_async(queue=queue)
    state = get_state(proj.app)
    scripts = state.scripts
    token = uuid.uuid4().hex
    assert scripts.claim(queue, ids[0], token, LEASE)[0] is Status.CLAIMED
    status, _, handed = scripts.complete_releasing(
        queue,
        ids[0],
        token,
        ttl=600,
        is_parent=False,
        parent=ParentRef(res.id, queue),
        value=state.dumps(2),
        next_step=ids[1],
        hand_ms=LEASE,
    )
    assert status is Status.ADVANCED and handed is not None
    return scripts, res, ids


def test_a_handed_step_is_active_without_a_token_and_taken_once(
    proj: Any, store: redis.Redis, own_queue: Any
) -> None:
    queue = own_queue("hand")
    scripts, res, (_, second, third) = _handed(proj, store, queue)
    parent = res.id
    handed = row(store, queue, second)
    assert handed["state"] == "active" and "token" not in handed
    assert handed["attempts"] == "1" and json.loads(handed["input"]) == 2
    assert store.zscore(KEYS.queue_key(queue, "active"), second) is not None
    assert store.zscore(KEYS.queue_key(queue, "pending"), second) is None
    assert row(store, queue, third)["state"] == "waiting"

    assert scripts.take_handed(queue, second, "tok-1", parent)
    assert row(store, queue, second)["token"] == "tok-1"
    # The same call resent (through a failover) finds its own token: still taken.
    assert scripts.take_handed(queue, second, "tok-1", parent)
    # A second delivery (a duplicate) takes nothing: it claims, and finds the step busy.
    assert not scripts.take_handed(queue, second, "tok-2", parent)
    assert row(store, queue, second)["token"] == "tok-1"
    assert scripts.claim(queue, second, "tok-2", LEASE)[0] is Status.BUSY


def test_a_forged_cancelled_or_vanished_step_is_not_taken_and_nothing_is_left(
    proj: Any, store: redis.Redis, own_queue: Any
) -> None:
    queue = own_queue("hand")
    scripts, res, (_, second, _) = _handed(proj, store, queue)
    parent = res.id
    assert not scripts.take_handed(queue, second, "forger", "JOB" + uuid.uuid4().hex)
    assert "token" not in row(store, queue, second)  # the real delivery can still take it
    store.hset(KEYS.job_key(queue, second), "state", "cancelled")
    assert not scripts.take_handed(queue, second, "late", parent)
    assert "token" not in row(store, queue, second)
    gone = "JOB" + uuid.uuid4().hex
    assert not scripts.take_handed(queue, gone, "late", parent)
    assert not store.exists(KEYS.job_key(queue, gone))  # no key made of a token alone


def test_an_untaken_step_goes_back_to_pending_only_once_its_lease_lapsed(
    proj: Any, store: redis.Redis, own_queue: Any
) -> None:
    queue = own_queue("hand")
    scripts, res, (_, second, _) = _handed(proj, store, queue)
    parent = res.id
    assert scripts.unhand(queue, second) is Status.FRESH
    handed_at = int(row(store, queue, second)["started"])
    store.zadd(KEYS.queue_key(queue, "active"), {second: 0})  # its lease lapsed
    assert scripts.unhand(queue, second) is Status.PENDING
    back = row(store, queue, second)
    assert back["state"] == "pending" and back["attempts"] == "0"
    assert store.zscore(KEYS.queue_key(queue, "pending"), second) == handed_at
    assert store.zscore(KEYS.queue_key(queue, "active"), second) is None
    # Its message, when it comes, is claimed as any delivery's: the take fails, the claim runs.
    assert not scripts.take_handed(queue, second, "tok", parent)
    assert scripts.claim(queue, second, "tok", LEASE)[0] is Status.CLAIMED
    assert scripts.unhand(queue, second) is Status.NOOP  # taken: a holder's lease now


def test_a_cancelled_flow_stops_a_handed_step_no_delivery_took_as_one_never_started(
    proj: Any, store: redis.Redis, own_queue: Any
) -> None:
    queue = own_queue("hand")
    scripts, res, (_, second, third) = _handed(proj, store, queue)
    res.revoke()
    assert row(store, queue, second)["state"] == "cancelled"
    assert row(store, queue, third)["state"] == "cancelled"
    assert store.zscore(KEYS.queue_key(queue, "active"), second) is None
    # It never ran: its result says so, as a waiting step's does.
    assert proj.app.AsyncResult(second).state == "REVOKED"
    assert not scripts.take_handed(queue, second, "late", res.id)


# --- on a real worker --------------------------------------------------------------------------


def test_a_handed_step_behind_a_backlog_is_not_republished(
    proj: Any, store: Any, queue: str, start_worker: Any
) -> None:
    # Two pool processes: the first step waits on a gate while two plain tasks of three stall
    # timeouts each are sent to the queue; the gate opens, and the second step's message waits
    # behind them. Its lease lapses untaken, it is pending again, the worker holds its message
    # or the queue is not empty: nothing is re-published, and it runs once, when its turn comes.
    s1, s2, s3 = jobs(3)
    gate = f"test:gate:{uuid.uuid4().hex}"
    w = start_worker(queues=queue, concurrency=2, extra_env=fast_recovery())
    steps = chain(
        proj.gated.s(2, gate).set(task_id=s1),
        proj.add.s(10).set(task_id=s2),
        proj.add.s(100).set(task_id=s3),
    )
    res = flow(proj.tsum.s(), [steps]).apply_async(queue=queue)
    wait_for(lambda: row(store, queue, s1).get("state") == "active", timeout=60)
    slow = [proj.slow_child.s(i, STALL * 3).apply_async(queue=queue) for i in range(2)]
    wait_for(lambda: all(store.get(f"test:ran:slow:{r.id}") for r in slow[:1]), timeout=60)
    store.set(gate, 1)
    assert res.get(timeout=90) == 112
    logged(w, f"handed step {s2} not taken within its lease: pending again")
    assert counters(store, queue).get("republished", 0) == 0
    assert [row(store, queue, s)["attempts"] for s in (s1, s2, s3)] == ["1", "1", "1"]
    assert json.loads(row(store, queue, s2)["input"]) == 2
    assert res.dependencies() == (0, 1, 0, 0)
    assert [r.get(timeout=60) for r in slow] == [0, 1]


@pytest.fixture
def queue(own_queue: Any) -> str:
    return str(own_queue("hand"))
