"""Flows compose like chords: nested trees, chains, groups, chords, JSON, canvas options."""

from __future__ import annotations

import json
import uuid
from typing import Any

import celery
import pytest
from celery import chain, chord, group
from celery.canvas import Signature
from celery.result import GroupResult

from celery_echomq import FlowFailed, FlowResult, flow
from tests.helpers import id_of, wait_for, with_id


def test_three_level_tree_fans_in_level_by_level(proj: Any, worker: Any) -> None:
    innermost = flow(proj.tsum.s(), [proj.add.s(3, 3), proj.add.s(4, 4)])
    middle = flow(proj.tsum.s(), [proj.add.s(2, 2), innermost])
    outer = flow(proj.collect.s(tag=uuid.uuid4().hex), [proj.add.s(1, 1), middle])
    outer.freeze()
    res = outer.apply_async()
    assert res.get(timeout=60)["values"] == [2, 18]  # 18 = 4 + (6 + 8)
    assert res.dependencies() == (0, 2, 0, 0)
    middle_id = middle.parent.options["task_id"]
    assert res.children_values()[middle_id] == 18


def test_nested_flow_is_equivalent_to_the_nested_chord(proj: Any, worker: Any) -> None:
    inner_chord = chord([proj.add.s(i, i) for i in range(3)], proj.tsum.s())
    expected = chord([inner_chord, proj.add.s(10, 10)])(proj.tsum.s()).get(timeout=60)
    inner = flow(proj.tsum.s(), [proj.add.s(i, i) for i in range(3)])
    got = flow(proj.tsum.s(), [inner, proj.add.s(10, 10)]).apply_async().get(timeout=60)
    assert got == expected == 26


def test_a_parent_replaced_by_a_chain_gives_the_chains_link_its_value(
    proj: Any, worker: Any, store: Any
) -> None:
    # The chain's link runs on a worker with the chain's value, the flow's values list: it
    # succeeds (no error logged by a worker in a green run) and records that list.
    key = f"test:compose:{uuid.uuid4().hex}"
    try:
        f = flow(proj.replace_with_chain.s(link_key=key), [proj.identity.s(42)])
        assert f.apply_async().get(timeout=60) == [42]
        # Celery before 5.7 runs a replacing chain's link twice, a plain task's as a flow's.
        runs = 1 if celery.VERSION >= (5, 7) else 2
        wait_for(lambda: store.llen(key) >= runs, timeout=30)
        assert [json.loads(v) for v in store.lrange(key, 0, -1)] == [[42]] * runs
    finally:
        store.delete(key)


def test_failure_inside_a_nested_flow_fails_the_outer_flow_under_fail(
    proj: Any, worker: Any
) -> None:
    inner = flow(proj.tsum.s(), [proj.add.s(1, 1), proj.boom.s("deep")])
    outer = flow(proj.tsum.s(), [proj.add.s(5, 5), inner])
    res = outer.freeze()
    outer.apply_async()
    with pytest.raises(FlowFailed) as info:
        res.get(timeout=60)
    assert info.value.child_id == inner.parent.options["task_id"]
    assert "ValueError: deep" in str(info.value)


def test_a_nested_flow_can_be_ignored_by_its_outer_flow(proj: Any, worker: Any) -> None:
    inner = flow(proj.tsum.s(), [proj.boom.s("deep")]).set(parent_policy="ignore")
    outer = flow(proj.tsum.s(), [proj.add.s(5, 5), inner])
    res = outer.freeze()
    outer.apply_async()
    assert res.get(timeout=60) == 10
    ((failed_id, error),) = res.ignored_failures().items()
    assert failed_id == inner.parent.options["task_id"]
    assert error.startswith("FlowFailed") and "ValueError: deep" in error


def test_chain_flow_then_task_passes_the_parents_value_on(proj: Any, worker: Any) -> None:
    f = flow(proj.tsum.s(), [proj.add.s(1, 1), proj.add.s(2, 2)])
    assert chain(f, proj.square.s()).apply_async().get(timeout=60) == 36
    assert (f.clone() | proj.square.s()).apply_async().get(timeout=60) == 36


def test_chain_task_then_flow_gives_the_value_to_every_child(proj: Any, worker: Any) -> None:
    f = flow(proj.collect.s(), [proj.add.s(10), proj.add.s(20)])
    res = chain(proj.add.s(1, 2), f).apply_async()
    assert res.get(timeout=60)["values"] == [13, 23]
    # The same as a chord in that position.
    c = chord([proj.add.s(10), proj.add.s(20)], proj.collect.s())
    assert chain(proj.add.s(1, 2), c).apply_async().get(timeout=60)["values"] == [13, 23]


