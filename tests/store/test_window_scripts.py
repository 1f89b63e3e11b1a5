"""The queue's count of children waiting in flows' windows (``window_waiting`` in its
counters, what the dashboard charts): up by the children written waiting, down once by
whichever transition takes each out of ``waiting`` (its window letting it out, a cancel, a
deadline, a quorum's cut, a revoke by id, a forget), never twice under redelivery. The
scripts on a real Redis, no worker."""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Any

import pytest
import redis

from celery_echomq import get_state
from celery_echomq.ops.forget import forget_flow
from celery_echomq.ops.pages import read_flow
from celery_echomq.store import deadlines as dl
from celery_echomq.store.keyspace import new_job_id
from celery_echomq.store.replies import Status
from celery_echomq.store.scripts import ParentRef
from tests.helpers import KEYS

TTL = 600
LEASE = 60_000


@pytest.fixture
def state(proj: Any) -> Any:
    return get_state(proj.app)


def windowed(state: Any, queue: str, out: int, waiting: int) -> tuple[ParentRef, list[str], bytes]:
    """A held flow of ``out + waiting`` children, its window ``out`` wide: the first ``out``
    pending (holding a slot), the others waiting, as enqueue_flow writes them; a child that
    fails is ignored (the flow goes on)."""
    parent, kids = new_job_id(), [new_job_id() for _ in range(out + waiting)]
    payload = state.dumps({"task": "t", "children": kids, "options": {}})
    kinds = "q" * out + "P" * waiting
    children = [(k, b"c") for k in kids]
    state.scripts.enqueue_flow(queue, parent, payload, children, kinds=kinds, policy="ignore")
    return ParentRef(parent, queue), kids, payload


def waiting_count(store: redis.Redis, queue: str) -> int:
    return int(store.hget(KEYS.queue_key(queue, "counters"), "window_waiting") or 0)


def finish(state: Any, ref: ParentRef, kid: str, token: str) -> Status:
    return state.scripts.complete(
        ref.queue, kid, token, ttl=TTL, is_parent=False, parent=ref, value=b"1"
    )


def test_counted_in_when_written_and_out_once_by_each_way_out(
    state: Any, store: redis.Redis, own_queue: Any
) -> None:
    queue = own_queue("win")
    ref, kids, _ = windowed(state, queue, out=2, waiting=4)
    assert waiting_count(store, queue) == 4
    # The first child finishes: the window lets the next one out (a batch of 1 for 2 slots).
    assert state.scripts.claim(queue, kids[0], "t0", LEASE)[0] is Status.CLAIMED
    assert finish(state, ref, kids[0], "t0") is Status.CREDITED
    assert store.hget(KEYS.job_key(queue, kids[2]), "state") == b"pending"
    assert waiting_count(store, queue) == 3
    # The same completion delivered again lets nothing more out and counts nothing.
    assert finish(state, ref, kids[0], "t0") is not Status.CREDITED
    assert waiting_count(store, queue) == 3
    # A waiting child revoked by its id: failed, once.
    for _ in range(2):
        state.scripts.fail(queue, kids[3], "", "Revoked", ttl=TTL, is_parent=False, parent=ref)
        assert waiting_count(store, queue) == 2
    # The flow cancelled: the two still waiting leave with it, once.
    for _ in range(2):
        state.scripts.cancel(queue, ref.id, kids, ttl=TTL)
        assert waiting_count(store, queue) == 0
    assert store.hget(KEYS.job_key(queue, kids[5]), "state") == b"cancelled"


