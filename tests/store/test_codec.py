"""A child's stored job as a delta against its flow's template: joined back, it is the job."""

from __future__ import annotations

from typing import Any

import pytest
from kombu.exceptions import EncodeError
from kombu.serialization import dumps, register, unregister

from celery_echomq.store.codec import child_template, job_delta, join_job, serialize
from celery_echomq.store.planned import (
    Held,
    Plan,
    PlannedChain,
    PlannedJob,
    held_of,
    is_row_job,
    nested_plan,
    node_of,
    stored_message,
    stored_node,
)


def job(task_id: str, *args: Any, task: str = "t.add", **options: Any) -> dict[str, Any]:
    opts = {"queue": "q", "headers": {"echomq_q": "q", "echomq_p": "JOBp"}, **options}
    opts["task_id"] = task_id
    opts.setdefault("ignore_result", True)  # after task_id, as plan_children sets it
    return {
        "task": task,
        "args": list(args),
        "kwargs": {},
        "options": opts,
        "subtask_type": None,
        "immutable": False,
    }


def test_only_what_differs_is_stored_and_the_join_gives_the_job_back() -> None:
    first = job("JOB1", 1, 2)
    template = child_template([first])
    assert template is not None and template["options"]["task_id"] is None
    assert job_delta(template, first) == {}
    assert job_delta(template, job("JOB2", 3, 4)) == {"args": [3, 4]}
    for other in (
        job("JOB2", 3, 4),
        job("JOB3", 1, 2, task="t.mul"),
        job("JOB4", 1, 2, soft_time_limit=5),
        job("JOB5"),
    ):
        delta = job_delta(template, other)
        assert delta is not None
        joined = join_job(template, delta, other["options"]["task_id"])
        assert joined == other
        # Same order too: the message built from it is the one first sent.
        assert list(joined["options"]) == list(other["options"])


def test_a_header_tasks_place_in_its_group_is_kept_beside_its_options() -> None:
    # A chord's header tasks differ in group_index alone: each delta keeps its place, not its
    # whole options, and the join gives each job back with its options in order.
    header = [job(f"JOB{i}", i, group_id="g", group_index=i) for i in range(3)]
    template = child_template(header)
    assert template is not None and template["options"]["group_index"] is None
    deltas = [job_delta(template, j) for j in header]
    assert deltas == [
        {"group_index": 0},
        {"args": [1], "group_index": 1},
        {"args": [2], "group_index": 2},
    ]
    for j, delta in zip(header, deltas, strict=True):
        assert delta is not None
        joined = join_job(template, delta, j["options"]["task_id"])
        assert joined == j and list(joined["options"]) == list(j["options"])
    # Another option differing too (another value, another key): the options whole, with
    # their place in them.
    for other in (
        job("JOB8", 8, group_id="h", group_index=5),
        job("JOB9", 9, group_id="g", group_index=4, soft_time_limit=5),
    ):
        delta = job_delta(template, other)
        assert delta is not None and "group_index" not in delta
        assert delta["options"]["group_index"] == other["options"]["group_index"]
        assert join_job(template, delta, other["options"]["task_id"]) == other


def test_a_template_written_with_a_place_still_joins() -> None:
    # A row a producer of an earlier release wrote: its template keeps its first child's
    # group_index, each other child's delta its whole options.
    first, second = (job(f"JOB{i}", i, group_id="g", group_index=i) for i in range(2))
    template = {**first, "options": {**first["options"], "task_id": None}}
    assert join_job(template, {}, "JOB0") == first
    delta = {"args": [1], "options": {**second["options"], "task_id": None}}
    assert join_job(template, delta, "JOB1") == second


@pytest.mark.parametrize("arg", [1.0, True, "1", None, [1], (1, 2)])
def test_an_argument_of_another_type_is_not_the_same_argument(arg: Any) -> None:
    template = child_template([job("JOB1", 1)])
    assert template is not None
    assert job_delta(template, job("JOB2", arg)) == {"args": [arg]}


def test_keyword_arguments_in_another_order_are_stored() -> None:
    first, other = job("JOB1"), job("JOB2")
    first["kwargs"], other["kwargs"] = {"x": 1, "y": 2}, {"y": 2, "x": 1}
    template = child_template([first])
    assert template is not None
    assert job_delta(template, other) == {"kwargs": {"y": 2, "x": 1}}


def nested(parent_id: str, *children: PlannedJob | Plan | PlannedChain) -> Plan:
    return Plan(queue="q", parent_id=parent_id, parent=job(parent_id), children=list(children))


