"""Children cut, counted on their parent by the scripts that cut them, on a real Redis: on
the parent's slot in the same script, on another slot by credit_cut after it, once each
whatever repeats; a flow written before cuts were counted reads as it did."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from celery_echomq import dependencies, get_state
from celery_echomq.store import deadlines as dl
from celery_echomq.store.keyspace import new_job_id
from tests.helpers import KEYS, wait_for

TTL = 600


@pytest.fixture
def state(proj: Any) -> Any:
    return get_state(proj.app)


def held(state: Any, queue: str, n: int) -> tuple[str, list[str]]:
    """A held parent with ``n`` pending children on its slot (enqueue_flow)."""
    parent, kids = new_job_id(), [new_job_id() for _ in range(n)]
    payload = state.dumps({"task": "t", "children": kids, "options": {}})
    state.scripts.enqueue_flow(queue, parent, payload, [(k, b"c") for k in kids])
    return parent, kids


def elsewhere(store: redis.Redis, queue: str, parent: str, n: int) -> list[str]:
    """``n`` pending children of ``parent`` whose rows live on ``queue``'s slot."""
    kids = [new_job_id() for _ in range(n)]
    for kid in kids:
        store.hset(KEYS.job_key(queue, kid), mapping={"state": "pending", "parent": parent})
        store.zadd(KEYS.queue_key(queue, "pending"), {kid: 1})
    return kids


def cut_of(store: redis.Redis, queue: str, parent: str) -> int:
    return int(store.hget(KEYS.job_key(queue, parent), "cut_children") or 0)


def test_a_cancel_counts_its_children_cut_on_the_parent_once(
    state: Any, store: redis.Redis, own_queue: Any
) -> None:
    queue = own_queue("cut")
    parent, kids = held(state, queue, 3)
    status, _, cancelled = state.scripts.cancel(queue, parent, kids, ttl=TTL)
    assert status.value == "cancelled" and sorted(cancelled) == sorted(kids)
    assert dependencies(parent, app=state.app, queue=queue) == (0, 0, 0, 0)
    assert dependencies(parent, app=state.app, queue=queue).cut == 3
    # Again: nothing more cancelled, nothing counted twice.
    state.scripts.cancel(queue, parent, kids, ttl=TTL)
    state.scripts.cancel_elsewhere(queue, parent, kids, ttl=TTL, started=True, parent_queue=queue)
    assert cut_of(store, queue, parent) == 3


def test_children_of_another_slot_are_counted_on_the_parents_once(
    state: Any, store: redis.Redis, own_queue: Any
) -> None:
    home, other = own_queue("cuthome"), own_queue("cutother")
    parent, _ = held(state, home, 1)
    remote = elsewhere(store, other, parent, 2)
    cancelled = state.scripts.cancel_elsewhere(
        other, parent, remote, ttl=TTL, started=False, parent_queue=home
    )
    assert sorted(cancelled) == sorted(remote)
    assert cut_of(store, home, parent) == 2
    assert store.hget(KEYS.queue_key(home, "counters"), "children_cut") == b"2"
    assert store.hget(KEYS.queue_key(other, "counters"), "children_cut") is None
    # A repeat of the count (a resend through a failover) counts nothing again.
    assert state.scripts.credit_cut(home, parent, remote) == 0
    assert cut_of(store, home, parent) == 2
    # A deadline's cut on another slot is counted on the parent's too.
    late = elsewhere(store, other, parent, 1)
    assert dl.cut_children(state, other, parent, late, "FlowDeadlineExceeded: x", home) == late
    assert dl.cut_children(state, other, parent, late, "FlowDeadlineExceeded: x", home) == []
    assert cut_of(store, home, parent) == 3
    assert store.hget(KEYS.queue_key(home, "counters"), "children_cut") == b"3"
    # Nothing of the other slot's was written on the parent's placeholder.
    assert not store.exists(KEYS.job_key(other, parent))


