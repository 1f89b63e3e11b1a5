"""Any canvas as a tree of flows whose parents are single tasks: what a flow takes where a
chord takes a canvas, in the only shape the store holds (a held row per parent).

- a group among the children is unrolled into its tasks (nested groups flattened), as a
  chord's header is;
- a chain ``a | b | c`` of single tasks is *linked*: one child of the flow whose steps are
  plain job rows, run in order (``a`` pending, ``b`` and ``c`` waiting until the step before
  them completes; see ``linked``); its value is its last step's. A run of tasks after a
  group, chord or flow step (or after the tasks a flow's parent chain holds first) is linked
  too, its first step a nested flow (``x`` held on what comes before it, the tasks after it
  waiting rows behind it; see ``_linked_on``): a chain costs a flow level per such step and
  per run, never one per task step. A step held on the one before it takes that single
  value as is (``single``), not as a list;
- a chord child ``chord(header, body)`` is ``flow(body, header, policy="fail_at_end")``: its
  body fails once its whole header has run, as a chord's does;
- a parent that fans out (a group, a chord or a flow) is held as the *spread* task: once
  released, it adds that canvas's children, each given the values, to the flow whose
  parent stands for the canvas's own parent (``spread`` below). A group parent's own
  parent is *collect*, which returns the list of its children's values as is.

Every id of the tree is assigned here, including the ids of what a spread will add, so a
spread delivered twice adds the same jobs, which the second time are already there.

Below the shaping, in the order it calls them: the nodes a shape is made of (a flow whose
parent is a task, a linked chain, a canvas's parts) and what it reads of a signature (its
callbacks, the options that are a canvas's own, a task copied with an id of its own); and
above it the options it writes on what it makes. Pure: nothing here touches Redis or the
broker.
"""

from __future__ import annotations

from typing import Any

from celery.canvas import Signature, _chain, _chord, group, maybe_signature
from celery.utils.functional import maybe_list

from celery_echomq.store.keyspace import new_job_id

FLOW_TASK = "celery_echomq.flow"
# The tasks a flow whose parent is a canvas runs (send/tasks.py registers them).
SPREAD_TASK = "celery_echomq.spread"
COLLECT_TASK = "celery_echomq.collect"
# A chord's: its body fails once the whole header has run, whatever canvas holds it.
CHORD_POLICY = "fail_at_end"

# The options a signature's callbacks travel in.
CALLBACKS = ("link", "link_error")
# The option that marks a linked chain (a chain of single tasks, each with its id): a child
# of a flow planned as steps (send/plan.py), not as nested flows.
LINKED = "echomq_linked"
# An option of a chain parent's steps after its first: the errbacks each step carries (the
# chain's own). A job held on the steps before it (its last step, a flow step) that one of
# them failed does not run these again (send/jobs.py stores them as its ``step_errbacks``).
STEP_ERRBACKS = "echomq_step_errbacks"
# An option of a chord's node among a flow's children, with every chord on the engine
# (``echomq_chords``): its failure is worded as Celery words a chord's (send/plan.py marks it).
CHORD_WORDS = "echomq_chord_words"

# Options of a chain, group or chord that are its own, not handed down to its tasks.
_OWN = frozenset(
    "task_id group_id group_index chord parent_policy subtask_type link link_error chain "  # noqa: SIM905
    "reply_to root_id parent_id echomq_silent echomq_linked echomq_step_errbacks "
    "echomq_chord_words".split()
)


def nested_chain(sig: Signature, app: Any) -> Signature:
    """A linked chain as nested flows (each step held on the one before it): for a chain
    whose steps live on different queues' slots, which one script cannot link."""
    steps = list(sig.tasks)
    return _chain_on(steps[1:], [steps[0]], False, app, {}, _own(steps[-1]))[0]


def is_normal(sig: Any) -> bool:
    """A task, a linked chain, or a flow whose parent is a task and whose children are
    normal: planned as it is (what this module makes, and the common case)."""
    if is_task(sig) or is_linked(sig):
        return True
    return (
        getattr(sig, "subtask_type", None) == "flow"
        and is_task(sig.parent)
        and all(map(is_normal, sig.children))
    )


def expand(children: list[Any], app: Any) -> list[Signature]:
    """Children as the flow children they stand for: tasks and normal flows as they are."""
    out: list[Signature] = []
    for child in children:
        if is_normal(child):
            out.append(child)
        else:
            out.extend(as_children(child, app, {}))
    return out


