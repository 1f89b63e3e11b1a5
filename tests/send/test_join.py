"""``apply_async(on_exists="join")``: a flow whose ids name jobs in the store joins them.

Re-adding a flow returns the flow that exists, and nothing runs twice; a new parent whose
child id names a job waits for that job (a job shared by several parents: a DAG); a joined id
that names another task, or other arguments, is refused before anything is written. Each case
runs on a real worker and eagerly.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest
import redis

from celery_echomq import (
    DuplicateIdError,
    FlowCancelled,
    FlowDeadlineExceeded,
    FlowExistsError,
    FlowFailed,
    OnExistsError,
    flow,
    get_state,
)
from celery_echomq.send.ids import CycleError
from celery_echomq.store.replies import Status
from celery_echomq.store.scripts import ParentRef
from tests.helpers import echomq, run, wait_for

TIMEOUT = 60


def runs(store: redis.Redis, tag: str) -> int:
    """How many times ``counted(..., tag)`` ran."""
    return int(store.get(f"test:ran:counted:{tag}") or 0)


def flow_keys(store: redis.Redis, *ids: str) -> dict[bytes, Any]:
    """The store's keys that name any of ``ids`` (rows, flow keys, locators, edges), each with
    its content: what a refused flow could have written. (The session's worker moves the
    queue's own sets meanwhile: those are not looked at.)"""
    found = {k for i in ids for k in store.scan_iter(match=f"emq:*{i}*", count=1000)}
    return {k: store.dump(k) for k in sorted(found)}


def finished(proj: Any, store: redis.Redis, res: Any, how: str) -> None:
    """Wait until the worker recorded ``res``'s parent done (its value reaches the caller a
    moment before its completion's script runs): the rows are still after that."""
    if how == "apply_async":
        key = get_state(proj.app).keys.job_key("celery", res.id)
        wait_for(lambda: store.hget(key, "state") == b"done", TIMEOUT)


def tag() -> str:
    return uuid.uuid4().hex


# --- on_exists: its values ---------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["skip", "", None, True, "JOIN"])
def test_an_on_exists_other_than_raise_or_join_is_refused_before_any_write(
    proj: Any, how: str, store: redis.Redis, bad: Any
) -> None:
    t = tag()
    child = proj.counted.s(1, t)
    sig = flow(proj.tsum.s(), [child])
    ids = (sig.freeze().id, child.options["task_id"])
    with pytest.raises(OnExistsError, match=r"allowed values are 'raise'.*and 'join'"):
        run(sig, how, on_exists=bad)
    assert runs(store, t) == 0
    assert flow_keys(store, *ids) == {}


def test_re_adding_a_flow_raises_by_default(proj: Any, worker: Any) -> None:
    sig = flow(proj.tsum.s(), [proj.add.s(1, 2)])
    sig.freeze()
    assert sig.apply_async().get(timeout=TIMEOUT) == 3
    with pytest.raises(FlowExistsError, match="already exists"):
        sig.apply_async()
    with pytest.raises(FlowExistsError, match="already exists"):
        sig.apply_async(on_exists="raise")


# --- re-adding the same flow ------------------------------------------------------------------


def test_re_adding_the_same_flow_returns_it_and_runs_nothing_twice(
    proj: Any, how: str, store: redis.Redis
) -> None:
    t = tag()
    sig = flow(proj.tsum.s(), [proj.counted.s(1, t), proj.counted.s(2, t)])
    first = sig.freeze()
    res = run(sig, how, on_exists="join")
    assert res.id == first.id
    assert res.get(timeout=TIMEOUT) == 3
    again = run(sig, how, on_exists="join")
    assert again.id == res.id
    assert again.get(timeout=TIMEOUT) == 3
    assert again.children_values() == res.children_values()
    assert runs(store, t) == 2  # each child once


def test_re_adding_a_flow_still_held_returns_it_and_its_children_run_once(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    t, gate = tag(), f"test:gate:{tag()}"
    sig = flow(proj.tsum.s(), [proj.counted.s(1, t), proj.gated.s(5, gate)])
    sig.freeze()
    res = sig.apply_async(on_exists="join")
    wait_for(lambda: runs(store, t) == 1, TIMEOUT)
    again = sig.apply_async(on_exists="join")
    assert again.id == res.id and again.dependencies().outstanding == 1
    store.set(gate, 1)
    assert again.get(timeout=TIMEOUT) == 6
    assert runs(store, t) == 1


def test_a_joined_parent_of_other_arguments_or_children_is_refused_naming_both(
    proj: Any, how: str, store: redis.Redis
) -> None:
    t = tag()
    sig = flow(proj.collect.s("a"), [proj.counted.s(1, t)])
    parent_id = sig.freeze().id
    res = run(sig, how, on_exists="join")
    assert res.get(timeout=TIMEOUT)["values"] == [1]
    finished(proj, store, res, how)
    other_child = proj.counted.s(1, t)
    other = flow(proj.collect.s("b").set(task_id=parent_id), [other_child])
    ids = (parent_id, *(c.options["task_id"] for c in sig.children), other_child.freeze().id)
    before = flow_keys(store, *ids)
    with pytest.raises(FlowExistsError) as info:
        run(other, how, on_exists="join")
    message = str(info.value)
    assert parent_id in message
    assert "tests.proj.collect('a')" in message and "tests.proj.collect('b')" in message
    if how == "apply_async":
        more = flow(proj.collect.s("a").set(task_id=parent_id), [proj.counted.s(2, t)])
        with pytest.raises(FlowExistsError, match="with children"):
            more.apply_async(on_exists="join")
    assert runs(store, t) == 1
    assert flow_keys(store, *ids) == before


# --- a new parent joined to a job that exists (a DAG) -----------------------------------------


def test_a_new_parent_joined_to_a_done_job_is_credited_with_its_value_at_once(
    proj: Any, how: str, store: redis.Redis
) -> None:
    t = tag()
    shared = proj.counted.s(5, t)
    shared_id = shared.freeze().id
    first = run(flow(proj.tsum.s(), [shared, proj.add.s(1, 1)]), how, on_exists="join")
    assert first.get(timeout=TIMEOUT) == 7
    again = proj.counted.s(5, t).set(task_id=shared_id)
    second = run(flow(proj.tsum.s(), [again, proj.add.s(10, 10)]), how, on_exists="join")
    assert second.get(timeout=TIMEOUT) == 25
    assert second.children_values()[shared_id] == 5
    assert second.dependencies() == (0, 2, 0, 0)
    assert runs(store, t) == 1  # the shared job ran once, for both parents
    if how == "apply_async":
        # The job's first parent stays its row's; the second is its edge.
        state = get_state(proj.app)
        queue = second.queue or "celery"
        edges = store.hgetall(state.keys.parents_key(queue, shared_id))
        assert list(edges) == [second.id.encode()]


def test_a_parent_of_only_joined_done_jobs_is_released_at_once(
    proj: Any, how: str, store: redis.Redis
) -> None:
    t = tag()
    a, b = proj.counted.s(1, t), proj.counted.s(2, t)
    ids = [a.freeze().id, b.freeze().id]
    assert run(flow(proj.tsum.s(), [a, b]), how, on_exists="join").get(timeout=TIMEOUT) == 3
    kids = [proj.counted.s(x, t).set(task_id=i) for x, i in zip((1, 2), ids, strict=True)]
    res = run(flow(proj.collect.s("again"), kids), how, on_exists="join")
    assert res.get(timeout=TIMEOUT)["values"] == [1, 2]
    assert runs(store, t) == 2


@pytest.mark.parametrize("policy", ["ignore", "fail"])
def test_a_joined_failed_job_is_settled_under_the_new_parents_policy(
    proj: Any, how: str, store: redis.Redis, policy: str
) -> None:
    bad = proj.boom.s("shared failure")
    bad_id = bad.freeze().id
    first = run(flow(proj.tsum.s(), [bad, proj.add.s(1, 1)], policy="ignore"), how)
    assert first.get(timeout=TIMEOUT) == 2
    again = proj.boom.s("shared failure").set(task_id=bad_id)
    res = run(flow(proj.tsum.s(), [again, proj.add.s(3, 3)], policy=policy), how, on_exists="join")
    if policy == "ignore":
        assert res.get(timeout=TIMEOUT) == 6
        assert "shared failure" in res.failed_children()[bad_id]
    else:
        with pytest.raises(FlowFailed) as info:
            res.get(timeout=TIMEOUT, propagate=True)
        assert info.value.child_id == bad_id


def test_a_joined_id_whose_arguments_differ_is_refused_naming_both_before_any_write(
    proj: Any, how: str, store: redis.Redis
) -> None:
    t = tag()
    shared = proj.counted.s(5, t)
    shared_id = shared.freeze().id
    first = run(flow(proj.tsum.s(), [shared]), how)
    first.get(timeout=TIMEOUT)
    finished(proj, store, first, how)
    other = proj.counted.s(6, t).set(task_id=shared_id)
    new = proj.add.s(1, 1)
    refused = flow(proj.tsum.s(), [other, new])
    ids = (shared_id, refused.freeze().id, new.options["task_id"])
    before = flow_keys(store, *ids)
    with pytest.raises(FlowExistsError) as info:
        run(refused, how, on_exists="join")
    message = str(info.value)
    assert shared_id in message
    assert f"tests.proj.counted(5, {t!r})" in message
    assert f"tests.proj.counted(6, {t!r})" in message
    assert runs(store, t) == 1
    assert flow_keys(store, *ids) == before


def test_a_new_parent_joined_to_a_running_job_is_credited_when_it_completes(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    gate = f"test:gate:{tag()}"
    held = proj.gated.s(7, gate)
    held_id = held.freeze().id
    first = flow(proj.tsum.s(), [held, proj.add.s(1, 1)]).apply_async()
    wait_for(lambda: store.exists(f"test:started:{held_id}") or first.dependencies().done == 1)
    again = proj.gated.s(7, gate).set(task_id=held_id)
    second = flow(proj.collect.s("second"), [proj.add.s(2, 2), again]).apply_async(on_exists="join")
    third = flow(proj.tsum.s(), [again.clone()]).apply_async(on_exists="join")
    # The new parents wait for the running job, as for any child of their own.
    wait_for(lambda: second.dependencies() == (1, 1, 0, 0), TIMEOUT)
    assert third.dependencies() == (1, 0, 0, 0)
    store.set(gate, 1)
    assert first.get(timeout=TIMEOUT) == 9
    assert second.get(timeout=TIMEOUT)["values"] == [4, 7]
    assert third.get(timeout=TIMEOUT) == 7
    assert third.dependencies() == (0, 1, 0, 0)
    # Nothing left staged for recovery: every parent was credited by the completion's worker.
    queue = "celery"
    wait_for(lambda: not store.zscore(get_state(proj.app).keys.queue_key(queue, "joined"), held_id))


def test_a_joined_job_that_fails_later_is_settled_under_each_parents_policy(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    gate = f"test:gate:{tag()}"
    bad = proj.gated_boom.s(gate, "late failure")
    bad_id = bad.freeze().id
    first = flow(proj.tsum.s(), [bad, proj.add.s(1, 1)], policy="ignore").apply_async()
    again = proj.gated_boom.s(gate, "late failure").set(task_id=bad_id)
    failing = flow(proj.tsum.s(), [again]).apply_async(on_exists="join")
    ignoring = flow(proj.tsum.s(), [again.clone(), proj.add.s(5, 5)], policy="ignore")
    ignoring_res = ignoring.apply_async(on_exists="join")
    store.set(gate, 1)
    assert first.get(timeout=TIMEOUT) == 2
    assert ignoring_res.get(timeout=TIMEOUT) == 10
    assert "late failure" in ignoring_res.failed_children()[bad_id]
    with pytest.raises(FlowFailed) as info:
        failing.get(timeout=TIMEOUT)
    assert info.value.child_id == bad_id


def test_cancelling_one_parent_leaves_a_shared_job_another_parent_waits_for(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    gate = f"test:gate:{tag()}"
    shared = proj.gated.s(3, gate)
    sid = shared.freeze().id
    first = flow(proj.tsum.s(), [shared, proj.add.s(0, 0)]).apply_async()
    again = proj.gated.s(3, gate).set(task_id=sid)
    second = flow(proj.tsum.s(), [again, proj.add.s(1, 0)]).apply_async(on_exists="join")
    first.revoke()  # the first parent (the one the job's row names) is cancelled
    keys = get_state(proj.app).keys
    assert store.hget(keys.job_key("celery", first.id), "state") == b"cancelled"
    # The shared job is left to run: the second parent still waits for it.
    assert store.hget(keys.job_key("celery", sid), "state") in (b"pending", b"active")
    store.set(gate, 1)
    assert second.get(timeout=TIMEOUT) == 4
    assert store.hget(keys.job_key("celery", sid), "state") == b"done"


def test_cancelling_the_last_parent_that_waits_cancels_the_shared_job(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    gate = f"test:gate:{tag()}"
    shared = proj.gated.s(3, gate)
    sid = shared.freeze().id
    first = flow(proj.tsum.s(), [shared]).apply_async()
    again = proj.gated.s(3, gate).set(task_id=sid)
    second = flow(proj.tsum.s(), [again]).apply_async(on_exists="join")
    keys = get_state(proj.app).keys
    second.revoke()  # the joined parent first: the first one still waits
    assert store.hget(keys.job_key("celery", sid), "state") in (b"pending", b"active")
    first.revoke()  # the last parent that waited
    assert store.hget(keys.job_key("celery", sid), "state") == b"cancelled"
    store.set(gate, 1)
    with pytest.raises(FlowCancelled):
        first.get(timeout=TIMEOUT)
    with pytest.raises(FlowCancelled):
        second.get(timeout=TIMEOUT)


def test_release_of_one_parent_leaves_the_shared_job_to_the_other(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    from celery_echomq import release_flow

    gate = f"test:gate:{tag()}"
    shared = proj.gated.s(3, gate)
    sid = shared.freeze().id
    first = flow(proj.tsum.s(), [shared]).apply_async()
    again = proj.gated.s(3, gate).set(task_id=sid)
    second = flow(proj.collect.s("now"), [again, proj.add.s(1, 1)]).apply_async(on_exists="join")
    wait_for(lambda: second.dependencies().done == 1, TIMEOUT)
    release_flow(get_state(proj.app), second.id)  # runs now, with what it has
    assert second.get(timeout=TIMEOUT)["values"] == [2]
    store.set(gate, 1)
    assert first.get(timeout=TIMEOUT) == 3
    assert second.children_values()[sid] == 3  # its later value is still recorded


def test_a_joined_job_whose_worker_died_after_completing_it_is_credited_by_recovery_once(
    proj: Any, store: redis.Redis, own_queue: Any
) -> None:
    """The worker that completed a shared job died before crediting its other parents (the
    completion as its script left it, then nothing): recovery credits them, once."""
    from celery_echomq.worker.recovery import run_pass
    from celery_echomq.worker.recovery.sweep import anything_due

    queue = own_queue("join-rec")  # no worker consumes it: the test is the worker
    state = get_state(proj.app)
    shared = proj.add.s(2, 3).set(queue=queue)
    sid = shared.freeze().id
    first = flow(proj.tsum.s(), [shared]).apply_async(queue=queue)
    again = proj.add.s(2, 3).set(task_id=sid, queue=queue)
    second = flow(proj.tsum.s(), [again]).apply_async(queue=queue, on_exists="join")
    # The first parent's completion, as the dead worker's script did it.

    state.scripts.claim(queue, sid, "t-dead", 60_000)
    status, _, _, shared_flag = state.scripts.complete_settling(
        queue,
        sid,
        "t-dead",
        ttl=600,
        is_parent=False,
        parent=ParentRef(first.id, queue),
        value=b"5",
    )
    assert status is Status.RELEASED and shared_flag
    index = state.keys.queue_key(queue, "joined")
    assert store.zscore(index, sid) is not None
    assert second.dependencies().outstanding == 1  # the second parent still waits
    store.zadd(index, {sid: 0})  # staged a stall timeout ago
    # A worker's recovery loop runs a pass only when something is due: the staged job is.
    assert anything_due(state, [queue])
    lines = run_pass(state, queues=[queue])
    assert any(f"credited the other parents of joined {sid}" in line for line in lines), lines
    assert second.dependencies() == (0, 1, 0, 0)
    assert store.zscore(index, sid) is None
    # A second credit of the same edge (a repeated pass, a redelivery) changes nothing.
    again_status, _ = state.scripts.credit(
        ParentRef(second.id, queue), sid, Status.DONE, b"5", "", ttl=600
    )
    assert again_status is Status.DUPLICATE
    assert second.dependencies() == (0, 1, 0, 0)
    assert store.hget(state.keys.job_key(queue, second.id), "state") in (b"pending", b"active")


# --- a DAG drawn: show and the dashboard --------------------------------------------------------


def dag(proj: Any) -> tuple[Any, Any, str, str, str]:
    """Five jobs: ``p1`` over ``[s, x]`` and ``p2`` over ``[s, y]``, ``s`` shared (joined)."""
    t = tag()
    s = proj.counted.s(4, t)
    sid = s.freeze().id
    x, y = proj.add.s(1, 1), proj.add.s(2, 3)
    xid, yid = x.freeze().id, y.freeze().id
    p1 = flow(proj.tsum.s(), [s, x]).apply_async(on_exists="join")
    assert p1.get(timeout=TIMEOUT) == 6
    again = proj.counted.s(4, t).set(task_id=sid)
    p2 = flow(proj.tsum.s(), [again, y]).apply_async(on_exists="join")
    assert p2.get(timeout=TIMEOUT) == 9
    return p1, p2, sid, xid, yid


def test_show_draws_a_shared_job_under_each_parent_marked_shared(proj: Any, worker: Any) -> None:

    p1, p2, sid, x, y = dag(proj)
    for res, own in ((p1, x), (p2, y)):
        out = echomq("show", res.id)
        assert out.exit_code == 0, out.output
        print(f"$ celery echomq show {res.id}\n{out.output}")  # what a user reads (-s)
        lines = out.output.splitlines()
        shared = [line for line in lines if sid in line]
        assert len(shared) == 1 and "[shared by 2 parents]" in shared[0], out.output
        assert "value=4" in shared[0]
        mine = [line for line in lines if own in line]
        assert len(mine) == 1 and "shared" not in mine[0]


def test_the_dashboard_draws_a_shared_job_under_each_parent(
    proj: Any, worker: Any, serve: Any, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    p1, p2, sid, _, _ = dag(proj)
    site = serve()
    for name, res in (("p1", p1), ("p2", p2)):
        browser.get(f"{site.url}/flows/{res.id}")
        wait_for(lambda: browser.find_elements(By.ID, f"job-{sid}"), timeout=30)
        line = browser.find_element(By.ID, f"job-{sid}")
        assert "shared by 2 parents" in line.find_element(By.CLASS_NAME, "shared").text
        # ECHOMQ_JOIN_SCREENSHOT=<dir>: each parent's page saved there, as a user sees it.
        where = os.environ.get("ECHOMQ_JOIN_SCREENSHOT")
        if where:
            browser.set_window_size(1500, 560)
            try:
                assert browser.save_screenshot(os.path.join(where, f"join-dag-{name}.png"))
            finally:
                browser.set_window_size(1280, 720)


# --- one job in several flows of one canvas ---------------------------------------------------


def test_a_shared_job_delivered_twice_is_credited_once_to_each_parent(
    proj: Any, store: redis.Redis, own_queue: Any
) -> None:
    """A second completion of the same job (a redelivery, a stale token) stages nothing: each
    parent counts it once."""
    from celery_echomq.worker.settle import settle_success

    queue = own_queue("join-dup")  # no worker consumes it: the test is the worker
    state = get_state(proj.app)
    shared = proj.add.s(1, 2).set(queue=queue)
    sid = shared.freeze().id
    first = flow(proj.tsum.s(), [shared, proj.add.s(0, 0).set(queue=queue)]).apply_async(
        queue=queue
    )
    again = proj.add.s(1, 2).set(task_id=sid, queue=queue)
    second = flow(proj.tsum.s(), [again, proj.add.s(5, 5).set(queue=queue)]).apply_async(
        queue=queue, on_exists="join"
    )
    state.scripts.claim(queue, sid, "t-1", 60_000)
    ref = ParentRef(first.id, queue)
    assert settle_success(state, queue, sid, "t-1", False, ref, b"3") is Status.CREDITED
    for token in ("t-1", "t-2"):  # the same delivery again, and a stale one
        assert settle_success(state, queue, sid, token, False, ref, b"3") in (
            Status.DONE,
            Status.STALE,
        )
    assert first.dependencies() == (1, 1, 0, 0)
    assert second.dependencies() == (1, 1, 0, 0)
    assert store.zscore(state.keys.queue_key(queue, "joined"), sid) is None


def test_one_signature_in_two_flows_of_one_canvas_is_one_job_credited_to_each(
    proj: Any, how: str, store: redis.Redis
) -> None:
    t = tag()
    s = proj.counted.s(3, t)
    sid = s.freeze().id
    left = flow(proj.tsum.s(), [s, proj.add.s(1, 0)])
    right = flow(proj.tsum.s(), [s, proj.add.s(10, 0)])
    ids = left.freeze().id, right.freeze().id
    res = run(flow(proj.tsum.s(), [left, right]), how, on_exists="join")
    assert res.get(timeout=TIMEOUT) == (3 + 1) + (3 + 10)
    assert runs(store, t) == 1  # one job, credited to each of its two parents
    assert res.children_values() == {ids[0]: 4, ids[1]: 13}
    if how == "apply_async":
        keys = get_state(proj.app).keys
        # The left flow wrote it (its row's parent), the right one joined it (its edge).
        assert store.hget(keys.job_key("celery", sid), "parent") == ids[0].encode()
        assert list(store.hgetall(keys.parents_key("celery", sid))) == [ids[1].encode()]


def test_a_shared_job_that_fails_is_settled_under_each_parents_own_policy(
    proj: Any, how: str
) -> None:
    bad = proj.boom.s("shared")
    bad.freeze()
    lenient = flow(proj.tsum.s(), [bad, proj.add.s(2, 0)], policy="ignore")
    strict = flow(proj.tsum.s(), [bad, proj.add.s(5, 0)])
    strict.freeze()
    top = flow(proj.collect.s("top"), [lenient, strict], policy="ignore")
    res = run(top, how, on_exists="join")
    out = res.get(timeout=TIMEOUT)
    assert out["values"] == [2]  # the lenient parent ran; the strict one failed
    assert strict.options["task_id"] in res.failed_children()


def test_a_group_of_two_flows_sharing_a_job_runs_it_once(
    proj: Any, how: str, store: redis.Redis
) -> None:
    from celery import group

    t = tag()
    s = proj.counted.s(2, t)
    s.freeze()
    both = group(flow(proj.tsum.s(), [s]), flow(proj.tsum.s(), [s, proj.add.s(1, 1)]))
    res = run(flow(proj.tsum.s(), [both]), how, on_exists="join")
    assert res.get(timeout=TIMEOUT) == 2 + 4
    assert runs(store, t) == 1


def test_cycles_and_shared_flows_are_refused_before_any_write(
    proj: Any, how: str, store: redis.Redis
) -> None:
    inner_parent = proj.tsum.s()
    inner = flow(inner_parent, [proj.add.s(1, 1)])
    inner_id = inner.freeze().id
    looped = flow(proj.tsum.s(), [inner, proj.add.s(0, 0)])
    # The inner flow's parent listed again under itself, as a task: a cycle.
    inner.children.append(proj.tsum.s().set(task_id=inner_id))
    with pytest.raises(CycleError, match="cycle"):
        run(looped, how, on_exists="join")
    twice = flow(proj.tsum.s(), [flow(proj.tsum.s(), [inner]), inner])
    with pytest.raises(DuplicateIdError, match="only a task can be shared"):
        run(twice, how, on_exists="join")
    assert flow_keys(store, inner_id) == {}


def test_parents_on_other_queues_than_the_shared_job_are_credited_across_slots(
    proj: Any, worker: Any, start_worker: Any, store: redis.Redis, own_queue: Any
) -> None:
    gate = f"test:gate:{tag()}"
    there = own_queue("join-x")
    start_worker(queues=there, concurrency=2)
    shared = proj.gated.s(6, gate).set(queue=there)
    sid = shared.freeze().id
    first = flow(proj.tsum.s(), [shared]).apply_async()  # its parent on celery
    again = proj.gated.s(6, gate).set(task_id=sid, queue=there)
    second = flow(proj.tsum.s(), [again, proj.add.s(1, 1)]).apply_async(
        queue=there, on_exists="join"
    )
    nested = flow(proj.tsum.s(), [flow(proj.tsum.s(), [again.clone()])])
    third = nested.apply_async(on_exists="join")  # joined by a nested flow, on celery
    store.set(gate, 1)
    assert first.get(timeout=TIMEOUT) == 6
    assert second.get(timeout=TIMEOUT) == 8
    assert third.get(timeout=TIMEOUT) == 6


def test_a_deadline_of_one_parent_leaves_the_shared_job_to_the_other(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    gate = f"test:gate:{tag()}"
    blocker = proj.gated.s(0, gate)
    shared = proj.add.s(2, 2).set(countdown=2)  # still pending when the deadline passes
    sid = shared.freeze().id
    hurried = flow(proj.tsum.s(), [shared, blocker], deadline=0.5).apply_async()
    again = proj.add.s(2, 2).set(task_id=sid)
    patient = flow(proj.tsum.s(), [again]).apply_async(on_exists="join")
    with pytest.raises(FlowDeadlineExceeded):
        hurried.get(timeout=TIMEOUT)
    assert patient.get(timeout=TIMEOUT) == 4  # the shared job was not cut
    store.set(gate, 1)


def test_retry_of_a_parent_failed_by_a_shared_job_runs_it_again_for_that_parent(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    flag = f"test:flag:{tag()}"
    shaky = proj.flaky.s(9, flag)
    sid = shaky.freeze().id
    lenient = flow(proj.tsum.s(), [shaky, proj.add.s(1, 0)], policy="ignore").apply_async()
    assert lenient.get(timeout=TIMEOUT) == 1
    again = proj.flaky.s(9, flag).set(task_id=sid)
    strict = flow(proj.tsum.s(), [again]).apply_async(on_exists="join")
    with pytest.raises(FlowFailed):
        strict.get(timeout=TIMEOUT)
    store.set(flag, 1)
    from celery_echomq import retry_flow

    outcome = retry_flow(get_state(proj.app), strict.id)
    assert outcome.republished == (sid,)
    assert strict.get(timeout=TIMEOUT) == 9
    assert strict.children_values() == {sid: 9}
    assert lenient.get(timeout=TIMEOUT) == 1  # the first parent's outcome stays
