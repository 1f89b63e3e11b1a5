"""Linked chains: a chain of tasks among a flow's children, its steps plain job rows run in
order (send/shape.py ``linked``, includes/chain_step.lua, complete.lua's ``advanced``), on
a real worker and eagerly, of any length."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import redis
from celery import chain

from celery_echomq import FlowCancelled, FlowFailed, flow
from celery_echomq.store.keyspace import new_job_id as job_id
from tests.helpers import KEYS, counters, echomq, fast_recovery, logged, quiet, skipped, wait_for

TIMEOUT = 60


def run(sig: Any, how: str) -> Any:
    return sig.apply() if how == "eager" else sig.apply_async()


@pytest.fixture(params=["eager", "worker"])
def how(request: pytest.FixtureRequest) -> str:
    if request.param == "worker":
        request.getfixturevalue("worker")
    return str(request.param)


def counting(proj: Any, steps: int) -> Any:
    """add(0, 1) then ``steps - 1`` times add(1): its value is ``steps``."""
    return chain(proj.add.s(0, 1), *(proj.add.s(1) for _ in range(steps - 1)))


def test_a_chain_child_gives_its_last_value(proj: Any, how: str) -> None:
    sig = flow(proj.tsum.s(), [counting(proj, 3), proj.add.s(10, 0)])
    assert run(sig, how).get(timeout=TIMEOUT) == 13


@pytest.mark.parametrize("steps", [42, 1000])
def test_a_chain_child_of_any_length_runs(proj: Any, how: str, steps: int) -> None:
    started = time.monotonic()
    res = run(flow(proj.tsum.s(), [counting(proj, steps), proj.add.s(1, 1)]), how)
    assert res.get(timeout=300) == steps + 2
    print(f"{steps}-step chain child ({how}): {time.monotonic() - started:.2f}s")


def test_a_failed_step_fails_the_flow_naming_it(proj: Any, how: str) -> None:
    bad = proj.fail.s().set(task_id=job_id())
    sig = flow(proj.tsum.s(), [chain(proj.add.s(1, 1), bad, proj.add.s(1))])
    with pytest.raises(FlowFailed, match="Task expected to fail") as caught:
        run(sig, how).get(timeout=TIMEOUT)
    assert caught.value.child_id == bad.options["task_id"]


@pytest.mark.parametrize("policy", ["ignore", "remove"])
def test_a_failed_step_counts_the_chain_once_under_its_policy(
    proj: Any, how: str, policy: str
) -> None:
    bad = chain(proj.add.s(1, 1), proj.fail.s(), proj.add.s(1)).set(parent_policy=policy)
    res = run(flow(proj.tsum.s(), [bad, proj.add.s(2, 3)]), how)
    assert res.get(timeout=TIMEOUT) == 5
    assert res.dependencies().outstanding == 0
    assert len(res.failed_children()) == 1


# --- the guarantees, on a real worker -----------------------------------------------------


def row(store: redis.Redis, jid: str, field: str, queue: str = "celery") -> str | None:
    value = store.hget(KEYS.job_key(queue, jid), field)
    return value.decode() if value is not None else None


def frozen(proj: Any, steps: Any) -> tuple[Any, list[str]]:
    """flow(tsum, [steps]) with every id assigned, and the ids of the chain's steps."""
    sig = flow(proj.tsum.s(), [steps])
    sig.freeze()
    return sig, [str(task.options["task_id"]) for task in steps.tasks]


def test_a_redelivered_step_is_counted_once(
    proj: Any, store: redis.Redis, own_queue: Any, start_worker: Any
) -> None:
    queue = own_queue("chain")
    w = start_worker(queues=queue)
    dup = job_id()
    steps = chain(proj.add.s(1, 1), proj.redeliver.s(countdown=1.0).set(task_id=dup), proj.add.s(1))
    sig, ids = frozen(proj, steps)
    res = sig.apply_async(queue=queue)
    # redeliver gets 2 and returns 21; the copy of its message it sends arrives once it
    # completed, and is skipped: the step after it runs once, with 21.
    assert res.get(timeout=TIMEOUT) == 22
    wait_for(lambda: skipped(w, dup, "done"), timeout=60)
    _, _, last = ids
    assert int(store.get(f"test:delivery:{dup}") or 0) == 1  # the copy's body did not run
    assert row(store, dup, "attempts", queue) == "1"
    assert row(store, last, "attempts", queue) == "1"
    assert counters(store, queue).get("duplicates_skipped") == 1
    assert res.dependencies() == (0, 1, 0, 0)
    assert res.children_values() == {last: 22}


