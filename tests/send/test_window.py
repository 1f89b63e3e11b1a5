"""A window on a flow's children, ``flow(parent, children, max_active=N)``: at most N of them
published or running at once, the others waiting rows published in the children's order as
earlier ones finish (send/window.py, store/lua/includes/window.lua), on real workers and
eagerly."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_echomq import FlowCancelled, FlowDeadlineExceeded, FlowFailed, add_children, flow
from celery_echomq.store.keyspace import new_job_id
from tests.helpers import (
    KEYS,
    Env,
    echomq,
    fast_recovery,
    kept_keys,
    keys_written,
    logged,
    wait_for,
)

TIMEOUT = 90


def run(sig: Any, how: str, **options: Any) -> Any:
    return sig.apply(**options) if how == "eager" else sig.apply_async(**options)


@pytest.fixture(params=["eager", "worker"])
def how(request: pytest.FixtureRequest) -> str:
    if request.param == "worker":
        request.getfixturevalue("worker")
    return str(request.param)


@pytest.fixture
def key() -> str:
    """Where this test's ``windowed`` children record themselves."""
    return f"test:window:{uuid.uuid4().hex}"


def order(store: redis.Redis, key: str) -> list[int]:
    return [int(x) for x in store.lrange(f"{key}:order", 0, -1)]


def peak(store: redis.Redis, key: str, what: str) -> int:
    return int(store.get(f"{key}:{what}") or 0)


def row(store: redis.Redis, queue: str, job_id: str, field: str) -> str | None:
    value = store.hget(KEYS.job_key(queue, job_id), field)
    return value.decode() if value is not None else None


def waiting_ids(store: redis.Redis, queue: str, parent: str) -> list[str]:
    return [x.decode() for x in store.lrange(KEYS.window_key(queue, parent), 0, -1)]


class Sampler:
    """Samples ``read()`` every 10 ms on a thread until stopped: the most it returned."""

    def __init__(self, read: Callable[[], int]) -> None:
        self.read, self.most, self.samples = read, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.most = max(self.most, self.read())
            self.samples += 1
            time.sleep(0.01)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.most


# --- the window: its bound and its order ---------------------------------------------------


# A window of 3 lets a child out as each one finishes; one of 30, three at a time (a tenth).
@pytest.mark.parametrize(("n", "size"), [(40, 3), (240, 30)])
def test_at_most_max_active_children_are_out_and_they_start_in_order(
    proj: Any,
    env: Env,
    store: redis.Redis,
    own_queue: Any,
    start_worker: Any,
    key: str,
    n: int,
    size: int,
) -> None:
    queue = own_queue("window")
    broker = redis.Redis.from_url(env.broker)
    kids = [proj.windowed.s(i, key, queue, 0.02) for i in range(n)]
    res = flow(proj.tsum.s(), kids, max_active=size).apply_async(queue=queue)
    # Before any worker: ``size`` messages, the other children waiting rows in order.
    assert broker.llen(queue) == size
    assert len(waiting_ids(store, queue, res.id)) == n - size
    assert f"max_active={size}  waiting={n - size}" in echomq("show", res.id).output
    sampled = Sampler(lambda: int(broker.llen(queue)))
    start_worker(queues=queue, concurrency=4)
    try:
        assert res.get(timeout=TIMEOUT) == sum(range(n))
    finally:
        in_broker = sampled.stop()
    assert sampled.samples > 10
    assert in_broker <= size
    assert peak(store, key, "out") <= size  # pending or active in the store, seen by each child
    assert 1 <= peak(store, key, "peak") <= min(size, 4)  # running at once
    started = order(store, key)
    assert sorted(started) == list(range(n))
    # Published in order: child i only once i - size children before it had finished.
    assert all(started.index(i) >= i - size for i in range(n))
    assert not store.exists(KEYS.window_key(queue, res.id))


def test_max_active_one_runs_the_children_one_by_one_in_order(
    proj: Any, store: redis.Redis, how: str, key: str
) -> None:
    kids = [proj.windowed.s(i, key) for i in range(12)]
    res = run(flow(proj.tsum.s(), kids, max_active=1), how)
    assert res.get(timeout=TIMEOUT) == sum(range(12))
    assert order(store, key) == list(range(12))
    assert peak(store, key, "peak") == 1


