"""Deadlines (issue 25): a flow's fan-in failed or released exactly once when its deadline
passes while it still waits, by whichever worker polls first; on real workers and eagerly."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis

from celery_echomq import (
    DeadlineError,
    FlowDeadlineExceeded,
    FlowFailed,
    NotRepairableError,
    flow,
    get_state,
    retry_flow,
)
from celery_echomq.ops.views import read_tree
from tests.helpers import KEYS, script_args, wait_for


def tag() -> str:
    return uuid.uuid4().hex


def ran(store: redis.Redis, name: str) -> int:
    return int(store.get(f"test:ran:{name}") or 0)


def row(store: redis.Redis, job_id: str, queue: str = "celery") -> dict[str, str]:
    raw = store.hgetall(KEYS.job_key(queue, job_id))
    return {k.decode(): v.decode(errors="replace") for k, v in raw.items()}


# --- bad input: refused when the flow is made, before anything reaches Redis ---------------


@pytest.mark.parametrize(
    ("deadline", "words"),
    [
        (0, "more than 0 seconds"),
        (-5, "more than 0 seconds"),
        (float("nan"), "more than 0 seconds"),
        ("60", "is a str"),
        (True, "is a bool"),
        (10**9, "more than a year"),
        (datetime(2030, 1, 1), "naive datetime"),
        (datetime(2001, 1, 1, tzinfo=timezone.utc), "already passed"),
    ],
)
def test_a_bad_deadline_is_refused_when_the_flow_is_made(
    proj: Any, deadline: Any, words: str
) -> None:
    with pytest.raises(DeadlineError, match=words) as info:
        flow(proj.tsum.s(), [proj.add.s(1, 1)], deadline=deadline)
    assert isinstance(info.value, ValueError)


def test_an_unknown_on_deadline_is_refused(proj: Any) -> None:
    with pytest.raises(DeadlineError, match="allowed: fail, continue"):
        flow(proj.tsum.s(), [proj.add.s(1, 1)], deadline=5, on_deadline="later")


def test_the_deadline_survives_json_clone_and_a_timedelta(proj: Any) -> None:
    from celery.canvas import Signature

    f = flow(proj.tsum.s(), [proj.add.s(1, 1)], deadline=timedelta(seconds=90))
    back = Signature.from_dict(dict(f), app=proj.app)
    assert back.deadline == {"in": 90.0} and back.on_deadline == "fail"
    when = datetime.now(timezone.utc) + timedelta(minutes=5)
    g = flow(proj.tsum.s(), [proj.add.s(1, 1)], deadline=when, on_deadline="continue").clone()
    assert g.deadline == {"at": when.timestamp()} and g.on_deadline == "continue"


# --- on a worker ----------------------------------------------------------------------------


def _blocked(proj: Any, gate: str, *, n_running: int = 2, n_waiting: int = 2) -> list[Any]:
    """Children that hold both pool slots (gated) and children queued behind them."""
    running = [proj.gated.s(i, gate) for i in range(1, n_running + 1)]
    waiting = [proj.add.s(10 * i, 1) for i in range(1, n_waiting + 1)]
    return running + waiting


def test_fail_fails_the_parent_naming_the_outstanding_children_and_cuts_the_waiting_ones(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    t, gate = tag(), f"gate:{tag()}"
    kids = _blocked(proj, gate)
    f = flow(proj.collect.s(tag=t), kids, deadline=1.5)
    f.on_error(proj.errback.s())
    res = f.freeze()
    ids = [k.options["task_id"] for k in kids]
    started = time.monotonic()
    f.apply_async()
    with pytest.raises(FlowDeadlineExceeded) as info:
        res.get(timeout=30)
    took = time.monotonic() - started
    exc = info.value
    assert isinstance(exc, FlowFailed)
    assert exc.flow_id == res.id
    assert set(exc.outstanding) == set(ids) and exc.count == 4
    assert "passed its deadline with 4 children outstanding" in str(exc)
    assert 1.4 < took < 4, took
    parent = row(store, res.id)
    assert parent["state"] == "failed" and parent["failed_by"] == "deadline"
    lateness = int(parent["deadline_fired"]) - int(parent["deadline_at"])
    assert 0 <= lateness < 1000, lateness
    # The children queued behind were cut, not run.
    for cid in ids[2:]:
        assert row(store, cid)["state"] == "cancelled" and row(store, cid)["cut"] == "deadline"
    # The running children finish and are recorded; the parent is never run; its link_error
    # callback (queued behind the running children) runs once.
    store.set(gate, 1)
    wait_for(lambda: sorted(res.children_values().values()) == [1, 2])
    wait_for(lambda: res.id.encode() in store.lrange("test:errback", 0, -1))
    tree = read_tree(get_state(proj.app), res.id)
    assert [c.outcome for c in tree.children] == ["credited", "credited", "deadline", "deadline"]
    time.sleep(0.5)
    assert ran(store, f"collect:{t}") == 0
    assert store.lrange("test:errback", 0, -1).count(res.id.encode()) == 1
    for cid in ids[2:]:
        assert row(store, cid)["state"] == "cancelled"


def test_continue_releases_the_parent_with_the_values_so_far(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    t, gate = tag(), f"gate:{tag()}"
    quick = proj.add.s(1, 1)
    kids = [quick, proj.gated.s(2, gate), proj.gated.s(3, gate), proj.add.s(4, 4)]
    f = flow(proj.collect.s(tag=t), kids, deadline=1.5, on_deadline="continue")
    f.freeze()
    res = f.apply_async()
    wait_for(lambda: row(store, res.id).get("released_by") == "deadline", timeout=10)
    # Released with the values so far; both pool slots are still busy with the gated
    # children, so the parent runs once they finish (their values come too late for it).
    store.set(gate, 1)
    assert res.get(timeout=30) == {"values": [2], "tag": t}
    assert "failed_by" not in row(store, res.id)
    assert row(store, kids[3].options["task_id"])["cut"] == "deadline"
    wait_for(lambda: sorted(res.children_values().values()) == [2, 2, 3])
    time.sleep(0.5)
    assert ran(store, f"collect:{t}") == 1  # never released again


def test_a_flow_done_before_its_deadline_is_left_alone_and_its_entry_goes(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    res = flow(proj.tsum.s(), [proj.add.s(1, 1), proj.add.s(2, 2)], deadline=1).apply_async()
    assert res.get(timeout=30) == 6
    assert store.zscore("emq:{celery}:deadlines", res.id) is not None
    wait_for(lambda: store.zscore("emq:{celery}:deadlines", res.id) is None, timeout=10)
    assert "deadline_fired" not in row(store, res.id)


# --- eager mode gives the same values and errors ------------------------------------------


# The pair's deadline: time enough for the quick child on a worker of the test's own.
DEADLINE = 3


def _pair(proj: Any, t: str, on_deadline: str) -> tuple[Any, list[str], str]:
    """One flow, the same ids each time it is made: a quick child done before the deadline
    and one that waits on a gate (the third value) the test opens only once the deadline has
    passed, so that no loaded machine can finish it in time."""
    ids = [f"JOB{uuid.uuid5(uuid.NAMESPACE_URL, f'{t}:{n}').hex}" for n in range(3)]
    gate = f"gate:{t}"

    def make() -> Any:
        kids = [proj.add.s(1, 1).set(task_id=ids[1]), proj.gated.s(2, gate).set(task_id=ids[2])]
        parent = proj.collect.s(tag=t).set(task_id=ids[0])
        return flow(parent, kids, deadline=DEADLINE, on_deadline=on_deadline)

    return make, ids, gate


def _eagerly(make: Any, store: redis.Redis, gate: str) -> Any:
    """The flow applied eagerly, its gated child let through a second after its deadline
    (eager mode runs the children one after another in this thread), the gate closed again."""
    opener = threading.Timer(DEADLINE + 1, store.set, (gate, 1))
    opener.start()
    try:
        return make().apply()
    finally:
        opener.join()
        store.delete(gate)


def test_fail_gives_the_same_error_eagerly_and_on_a_worker(
    proj: Any, own_queue: Any, start_worker: Any, store: redis.Redis
) -> None:
    t, q = tag(), own_queue("deadline-pair")
    start_worker(queues=q)
    make, ids, gate = _pair(proj, t, "fail")
    errors = []
    for res in (_eagerly(make, store, gate), make().apply_async(queue=q)):
        with pytest.raises(FlowDeadlineExceeded) as info:
            res.get(timeout=30)
        errors.append(info.value)
    store.set(gate, 1)
    eager, real = errors
    assert str(eager) == str(real)
    assert eager.outstanding == real.outstanding == (ids[2],)
    assert eager.flow_id == real.flow_id == ids[0] and eager.count == real.count == 1


def test_continue_gives_the_same_values_eagerly_and_on_a_worker(
    proj: Any, own_queue: Any, start_worker: Any, store: redis.Redis
) -> None:
    t, q = tag(), own_queue("deadline-pair")
    start_worker(queues=q)
    make, ids, gate = _pair(proj, t, "continue")
    eager = _eagerly(make, store, gate)
    assert eager.get() == {"values": [2], "tag": t}
    # The gated child finished after the deadline: recorded, too late for the parent.
    assert eager.children_values() == {ids[1]: 2, ids[2]: 2}
    real = make().apply_async(queue=q)
    # The worker's second pool process runs the parent while the first waits on the gate.
    assert real.get(timeout=30) == {"values": [2], "tag": t}
    store.set(gate, 1)
    wait_for(lambda: real.children_values() == {ids[1]: 2, ids[2]: 2})


def test_eager_cuts_the_children_not_started_when_the_deadline_passes(proj: Any) -> None:
    t = tag()
    kids = [proj.sleep_then.s(1, 1.2), proj.add.s(2, 2), proj.add.s(3, 3)]
    f = flow(proj.collect.s(tag=t), kids, deadline=0.5)
    f.freeze()
    res = f.apply()
    with pytest.raises(FlowDeadlineExceeded) as info:
        res.get()
    ids = [k.options["task_id"] for k in kids]
    assert info.value.outstanding == tuple(ids) and info.value.count == 3
    assert res.fanin.cut == ids[1:]
    assert list(res.children_values().values()) == [1]


# --- nested flows, added children, canvases ------------------------------------------------


def test_a_nested_flow_keeps_its_own_deadline(proj: Any, worker: Any, store: redis.Redis) -> None:
    t, gate = tag(), f"gate:{tag()}"
    inner = flow(proj.collect.s(tag=f"{t}-in"), [proj.gated.s(5, gate)], deadline=1)
    inner = inner.set(parent_policy="ignore")
    f = flow(proj.collect.s(tag=t), [inner, proj.add.s(1, 1)], deadline=60)
    f.freeze()
    res = f.apply_async()
    inner_id = inner.options["task_id"]
    # The inner flow fails by its own deadline; the outer takes that as an ignored failure
    # and runs long before its own.
    assert res.get(timeout=30) == {"values": [2], "tag": t}
    ignored = res.ignored_failures()
    assert list(ignored) == [inner_id]
    assert ignored[inner_id].startswith(f"FlowDeadlineExceeded: flow {inner_id} passed")
    assert "deadline_fired" not in row(store, res.id)
    assert row(store, inner_id)["failed_by"] == "deadline"
    store.set(gate, 1)


def test_the_same_nested_deadline_eagerly(proj: Any) -> None:
    t = tag()
    inner = flow(proj.collect.s(tag=f"{t}-in"), [proj.sleep_then.s(5, 1.0)], deadline=0.3)
    f = flow(proj.collect.s(tag=t), [inner.set(parent_policy="ignore"), proj.add.s(1, 1)])
    res = f.apply()
    assert res.get() == {"values": [2], "tag": t}
    (error,) = res.ignored_failures().values()
    assert error.startswith("FlowDeadlineExceeded: flow ") and "1 children outstanding" in error


def test_add_children_cannot_extend_the_deadline(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    gate = f"gate:{tag()}"
    f = flow(proj.tsum.s(), [proj.gated.s(1, gate)], deadline=1.5)
    started = time.monotonic()
    res = f.apply_async()
    due = store.zscore("emq:{celery}:deadlines", res.id)
    added = res.add_children([proj.gated.s(2, gate), proj.add.s(3, 3)])
    assert len(added) == 2
    assert store.zscore("emq:{celery}:deadlines", res.id) == due
    with pytest.raises(FlowDeadlineExceeded) as info:
        res.get(timeout=30)
    assert time.monotonic() - started < 4
    # The added children are the flow's children like the others: named, or cut.
    assert set(added) <= set(info.value.outstanding)
    store.set(gate, 1)


def test_a_chain_parent_keeps_the_deadline_on_the_job_holding_the_children(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    from celery import chain

    gate = f"gate:{tag()}"
    parent = chain(proj.tsum.s(), proj.add.s(100))
    f = flow(parent, [proj.add.s(1, 1), proj.gated.s(9, gate)], deadline=1, on_deadline="continue")
    res = f.apply_async()
    wait_for(lambda: row(store, res.fan_in).get("released_by") == "deadline", timeout=10)
    store.set(gate, 1)
    assert res.get(timeout=30) == 102  # tsum([2]) then + 100
    assert "deadline_fired" not in row(store, res.id)


def test_an_aware_datetime_deadline(proj: Any, worker: Any, store: redis.Redis) -> None:
    gate = f"gate:{tag()}"
    when = datetime.now(timezone.utc) + timedelta(seconds=1.2)
    res = flow(proj.tsum.s(), [proj.gated.s(1, gate)], deadline=when).apply_async()
    with pytest.raises(FlowDeadlineExceeded):
        res.get(timeout=30)
    fired = int(row(store, res.id)["deadline_fired"])
    assert abs(fired - when.timestamp() * 1000) < 1000
    store.set(gate, 1)


# --- retry ----------------------------------------------------------------------------------


def test_retry_of_a_flow_failed_by_its_deadline_needs_a_new_deadline(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    from celery.bin.celery import celery as celery_main
    from click.testing import CliRunner

    t, gate = tag(), f"gate:{tag()}"
    kids = _blocked(proj, gate)
    f = flow(proj.collect.s(tag=t), kids, deadline=1)
    f.freeze()
    res = f.apply_async()
    with pytest.raises(FlowDeadlineExceeded):
        res.get(timeout=30)
    state = get_state(proj.app)
    with pytest.raises(NotRepairableError, match="--deadline"):
        retry_flow(state, res.id)
    assert row(store, res.id)["state"] == "failed"  # nothing changed
    store.set(gate, 1)  # the running children finish and are recorded
    wait_for(lambda: sorted(res.children_values().values()) == [1, 2])
    out = CliRunner().invoke(
        celery_main, ["-A", "tests.proj", "echomq", "retry", res.id, "--deadline", "30"]
    )
    assert out.exit_code == 0, out.output
    # The cut children run now; the parent gets every value, in the children's order.
    fresh = type(res)(res.id, app=proj.app)
    assert fresh.get(timeout=30) == {"values": [1, 2, 11, 21], "tag": t}
    assert ran(store, f"collect:{t}") == 1
    assert store.zscore("emq:{celery}:deadlines", res.id) is not None  # the new one, armed


def test_retry_without_a_new_deadline_is_refused_by_the_cli_too(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    from celery.bin.celery import celery as celery_main
    from click.testing import CliRunner

    gate = f"gate:{tag()}"
    res = flow(proj.tsum.s(), [proj.gated.s(1, gate)], deadline=0.5).apply_async()
    with pytest.raises(FlowDeadlineExceeded):
        res.get(timeout=30)
    out = CliRunner().invoke(celery_main, ["-A", "tests.proj", "echomq", "retry", res.id])
    assert out.exit_code == 1 and "--deadline" in out.output
    store.set(gate, 1)


# --- kept by the store: any worker, exactly once, across a restart --------------------------


def test_several_workers_racing_fire_each_deadline_exactly_once(
    proj: Any, start_worker: Any, store: redis.Redis, own_queue: Any
) -> None:
    queue = own_queue("dl-race")
    workers = [start_worker(queues=queue, concurrency=1, name=f"race{i}") for i in range(3)]
    gate = f"gate:{tag()}"
    flows = [
        flow(proj.tsum.s(), [proj.gated.s(i, gate), proj.add.s(i, i)], deadline=1)
        for i in range(12)
    ]
    results = [f.apply_async(queue=queue) for f in flows]
    for res in results:
        with pytest.raises(FlowDeadlineExceeded):
            res.get(timeout=30)
    store.set(gate, 1)
    time.sleep(1.0)  # every follow-up done, and every worker had its chance to fire again
    counters = store.hgetall(KEYS.queue_key(queue, "counters"))
    assert int(counters[b"deadlines"]) == 12
    assert store.zcard(KEYS.queue_key(queue, "deadlines")) == 0
    logs = "".join(w.output() for w in workers)
    for res in results:
        assert logs.count(f"flow {res.id} passed its deadline") == 1, res.id
    # More than one worker fired some (the work is shared, not held by one).
    firing = [w for w in workers if "passed its deadline" in w.output()]
    assert len(firing) >= 1


def test_a_producer_slower_than_the_deadline_between_arm_and_enqueue_keeps_it(
    proj: Any, worker: Any, store: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery_echomq.send import start

    # The producer stalls after arming the deadline and before the flow lands (a paused
    # process, a slow network): the worker's poller meets the entry due with no row yet.
    enqueue = start._enqueue_levels

    def stalled(*args: Any, **kwargs: Any) -> Any:
        time.sleep(1.5)
        return enqueue(*args, **kwargs)

    monkeypatch.setattr(start, "_enqueue_levels", stalled)
    gate = f"gate:{tag()}"
    res = flow(proj.tsum.s(), [proj.gated.s(1, gate)], deadline=0.5).apply_async()
    with pytest.raises(FlowDeadlineExceeded):
        res.get(timeout=30)
    assert row(store, res.id)["failed_by"] == "deadline"
    store.set(gate, 1)


def test_a_deadline_holds_across_a_worker_killed_and_one_started_later(
    proj: Any, start_worker: Any, store: redis.Redis, own_queue: Any
) -> None:
    queue = own_queue("dl-restart")
    gate = f"gate:{tag()}"
    first = start_worker(queues=queue, concurrency=1, name="dl-first")
    res = flow(proj.tsum.s(), [proj.gated.s(1, gate)], deadline=2).apply_async(queue=queue)
    wait_for(lambda: row(store, res.id, queue).get("state") == "awaiting_children")
    first.kill()  # SIGKILL: no worker runs while the deadline passes
    time.sleep(2.5)
    assert row(store, res.id, queue)["state"] == "awaiting_children"
    start_worker(queues=queue, concurrency=1, name="dl-second")
    with pytest.raises(FlowDeadlineExceeded):
        res.get(timeout=30)
    assert row(store, res.id, queue)["failed_by"] == "deadline"
    store.set(gate, 1)


def test_recover_fires_a_due_deadline_without_any_worker(
    proj: Any, store: redis.Redis, own_queue: Any
) -> None:
    from celery_echomq.worker.recovery import run_pass

    queue = own_queue("dl-recover")
    res = flow(proj.tsum.s(), [proj.add.s(1, 1)], deadline=0.3).apply_async(queue=queue)
    time.sleep(0.5)
    lines = run_pass(get_state(proj.app), queues=[queue])
    fired = any(f"flow {res.id} passed its deadline" in line for line in lines)
    # In the fast tier, the in-process worker's own recovery pass may fire it a moment first:
    # the store's row says so either way, and it fired once.
    assert fired or store.hget(KEYS.job_key(queue, res.id), "state") == b"failed"
    with pytest.raises(FlowDeadlineExceeded):
        res.get(timeout=10)
    assert run_pass(get_state(proj.app), queues=[queue]) == []


def test_failed_children_marks_the_cut_ones_deadline_eagerly_and_on_a_worker(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    gate = f"gate:{tag()}"
    kids = _blocked(proj, gate)
    f = flow(proj.tsum.s(), kids, deadline=1)
    f.freeze()
    res = f.apply_async()
    with pytest.raises(FlowDeadlineExceeded):
        res.get(timeout=30)
    ids = [k.options["task_id"] for k in kids]
    cut = f"FlowDeadlineExceeded: flow {res.id} passed its deadline before this child started"
    assert res.failed_children() == {ids[2]: cut, ids[3]: cut}
    store.set(gate, 1)
    g = flow(proj.tsum.s(), [proj.sleep_then.s(1, 0.6), proj.add.s(2, 2)], deadline=0.3)
    g.freeze()
    eager = g.apply()
    (cut_id,) = eager.failed_children()
    assert eager.failed_children()[cut_id] == cut.replace(res.id, eager.id)


def test_children_on_another_queue_are_cut_on_their_own_slot(
    proj: Any, worker: Any, store: redis.Redis, own_queue: Any
) -> None:
    other = own_queue("dl-other")  # no worker consumes it: its child never starts
    gate = f"gate:{tag()}"
    far = proj.add.s(7, 7).set(queue=other)
    f = flow(proj.tsum.s(), [proj.gated.s(1, gate), far], deadline=1)
    f.freeze()
    res = f.apply_async()
    with pytest.raises(FlowDeadlineExceeded) as info:
        res.get(timeout=30)
    far_id = far.options["task_id"]
    assert far_id in info.value.outstanding
    wait_for(lambda: row(store, far_id, other).get("cut") == "deadline", timeout=10)
    assert row(store, far_id, other)["state"] == "cancelled"
    assert store.zscore(KEYS.queue_key(other, "pending"), far_id) is None
    assert res.failed_children()[far_id].startswith("FlowDeadlineExceeded: ")
    store.set(gate, 1)
    # Cut on its own slot, counted on its parent's: once the running child is done, the
    # counts add up with none outstanding.
    wait_for(lambda: res.dependencies().outstanding == 0, timeout=30)
    deps = res.dependencies()
    assert deps == (0, 1, 0, 0) and deps.cut == 1


def test_a_deadline_cuts_a_chain_childs_step_not_started_and_a_retry_runs_the_chain(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    from celery import chain
    from celery.bin.celery import celery as celery_main
    from click.testing import CliRunner

    t, gate = tag(), f"gate:{tag()}"
    # The two gated children hold both pool slots: the chain's first step waits in the queue.
    steps = chain(proj.add.s(10, 1), proj.add.s(10), proj.add.s(100))
    f = flow(proj.collect.s(tag=t), [*_blocked(proj, gate, n_waiting=0), steps], deadline=1)
    f.freeze()
    first, second, last = (str(s.options["task_id"]) for s in steps.tasks)
    res = f.apply_async()
    with pytest.raises(FlowDeadlineExceeded) as info:
        res.get(timeout=30)
    assert first in info.value.outstanding
    assert row(store, first)["state"] == "cancelled" and row(store, first)["cut"] == "deadline"
    assert row(store, second)["state"] == "waiting" and row(store, last)["state"] == "waiting"
    store.set(gate, 1)
    wait_for(lambda: sorted(res.children_values().values()) == [1, 2])
    out = CliRunner().invoke(
        celery_main, ["-A", "tests.proj", "echomq", "retry", res.id, "--deadline", "30"]
    )
    assert out.exit_code == 0, out.output
    # The cut step runs now, then the steps after it: the chain's value is its last step's.
    fresh = type(res)(res.id, app=proj.app)
    assert fresh.get(timeout=30) == {"values": [1, 2, 121], "tag": t}
    assert [row(store, s)["attempts"] for s in (first, second, last)] == ["1", "1", "1"]


@pytest.mark.timeout(300)
def test_the_deadline_of_a_flow_of_2500_children_cuts_them_a_chunk_per_script_call(
    proj: Any, store: redis.Redis, own_queue: Any, start_worker: Any
) -> None:
    from celery_echomq.store.deadlines import CUT_CHUNK
    from celery_echomq.worker.recovery import run_pass

    n, t = 2500, tag()
    queue = own_queue("dl-big")
    res = flow(proj.tsum.s(), [proj.counted.s(i, t) for i in range(n)], deadline=1).apply_async(
        queue=queue
    )
    ids = [
        str(c)
        for c in get_state(proj.app).loads(store.hget(KEYS.job_key(queue, res.id), "payload"))[
            "children"
        ]
    ]
    assert len(ids) == n
    before = store.config_get("slowlog-*")
    store.config_set("slowlog-log-slower-than", 0)
    store.config_set("slowlog-max-len", 100_000)
    time.sleep(1.2)
    store.slowlog_reset()
    try:
        lines = run_pass(get_state(proj.app), queues=[queue])  # no worker yet: all pending
        sizes = script_args(store)
    finally:
        for name, value in before.items():
            store.config_set(name, value)
    assert any(f"flow {res.id} passed its deadline" in line for line in lines), lines
    assert any(f"{n} children outstanding, {n} cut" in line for line in lines), lines
    # A chunk (a key and an id a child) per script call at most, three or more of them; one
    # call for the whole flow would take 2,500 keys and as many ids.
    assert len([s for s in sizes if s > CUT_CHUNK]) >= 3 and max(sizes) <= 2 * CUT_CHUNK + 20
    with pytest.raises(FlowDeadlineExceeded) as raised:
        res.get(timeout=30)
    assert f"passed its deadline with {n} children outstanding" in str(raised.value)
    assert raised.value.count == n
    assert tuple(raised.value.outstanding[:10]) == tuple(ids[:10])  # in the children's order
    pipe = store.pipeline(transaction=False)
    for cid in ids:
        pipe.hmget(KEYS.job_key(queue, cid), "state", "cut")
    assert {tuple(r) for r in pipe.execute()} == {(b"cancelled", b"deadline")}
    deps = res.dependencies()  # the script's chunk and deadline_cut's each counted as cut
    assert deps == (0, 0, 0, 0) and deps.cut == n
    # A worker started now runs none of them (revoked, and cancelled in the store), and a
    # plain task behind their messages shows it went through every one.
    start_worker(queues=queue, concurrency=2)
    assert proj.add.s(1, 2).apply_async(queue=queue).get(timeout=120) == 3
    assert ran(store, f"counted:{t}") == 0
    assert row(store, res.id, queue)["deadline_outstanding"] == str(n)