def test_flow_in_the_middle_of_a_chain(proj: Any, worker: Any) -> None:
    f = flow(proj.tsum.s(), [proj.add.s(1), proj.add.s(2)])
    res = chain(proj.add.s(1, 1), f, proj.square.s()).apply_async()
    assert res.get(timeout=60) == 49  # 2 -> [3, 4] -> 7 -> 49


def test_group_of_flows(proj: Any, worker: Any) -> None:
    g = group(
        flow(proj.tsum.s(), [proj.add.s(1, 1), proj.add.s(2, 2)]),
        flow(proj.tsum.s(), [proj.add.s(3, 3)]),
    )
    assert g.apply_async().get(timeout=60) == [6, 6]


def test_flow_inside_a_chords_header(proj: Any, worker: Any) -> None:
    header = [flow(proj.tsum.s(), [proj.add.s(1, 1), proj.add.s(2, 2)]), proj.add.s(10, 10)]
    assert chord(header)(proj.tsum.s()).get(timeout=60) == 26


def test_json_round_trip_gives_back_a_flow(proj: Any) -> None:
    f = flow(
        proj.tsum.s(), [proj.add.s(1, 1), flow(proj.tsum.s(), [proj.add.s(2, 2)])], policy="ignore"
    )
    back = Signature.from_dict(json.loads(json.dumps(f)), app=proj.app)
    assert isinstance(back, flow)
    assert back.policy == "ignore"
    assert back.parent.task == "tests.proj.tsum"
    assert isinstance(back.children[1], flow)
    assert json.loads(json.dumps(back)) == json.loads(json.dumps(f))


def test_json_round_trip_inside_a_chain_that_a_worker_deserializes(proj: Any, worker: Any) -> None:
    f = flow(proj.tsum.s(), [proj.add.s(1), proj.add.s(2)])
    c = chain(proj.add.s(0, 1), f, proj.square.s())
    back = Signature.from_dict(json.loads(json.dumps(c)), app=proj.app)
    # The worker that runs add(0, 1) rebuilds the flow from the message's JSON chain.
    assert back.apply_async().get(timeout=60) == 25  # 1 -> [2, 3] -> 5 -> 25


def test_freeze_assigns_every_id_before_anything_is_sent(proj: Any, store: Any) -> None:
    inner = flow(proj.tsum.s(), [proj.add.s(1, 1)])
    f = flow(proj.tsum.s(), [proj.add.s(1, 1), inner])
    res = f.freeze()
    ids = [
        f.parent.options["task_id"],
        f.children[0].options["task_id"],
        inner.parent.options["task_id"],
        inner.children[0].options["task_id"],
    ]
    assert res.id == ids[0]
    assert all(i.startswith("JOB") for i in ids) and len(set(ids)) == 4
    assert store.keys(f"*{res.id}*") == []


def test_clone_is_independent(proj: Any) -> None:
    f = flow(proj.tsum.s(), [proj.add.s(1, 1)])
    c = f.clone()
    c.freeze()
    assert "task_id" not in f.parent.options
    assert "task_id" not in f.children[0].options
    assert isinstance(c, flow)


def test_link_goes_to_the_parent(proj: Any, worker: Any, store: Any) -> None:
    t = uuid.uuid4().hex
    f = flow(proj.tsum.s(), [proj.add.s(1, 1), proj.add.s(2, 2)])
    f.link(proj.collect.s(tag=t))  # called with the parent's value, like a chord's link
    assert f.apply_async().get(timeout=60) == 6
    wait_for(lambda: store.get(f"test:ran:collect:{t}") == b"1")


def test_options_reach_children_and_parent(proj: Any, start_worker: Any) -> None:
    queue = "opts" + uuid.uuid4().hex[:6]
    start_worker(queues=queue, concurrency=1)
    f = flow(proj.whereami.s(), [proj.whereami.s(1), proj.whereami.s(2)])
    res = f.apply_async(queue=queue, priority=3, headers={"x-trace": "abc"})
    value = res.get(timeout=60)
    assert value["queue"] == queue and value["header"] == "abc"
    assert value["priority"] == 3
    children = value["args"][0]
    assert [c["args"] for c in children] == [[1], [2]]
    assert all(c["queue"] == queue and c["header"] == "abc" for c in children)
    assert all(c["priority"] == 3 for c in children)
    assert res.flow_queue == queue  # the flow's keys live on that queue's slot


def test_countdown_delays_the_children(proj: Any, worker: Any) -> None:
    import time

    start = time.monotonic()
    res = flow(proj.tsum.s(), [proj.add.s(1, 1)]).apply_async(countdown=1.5)
    assert res.get(timeout=60) == 2
    assert time.monotonic() - start >= 1.4