def test_a_step_whose_message_was_never_published_is_recovered(
    proj: Any, store: redis.Redis, own_queue: Any, start_worker: Any
) -> None:
    queue = own_queue("chain")
    # Each pool process that completes a step SIGKILLs itself before publishing the next:
    # recovery finds that step pending with no message, and re-publishes it with its input.
    w = start_worker(queues=queue, extra_env=fast_recovery(ECHOMQ_T_DIE_AT="publish_step"))
    steps = chain(proj.add.s(1, 1), proj.add.s(10), proj.add.s(100))
    sig, ids = frozen(proj, steps)
    res = sig.apply_async(queue=queue)
    assert res.get(timeout=120) == 112
    logged(w, "killed itself at publish_step")
    first, second, third = ids
    logged(w, f"re-published {second}")
    logged(w, f"re-published {third}")
    for step in (first, second, third):
        assert row(store, step, "state", queue) == "done"
    assert row(store, third, "attempts", queue) == "1"


def test_cancel_reaches_the_running_step_and_those_waiting(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    gate = f"test:gate:{uuid.uuid4().hex}"
    steps = chain(proj.add.s(1, 1), proj.gated.s(gate), proj.add.s(1))
    sig, ids = frozen(proj, steps)
    first, running, waiting = ids
    res = sig.apply_async()
    wait_for(lambda: row(store, running, "state") == "active")
    assert row(store, waiting, "state") == "waiting"
    res.revoke()
    assert row(store, running, "state") == "cancelled"
    assert row(store, waiting, "state") == "cancelled"
    store.set(gate, 1)  # the running step finishes: its completion goes nowhere
    with pytest.raises(FlowCancelled):
        res.get(timeout=TIMEOUT)
    time.sleep(1.0)
    assert row(store, waiting, "state") == "cancelled"
    assert row(store, waiting, "attempts") == "0"
    assert row(store, first, "state") == "done"


def test_retry_runs_the_failed_step_again_with_its_input(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    flag = f"test:flag:{uuid.uuid4().hex}"
    steps = chain(proj.add.s(1, 1), proj.flaky.s(flag), proj.add.s(1))
    sig, ids = frozen(proj, steps)
    first, failing, last = ids
    res = sig.apply_async()
    with pytest.raises(FlowFailed) as caught:
        res.get(timeout=TIMEOUT)
    assert caught.value.child_id == failing
    assert row(store, last, "state") == "waiting"
    store.set(flag, 1)
    out = echomq("retry", res.id)
    assert out.exit_code == 0, out.output
    # flaky gets 2 again (the first step's value, kept on its row), then the last step runs.
    assert res.get(timeout=TIMEOUT) == 3
    assert store.get(f"test:ran:flaky:{flag}") == b"2"
    assert row(store, first, "attempts") == "1"
    assert res.children_values() == {last: 3}


@pytest.mark.parametrize("late", [0.0, 3.5], ids=["sibling-first", "sibling-after-the-ttl"])
def test_no_key_of_a_failed_chain_outlives_the_result_ttl(
    proj: Any, store: redis.Redis, own_queue: Any, start_worker: Any, late: float
) -> None:
    # The steps waiting behind the failed one never run: they expire with it, and with the
    # flow's own keys, within the result TTL (3 s here). A sibling still running when the
    # flow failed (here for longer than that TTL) is credited to a finished flow: what it
    # writes expires too, the flow's first value included, which makes its :processed anew.
    queue = own_queue("chain")
    start_worker(queues=queue, extra_env={"ECHOMQ_T_TTL": "3"})
    steps = chain(proj.add.s(1, 1), proj.fail.s(), proj.add.s(1), proj.add.s(1))
    sig, ids = frozen(proj, steps)
    other = proj.sleep_then.s(4, late).set(task_id=job_id())
    sig = flow(proj.tsum.s(), [steps, other])
    sig.freeze()
    res = sig.apply_async(queue=queue)
    with pytest.raises(FlowFailed):
        res.get(timeout=TIMEOUT)
    named = {res.id, *ids, other.options["task_id"]}

    def keys_left() -> list[str]:
        found = [k.decode() for k in store.scan_iter(match=f"emq:{{{queue}}}:*", count=1000)]
        return [k for k in found if any(jid in k for jid in named)]

    for waiting in ids[2:]:
        assert row(store, waiting, "state", queue) == "waiting"
        assert 0 < store.ttl(KEYS.job_key(queue, waiting)) <= 3
    assert keys_left()
    wait_for(lambda: not keys_left(), timeout=30)


def test_a_retried_step_keeps_the_steps_behind_it_until_they_run(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    flag, gate = f"test:flag:{uuid.uuid4().hex}", f"test:gate:{uuid.uuid4().hex}"
    steps = chain(proj.add.s(1, 1), proj.flaky.s(flag), proj.gated.s(gate), proj.add.s(1))
    sig, ids = frozen(proj, steps)
    _, failing, gated, last = ids
    res = sig.apply_async()
    with pytest.raises(FlowFailed):
        res.get(timeout=TIMEOUT)
    assert all(store.ttl(KEYS.job_key("celery", s)) > 0 for s in (failing, gated, last))
    # As in Celery's chain, the steps behind the failed one hold its error.
    assert proj.app.AsyncResult(last).state == "FAILURE"
    store.set(flag, 1)
    out = echomq("retry", res.id)
    assert out.exit_code == 0, out.output
    wait_for(lambda: row(store, gated, "state") == "active")
    # The retry made the failed step pending again, and the steps behind it no longer expire
    # nor hold the old error (recovery would read it as theirs).
    assert store.ttl(KEYS.job_key("celery", gated)) == -1
    assert store.ttl(KEYS.job_key("celery", last)) == -1
    assert proj.app.AsyncResult(last).state == "PENDING"
    store.set(gate, 1)
    assert res.get(timeout=TIMEOUT) == 3


def test_show_lists_the_steps_and_the_one_that_runs(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    gate = f"test:gate:{uuid.uuid4().hex}"
    steps = chain(proj.add.s(1, 1), proj.gated.s(gate), proj.add.s(1))
    sig, ids = frozen(proj, steps)
    first, running, last = ids
    res = sig.apply_async()
    try:
        wait_for(lambda: row(store, running, "state") == "active")
        out = echomq("show", res.id)
        assert out.exit_code == 0, out.output
        lines = out.output.splitlines()
        head = next(line for line in lines if f"chain {last}" in line)
        assert "3 steps, step 2 runs  active" in head
        one, two, three = lines[lines.index(head) + 1 : lines.index(head) + 4]
        assert f"step 1/3  {first}  tests.proj.add  done" in one and "value=2" in one
        assert f"step 2/3  {running}  tests.proj.gated  active" in two and "<- runs" in two
        assert "args=(2, " in two
        assert f"step 3/3  {last}  tests.proj.add  waiting" in three
    finally:
        store.set(gate, 1)
    assert res.get(timeout=TIMEOUT) == 3


def test_a_long_chain_child_inside_a_flow_that_is_a_step_of_a_chain(proj: Any, how: str) -> None:
    # The value before the flow goes to each child: their first tasks are immutable here.
    steps = chain(proj.add.si(0, 1), *(proj.add.s(1) for _ in range(199)))
    inner = flow(proj.tsum.s(), [steps, proj.add.si(1, 1)])
    sig = chain(proj.add.si(0, 1), inner, proj.add.s(1))
    assert run(sig, how).get(timeout=TIMEOUT) == 203


def test_a_chain_child_takes_the_values_a_chain_gives_its_flow(proj: Any, how: str) -> None:
    # chain(task, flow): the previous value goes to every child; a chain child's first step.
    sig = chain(proj.add.si(2, 3), flow(proj.tsum.s(), [chain(proj.add.s(1), proj.add.s(1))]))
    assert run(sig, how).get(timeout=TIMEOUT) == 7


def test_a_chain_child_on_another_queue_than_its_parent(
    proj: Any, store: redis.Redis, own_queue: Any, start_worker: Any
) -> None:
    # Its steps' rows live on the other queue's slot: the flow takes the chunked path, each step
    # makes the next pending there, and the last one is credited on the parent's slot.
    main, side = own_queue("chain"), own_queue("steps")
    start_worker(queues=f"{main},{side}")
    steps = chain(proj.add.s(1, 1).set(queue=side), proj.add.s(10).set(queue=side))
    sig, ids = frozen(proj, steps)
    res = sig.apply_async(queue=main)
    assert res.get(timeout=TIMEOUT) == 12
    assert [row(store, sid, "state", side) for sid in ids] == ["done", "done"]
    assert res.children_values() == {ids[-1]: 12}

    failing = chain(proj.add.s(1, 1).set(queue=side), proj.fail.s().set(queue=side))
    bad, bad_ids = frozen(proj, failing)
    with pytest.raises(FlowFailed) as caught:
        bad.apply_async(queue=main).get(timeout=TIMEOUT)
    assert caught.value.child_id == bad_ids[-1]


def test_a_chain_child_of_a_flow_on_the_chunked_path(proj: Any, worker: Any) -> None:
    # More children than echomq_chunk_size (1000): written in chunks, a chain's steps in one.
    kids = [proj.add.s(i, 0) for i in range(1000)]
    res = flow(proj.tsum.s(), [*kids[:500], counting(proj, 5), *kids[500:]]).apply_async()
    assert res.get(timeout=120) == sum(range(1000)) + 5
    assert res.dependencies() == (0, 1001, 0, 0)


# --- a chain as a flow's parent, and chains with a group or flow among their steps ----------


def test_a_long_chain_as_the_parent_takes_the_childrens_values_first(proj: Any, how: str) -> None:
    # flow(p1 | p2 | ... | p120, kids): p1 gets the list of the children's values, as a chord's
    # body chain does; each step after it the value before. 120 steps: past echomq_max_depth.
    parent = chain(proj.tsum.s(), *(proj.add.s(1) for _ in range(119)))
    res = run(flow(parent, [proj.add.s(1, 2), proj.add.s(3, 4)]), how)
    assert res.get(timeout=300) == 10 + 119


def test_a_chain_parent_in_a_flow_gives_its_last_value_to_the_outer_parent(
    proj: Any, how: str
) -> None:
    inner = flow(chain(proj.tsum.s(), *(proj.add.s(1) for _ in range(59))), [proj.add.s(1, 1)])
    res = run(flow(proj.tsum.s(), [inner, proj.add.s(100, 0)]), how)
    assert res.get(timeout=300) == 2 + 59 + 100


def test_a_chain_parent_whose_children_fail_fails_the_flow(proj: Any, how: str) -> None:
    parent = chain(proj.tsum.s(), *(proj.add.s(1) for _ in range(40)))
    with pytest.raises(FlowFailed, match="Task expected to fail"):
        run(flow(parent, [proj.fail.s(), proj.add.s(1, 1)]), how).get(timeout=TIMEOUT)


def test_a_failed_step_of_a_chain_parent_fails_the_flow_naming_it(proj: Any, how: str) -> None:
    bad = proj.fail.s().set(task_id=job_id())
    parent = chain(proj.tsum.s(), *(proj.add.s(1) for _ in range(40)), bad, proj.add.s(1))
    with pytest.raises(Exception, match="Task expected to fail"):
        run(flow(parent, [proj.add.s(1, 1)]), how).get(timeout=TIMEOUT)


def test_a_long_chain_with_a_group_step_is_not_too_deep(proj: Any, how: str) -> None:
    # 40 tasks, a group, 60 tasks: a flow level for the group and the run after it, none per
    # task step (echomq_max_depth is 32).
    from celery import group

    sig = chain(
        proj.add.s(0, 1),
        *(proj.add.s(1) for _ in range(39)),
        group(proj.add.s(1), proj.add.s(2)),
        proj.tsum.s(),
        *(proj.add.s(1) for _ in range(59)),
    )
    res = run(flow(proj.tsum.s(), [sig, proj.add.s(1, 1)]), how)
    assert res.get(timeout=300) == (41 + 42) + 59 + 2


def test_cancel_reaches_a_chain_parent_held_on_its_children_and_the_steps_behind_it(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    gate = f"test:gate:{uuid.uuid4().hex}"
    kid, head, middle, last = job_id(), job_id(), job_id(), job_id()
    parent = chain(
        proj.tsum.s().set(task_id=head), proj.add.s(1).set(task_id=middle), proj.add.s(1)
    )
    sig = flow(parent, [proj.gated.s(1, gate).set(task_id=kid)]).set(task_id=last)
    res = sig.apply_async()
    assert res.id == last  # the flow's id is its value task's: the chain's last
    try:
        wait_for(lambda: row(store, kid, "state") == "active")
        assert row(store, head, "state") == "awaiting_children"
        assert row(store, head, "next") == middle
        assert row(store, middle, "state") == "waiting"
        res.revoke()
        assert row(store, head, "state") == "cancelled"
        assert row(store, middle, "state") == "cancelled"
    finally:
        store.set(gate, 1)
    with pytest.raises(FlowCancelled):
        res.get(timeout=TIMEOUT)
    time.sleep(1.0)
    assert row(store, middle, "attempts") == "0"


def test_a_long_chain_across_two_queues_is_a_level_per_run_not_per_step(
    proj: Any, store: redis.Redis, own_queue: Any, start_worker: Any
) -> None:
    # 40 steps on one queue, then 40 on another: two linked runs, the second's first step held
    # on the first run (echomq_max_depth is 32: a level per step would be refused).
    main, side = own_queue("chain"), own_queue("steps")
    start_worker(queues=f"{main},{side}")
    steps = chain(
        proj.add.s(0, 1),
        *(proj.add.s(1) for _ in range(39)),
        *(proj.add.s(1).set(queue=side) for _ in range(40)),
    )
    sig, ids = frozen(proj, steps)
    res = sig.apply_async(queue=main)
    assert res.get(timeout=120) == 80
    assert row(store, ids[0], "next", main) == ids[1]  # linked on its run's queue
    assert row(store, ids[41], "next", side) == ids[42]
    assert row(store, ids[-1], "state", side) == "done"


def test_show_lists_a_chain_parents_children_under_its_first_step(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    gate = f"test:gate:{uuid.uuid4().hex}"
    kid, head = job_id(), job_id()
    parent = chain(proj.tsum.s().set(task_id=head), proj.add.s(1), proj.add.s(1))
    res = flow(parent, [proj.gated.s(1, gate).set(task_id=kid), proj.add.s(2, 2)]).apply_async()
    try:
        wait_for(lambda: row(store, kid, "state") == "active")
        out = echomq("show", res.id)
        assert out.exit_code == 0, out.output
        lines = out.output.splitlines()
        at = next(i for i, line in enumerate(lines) if f"step 1/2  flow {head}" in line)
        assert "awaiting_children" in lines[at]
        below = "\n".join(lines[at + 1 : at + 3])
        assert kid in below and "active" in below  # the flow's own children, under its step
    finally:
        store.set(gate, 1)
    assert res.get(timeout=TIMEOUT) == 7


def test_a_chain_parent_that_starts_with_a_group(proj: Any, how: str) -> None:
    # flow(chain(group(a, b), tsum, add(1) x 50), kids): each of the group's tasks gets the
    # children's values, tsum the list of theirs, each step after it the value before.
    from celery import group

    parent = chain(
        group(proj.tsum.s(), proj.tsum.s()), proj.tsum.s(), *(proj.add.s(1) for _ in range(50))
    )
    res = run(flow(parent, [proj.add.s(1, 2), proj.add.s(3, 4)]), how)
    assert res.get(timeout=300) == 2 * 10 + 50


def test_retry_runs_a_chain_parents_failed_step_and_those_after_it(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    flag = f"test:flag:{uuid.uuid4().hex}"
    failing = job_id()
    parent = chain(
        proj.tsum.s(), proj.flaky.s(flag).set(task_id=failing), *(proj.add.s(1) for _ in range(40))
    )
    res = flow(parent, [proj.add.s(1, 1)]).apply_async()
    with pytest.raises(ValueError, match="not set"):  # the step's own, as Celery's chain
        res.get(timeout=TIMEOUT)
    assert row(store, failing, "state") == "failed"
    store.set(flag, 1)
    out = echomq("retry", res.id)
    assert out.exit_code == 0, out.output
    assert res.get(timeout=TIMEOUT) == 2 + 40
    assert store.get(f"test:ran:flaky:{flag}") == b"2"


# --- a chain parent's own callbacks ---------------------------------------------------------


def errbacks_for(store: redis.Redis, *ids: str) -> list[int]:
    """How many times ``proj.errback`` ran for each of ``ids`` (old-style: it gets the id)."""
    ran = store.lrange("test:errback", 0, -1)
    return [ran.count(jid.encode()) for jid in ids]


def parent_chain(proj: Any, *middle: Any, **callbacks: Any) -> tuple[Any, list[str]]:
    """chain(tsum, *middle, add(10)) with every id assigned and ``callbacks`` of its own."""
    steps = [proj.tsum.s(), *middle, proj.add.s(10)]
    ids = [job_id() for _ in steps]
    parent = chain(*(s.set(task_id=i) for s, i in zip(steps, ids, strict=True)))
    return parent.set(**callbacks), ids


def test_a_chain_parent_with_callbacks_of_its_own_is_linked_and_links_once(
    proj: Any, how: str, store: redis.Redis, worker: Any
) -> None:
    # The worker is up either way: an eager task's link is sent, as Celery's eager trace does.
    tag = uuid.uuid4().hex
    parent, ids = parent_chain(
        proj, proj.add.s(1), link=proj.collect.s(tag=tag), link_error=proj.errback.s()
    )
    res = run(flow(parent, [proj.add.s(1, 1), proj.add.s(2, 2)]), how)
    assert res.get(timeout=TIMEOUT) == 6 + 1 + 10
    # ``link`` on the chain runs once, with the chain's value, as Celery's chain runs it.
    wait_for(lambda: store.get(f"test:ran:collect:{tag}") == b"1")
    assert quiet(lambda: store.get(f"test:ran:collect:{tag}")) == b"1"
    assert errbacks_for(store, *ids) == [0, 0, 0]
    if how == "worker":
        # Linked: its middle step is a plain step row, made pending by the one before it.
        assert row(store, ids[0], "next") == ids[1]
        assert row(store, ids[1], "chain") == ids[0]


def test_a_failed_step_of_a_chain_parent_runs_the_chains_errback_once_with_its_id(
    proj: Any, how: str, store: redis.Redis
) -> None:
    parent, ids = parent_chain(proj, proj.fail.s(), link_error=proj.errback.s())
    # The failed step's own error, as a chord's chain body raises it.
    with pytest.raises(proj.ExpectedException):
        run(flow(parent, [proj.add.s(1, 1)]), how).get(timeout=TIMEOUT)
    # Celery gives a chain's link_error to each of its tasks: the one that fails runs it, with
    # its own id, and the chain's last step, held on it, does not run it again.
    wait_for(lambda: errbacks_for(store, ids[1]) == [1])
    assert quiet(lambda: errbacks_for(store, *ids)) == [0, 1, 0]


def test_a_chain_parent_whose_children_fail_runs_its_errback_once(
    proj: Any, how: str, store: redis.Redis
) -> None:
    parent, ids = parent_chain(proj, proj.add.s(1), link_error=proj.errback.s())
    with pytest.raises(FlowFailed):
        run(flow(parent, [proj.fail.s(), proj.add.s(2, 2)]), how).get(timeout=TIMEOUT)
    # Its first step, held on the children, fails with them and runs it; nothing after it.
    wait_for(lambda: errbacks_for(store, ids[0]) == [1])
    assert quiet(lambda: errbacks_for(store, *ids)) == [1, 0, 0]