def test_a_deadline_and_a_quorums_cut_count_the_waiting_children_out_once(
    state: Any, store: redis.Redis, own_queue: Any
) -> None:
    queue = own_queue("win")
    parent = new_job_id()
    dl.arm(state, queue, parent, "in", 50)
    kids = [new_job_id() for _ in range(5)]
    payload = state.dumps({"task": "t", "children": kids, "options": {}})
    state.scripts.enqueue_flow(queue, parent, payload, [(k, b"c") for k in kids], kinds="qPPPP")
    assert waiting_count(store, queue) == 4
    time.sleep(0.08)
    check = hashlib.sha1(payload).hexdigest()
    # deadline.lua cuts the first two (its chunk); deadline_cut the rest, run twice.
    fired = dl.fire(state, queue, parent, check, "fail", kids[:3], [])
    assert fired.status == "failed" and set(fired.cut) == set(kids[:3])
    assert waiting_count(store, queue) == 2
    for _ in range(2):
        dl.cut_children(state, queue, parent, kids[3:], "FlowDeadlineExceeded: late", queue)
        assert waiting_count(store, queue) == 0

    # A quorum met cuts what has not started (send/quorum.py: cancel_elsewhere, not started).
    ref, kids, _ = windowed(state, queue, out=1, waiting=3)
    assert waiting_count(store, queue) == 3
    for _ in range(2):
        cut = state.scripts.cancel_elsewhere(
            queue, ref.id, kids, ttl=TTL, started=False, parent_queue=queue
        )
        assert waiting_count(store, queue) == 0
    assert cut == [] and store.hget(KEYS.job_key(queue, kids[3]), "state") == b"cancelled"


def test_children_added_waiting_are_counted_and_a_forget_counts_out_those_it_deletes(
    state: Any, store: redis.Redis, own_queue: Any
) -> None:
    queue = own_queue("win")
    ref, kids, payload = windowed(state, queue, out=1, waiting=1)
    # Children added to the held flow: past its window, they wait (grow_flow).
    more = [new_job_id() for _ in range(3)]
    grown = state.dumps({"task": "t", "children": kids + more, "options": {}})
    status, _ = state.scripts.grow_flow(
        ref,
        hashlib.sha1(payload).hexdigest(),
        grown,
        [(cid, b"c", "") for cid in more],
        [],
        max_active=1,
    )
    assert status is Status.ADDED and waiting_count(store, queue) == 4
    # A chunk of another queue's children written waiting (add_children), twice: once counted.
    other = own_queue("win")
    far = [new_job_id() for _ in range(2)]
    for _ in range(2):
        state.scripts.add_children(other, ref, [(c, b"c", "") for c in far], "PP", max_active=1)
        assert waiting_count(store, other) == 2
    # A child its window let out is deleted without a count: it was counted out already.
    assert state.scripts.forget(queue, [kids[0]]) == ([KEYS.job_key(queue, kids[0])], [])
    assert waiting_count(store, queue) == 4

    node = read_flow(state, ref.id, queue=queue, count=1, with_result=False)
    forget_flow(state, node)
    assert waiting_count(store, queue) == 0
    assert not store.exists(KEYS.job_key(queue, more[0]))
    # The undo of a refused start: its rows, counted out once however often it runs.
    assert state.scripts.forget(other, far) == ([KEYS.job_key(other, c) for c in far], [])
    assert waiting_count(store, other) == 0
    assert state.scripts.forget(other, far) == ([], [])
    assert waiting_count(store, other) == 0


def test_a_flow_without_a_window_counts_nothing(
    state: Any, store: redis.Redis, own_queue: Any
) -> None:
    queue = own_queue("win")
    parent, kids = new_job_id(), [new_job_id() for _ in range(3)]
    state.scripts.enqueue_flow(queue, parent, b"p", [(k, b"c") for k in kids])
    ref = ParentRef(parent, queue)
    token = "t-" + uuid.uuid4().hex
    assert state.scripts.claim(queue, kids[0], token, LEASE)[0] is Status.CLAIMED
    finish(state, ref, kids[0], token)
    state.scripts.cancel(queue, parent, kids, ttl=TTL)
    assert store.hget(KEYS.queue_key(queue, "counters"), "window_waiting") is None
