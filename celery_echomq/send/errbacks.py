"""A group parent's errbacks, as a chord's: given to each task of the group.

Celery's ``group.link_error`` puts the errback on every task of the group, so a chord whose
body is a group runs it once per failing task, each time with that task's id. A flow whose
parent is a group (held as ``collect`` over the spread, see shape.py) does the same: the
errbacks of the flow and of the group are given to each task the spread will add, which runs
them itself when it fails. The collect keeps them too, for a failure that is not one of its
tasks' (the flow's children, through the spread): then they run once, with the flow's id, as
they always did. A task's failure fails the collect, whose own errbacks must then not run a
second time (:func:`ran_by_child`).

Pure: the shaped tree's dicts, nothing else.
"""

from __future__ import annotations

from typing import Any

from celery.canvas import Signature
from celery.utils.functional import maybe_list

from celery_echomq.send.shape import COLLECT_TASK, as_plain, merge_callbacks
from celery_echomq.store.headers import H_CHORD, chord_headers
from celery_echomq.store.planned import Plan, held_of

# The H_CHORD of a chord's flow parent whose header another job of the flow holds.
FAN = "fan"


def _is_flow(node: Any) -> bool:
    return isinstance(node, dict) and node.get("subtask_type") == "flow"


def _is_collect(node: Any) -> bool:
    return _is_flow(node) and node["kwargs"]["parent"].get("task") == COLLECT_TASK


def _fanned(collect: Any) -> list[Any]:
    """The tasks (as the dicts they travel as) a collect's spread adds: the group's."""
    spreader = collect["kwargs"]["children"][0]
    return list(spreader["kwargs"]["parent"]["kwargs"]["children"])


def give_errbacks(node: Any, given: Any = None) -> None:
    """In a freshly shaped tree, in place: every collect's errbacks (its own and ``given``,
    for the top node) on each task of its group, nested groups and flows included."""
    if not _is_flow(node):
        return
    options = node.setdefault("options", {})
    if _is_collect(node):
        errbacks = merge_callbacks(options.get("link_error"), given)
        if errbacks:
            options["link_error"] = errbacks
            for task in _fanned(node):
                _give(task, errbacks)
    for child in node["kwargs"]["children"]:
        give_errbacks(child)


def _give(task: Any, errbacks: list[Any]) -> None:
    task_options = task.setdefault("options", {})
    task_options["link_error"] = merge_callbacks(task_options.get("link_error"), errbacks)
    # A flow among the group's tasks: its parent gets them (a group parent passes them on).
    give_errbacks(task)


def with_errbacks(node: Signature, given: Any) -> Signature:
    """``node`` (a shaped flow), or a copy of it whose group parent's tasks also carry the
    errbacks ``given`` at send time (``apply_async(link_error=...)``): the shape a frozen
    flow keeps is left as it is."""
    own = maybe_list(node.options.get("link_error")) or []
    extra = [e for e in maybe_list(given) or () if e not in own]
    if not extra or not _is_collect(node):
        return node
    copy = Signature.from_dict(as_plain(node), app=node._app)
    give_errbacks(copy, extra)
    return copy


def errbacks_left(job: dict[str, Any], child_id: str) -> list[Any]:
    """The errbacks a parent failed by ``child_id`` runs: none where its group's task ran them
    (:func:`ran_by_child`); else its own, but those the steps of a chain it is held on carry
    (a chain parent's last step, or a flow step of it, failed by a step before it, which ran
    them: each step has the chain's, as Celery gives a chain's ``link_error`` to each task)."""
    if ran_by_child(job, child_id):
        return []
    ran = held_of(job).step_errbacks
    return [e for e in maybe_list(job["options"].get("link_error")) or [] if e not in ran]


def ran_by_child(job: dict[str, Any], child_id: str) -> bool:
    """Whether a parent failed by ``child_id`` had its errbacks run already: a collect failed
    by one of its group's tasks, which carried them (see :func:`give_errbacks`)."""
    return job.get("task") == COLLECT_TASK and child_id not in held_of(job).silent


def mark_chord(plan: Plan, fan: str | None, options: dict[str, Any]) -> None:
    """Mark a flow that stands for a chord (chords.py passes ``options`` saying so) on the job
    that holds its header, whose failure runs Celery's own handling of the chord's body (and
    so its errbacks). Where that job is not the flow's parent (a group, chord or chain body),
    the parent is marked ``fan``: failed by that job, it runs no errback again."""
    marks = chord_headers(options)
    if not marks:
        return
    held = next(lv for lv in plan.levels(True) if lv.parent_id == (fan or plan.parent_id))
    held.parent["options"].setdefault("headers", {}).update(marks)
    if held.parent is not plan.parent:
        plan.parent["options"].setdefault("headers", {})[H_CHORD] = FAN
