"""The deadline scripts one by one, on a real Redis: every transition idempotent, every
refusal a no-op."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import pytest
import redis

from celery_echomq import FlowExistsError, get_state
from celery_echomq.store import deadlines as dl
from celery_echomq.store.keyspace import new_job_id
from tests.helpers import KEYS


@pytest.fixture
def state(proj: Any) -> Any:
    return get_state(proj.app)


def held(state: Any, queue: str, n: int = 2) -> tuple[str, list[str], bytes]:
    """A held parent with ``n`` pending children, written by enqueue_flow itself."""
    parent, kids = new_job_id(), [new_job_id() for _ in range(n)]
    payload = state.dumps({"task": "t", "children": kids, "options": {}})
    state.scripts.enqueue_flow(queue, parent, payload, [(k, b"c") for k in kids])
    return parent, kids, payload


def sha(payload: bytes) -> str:
    return hashlib.sha1(payload).hexdigest()


def test_arm_refuses_a_row_that_exists_and_writes_nothing(
    state: Any, store: redis.Redis, own_queue: Any
) -> None:
    queue = own_queue("dls")
    parent, _, _ = held(state, queue)
    with pytest.raises(FlowExistsError):
        dl.arm(state, queue, parent, "in", 1000)
    assert store.zcard(KEYS.queue_key(queue, "deadlines")) == 0


def test_fire_once_then_nothing_and_the_follow_up_comes_back_if_it_is_not_done(
    state: Any, store: redis.Redis, own_queue: Any
) -> None:
    queue = own_queue("dls")
    parent = new_job_id()
    # Due in 500 ms: the first fire comes before it even on a loaded machine.
    dl.arm(state, queue, parent, "in", 500)
    kids = [new_job_id(), new_job_id()]
    payload = state.dumps({"task": "t", "children": kids, "options": {}})
    state.scripts.enqueue_flow(queue, parent, payload, [(k, b"c") for k in kids])
    early = dl.fire(state, queue, parent, sha(payload), "fail", kids, [])
    assert early.status == "early"
    time.sleep(0.53)
    assert dl.fire(state, queue, parent, "0" * 40, "fail", kids, []).status == "stale"
    fired = dl.fire(state, queue, parent, sha(payload), "fail", kids, [])
    assert fired.status == "failed" and fired.cut == tuple(kids)
    assert 0 <= fired.fired_ms - fired.due_ms < 1000
    row = store.hgetall(KEYS.job_key(queue, parent))
    assert row[b"state"] == b"failed" and row[b"failed_by"] == b"deadline"
    # Fired: a second call (another worker, a resent call) changes nothing.
    assert dl.fire(state, queue, parent, sha(payload), "fail", kids, []).status == "noop"
    assert store.hget(KEYS.queue_key(queue, "counters"), "deadlines") == b"1"
    # Its follow-up lease lapses (the firing process died): it comes back as "fired", once.
    store.zadd(KEYS.queue_key(queue, "deadlines"), {parent: 1})
    again = dl.fire(state, queue, parent, sha(payload), "fail", kids, [])
    assert again.status == "fired" and again.outcome == "failed"
    assert dl.fire(state, queue, parent, sha(payload), "fail", kids, []).status == "noop"
    assert not dl.done(state, queue, parent, fired.fired_ms + 1)  # not that firing: kept
    assert dl.done(state, queue, parent, fired.fired_ms)
    assert store.zcard(KEYS.queue_key(queue, "deadlines")) == 0
    assert store.hget(KEYS.queue_key(queue, "counters"), "deadlines") == b"1"


def test_the_children_are_checked_by_the_length_of_the_flows_index_where_it_has_one(
    state: Any, store: redis.Redis, own_queue: Any
) -> None:
    queue = own_queue("dls")
    parent, kids, _ = held(state, queue, 3)
    assert store.llen(KEYS.children_key(queue, parent)) == 3  # enqueue_flow wrote the index
    store.zadd(KEYS.queue_key(queue, "deadlines"), {parent: 1})
    # A child added since the host read them (add_children appends to the index): stale.
    assert dl.fire(state, queue, parent, "n:2", "fail", kids[:2], []).status == "stale"
    fired = dl.fire(state, queue, parent, "n:3", "fail", kids, [])
    assert fired.status == "failed" and fired.cut == tuple(kids) and fired.count == 3


def test_a_flow_that_never_landed_or_no_longer_waits_leaves_the_index(
    state: Any, store: redis.Redis, own_queue: Any
) -> None:
    queue = own_queue("dls")
    ghost = new_job_id()
    dl.arm(state, queue, ghost, "in", 1)  # its producer died before the enqueue
    time.sleep(0.01)
    assert dl.fire(state, queue, ghost, sha(b""), "fail", [], []).status == "missing"
    parent, kids, payload = held(state, queue)
    dl.arm(state, queue, new_job_id(), "in", 1)
    store.zadd(KEYS.queue_key(queue, "deadlines"), {parent: 1})
    store.hset(KEYS.job_key(queue, parent), "state", "done")
    moot = dl.fire(state, queue, parent, sha(payload), "fail", kids, [])
    assert moot.status == "moot" and moot.outcome == "done"
    assert store.zscore(KEYS.queue_key(queue, "deadlines"), parent) is None


def test_continue_releases_and_cut_children_stay_cut(
    state: Any, store: redis.Redis, own_queue: Any
) -> None:
    queue = own_queue("dls")
    parent, kids, payload = held(state, queue, 3)
    store.hset(KEYS.job_key(queue, kids[0]), "state", "active")
    store.zadd(KEYS.queue_key(queue, "deadlines"), {parent: 1})
    fired = dl.fire(state, queue, parent, sha(payload), "continue", kids, ["JOB" + "b" * 32])
    assert fired.status == "released"
    assert fired.running == (kids[0],) and fired.cut == tuple(kids[1:])
    assert fired.remote == ("JOB" + "b" * 32,)
    assert store.hget(KEYS.job_key(queue, parent), "state") == b"pending"
    # A second cut of the same children (deadline_cut) changes nothing.
    assert dl.cut_children(state, queue, parent, kids, "FlowDeadlineExceeded: x", queue) == []
    for kid in kids[1:]:
        assert store.hget(KEYS.job_key(queue, kid), "cut") == b"deadline"


def test_a_refused_flow_leaves_no_deadline_behind(
    proj: Any, state: Any, store: redis.Redis, own_queue: Any
) -> None:
    from celery_echomq import flow

    queue = own_queue("dls")
    taken = new_job_id()
    state.scripts.enqueue_flow(queue, new_job_id(), b"p", [(taken, b"c")])
    inner = flow(proj.tsum.s(), [proj.add.s(1, 1)], deadline=30)
    f = flow(proj.tsum.s(), [inner, proj.add.s(2, 2).set(task_id=taken)], deadline=30)
    with pytest.raises(FlowExistsError):
        f.apply_async(queue=queue)
    assert store.zcard(KEYS.queue_key(queue, "deadlines")) == 0


def test_a_deadline_armed_before_a_failover_fires_once_on_the_new_primary() -> None:
    """Sentinel promotes the replica while a flow waits: its deadline is in the new primary's
    index (replicated with the flow) and fires there, once."""
    from celery import Celery

    import celery_echomq
    from celery_echomq.embedded import RedisSentinelServer, wait_replicated

    with RedisSentinelServer(replicas=1, sentinels=3) as ha:
        app = Celery("dlha", set_as_current=False)
        app.conf.update(
            echomq_redis_url=ha.url(3),
            echomq_transport_options={"master_name": ha.master_name},
        )
        state = celery_echomq.install(app)
        queue, parent, kids = "q", new_job_id(), [new_job_id(), new_job_id()]
        payload = state.dumps({"task": "t", "children": kids, "options": {}})
        armed = time.monotonic()
        dl.arm(state, queue, parent, "in", 2500)
        state.scripts.enqueue_flow(queue, parent, payload, [(k, b"c") for k in kids])
        wait_replicated(ha.redis_client(ha.primary_port()), 1)
        old = ha.kill_primary()
        new = ha.wait_failover(old)
        assert new != old
        primary = ha.redis_client(new, db=3)
        assert primary.zscore(KEYS.queue_key(queue, "deadlines"), parent) is not None
        time.sleep(max(0.0, 2.6 - (time.monotonic() - armed)))
        fired = dl.fire(state, queue, parent, sha(payload), "fail", kids, [])
        assert fired.status == "failed" and fired.cut == tuple(kids)
        assert dl.fire(state, queue, parent, sha(payload), "fail", kids, []).status == "noop"
        assert primary.hget(KEYS.job_key(queue, parent), "failed_by") == b"deadline"
        state.client.close()
