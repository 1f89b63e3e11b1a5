"""The tasks a flow whose parent is a canvas runs (see shape.py): ``spread`` adds the
canvas's children, each given the values; ``collect`` is a group parent's own parent."""

from __future__ import annotations

from typing import Any

from celery.canvas import maybe_signature

from celery_echomq.send.flow_reads import add_children
from celery_echomq.send.shape import COLLECT_TASK, SPREAD_TASK


def register_tasks(app: Any) -> None:
    """The spread and collect tasks on ``app``: a worker runs them, as eager mode does."""
    if SPREAD_TASK in app.tasks:
        return
    app.task(name=SPREAD_TASK, bind=True, shared=False, lazy=False)(spread_task)
    app.task(name=COLLECT_TASK, shared=False, lazy=False)(collect_task)


def collect_task(values: Any) -> Any:
    """A group parent's values: the list of its tasks' values, as they came."""
    return values


def spread_task(task: Any, values: Any, children: list[Any], args: list[Any] | None = None) -> int:
    """Add ``children`` (their ids assigned when the flow was planned), each given ``values``
    first, to this job's own parent: the flow that stands for the canvas they belong to.

    Delivered again, it adds nothing: the flow already lists those ids.
    """
    partial = (values, *(args or ()))
    sigs = [maybe_signature(child, app=task.app).clone(args=partial) for child in children]
    return len(add_children(sigs, app=task.app))
