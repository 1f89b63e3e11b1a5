"""The nodes a shape is made of (send/shapes.py): a flow whose parent is a task, and a linked
chain (a run of single tasks whose steps are plain job rows run in order, one flow child;
send/plan.py plans its steps); and what a canvas's parts are. Pure.
"""

from __future__ import annotations

from typing import Any

from celery.canvas import Signature, _chain, _chord, group, maybe_signature
from celery.utils.functional import maybe_list

from celery_echomq.send.signatures import (
    LINKED,
    STEP_ERRBACKS,
    is_task,
    merge_callbacks,
    task_copy,
)

FLOW_TASK = "celery_echomq.flow"
# The tasks a flow whose parent is a canvas runs (send/tasks.py registers them).
SPREAD_TASK = "celery_echomq.spread"
COLLECT_TASK = "celery_echomq.collect"


def flow_node(
    parent: Signature,
    children: list[Signature],
    inherited: dict[str, Any],
    *,
    policy: str = "fail",
    single: bool = False,
    timing: dict[str, Any] | None = None,
) -> Signature:
    """A flow whose parent is ``parent``, held on ``children``: the node shapes are made of."""
    # Made from its registered type (canvas.flow), as its JSON would be: this module comes
    # before the signature class in the package's imports.
    node = Signature.from_dict(
        {
            "task": FLOW_TASK,
            "subtask_type": "flow",
            "args": (),
            "kwargs": {
                "parent": parent,
                "children": children,
                "policy": policy,
                "single": single,
                **(timing or {}),
            },
            "options": {**inherited, "task_id": parent.options["task_id"]},
            "immutable": False,
        },
        app=parent._app,
    )
    return node


def is_linked(sig: Any) -> bool:
    """A linked chain: made by :func:`linked`, planned as steps."""
    return isinstance(sig, _chain) and bool(sig.options.get(LINKED))


def linked(
    sig: _chain, steps: list[Any], app: Any, inherited: dict[str, Any], *, own: bool = True
) -> Signature:
    """A chain of single tasks as one child whose steps run in order: each step a copy with
    its own id (the last takes the chain's, with ``own``), the chain's options handed down to
    each."""
    own_id = sig.options.get("task_id") if own else None
    last = len(steps) - 1
    tasks = [task_copy(s, inherited, own_id if i == last else None) for i, s in enumerate(steps)]
    node = _chain(tasks, app=app)
    node.options[LINKED] = True
    node.options["task_id"] = tasks[-1].options["task_id"]
    return node


def linked_after(
    head: Signature, steps: list[Any], app: Any, inherited: dict[str, Any], own_id: Any
) -> Signature:
    """``head`` (a flow: the step held on what comes before it; or a linked chain) and then
    ``steps`` (single tasks), linked: ``head``'s value goes to the first of them as a
    chain's does. ``own_id``: the id the last step takes (the chain's own)."""
    first = list(head.tasks) if is_linked(head) else [head]
    last = len(steps) - 1
    tasks = [task_copy(s, inherited, own_id if i == last else None) for i, s in enumerate(steps)]
    node = _chain([*first, *tasks], app=app)
    node.options[LINKED] = True
    node.options["task_id"] = tasks[-1].options["task_id"]
    return node


def as_flow_node(node: Signature, app: Any) -> Signature:
    """A node that must be a flow (the top of a tree): a linked chain's last step is held on
    the steps before it (taking their value as is), so the flow's id stays its value task's."""
    if not is_linked(node):
        return node
    *before, last = node.tasks
    if len(before) == 1:
        below = before[0]
    else:
        below = _chain(before, app=app)
        below.options[LINKED] = True
        below.options["task_id"] = before[-1].options["task_id"]
    return flow_node(last, [below], {}, single=True)


def with_chain_callbacks(steps: list[Any], options: dict[str, Any], app: Any) -> list[Any]:
    """A chain parent's steps with the chain's own callbacks where Celery's chain puts them:
    ``link`` on its last step (it runs once, with the chain's value), ``link_error`` on each
    step (the step that fails runs it, with its own id; no step after it runs)."""
    errbacks = maybe_list(options.get("link_error")) or []
    out = [maybe_signature(step, app=app).clone() for step in steps]
    for i, step in enumerate(out):
        if errbacks:
            # A group, chord or flow step takes them as its own link_error (a group's then go
            # to each of its tasks, as a group parent's do: send/errbacks.py).
            step.options["link_error"] = merge_callbacks(step.options.get("link_error"), errbacks)
        if i and errbacks:
            step.options[STEP_ERRBACKS] = list(errbacks)
    if options.get("link"):
        last = out[-1]
        last.options["link"] = merge_callbacks(last.options.get("link"), options["link"])
    return out


def task_run(steps: list[Any], start: int) -> int:
    """How many of ``steps`` from ``start`` on are single tasks, one after another."""
    end = start
    while end < len(steps) and is_task(steps[end]):
        end += 1
    return end - start


def group_tasks(sig: group) -> list[Any]:
    return [maybe_signature(t, app=sig._app) for t in sig.tasks]


def header_tasks(sig: _chord, app: Any) -> list[Any]:
    tasks = sig.tasks
    if isinstance(tasks, group):
        return group_tasks(tasks)
    return [maybe_signature(t, app=app) for t in tasks]


def fans_out(sig: Any) -> bool:
    """Whether a step's value is the list of a group's values, not a single value."""
    return isinstance(maybe_signature(sig), group)


def queue_runs(chain: Signature, queues: list[str], app: Any) -> Signature:
    """A linked chain whose steps live on several queues' slots (``queues``: each step's), as
    runs of steps on one queue: each run linked (one script makes its next step pending on its
    slot), its first step held on the run before it. A flow level per run, none per step."""
    tasks = list(chain.tasks)
    node: Signature | None = None
    start = 0
    while start < len(tasks):
        end = start + 1
        while end < len(tasks) and queues[end] == queues[start]:
            end += 1
        head = tasks[start] if node is None else flow_node(tasks[start], [node], {}, single=True)
        rest = tasks[start + 1 : end]
        node = linked_after(head, rest, app, {}, None) if rest else head
        start = end
    assert node is not None
    return node