def test_a_job_of_other_fields_is_stored_whole() -> None:
    assert child_template([]) is None
    template = child_template([job("JOB1")])
    assert template is not None
    assert job_delta(template, {**job("JOB2"), "chord_size": 2}) is None
    # A field of the name a delta keeps a place under: never read as one.
    odd = child_template([{**job("JOB1"), "group_index": 1}])
    assert odd is not None
    assert job_delta(odd, {**job("JOB3"), "group_index": 2}) is None


def test_every_kind_of_node_reads_back_as_it_was_planned() -> None:
    ran = Held(step_errbacks=[{"task": "t.err"}])
    chain = PlannedChain([nested("JOBh", PlannedJob(job("JOBh1"))), PlannedJob(job("JOBs2"), ran)])
    inner = nested("JOBi", PlannedJob(job("JOBi1")), chain)
    inner.policy, inner.child_policies, inner.outer = "continue", {"JOBi1": "ignore"}, "JOBo"
    inner.silent, inner.max_active, inner.single = ["JOBi1"], 1, True
    inner.held = Held(
        children=inner.child_ids(), silent=["JOBi1"], single=True, max_active=1, window_queue="q"
    )
    for node in (PlannedJob(job("JOB1", 1)), chain, inner):
        assert node_of(stored_node(node)) == node
    assert nested_plan(stored_node(inner)) == inner
    assert nested_plan(job("JOB1")) is None


def test_a_nested_flow_kept_by_the_previous_release_reads_back() -> None:
    """Rows keep the form the previous release wrote: its flows in flight finish."""
    kept = {
        "nested": {
            "queue": "q",
            "parent_id": "JOBn",
            "parent": job("JOBn"),
            "children": [job("JOBc1"), {"steps": [job("JOBs1"), job("JOBs2")]}],
            "policy": "fail",
            "child_policies": {},
            "outer": "JOBo",
            "single": False,
            "silent": [],
        }
    }
    plan = nested_plan(kept)
    assert plan is not None and plan.max_active == 0 and plan.outer == "JOBo"
    assert [c.id for c in plan.children] == ["JOBc1", "JOBs2"]
    assert plan.children[1].row_ids() == ["JOBs1", "JOBs2"]


@pytest.mark.parametrize("stored", [None, 3, "job", [], {}, {"task": "t.add"}, {"steps": []}])
def test_what_is_no_job_is_refused_by_name(stored: Any) -> None:
    assert not is_row_job(stored)
    with pytest.raises(ValueError, match="not a stored job"):
        node_of(stored)


@pytest.mark.parametrize("serializer", ["json", "pickle", "yaml-like", "raw"])
def test_a_message_is_encoded_as_kombu_encodes_it(serializer: str) -> None:
    """The producer's own path to the registered encoder gives kombu's bytes, and kombu's
    EncodeError, for its JSON encoder, another built-in one and one an app registers."""
    register("yaml-like", repr, lambda s: s, content_type="text/x-like")
    try:
        value: Any = b"raw bytes" if serializer == "raw" else {"args": [1, 2.5, "é", None]}
        assert serialize(value, serializer) == dumps(value, serializer=serializer)
        if serializer in ("json", "pickle"):
            with pytest.raises(EncodeError):
                serialize(lambda: None, serializer)
    finally:
        unregister("yaml-like")


def test_what_a_held_parent_keeps_follows_celerys_fields_in_its_order_and_reads_back() -> None:
    held = Held(
        children=["JOB1", "JOB2", "JOB3"],
        silent=["JOB2"],
        quorum=2,
        reduce=["sum"],
        deadline={"in": 5.0},
        on_deadline="continue",
    )
    plan = Plan(queue="q", parent_id="JOBp", parent=job("JOBp"), held=held)
    stored = stored_message(plan)
    kept = ["children", "silent", "deadline", "on_deadline", "quorum", "reduce"]
    assert list(stored) == [*job("JOBp"), *kept] and list(plan.parent) == list(job("JOBp"))
    assert held_of(stored) == held and held.valued() == ["JOB1", "JOB3"]
    assert held_of(job("JOB1")) == Held() and held_of(None) == Held()
    # A parent with no child still lists them; a job that holds nothing is its message as is.
    empty = Plan(queue="q", parent_id="JOBe", parent=job("JOBe"))
    assert stored_message(empty)["children"] == []
    alone = PlannedJob(job("JOB1"))
    assert stored_message(alone) is alone.message