def test_a_window_larger_than_the_flow_changes_nothing(
    proj: Any, store: redis.Redis, how: str, key: str
) -> None:
    res = run(flow(proj.tsum.s(), [proj.windowed.s(i, key) for i in range(5)], max_active=50), how)
    assert res.get(timeout=TIMEOUT) == 10
    assert sorted(order(store, key)) == list(range(5))


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "3", [2]])
def test_max_active_must_be_an_int_of_one_or_more(proj: Any, size: Any) -> None:
    with pytest.raises(ValueError, match=r"max_active.*allowed: an int >= 1"):
        flow(proj.tsum.s(), [proj.add.s(1, 1)], max_active=size)


def test_a_window_the_store_cannot_keep_is_refused_before_anything_is_written(
    proj: Any, env: Env, store: redis.Redis, own_queue: Any
) -> None:
    from celery import chain

    queue, other = own_queue("refused"), own_queue("elsewhere")
    broker = redis.Redis.from_url(env.broker)
    before = kept_keys(store)
    spread = [proj.add.s(1, 1), proj.add.s(2, 2).set(queue=other)]
    linked = [chain(proj.add.s(1, 1), proj.add.s(1)), proj.add.s(2, 2)]
    for send in ("apply_async", "apply"):  # the same errors eagerly
        with pytest.raises(ValueError, match=f"needs every child on one queue.*{other}"):
            getattr(flow(proj.tsum.s(), spread, max_active=1), send)(queue=queue)
        with pytest.raises(ValueError, match="not a chain of tasks"):
            getattr(flow(proj.tsum.s(), linked, max_active=1), send)(queue=queue)
    assert not keys_written(store, before)
    assert broker.llen(queue) == broker.llen(other) == 0


def test_a_waiting_child_keeps_under_400_bytes_in_redis(
    proj: Any, env: Env, store: redis.Redis, own_queue: Any
) -> None:
    queue = own_queue("compact")
    kids = [proj.add.s(i, i) for i in range(500)]
    res = flow(proj.tsum.s(), kids, max_active=10).apply_async(queue=queue)
    waiting = waiting_ids(store, queue, res.id)
    assert len(waiting) == 490
    assert {row(store, queue, cid, "state") for cid in waiting} == {"waiting"}
    assert row(store, queue, waiting[0], "payload") is None  # a delta, not a message
    used = sum(store.memory_usage(KEYS.job_key(queue, cid)) or 0 for cid in waiting)
    used += store.memory_usage(KEYS.window_key(queue, res.id)) or 0
    per_child = used / len(waiting)
    print(f"Redis bytes per waiting child: {per_child:.0f}")
    assert per_child <= 400
    assert redis.Redis.from_url(env.broker).llen(queue) == 10


# --- what finishes a child frees its slot ---------------------------------------------------


@pytest.mark.parametrize("policy", ["ignore", "remove", "continue"])
def test_a_failed_child_frees_its_slot_under_its_policy(
    proj: Any, store: redis.Redis, how: str, key: str, policy: str
) -> None:
    kids = [
        proj.windowed_boom.s(i, key) if i % 3 == 0 else proj.windowed.s(i, key) for i in range(10)
    ]
    res = run(flow(proj.collect.s(), kids, max_active=2, policy=policy), how)
    value = res.get(timeout=TIMEOUT)
    if policy != "continue":
        assert value["values"] == [i for i in range(10) if i % 3]
    wait_for(lambda: len(order(store, key)) == 10, timeout=TIMEOUT)
    assert sorted(order(store, key)) == list(range(10))
    assert peak(store, key, "peak") <= 2


def test_a_child_failing_the_flow_frees_its_slot_and_a_retry_completes_it(
    proj: Any, store: redis.Redis, worker: Any, key: str
) -> None:
    flag = f"test:flag:{uuid.uuid4().hex}"
    kids = [proj.windowed.s(i, key) for i in range(6)]
    kids[2] = proj.flaky.s(2, flag)
    res = flow(proj.tsum.s(), kids, max_active=2).apply_async()
    with pytest.raises(FlowFailed, match=f"flag {flag} not set"):
        res.get(timeout=TIMEOUT)
    # The children after the failed one still run (a retry needs only the failed one).
    wait_for(lambda: len(order(store, key)) == 5, timeout=TIMEOUT)
    store.set(flag, 1)
    res.retry()
    assert res.get(timeout=TIMEOUT) == 0 + 1 + 2 + 3 + 4 + 5


