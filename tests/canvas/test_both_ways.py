"""Any canvas wherever a chord takes one: chains, groups, chords and flows as a flow's
children and as its parent, each case run eagerly and on a worker, with the same values."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery import chain, chord, group

from celery_echomq import FlowCancelled, FlowFailed, KindError, flow
from tests.helpers import echomq, wait_for

# name -> (a function of the test app making the flow, the parent's value)
CASES: dict[str, tuple[Callable[[Any], Any], Any]] = {
    "chain child: its last task's value": (
        lambda p: flow(p.tsum.s(), [chain(p.add.s(1, 1), p.square.s()), p.add.s(2, 2)]),
        8,
    ),
    "chain child of three steps, in order": (
        lambda p: flow(
            p.collect.s(), [chain(p.add.s(1, 2), p.add.s(10), p.square.s()), p.add.s(0, 1)]
        ),
        {"values": [169, 1], "tag": ""},
    ),
    "group child: unrolled, values flattened in order": (
        lambda p: flow(
            p.collect.s(), [group(p.add.s(1, 1), group(p.add.s(2, 2), p.add.s(3, 3))), p.noargs.s()]
        ),
        {"values": [2, 4, 6, "ran"], "tag": ""},
    ),
    "chord child: its body's value": (
        lambda p: flow(
            p.tsum.s(), [chord([p.add.s(1, 1), p.add.s(2, 2)], p.tsum.s()), p.add.s(5, 5)]
        ),
        16,
    ),
    "chain parent: first step gets the values, get() the last's": (
        lambda p: flow(chain(p.tsum.s(), p.square.s(), p.add.s(1)), [p.add.s(1, 1), p.add.s(2, 2)]),
        37,
    ),
    "group parent: each task gets the values": (
        lambda p: flow(group(p.tsum.s(), p.collect.s(tag="g")), [p.add.s(1, 1), p.add.s(2, 2)]),
        [6, {"values": [2, 4], "tag": "g"}],
    ),
    "flow parent: the values reach each of its children": (
        lambda p: flow(
            flow(p.collect.s(tag="p"), [p.tsum.s(), p.tsum.s()]), [p.add.s(1, 1), p.add.s(2, 2)]
        ),
        {"values": [6, 6], "tag": "p"},
    ),
    "chord parent: the values reach each header task, get() is the body's": (
        lambda p: flow(chord([p.tsum.s(), p.tsum.s()], p.tsum.s()), [p.add.s(1, 1), p.add.s(2, 2)]),
        12,
    ),
    "any depth and mix": (
        lambda p: flow(
            chain(p.tsum.s(), p.square.s()),
            [
                flow(
                    p.tsum.s(),
                    [
                        chain(group(p.add.s(1, 1), p.add.s(1, 2)), p.tsum.s()),
                        chord([p.add.s(1, 1), chain(p.add.s(0, 1), p.square.s())], p.tsum.s()),
                    ],
                ),
                group(p.add.s(0, 1)),
            ],
        ),
        (5 + 3 + 1) ** 2,
    ),
}


def run(sig: Any, how: str) -> Any:
    return sig.apply() if how == "eager" else sig.apply_async()


@pytest.mark.parametrize("name", list(CASES))
def test_canvas_values_eager_and_on_a_worker(proj: Any, worker: Any, name: str) -> None:
    make, expected = CASES[name]
    eager = make(proj).apply().get(timeout=60)
    on_worker = make(proj).apply_async().get(timeout=60)
    assert eager == on_worker == expected


@pytest.mark.parametrize("how", ["eager", "worker"])
def test_a_failure_inside_a_chain_child_fails_the_flow(proj: Any, worker: Any, how: str) -> None:
    sig = flow(proj.tsum.s(), [chain(proj.add.s(1, 1), proj.boom.si("in chain")), proj.add.s(1, 1)])
    with pytest.raises(FlowFailed, match="ValueError: in chain"):
        run(sig, how).get(timeout=60)


@pytest.mark.parametrize("how", ["eager", "worker"])
def test_a_chord_child_fails_once_its_whole_header_has_run(
    proj: Any, worker: Any, store: Any, how: str
) -> None:
    # As a chord's body fails: the header's slow task settles before the failure reaches
    # the flow, which names the header task's error.
    slow = proj.slow_child.s(5, 1.0)
    slow_id = slow.freeze().id
    inner = chord([proj.boom.si("in header"), slow], proj.tsum.s())
    sig = flow(proj.tsum.s(), [inner, proj.add.s(1, 1)])
    with pytest.raises(FlowFailed, match="ValueError: in header"):
        run(sig, how).get(timeout=60)
    assert store.get(f"test:ran:slow:{slow_id}") == b"1"
    if how == "worker":  # eager results are not stored
        assert proj.app.AsyncResult(slow_id).state == "SUCCESS"


@pytest.mark.parametrize("how", ["eager", "worker"])
def test_a_chain_child_under_ignore_is_left_out(proj: Any, worker: Any, how: str) -> None:
    bad = chain(proj.add.s(1, 1), proj.boom.si("left out")).set(parent_policy="ignore")
    res = run(flow(proj.collect.s(), [bad, proj.add.s(2, 2)]), how)
    assert res.get(timeout=60) == {"values": [4], "tag": ""}
    (error,) = res.ignored_failures().values()
    assert error == "ValueError: left out"


@pytest.mark.parametrize("how", ["eager", "worker"])
def test_children_values_of_a_chain_parent_are_the_flows_children(
    proj: Any, worker: Any, how: str
) -> None:
    kids = [proj.add.s(1, 1), proj.add.s(2, 2)]
    res = run(flow(chain(proj.tsum.s(), proj.square.s()), kids), how)
    assert res.get(timeout=60) == 36
    assert sorted(res.children_values().values()) == [2, 4]
    assert res.dependencies().outstanding == 0


@pytest.mark.parametrize("how", ["eager", "worker"])
def test_a_group_parent_with_no_children_gets_an_empty_list(
    proj: Any, worker: Any, how: str
) -> None:
    res = run(flow(group(proj.collect.s(), proj.collect.s(tag="b")), []), how)
    assert res.get(timeout=60) == [{"values": [], "tag": ""}, {"values": [], "tag": "b"}]


def test_a_frozen_flow_with_a_chain_parent_sends_the_ids_it_froze(proj: Any, worker: Any) -> None:
    last = proj.square.s()
    sig = flow(chain(proj.tsum.s(), last), [proj.add.s(1, 1)])
    frozen = sig.freeze()
    assert frozen.id == last.options["task_id"]
    res = sig.apply_async()
    assert res.id == frozen.id
    assert res.get(timeout=60) == 4


@pytest.mark.parametrize("how", ["eager", "worker"])
def test_a_uuid_as_the_flows_id_is_kept(proj: Any, worker: Any, how: str) -> None:
    given = str(uuid.uuid4())
    sig = flow(proj.tsum.s(), [proj.add.s(1, 1)])
    res = sig.apply(task_id=given) if how == "eager" else sig.apply_async(task_id=given)
    assert res.id == given
    assert res.get(timeout=60) == 2
    if how == "worker":  # eagerly, as for a chord, nothing is stored in the backend
        assert proj.app.AsyncResult(given).get(timeout=60) == 2


@pytest.mark.parametrize("how", ["eager", "worker"])
def test_a_chain_ending_in_a_flow_runs_again_after_apply_async(
    proj: Any, worker: Any, how: str
) -> None:
    # Celery's chain hands the flow an id of its own (a uuid): kept as given, both ways.
    c = chain(proj.add.s(1, 1), flow(proj.tsum.s(), [proj.add.s(1), proj.add.s(2)]))
    assert c.apply_async().get(timeout=60) == 7
    assert c.apply().get(timeout=60) == 7


@pytest.mark.parametrize("how", ["eager", "worker"])
def test_a_child_id_outside_the_job_namespace_is_refused_by_position(
    proj: Any, worker: Any, how: str, store: Any
) -> None:
    good = proj.add.s(1, 1).set(task_id="JOB" + uuid.uuid4().hex)
    bad = proj.add.s(2, 2).set(task_id=uuid.uuid4().hex)  # a uuid, not in Celery's form
    parent = proj.tsum.s().set(task_id="JOB" + uuid.uuid4().hex)
    with pytest.raises(KindError) as info:
        run(flow(parent, [good, bad]), how)
    assert "flow child 2" in str(info.value)
    assert "'JOB' + uuid.uuid4().hex" in str(info.value) and "freeze()" in str(info.value)
    for job_id in (good.options["task_id"], parent.options["task_id"]):
        assert store.keys(f"*{job_id}*") == []


def test_the_released_parent_is_the_child_of_the_child_that_released_it(
    proj: Any, worker: Any
) -> None:
    kid = proj.add.s(1, 1)
    sig = flow(proj.lineage.s(), [kid])
    sig.freeze()
    assert sig.apply_async().get(timeout=60)["parent_id"] == kid.options["task_id"]


def test_show_lists_a_chain_childs_steps_inside_it(proj: Any, worker: Any) -> None:
    steps = chain(proj.add.s(1, 1), proj.square.s())
    sig = flow(proj.tsum.s(), [steps, proj.add.s(2, 2)])
    sig.freeze()
    # Celery's chain holds copies of the signatures it was given: the ids are on those.
    first, second = steps.tasks
    res = sig.apply_async()
    assert res.get(timeout=60) == 8
    lines = wait_for(lambda: _show_done(res.id))
    head = next(line for line in lines if f"chain {second.options['task_id']}" in line)
    one, two = lines[lines.index(head) + 1 : lines.index(head) + 3]
    assert "2 steps  done" in head and "value=4" in head
    assert f"step 1/2  {first.options['task_id']}  tests.proj.add  done" in one
    assert "args=(1, 1)" in one and "value=2" in one
    assert f"step 2/2  {second.options['task_id']}  tests.proj.square  done" in two
    assert "args=(2,)" in two and "value=4" in two


def _show_done(job_id: str) -> list[str] | None:

    out = echomq("show", job_id)
    lines = out.stdout.splitlines()
    return lines if out.exit_code == 0 and "  done  " in lines[0] else None


def test_release_of_a_chain_parent_runs_the_chain_with_the_values_so_far(
    proj: Any, worker: Any, store: Any
) -> None:
    gate = f"test:gate:{uuid.uuid4().hex}"
    fast = proj.add.s(1, 1)
    sig = flow(chain(proj.tsum.s(), proj.square.s()), [fast, proj.gated.s(5, gate)])
    sig.freeze()
    try:
        res = sig.apply_async()
        wait_for(lambda: res.children_values().get(fast.options["task_id"]) == 2)
        # From the flow's own id, as an operator names it: the chain's first step runs.

        out = echomq("release", res.id)
        assert out.exit_code == 0, out.output
        assert res.get(timeout=60) == 4
    finally:
        store.set(gate, 1)


@pytest.mark.parametrize("shape", ["chain parent", "group parent", "chain child"])
def test_revoke_cancels_the_whole_canvas(proj: Any, worker: Any, store: Any, shape: str) -> None:
    gate = f"test:gate:{uuid.uuid4().hex}"
    held = proj.gated.s(5, gate)
    tag = uuid.uuid4().hex
    if shape == "chain child":
        # A chain holds copies: the gated task's id is the copy's.
        steps = chain(held, proj.collect.s(tag=tag))
        held = steps.tasks[0]
    if shape == "chain parent":
        sig = flow(chain(proj.tsum.s(), proj.collect.s(tag=tag)), [held])
    elif shape == "group parent":
        sig = flow(group(proj.collect.s(tag=tag)), [held])
    else:
        sig = flow(proj.collect.s(tag=tag), [steps])
    sig.freeze()
    try:
        res = sig.apply_async()
        wait_for(lambda: store.hget(f"emq:{{celery}}:{held.options['task_id']}", "state"))
        res.revoke()
        with pytest.raises(FlowCancelled):
            res.get(timeout=60)
    finally:
        store.set(gate, 1)
    # Nothing after the cancelled part runs, whatever the gated child does once let go.
    time.sleep(1.5)
    assert not store.exists(f"test:ran:collect:{tag}")


@pytest.mark.parametrize("name", list(CASES))
def test_task_always_eager_gives_the_same_values(proj: Any, name: str) -> None:
    make, expected = CASES[name]
    proj.app.conf.task_always_eager = True
    try:
        assert make(proj).apply_async().get(timeout=60) == expected
    finally:
        proj.app.conf.task_always_eager = False


@pytest.mark.parametrize("where", ["chain child", "chain parent"])
def test_retry_runs_a_failed_step_again(proj: Any, worker: Any, store: Any, where: str) -> None:
    flag = f"test:flag:{uuid.uuid4().hex}"
    if where == "chain child":
        step = chain(proj.add.s(1, 1), proj.flaky.si(5, flag))
        sig, expected = flow(proj.tsum.s(), [step, proj.add.s(1, 1)]), 7
    else:
        steps = chain(proj.tsum.s(), proj.flaky.si(5, flag), proj.add.s(1))
        sig, expected = flow(steps, [proj.add.s(1, 1)]), 6
    res = sig.apply_async()
    # A chain child's failed step fails the flow; a chain parent's raises its own error, as
    # a chord's chain body does.
    error = FlowFailed if where == "chain child" else ValueError
    with pytest.raises(error, match=f"flag {flag} not set"):
        res.get(timeout=60)
    store.set(flag, 1)
    res.retry()
    assert res.get(timeout=60) == expected
    assert int(store.get(f"test:ran:flaky:{flag}")) == 2  # the failed step ran again, once