def normal_flow(sig: Any) -> tuple[Any, str]:
    """A flow as a normal one (itself when it is), and the id of its fan-in: the job that
    holds its own children, whose reads (``children_values()`` and the rest) are the flow's."""
    app = sig._get_app()
    if is_normal(sig):
        return sig, ""
    kids = [n for c in sig.children for n in as_children(c, app, {})]
    node, fan = _held(sig.parent, kids, app, {}, **_as_flow(sig))
    node = as_flow_node(node, app)
    node.args = tuple(sig.args)
    node.immutable = sig.immutable
    for key, value in sig.options.items():
        if key in CALLBACKS and key in node.options:
            node.options[key] = merge_callbacks(node.options[key], value)
        elif key != "task_id":
            node.options.setdefault(key, value)
    return node, fan


def _with_callbacks(parent: Signature, held: tuple[Signature, str]) -> tuple[Signature, str]:
    """A canvas parent's own callbacks on the flow that stands for it: ``link`` runs with its
    value, ``link_error`` once if any part of it (or what it waits for) fails."""
    node = held[0]
    for key in (*CALLBACKS, STEP_ERRBACKS):
        if key in parent.options:
            node.options[key] = merge_callbacks(node.options.get(key), parent.options[key])
    if parent.options.get("chain"):  # the rest of the Celery chain it was sent in: after it
        node.options["chain"] = parent.options["chain"]
    return held


def _own(sig: Signature) -> Any:
    return sig.options.get("task_id")


def _as_flow(sig: Any) -> dict[str, Any]:
    """What a flow hands the job that holds its own children: its policy, whether it takes
    one value, its id, and its deadline options and window (kept by that job)."""
    keys = ("deadline", "on_deadline", "max_active", "quorum", "reduce", "batch")
    timing = {k: sig.kwargs[k] for k in keys if k in sig.kwargs}
    return {"policy": sig.policy, "single": sig.single, "own_id": _own(sig), "timing": timing}


def as_children(sig: Any, app: Any, inherited: dict[str, Any]) -> list[Signature]:
    """A child canvas as the flow children it stands for (a group: one per task)."""
    sig = maybe_signature(sig, app=app)
    policy = sig.options.get("parent_policy")
    if isinstance(sig, group):
        mine = {**inherited, **options_of(sig)}
        nodes = [node for task in group_tasks(sig) for node in as_children(task, app, mine)]
    elif is_task(sig):
        return [task_copy(sig, inherited)]
    elif isinstance(sig, _chain) and not sig.tasks:
        return []  # an empty chain is nothing to wait for, as in a chord's header
    elif isinstance(sig, _chain) and len(sig.tasks) == 1:
        nodes = as_children(sig.tasks[0], app, {**inherited, **options_of(sig)})
    else:
        nodes = [as_node(sig, app, inherited)]
    if policy is not None:
        for node in nodes:
            node.options.setdefault("parent_policy", policy)
    return nodes


def as_node(sig: Any, app: Any, inherited: dict[str, Any]) -> Signature:
    """A chain, chord or flow as one flow whose parent is a single task."""
    mine = {**inherited, **options_of(sig)}
    if is_linked(sig):
        return sig
    if isinstance(sig, _chain):
        steps = [maybe_signature(s, app=app) for s in sig.tasks]
        if not steps:
            raise ValueError("a chain among a flow's children has no tasks")
        if len(steps) > 1 and all(map(is_task, steps)):
            return linked(sig, steps, app, mine)
        run = task_run(steps, 0)
        if run > 1:
            # Its leading tasks, one linked child: what the rest is held on.
            head = linked(sig, steps[:run], app, mine, own=False)
            return _linked_on(steps[run:], [head], False, app, mine, _own(sig))[0]
        first = as_children(steps[0], app, mine)
        if len(steps) == 1 and len(first) == 1:
            return first[0]
        return _linked_on(steps[1:], first, fans_out(steps[0]), app, mine, _own(sig))[0]
    if isinstance(sig, _chord):
        if sig.body is None:
            raise ValueError("a chord among a flow's children has no body")
        header = [n for t in header_tasks(sig, app) for n in as_children(t, app, mine)]
        node = _held(sig.body, header, app, mine, policy=CHORD_POLICY, own_id=_own(sig))[0]
        if app.conf.get("echomq_chords") is True and is_task(maybe_signature(sig.body, app=app)):
            # Every chord on the engine: one in a chord's header (or a flow) words its
            # failure as Celery's does, its body holding the header itself.
            node.options[CHORD_WORDS] = True
        return node
    if getattr(sig, "subtask_type", None) == "flow":
        kids = [n for c in sig.children for n in as_children(c, app, mine)]
        node, _ = _held(sig.parent, kids, app, mine, **_as_flow(sig))
        if sig.options.get("echomq_silent"):
            node.options["echomq_silent"] = True
        return node
    raise TypeError(f"{sig!r:.80} is not a task, a chain, a group, a chord or a flow")