def test_the_same_error_eagerly_and_on_a_worker(proj: Any, how: str, key: str) -> None:
    kids = [proj.windowed.s(0, key), proj.windowed_boom.s(1, key), proj.windowed.s(2, key)]
    with pytest.raises(FlowFailed, match="child 1 failed") as caught:
        run(flow(proj.tsum.s(), kids, max_active=1), how).get(timeout=TIMEOUT)
    assert "ValueError" in str(caught.value)


# --- cancel, deadline, release: waiting children are never published ---------------------


@pytest.fixture
def gate(store: redis.Redis) -> Iterator[str]:
    name = f"test:gate:{uuid.uuid4().hex}"
    yield name
    store.set(name, 1)


def gated_flow(proj: Any, gate: str, n: int, size: int, **options: Any) -> tuple[Any, list[str]]:
    ids = [new_job_id() for _ in range(n)]
    kids = [proj.gated.s(i, gate).set(task_id=cid) for i, cid in enumerate(ids)]
    return flow(proj.tsum.s(), kids, max_active=size, **options), ids


def test_cancel_never_publishes_the_waiting_children(
    proj: Any, store: redis.Redis, worker: Any, gate: str
) -> None:
    sig, ids = gated_flow(proj, gate, 8, 2)
    res = sig.apply_async()
    wait_for(lambda: [row(store, "celery", c, "state") for c in ids[:2]] == ["active"] * 2)
    res.revoke()
    store.set(gate, 1)
    with pytest.raises(FlowCancelled):
        res.get(timeout=TIMEOUT)
    time.sleep(1.0)  # the running two finish: their completions publish nothing
    for cid in ids[2:]:
        assert row(store, "celery", cid, "state") == "cancelled"
        assert row(store, "celery", cid, "attempts") is None  # never went out


def test_a_deadline_cuts_the_waiting_children(
    proj: Any, store: redis.Redis, worker: Any, gate: str
) -> None:
    sig, ids = gated_flow(proj, gate, 6, 2, deadline=1.5)
    res = sig.apply_async()
    with pytest.raises(FlowDeadlineExceeded):
        res.get(timeout=TIMEOUT)
    store.set(gate, 1)
    for cid in ids[2:]:
        assert row(store, "celery", cid, "state") == "cancelled"
        assert row(store, "celery", cid, "cut") == "deadline"
        assert row(store, "celery", cid, "attempts") is None  # never went out


def test_release_with_revoke_cancels_the_waiting_children(
    proj: Any, store: redis.Redis, worker: Any, gate: str
) -> None:
    sig, ids = gated_flow(proj, gate, 6, 2)
    res = sig.apply_async()
    wait_for(lambda: row(store, "celery", ids[1], "state") == "active")
    res.release(revoke=True)
    store.set(gate, 1)  # the two running finish, counted nowhere: the parent ran without them
    assert res.get(timeout=TIMEOUT) == 0
    for cid in ids[2:]:
        assert row(store, "celery", cid, "state") == "cancelled"
        assert row(store, "celery", cid, "attempts") is None  # never went out


# --- children added, nested flows, other queues ---------------------------------------------


def test_added_children_join_the_window_in_order(
    proj: Any, store: redis.Redis, worker: Any, gate: str, key: str
) -> None:
    sig, ids = gated_flow(proj, gate, 2, 3)
    res = sig.apply_async()
    wait_for(lambda: row(store, "celery", ids[1], "state") == "active")
    added = add_children(
        [proj.windowed.s(10 + i, key).set(task_id=new_job_id()) for i in range(5)], res.id
    )
    # One slot was free: the first added child runs, the four others wait, in order.
    assert waiting_ids(store, "celery", res.id) == added[1:]
    store.set(gate, 1)
    assert res.get(timeout=TIMEOUT) == 0 + 1 + sum(10 + i for i in range(5))
    assert peak(store, key, "peak") <= 3


def test_children_added_to_a_full_window_with_none_waiting_go_out_as_its_first_finish(
    proj: Any, store: redis.Redis, worker: Any, gate: str, key: str
) -> None:
    # Both children of a window of 2 went out at once, and none waited: the children added
    # later wait, and each slot the first two free lets one out (the first two hold their
    # slots from the start, not only children that once waited).
    sig, ids = gated_flow(proj, gate, 2, 2)
    res = sig.apply_async()
    wait_for(lambda: [row(store, "celery", c, "state") for c in ids] == ["active"] * 2)
    added = add_children(
        [proj.windowed.s(10 + i, key).set(task_id=new_job_id()) for i in range(3)], res.id
    )
    assert waiting_ids(store, "celery", res.id) == added
    store.set(gate, 1)
    assert res.get(timeout=TIMEOUT) == 0 + 1 + sum(10 + i for i in range(3))
    assert peak(store, key, "peak") <= 2