def test_expires_applies_to_the_children(proj: Any, worker: Any) -> None:
    # An already-expired child is revoked by the worker: a failure under its policy.
    f = flow(proj.tsum.s(), [proj.add.s(1, 1)], policy="ignore")
    res = f.apply_async(expires=-1)
    assert res.get(timeout=60) == 0
    (error,) = res.ignored_failures().values()
    assert error == "TaskRevokedError: expired"


@pytest.mark.parametrize("child_results", [True, False])
def test_echomq_child_results_decides_whether_children_store_results(
    proj: Any, worker: Any, child_results: bool
) -> None:
    import dataclasses

    from celery_echomq.store.state import get_state

    state = get_state(proj.app)
    saved = state.settings
    state.settings = dataclasses.replace(saved, child_results=child_results)
    try:
        res = flow(proj.tsum.s(), [proj.add.s(i, i) for i in range(3)]).apply_async()
    finally:
        state.settings = saved
    assert res.get(timeout=60) == 6
    values = res.children_values()
    assert sorted(values.values()) == [0, 2, 4]
    backend = proj.app.backend
    stored = {cid: backend.get(backend.get_key_for_task(cid)) for cid in values}
    if child_results:
        # As a chord's children: each result is in the backend too.
        assert all(proj.app.AsyncResult(cid).get(timeout=10) == v for cid, v in values.items())
    else:
        # The values reach the parent (and children_values) through the store alone.
        assert stored == dict.fromkeys(values)


@pytest.mark.parametrize("value", ["no", 0, 1, "False"])
def test_echomq_child_results_must_be_a_bool(value: Any) -> None:
    from celery_echomq.config import read_settings
    from celery_echomq.errors import ConfigError

    conf = {"echomq_redis_url": "redis://localhost:6379/0", "echomq_child_results": value}
    with pytest.raises(ConfigError, match=r"echomq_child_results=.* must be True or False"):
        read_settings(conf)


@pytest.mark.parametrize("how", ["apply", "apply_async"])
def test_a_flows_parent_is_its_childrens_results_as_a_chords_is_its_headers(
    proj: Any, worker: Any, how: str
) -> None:
    inner = flow(proj.tsum.s(), [proj.add.s(5, 5)])
    kids = [with_id(proj.add.s(1, 1)), inner, with_id(proj.boom.s("x")).set(parent_policy="ignore")]
    ids = [id_of(kids[0]), inner.freeze().id, id_of(kids[2])]
    res = getattr(flow(proj.collect.s(), kids), how)()
    assert res.get(timeout=60) == {"values": [2, 10], "tag": ""}  # no child's error raised
    header = res.parent
    assert isinstance(header, GroupResult)
    assert [r.id for r in header.results] == ids  # the children's order
    first, nested, failed = header.results
    assert first.get(timeout=60) == 2
    assert nested.get(timeout=60) == 10  # a nested flow's: its parent's value
    assert failed.state == "FAILURE" and "x" in str(failed.result)
    assert header.completed_count() == 2 and header.failed()
    if how == "apply_async":
        # A result made from the flow's id alone reads its children from the store.
        again = FlowResult(res.id, app=proj.app)
        assert [r.id for r in again.parent.results] == ids
        assert again.parent.join(timeout=60, propagate=False)[:2] == [2, 10]


@pytest.mark.parametrize("how", ["apply", "apply_async"])
def test_the_parent_of_a_flow_whose_parent_is_a_chain_is_the_flows_children(
    proj: Any, worker: Any, how: str
) -> None:
    kids = [with_id(proj.add.s(1, 1)), with_id(proj.add.s(2, 2))]
    res = getattr(flow(chain(proj.tsum.s(), proj.square.s()), kids), how)()
    assert res.get(timeout=60) == 36
    assert [r.get(timeout=60) for r in res.parent.results] == [2, 4]
    assert [r.id for r in res.parent.results] == [id_of(k) for k in kids]


@pytest.mark.parametrize("how", ["apply", "apply_async"])
def test_a_step_after_a_flow_raises_no_failure_the_flow_ignored(
    proj: Any, worker: Any, how: str
) -> None:
    # A chain's get() reads the parents of its last result, down to the flow's children: a
    # child's failure reaches it through the flow's policy alone.
    f = flow(proj.tsum.s(), [proj.add.s(1, 1), proj.boom.s("y").set(parent_policy="ignore")])
    res = getattr(chain(f, proj.square.s()), how)()
    assert res.get(timeout=60) == 4
    assert res.parent.parent.results[1].state == "FAILURE"
