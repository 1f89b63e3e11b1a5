"""A window on a flow's children (``flow(parent, children, max_active=N)``), planned: at most
N of them published or running at once. Pure.

The first N children start as any flow's do; the others are written ``waiting`` (kinds
``D``/``P`` beside the usual ``d``/``p``), their ids in order in their parent's ``:window``
list, and have no message. The script that finishes a child makes the next one pending and
hands it to its caller to publish (``store/lua/includes/window.lua``): publication follows
the children's order. A nested flow among them is one child: its own level is enqueued when
its turn comes, and it holds its slot until it finishes.
"""

from __future__ import annotations

from typing import Any

from celery_echomq.send.entries import child_queue

ALLOWED = "an int >= 1 (the most children published or running at once), or None (no window)"


def check_max_active(value: object, where: str = "flow(max_active=...)") -> int | None:
    """``value`` if it is a window's size, else a ValueError saying what is allowed."""
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise ValueError(f"{where}: {value!r} is not allowed; allowed: {ALLOWED}")
    return value


def window_of(plan: Any, kwargs: dict[str, Any]) -> None:
    """Give a planned level its window (from its flow signature's ``kwargs``), kept on its
    parent's stored job too (what ``add_children`` and ``show`` read); refuse a window the
    store cannot keep, before anything is written."""
    size = check_max_active(kwargs.get("max_active"))
    if size is None:
        return
    for job in plan.children:
        if "steps" in job:
            raise ValueError(
                f"flow {plan.parent_id}: max_active={size} takes tasks and flows as children, "
                "not a chain of tasks; allowed: wrap the chain in a flow of its own, or no "
                "max_active"
            )
    queues = sorted({child_queue(job) for job in plan.children})
    if len(queues) > 1:
        raise ValueError(
            f"flow {plan.parent_id}: max_active={size} needs every child on one queue (the "
            f"window is kept on their queue's slot); these go to {', '.join(queues)}; allowed: "
            "children routed to one queue (it may differ from the parent's), or no max_active"
        )
    plan.max_active = size
    plan.parent["max_active"] = size
    plan.parent["window_queue"] = queues[0] if queues else plan.queue


# A windowed level's first children, out at once, are marked as holding a slot (``e``, ``q``:
# the script that finishes one frees it); the others wait (``D``, ``P``). A child of a flow
# without a window keeps ``d`` or ``p``, and its completion never looks at a window.
_OUT_IN_WINDOW = str.maketrans("dp", "eq")


def waiting_kinds(kinds: str, size: int) -> str:
    """A level's row kinds for a window of ``size``: the first ``size`` children out at once,
    holding a slot (``d`` -> ``e``, ``p`` -> ``q``), each child after them waiting (``d`` ->
    ``D``, ``p`` -> ``P``); as they are with no window (a windowed level has no chain: one row
    per child)."""
    if not size:
        return kinds
    return kinds[:size].translate(_OUT_IN_WINDOW) + kinds[size:].upper()


def windowed(parent: dict[str, Any], queue: str, added: list[dict[str, Any]]) -> int:
    """The window of a running flow (``parent``: its stored job, on ``queue``) that
    ``added`` children join, 0 for none; refuses children its window cannot take, before
    anything is written: ``grow_flow`` keeps the window on the parent's slot, so they must
    be on the parent's queue, as the flow's own children must."""
    size = int(parent.get("max_active") or 0)
    if not size:
        return 0
    where = parent.get("window_queue") or queue
    strays = sorted({child_queue(job) for job in added} - {queue})
    if where != queue or strays:
        raise ValueError(
            f"flow {(parent.get('options') or {}).get('task_id')}: children added to a flow "
            f"with max_active={size} join its window on queue {queue!r}, its parent's; these "
            f"go to {', '.join(strays or [where])}; allowed: added children on {queue!r} (a "
            "flow whose children are on another queue than its parent takes none)"
        )
    return size
