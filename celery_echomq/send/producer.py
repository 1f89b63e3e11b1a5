"""The producer's one entry: a flow, shaped, sent as ``apply_async`` asked (``send_flow``).

``canvas.flow`` is the Signature a user builds and Celery's canvas composes; it shapes itself
(its parents single tasks, every id gated) and hands the shape here, with what
``apply_async`` was given. From there the producer runs its steps in order: the options the
flow is sent with, its plan (every id, message, deadline, window and fan-in, before anything
is sent), what joining jobs that exist means (``on_exists="join"``), and the start that
writes it and publishes its first messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from celery_echomq import tracing
from celery_echomq.send.errbacks import with_errbacks
from celery_echomq.send.fan_in import FlowSpec
from celery_echomq.send.join import (
    check_joinable,
    existing_flow,
    joined_children,
    shared_in_canvas,
)
from celery_echomq.send.plan import Plan, check_depth, plan_flow
from celery_echomq.send.shape import merge_callbacks
from celery_echomq.send.start import start_flow
from celery_echomq.store.headers import H_QUEUE
from celery_echomq.store.keyspace import new_job_id
from celery_echomq.store.replies import Status
from celery_echomq.store.state import EchoMQ
from celery_echomq.wire.results import writes_results

__all__ = ["Sending", "Sent", "send_flow"]


@dataclass
class Sending:
    """What ``apply_async`` was given for a flow: partial ``args`` and ``kwargs``, the id it
    asked for, its options (``chord``: the chord options Celery passes a chord's body, taken
    out of them; ``callbacks``: the flow's own links and errbacks with those it is sent with)
    and what a job that exists means (``on_exists``)."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] | None = None
    task_id: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    chord: dict[str, Any] = field(default_factory=dict)
    callbacks: dict[str, Any] = field(default_factory=dict)
    on_exists: str = "raise"


@dataclass
class Sent:
    """A flow sent: its parent's id and queue, and the joined jobs that had failed, settled
    under the new parent's policy for them (the caller acts on what that made of the flow)."""

    parent_id: str
    queue: str
    settled: list[tuple[Status, str, str]] = field(default_factory=list)


def send_flow(app: Any, state: EchoMQ, shape: Any, fan: str, sending: Sending) -> Sent:
    """Send the flow ``shape`` (a flow whose parents are single tasks; ``fan``: the id of the
    job that holds its own children, "" when that is its parent)."""
    shape, options = _sent_options(shape, sending)
    parent = shape.parent
    given = options.get("task_id") or parent.options.get("task_id")
    replaced = _replaced_job(given, options)
    if replaced is not None:
        # Task.replace(flow): Celery gives the replacement the replaced task's id, which names
        # the replaced flow job's own row. The flow's parent takes an id of its own; the
        # replaced job takes the parent's outcome (recovery reads it from the backend).
        parent = parent.clone()
        parent.options["task_id"] = options["task_id"] = new_job_id()
        if fan == given:
            fan = parent.options["task_id"]  # the parent holds the children, by its new id
    plan = _planned(app, state, shape, parent, fan, options, sending)
    joined: dict[str, Any] = {}
    if sending.on_exists == "join":
        if existing_flow(state, plan):
            # The same flow, sent before: its result, and nothing sent again.
            return Sent(plan.parent_id, plan.queue)
        joined = joined_children(state, plan)
        check_joinable(state, joined)
        joined.update(shared_in_canvas(plan, joined))
    if replaced is not None:
        queue, job_id = replaced
        state.client.hset(state.keys.job_key(queue, job_id), "replaced_by", plan.parent_id)
    with tracing.flow_span(app, plan, fan):
        settled = start_flow(state, plan, joined=joined)
    return Sent(plan.parent_id, plan.queue, settled)


def _sent_options(shape: Any, sending: Sending) -> tuple[Any, dict[str, Any]]:
    """The shape with the errbacks it is sent with, and the options its parent goes with: the
    shape's, ``apply_async``'s over them, and the callbacks of both."""
    merged = {**shape.options, **sending.options}
    for name, value in sending.callbacks.items():
        merged[name] = merge_callbacks(shape.options.get(name), value)
    shape = with_errbacks(shape, sending.callbacks.get("link_error"))
    if sending.task_id is not None:
        merged["task_id"] = sending.task_id
    for name in ("producer", "connection", "add_to_parent"):
        merged.pop(name, None)
    return shape, merged


def _planned(
    app: Any,
    state: EchoMQ,
    shape: Any,
    parent: Any,
    fan: str,
    options: dict[str, Any],
    sending: Sending,
) -> Plan:
    """Every id, message, deadline, window and fan-in of the flow, before anything is sent."""
    partial = () if shape.immutable else (*sending.args, *shape.args)
    plan = plan_flow(
        app,
        parent,
        shape.children,
        policy=shape.policy,
        single=shape.single,
        args=tuple(partial),
        kwargs=sending.kwargs,
        options=options,
        child_results=state.settings.child_results,
        store_results=writes_results(state),
        shared_jobs=sending.on_exists == "join",
        # Its deadline, window, quorum or reducer, kept by the job that holds its children.
        spec=FlowSpec.of(shape.kwargs),
        fan=fan,  # what operators' repairs follow from the flow's id to its children
        chord=sending.chord,  # a chord on the engine (chords.py)
    )
    check_depth(plan, state.settings.max_depth)
    return plan


def _replaced_job(task_id: Any, options: dict[str, Any]) -> tuple[str, str] | None:
    """``(queue, id)`` of the flow job this flow replaces (``Task.replace``), else None."""
    from celery import current_task

    if not task_id or "replaced_task_nesting" not in options or current_task is None:
        return None
    request = current_task.request
    queue = getattr(request, H_QUEUE, None)
    return (str(queue), str(task_id)) if queue and request.id == task_id else None