def test_a_forgotten_parent_is_not_written_by_a_late_count(
    state: Any, store: redis.Redis, own_queue: Any
) -> None:
    home = own_queue("cutgone")
    parent = new_job_id()
    kid = new_job_id()
    assert state.scripts.credit_cut(home, parent, [kid]) == 0
    assert not store.exists(KEYS.job_key(home, parent))
    assert not store.exists(KEYS.settled_key(home, parent))


def test_a_flow_cut_before_cuts_were_counted_reads_as_it_did(
    state: Any, store: redis.Redis, own_queue: Any
) -> None:
    """A flow the previous release cancelled has no 'cut_children': its cut children read as
    outstanding, as they always did, and nothing fails."""
    queue = own_queue("cutold")
    parent, kids = held(state, queue, 2)
    state.scripts.cancel(queue, parent, kids, ttl=TTL)
    store.hdel(KEYS.job_key(queue, parent), "cut_children")
    deps = dependencies(parent, app=state.app, queue=queue)
    assert deps == (2, 0, 0, 0) and deps.cut == 0


def test_a_deadline_counts_its_cut_children_and_a_retry_counts_them_back(
    state: Any, store: redis.Redis, own_queue: Any
) -> None:
    queue = own_queue("cutdl")
    parent = new_job_id()
    dl.arm(state, queue, parent, "in", 200)
    kids = [new_job_id(), new_job_id()]
    payload = state.dumps({"task": "t", "children": kids, "options": {}})
    state.scripts.enqueue_flow(queue, parent, payload, [(k, b"c") for k in kids])
    wait_for(lambda: dl.fire(state, queue, parent, f"n:{len(kids)}", "fail", kids, []).status
             == "failed", 10)  # fmt: skip
    deps = dependencies(parent, app=state.app, queue=queue)
    assert deps == (0, 0, 0, 0) and deps.cut == 2
    status, _, again = dl.retry(state, queue, parent, kids, "in", 60_000)
    assert status == "retried" and sorted(cid for cid, _ in again) == sorted(kids)
    deps = dependencies(parent, app=state.app, queue=queue)
    assert deps == (2, 0, 0, 0) and deps.cut == 0


def test_a_count_a_crash_left_undone_is_made_by_the_next_run(
    state: Any, store: redis.Redis, own_queue: Any
) -> None:
    """A host that died between a cut on the children's slot and the count on the parent's:
    a cancel (or a deadline's follow-up) run again counts what the rows say was cut."""
    home, other = own_queue("cutcrash"), own_queue("cutcrash2")
    parent, _ = held(state, home, 1)
    cancelled, cut = elsewhere(store, other, parent, 2), elsewhere(store, other, parent, 1)
    placeholder = KEYS.unused_key(other)
    sets = [KEYS.queue_key(other, s) for s in ("pending", "active", "counters")]
    rows = [KEYS.job_key(other, c) for c in cancelled]
    # The scripts alone, as a host that died before counting would have left them.
    state.scripts._run(
        "cancel_elsewhere", [*sets, placeholder, *rows], [parent, "60", "0", *cancelled]
    )
    keys = [sets[0], sets[2], placeholder, KEYS.job_key(other, cut[0])]
    state.scripts._run("deadline_cut", keys, [parent, "60", "FlowDeadlineExceeded: x", *cut])
    assert cut_of(store, home, parent) == 0
    again = state.scripts.cancel_elsewhere(
        other, parent, cancelled, ttl=TTL, started=False, parent_queue=home
    )
    assert again == []  # nothing cancelled now, nothing to revoke
    assert dl.cut_children(state, other, parent, cut, "FlowDeadlineExceeded: x", home) == []
    assert cut_of(store, home, parent) == 3
    state.scripts.cancel_elsewhere(
        other, parent, cancelled, ttl=TTL, started=False, parent_queue=home
    )
    assert cut_of(store, home, parent) == 3  # and never twice