def test_added_children_join_the_window_eagerly(proj: Any, store: redis.Redis, key: str) -> None:
    res = flow(proj.tsum.s(), [proj.spawner.s(1, [5, 6, 7])], max_active=1).apply()
    assert res.get() == 1 + 5 + 6 + 7


def test_a_nested_flow_holds_one_slot_until_it_finishes(
    proj: Any, store: redis.Redis, how: str, key: str
) -> None:
    parents = [new_job_id() for _ in range(5)]
    inner = [
        flow(
            proj.tsum.s().set(task_id=pid),
            [proj.windowed.s(10 * j + i, key, "celery", 0.1) for i in range(2)],
        )
        for j, pid in enumerate(parents)
    ]

    def open_flows() -> int:
        # The five states at one instant (one MULTI): read one by one, a flow that finished
        # and the one its slot started could both be counted.
        at_once = store.pipeline(transaction=True)
        for pid in parents:
            at_once.hget(KEYS.job_key("celery", pid), "state")
        states = [s.decode() if s else None for s in at_once.execute()]
        return sum(s in ("pending", "awaiting_children", "active") for s in states)

    sampled = Sampler(open_flows)
    try:
        res = run(flow(proj.tsum.s(), inner, max_active=2), how)
        assert res.get(timeout=TIMEOUT) == sum(10 * j + i for j in range(5) for i in range(2))
    finally:
        most = sampled.stop()
    assert most <= 2
    started = order(store, key)
    # A nested flow is started when its turn comes: both children of flows 0 and 1 before
    # any of flow 2's.
    assert sorted(started[:4]) == [0, 1, 10, 11]
    assert sorted(started) == sorted(10 * j + i for j in range(5) for i in range(2))


def test_children_on_another_queue_than_their_parent(
    proj: Any, env: Env, store: redis.Redis, own_queue: Any, start_worker: Any, key: str
) -> None:
    home, there = own_queue("home"), own_queue("there")
    kids = [proj.windowed.s(i, key, there).set(queue=there) for i in range(20)]
    res = flow(proj.tsum.s(), kids, max_active=2).apply_async(queue=home)
    assert len(waiting_ids(store, there, res.id)) == 18  # on the children's slot
    assert redis.Redis.from_url(env.broker).llen(there) == 2
    start_worker(queues=f"{home},{there}", concurrency=4)
    assert res.get(timeout=TIMEOUT) == sum(range(20))
    assert peak(store, key, "out") <= 2


# --- recovery -----------------------------------------------------------------------------


def test_the_lost_messages_of_the_children_out_are_republished(
    proj: Any, env: Env, store: redis.Redis, own_queue: Any, start_worker: Any, key: str
) -> None:
    queue = own_queue("lost")
    ids = [new_job_id() for _ in range(6)]
    kids = [proj.windowed.s(i, key, queue).set(task_id=cid) for i, cid in enumerate(ids)]
    res = flow(proj.tsum.s(), kids, max_active=2).apply_async(queue=queue)
    broker = redis.Redis.from_url(env.broker)
    assert broker.llen(queue) == 2
    broker.delete(queue)  # the broker lost both messages out
    w = start_worker(queues=queue, extra_env=fast_recovery())
    assert res.get(timeout=TIMEOUT) == sum(range(6))
    for cid in ids[:2]:
        logged(w, f"re-published {cid} of parent {res.id}")
    assert sorted(order(store, key)) == list(range(6))
    assert peak(store, key, "out") <= 2


def test_a_pool_process_killed_before_publishing_the_next_child_loses_nothing(
    proj: Any, store: redis.Redis, own_queue: Any, start_worker: Any, key: str
) -> None:
    queue = own_queue("freed")
    # Each pool process that finishes a child SIGKILLs itself before publishing the next one:
    # recovery finds that child pending without a message, and publishes it from its row.
    w = start_worker(queues=queue, extra_env=fast_recovery(ECHOMQ_T_DIE_AT="publish_freed"))
    ids = [new_job_id() for _ in range(3)]
    kids = [proj.windowed.s(i, key, queue).set(task_id=cid) for i, cid in enumerate(ids)]
    res = flow(proj.tsum.s(), kids, max_active=1).apply_async(queue=queue)
    assert res.get(timeout=180) == 0 + 1 + 2
    logged(w, "killed itself at publish_freed")
    for cid in ids[1:]:
        logged(w, f"re-published {cid}")
        assert row(store, queue, cid, "attempts") == "1"
    assert order(store, key) == [0, 1, 2]