def _chain_on(
    steps: list[Any],
    children: list[Signature],
    fans: bool,
    app: Any,
    inherited: dict[str, Any],
    own_id: Any,
) -> tuple[Signature, str]:
    """Each of ``steps`` held on the one before it, the first on ``children`` (the values of
    a group when ``fans``, else one value taken as is). Returns the last step's node and the
    id of the first step's fan-in."""
    node, fan = _held(
        steps[0],
        children,
        app,
        inherited,
        single=not fans,
        own_id=own_id if len(steps) == 1 else None,
    )
    for i, step in enumerate(steps[1:], 2):
        node, _ = _held(
            step,
            [node],
            app,
            inherited,
            single=not fans_out(steps[i - 2]),
            own_id=own_id if i == len(steps) else None,
        )
    return node, fan


def _linked_on(
    steps: list[Any],
    children: list[Signature],
    fans: bool,
    app: Any,
    inherited: dict[str, Any],
    own_id: Any,
    *,
    head: Signature | None = None,
) -> tuple[Signature, str]:
    """Each of ``steps`` after the one before it, the first given ``children``'s values (a
    group's list when ``fans``, else the one value as is), in a loop: a run of tasks is linked
    behind the node before it (``head``, when given, for the first run: it is already held on
    ``children``), any other step is held on the node before it. One flow level per group,
    chord or flow step and per run of tasks after it, none per task step. Returns the last
    node and the id of the first step's fan-in ('' with ``head``)."""
    node, fan, i = head, "", 0
    while i < len(steps):
        run = task_run(steps, i)
        if node is not None and run:
            last = i + run == len(steps)
            node = linked_after(node, steps[i : i + run], app, inherited, own_id if last else None)
            i += run
        else:
            below = children if i == 0 or node is None else [node]
            last = i + 1 == len(steps)
            node, held_fan = _held(
                steps[i],
                below,
                app,
                inherited,
                single=not fans,
                own_id=own_id if last else None,
            )
            fan = fan or held_fan
            i += 1
        fans = fans_out(steps[i - 1])
    assert node is not None
    return node, fan


def _held(
    parent: Any,
    children: list[Signature],
    app: Any,
    inherited: dict[str, Any],
    *,
    policy: str = "fail",
    single: bool = False,
    own_id: Any = None,
    timing: dict[str, Any] | None = None,
) -> tuple[Signature, str]:
    """A flow whose value is ``parent``'s, ``parent`` given ``children``'s values (the one
    value as is, when ``single``); and the id of the job that holds ``children``.

    ``own_id``: the id the canvas was given, which its value's job takes.
    """
    parent = maybe_signature(parent, app=app)
    if is_task(parent):
        task = task_copy(parent, inherited, own_id)
        node = flow_node(task, children, inherited, policy=policy, single=single, timing=timing)
        return node, str(task.options["task_id"])
    mine = {**inherited, **options_of(parent)}
    own_id = own_id if own_id is not None else _own(parent)
    if isinstance(parent, _chain):
        steps = [maybe_signature(s, app=app) for s in parent.tasks]
        if len(steps) > 1 and any(key in parent.options for key in CALLBACKS):
            steps = with_chain_callbacks(steps, parent.options, app)
        node, fan = _held(
            steps[0],
            children,
            app,
            mine,
            policy=policy,
            single=single,
            own_id=own_id if len(steps) == 1 else None,
            timing=timing,
        )
        if len(steps) == 1:
            return _with_callbacks(parent, (node, fan))
        rest = steps[1:]
        return _linked_on(rest, [node], fans_out(steps[0]), app, mine, own_id, head=node)[0], fan
    return _with_callbacks(
        parent, _held_fanning(parent, children, app, mine, policy, single, own_id, timing)
    )