def test_a_worker_killed_mid_child_the_window_goes_on(
    proj: Any, store: redis.Redis, own_queue: Any, start_worker: Any, key: str
) -> None:
    queue = own_queue("killed")
    hung = new_job_id()
    first = start_worker(queues=queue, extra_env=fast_recovery())
    kids = [
        proj.hang_first.s(100).set(task_id=hung),
        *(proj.windowed.s(i, key, queue) for i in range(4)),
    ]
    res = flow(proj.tsum.s(), kids, max_active=2).apply_async(queue=queue)
    wait_for(lambda: store.exists(f"test:pid:{hung}"), timeout=60)
    first.kill()  # SIGKILL the whole worker: the hung child's message is gone with it
    second = start_worker(queues=queue, extra_env=fast_recovery())
    assert res.get(timeout=TIMEOUT) == 100 + sum(range(4))
    logged(second, f"re-published {hung}")
    assert peak(store, key, "out") <= 2


# --- the scripts' side, with no worker ---------------------------------------------------------


def finish(state: Any, queue: str, parent: str, cid: str, value: int) -> Any:
    """Claim and complete ``cid`` as a worker would, and publish what its completion let out."""
    from celery_echomq.store.scripts import ParentRef
    from celery_echomq.worker.settle import settle_success

    token = f"test|{uuid.uuid4().hex}"
    assert state.scripts.claim(queue, cid, token, 60_000)[0] == "claimed"
    return settle_success(
        state, queue, cid, token, False, ParentRef(parent, queue), state.dumps(value)
    )


def test_a_window_lets_a_tenth_of_its_slots_out_at_once_and_never_more(
    proj: Any, env: Env, store: redis.Redis, own_queue: Any
) -> None:
    from celery_echomq.store.state import get_state

    state = get_state(proj.app)
    queue = own_queue("batch")
    broker = redis.Redis.from_url(env.broker)
    ids = [new_job_id() for _ in range(60)]
    kids = [proj.add.s(i, 0).set(task_id=cid) for i, cid in enumerate(ids)]
    res = flow(proj.tsum.s(), kids, max_active=30).apply_async(queue=queue)
    assert broker.llen(queue) == 30
    slots = KEYS.slots_key(queue, res.id)
    # Two finished: their slots free, nothing out yet (a batch is 3).
    for i in range(2):
        finish(state, queue, res.id, ids[i], i)
    assert broker.llen(queue) == 30 and store.hget(slots, "free") == b"2"
    assert row(store, queue, ids[30], "state") == "waiting"
    # The third: three more out, the next in order, pending with their messages.
    finish(state, queue, res.id, ids[2], 2)
    assert broker.llen(queue) == 33 and store.hget(slots, "free") == b"0"
    assert [row(store, queue, c, "state") for c in ids[30:34]] == ["pending"] * 3 + ["waiting"]
    assert [row(store, queue, c, "attempts") for c in ids[30:34]] == ["0"] * 3 + [None]
    assert waiting_ids(store, queue, res.id)[0] == ids[33]
    # A duplicate completion frees nothing.
    from celery_echomq.store.scripts import ParentRef

    again = state.scripts.complete(
        queue,
        ids[2],
        "stale",
        ttl=60,
        is_parent=False,
        parent=ParentRef(res.id, queue),
        value=state.dumps(2),
    )
    assert str(again) == "done" and store.hget(slots, "free") == b"0"
    assert "max_active=30  waiting=27" in echomq("show", res.id).output


def test_a_flow_without_a_window_keeps_no_window_keys(
    proj: Any, store: redis.Redis, own_queue: Any
) -> None:
    from celery_echomq.store.state import get_state

    state = get_state(proj.app)
    queue = own_queue("plain")
    ids = [new_job_id() for _ in range(3)]
    res = flow(proj.tsum.s(), [proj.add.s(i, 0).set(task_id=c) for i, c in enumerate(ids)])
    res = res.apply_async(queue=queue)
    for i, cid in enumerate(ids):
        finish(state, queue, res.id, cid, i)
    assert not store.exists(KEYS.window_key(queue, res.id), KEYS.slots_key(queue, res.id))
    assert "max_active" not in echomq("show", res.id).output
    # Nor does a child of it say it holds a slot: its completion never looks for a window.
    assert all(row(store, queue, cid, "windowed") is None for cid in ids)