def _held_fanning(
    parent: Any,
    children: list[Signature],
    app: Any,
    mine: dict[str, Any],
    policy: str,
    single: bool,
    own_id: Any,
    timing: dict[str, Any] | None,
) -> tuple[Signature, str]:
    """:func:`_held` of a parent that fans out (a group, a chord or a flow): held as the
    spread task, which adds that canvas's own fan-out once released."""
    if isinstance(parent, group):
        collect = app.signature(COLLECT_TASK)
        collect.options["task_id"] = own_id or new_job_id()
        fanned = group_tasks(parent)
        return _spread(collect, fanned, "fail", children, app, mine, policy, single, timing=timing)
    if isinstance(parent, _chord):
        if parent.body is None:
            raise ValueError("a chord as a flow's parent has no body")
        body = maybe_signature(parent.body, app=app)
        fanned = header_tasks(parent, app)
        return _spread(
            body,
            fanned,
            CHORD_POLICY,
            children,
            app,
            mine,
            policy,
            single,
            own_id=own_id,
            timing=timing,
        )
    if getattr(parent, "subtask_type", None) == "flow":
        return _spread(
            parent.parent,
            parent.children,
            parent.policy,
            children,
            app,
            mine,
            policy,
            single,
            args=list(parent.args),
            immutable=parent.immutable,
            own_id=own_id,
            timing=timing,
            own_timing=_as_flow(parent)["timing"],
        )
    raise TypeError(
        f"flow parent {parent!r:.80} is not a task, a chain, a group, a chord or a flow"
    )


def _spread(
    own_parent: Any,
    fanned: list[Any],
    fanned_policy: str,
    children: list[Signature],
    app: Any,
    inherited: dict[str, Any],
    policy: str,
    single: bool,
    *,
    args: list[Any] | None = None,
    immutable: bool = False,
    own_id: Any = None,
    timing: dict[str, Any] | None = None,
    own_timing: dict[str, Any] | None = None,
) -> tuple[Signature, str]:
    """``own_parent`` held on ``fanned``, each of which gets ``children``'s values: the spread
    task is held on ``children`` and, once released, adds ``fanned`` (their ids assigned
    now) under ``own_parent``."""
    fanned_nodes = [n for f in fanned for n in as_children(f, app, inherited)]
    spread = app.signature(
        SPREAD_TASK,
        kwargs={"children": [as_plain(n) for n in fanned_nodes], "args": list(args or ())},
        immutable=immutable,
    )
    spread.options["task_id"] = new_job_id()
    # The fanned tasks' own errbacks run if the fan-in fails (they never run then), as a
    # chord calls its body's errbacks when its header fails.
    errbacks = [
        e for f in fanned if is_task(f) for e in (maybe_list(f.options.get("link_error")) or [])
    ]
    if errbacks:
        spread.options["link_error"] = merge_callbacks(None, errbacks)
    spreader = flow_node(spread, children, inherited, policy=policy, single=single, timing=timing)
    # The spread's own value is not among the values ``own_parent`` gets (echomq_silent),
    # and a failure of the fan-in fails the whole canvas, whatever ``fanned_policy`` says.
    spreader.options["parent_policy"] = "fail"
    spreader.options["echomq_silent"] = True
    node, _ = _held(
        own_parent,
        [spreader],
        app,
        inherited,
        policy=fanned_policy,
        own_id=own_id,
        timing=own_timing,
    )
    return node, str(spread.options["task_id"])


def as_plain(value: Any) -> Any:
    """A signature as plain dicts and lists all the way down: what its message carries, and
    what a stored plan may copy (a Signature cannot be rebuilt from a generator of items)."""
    if isinstance(value, dict):
        return {k: as_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_plain(v) for v in value]
    return value


# --- the nodes a shape is made of -----------------------------------------------------------------


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


# --- what a shape reads of a signature ------------------------------------------------------------


def merge_callbacks(own: Any, given: Any) -> list[Any]:
    """A signature's own callbacks, then those it was sent with, each once."""
    merged: list[Any] = []
    for callback in [*(maybe_list(own) or ()), *(maybe_list(given) or ())]:
        if callback not in merged:
            merged.append(callback)
    return merged


def is_task(sig: Any) -> bool:
    """A single task's signature (not a chain, group, chord or flow)."""
    return type(sig) is Signature or (
        isinstance(sig, Signature)
        and not isinstance(sig, (_chain, _chord, group))
        and getattr(sig, "subtask_type", None) != "flow"
    )


def options_of(sig: Signature) -> dict[str, Any]:
    """A canvas's options that its tasks inherit (its own left out)."""
    return {k: v for k, v in sig.options.items() if k not in _OWN}


def task_copy(sig: Signature, inherited: dict[str, Any], task_id: Any = None) -> Signature:
    """A copy of a task with an id of its own and the options of the canvases around it."""
    copy = sig.clone()
    for key, value in inherited.items():
        copy.options.setdefault(key, value)
    if task_id is not None:
        copy.options.setdefault("task_id", task_id)
    copy.options.setdefault("task_id", new_job_id())
    return copy
