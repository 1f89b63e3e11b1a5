"""A flow, planned: every id assigned and gated, every message built, before anything is
sent.

Pure: nothing here touches Redis or the broker. The plan is made of ``store/planned.py``'s
types (a level, a task, a linked chain); ``send/start.py`` sends a :class:`Plan`; the headers
it writes on each job are named in ``store/headers.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from celery import current_task
from celery.canvas import Signature

from celery_echomq.errors import DepthError
from celery_echomq.send.batches import batch_of
from celery_echomq.send.errbacks import mark_chord
from celery_echomq.send.fan_in import NO_SPEC, FlowSpec, quorum_of, reduce_of, window_of
from celery_echomq.send.ids import check_ids
from celery_echomq.send.jobs import (
    CHILD_ONLY,
    PARENT_ONLY,
    check_policy,
    child_job_id,
    job_dict,
    job_id_of,
    mark_for_store,
    route_queue,
)
from celery_echomq.send.shape import CHORD_WORDS, expand, is_linked, nested_chain, queue_runs
from celery_echomq.store.headers import H_CHORD, H_FLOW, H_NEXT, H_PARENT, H_PARENT_QUEUE, H_QUEUE
from celery_echomq.store.planned import Held, Node, Plan, PlannedChain, PlannedJob, held_of

__all__ = ["Plan", "check_depth", "plan_flow", "too_deep"]


def is_flow(sig: Any) -> bool:
    return getattr(sig, "subtask_type", None) == "flow"


def parent_args(job: dict[str, Any], values: list[Any]) -> list[Any]:
    """A released parent's arguments: the values of its children (the one value as is, for a
    chain's step), then its own; an immutable parent's own alone."""
    if job.get("immutable"):
        return list(job["args"])
    if held_of(job).single:
        return [values[0] if values else None, *job["args"]]
    return [values, *job["args"]]


def plan_flow(
    app: Any,
    parent: Signature,
    children: Sequence[Signature],
    *,
    policy: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    options: dict[str, Any],
    outer: str = "",
    outer_queue: str = "",
    child_results: bool = True,
    store_results: bool = False,
    single: bool = False,
    shared_jobs: bool = False,
    spec: FlowSpec = NO_SPEC,
    fan: str = "",
    chord: dict[str, Any] | None = None,
) -> Plan:
    """Assign and gate every id and build every message; touches neither Redis nor the broker.

    ``spec``: how the flow's parent fans in (its deadline, window, quorum, reducer), applied
    here to its level and its children's messages; ``fan``: the job that holds the flow's
    children where that is not its parent (what operators' repairs follow from the flow's
    id to its children); ``chord``: the chord options Celery passes a chord's body, when the
    flow stands for a chord (chords.py). Nothing changes the plan once it is returned.

    Each job's keys live on the slot of the queue it is sent to: a child routed elsewhere
    than its parent is credited across slots (see ``start_flow``). ``child_results`` False
    (``echomq_child_results``): a child task whose signature does not say otherwise is sent
    with ``ignore_result``; its value reaches the parent through the store alone.
    ``store_results`` (the app's result backend is on the store's server and database, see
    wire/results.py): every job whose options leave ``ignore_result`` unset is marked for the
    store to write its result (:func:`mark_for_store`).
    """
    parent_id = job_id_of(parent.options, options.get("task_id"))
    queue = route_queue(app, parent, options)
    shared = {k: v for k, v in options.items() if k not in PARENT_ONLY}
    plan = Plan.for_children(queue, parent_id)  # its parent's message built below, once
    plan.policy, plan.outer, plan.single = policy, outer, single
    plan_children(
        app,
        plan,
        children,
        args=args,
        kwargs=kwargs,
        shared=shared,
        child_results=child_results,
        store_results=store_results,
    )
    parent_opts = {k: v for k, v in options.items() if k not in CHILD_ONLY}
    if not outer:
        # Whoever releases the parent publishes its stored message: its result must still
        # reach this caller where the result backend replies to the sender (rpc://), as the
        # reply_to of a message the caller sent itself would.
        parent_opts.setdefault("reply_to", app.thread_oid)
    headers = {H_QUEUE: queue, H_FLOW: "1"}
    if outer:
        headers[H_PARENT] = outer
        if outer_queue != queue:
            headers[H_PARENT_QUEUE] = outer_queue
    plan.parent, ran = job_dict(parent, parent_opts, headers)
    plan.parent["options"]["task_id"] = parent_id
    if store_results:
        mark_for_store(plan.parent)
    if not outer:
        # Every id of the tree once: a nested parent is listed as its outer flow's child.
        check_ids(list(plan.levels(True)), parent_id, shared_jobs)  # shared: see send/ids.py
        root = flow_root(options, parent_id)
        plan.parent["options"]["root_id"] = root
        set_root(plan.children, root)
    plan.held = _held(plan, spec, ran.step_errbacks, fan)
    batch_of(plan, spec.batch)
    if chord:
        mark_chord(plan, fan, chord)  # a chord on the engine: the job that holds its header
    return plan


def _held(plan: Plan, spec: FlowSpec, ran: list[Any], fan: str) -> Held:
    """What a planned level's parent keeps beside Celery's fields: its children, and how it
    fans in (``spec`` applied to its children as it is: a window, a quorum, a reducer);
    refuses a spec its children cannot take, before anything is written."""
    max_active, window_queue = window_of(plan, spec.max_active)
    quorum, quorum_queues = quorum_of(plan, spec.quorum)
    return Held(
        children=plan.child_ids(),
        silent=list(plan.silent),
        single=plan.single,
        quorum=quorum,
        quorum_queues=quorum_queues,
        reduce=reduce_of(plan, spec.reduce),
        max_active=max_active,
        window_queue=window_queue,
        deadline=spec.deadline,
        on_deadline=spec.on_deadline if spec.deadline else "fail",
        fan_in=fan if fan != plan.parent_id else "",
        step_errbacks=ran,
    )


def flow_root(options: dict[str, Any], flow_id: str) -> str:
    """The Celery ``root_id`` every job of a flow carries: the one it was sent with (a chain,
    a chord or ``Task.replace`` hands it down), else that of the task starting the flow (as
    ``send_task`` gives a task's messages), else the flow's own id: the job its tree grows
    from, whose value is the flow's."""
    given = options.get("root_id")
    if given:
        return str(given)
    request = getattr(current_task, "request", None)
    caller = getattr(request, "root_id", None) or getattr(request, "id", None)
    return str(caller) if caller else flow_id


def set_root(nodes: Iterable[Node], root: str) -> None:
    """Give every job of ``nodes`` (child tasks, and every parent and child of nested flows)
    ``root`` as its Celery ``root_id``: monitors (Flower, ``celery events``) then draw the
    flow as one tree, as they draw a chord's tasks under the task that started it. A job's
    own ``root_id`` gives way: the outermost flow's root is the one its tree can have."""
    for node in nodes:
        if isinstance(node, Plan):
            node.parent["options"]["root_id"] = root
            set_root(node.children, root)
        elif isinstance(node, PlannedChain):
            set_root(node.steps, root)  # its first may be a nested flow
        else:
            node.message["options"]["root_id"] = root


def plan_children(
    app: Any,
    plan: Plan,
    children: Sequence[Signature],
    *,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    shared: dict[str, Any] | None = None,
    child_results: bool = True,
    store_results: bool = False,
    linked: bool = True,
    split: bool = True,
) -> None:
    """Plan ``children`` as children of ``plan``'s parent: append them (ids assigned and
    gated, messages built) to ``plan.children`` and their policies to ``plan.child_policies``.
    ``linked`` False: a chain of tasks is planned as nested flows (what children added to a
    running flow are: grow_flow writes no chain's steps).

    What a flow does for its children at start, and what ``add_children`` does for children
    added while it runs. Pure.
    """
    shared = shared or {}
    parent_id, queue = plan.parent_id, plan.queue
    for position, child in enumerate(expand(list(children), app), len(plan.children) + 1):
        child_policy = child.options.get("parent_policy")
        if is_linked(child):
            steps = None
            queues = _step_queues(app, child, shared) if linked else []
            if len(set(queues)) > 1 and split:
                # Steps on several queues' slots: one linked run per queue, each held on the
                # run before it (a flow level per run, not per step).
                runs = queue_runs(child, queues, app)
                if child_policy is not None:
                    runs.options["parent_policy"] = child_policy
                again = {"child_results": child_results, "store_results": store_results}
                plan_children(
                    app, plan, [runs], args=args, kwargs=kwargs, shared=shared, split=False, **again
                )
                continue
            if linked:
                steps = _steps(app, plan, child, args, kwargs, shared, child_results, store_results)
            if steps is not None:
                plan.children.append(PlannedChain(steps))
                if child_policy is not None:
                    for step in steps:
                        cid = step.id
                        plan.child_policies[cid] = check_policy(child_policy, f"child {cid}")
                continue
            policy_of = child.options.get("parent_policy")
            child = nested_chain(child, app)
            if policy_of is not None:
                child.options["parent_policy"] = policy_of
        if is_flow(child):
            silent = child.options.get("echomq_silent", False)
            inner = _nested(app, plan, child, args, kwargs, shared, child_results, store_results)
            cid = inner.parent_id
            if silent:
                plan.silent.append(cid)
            plan.children.append(inner)
        else:
            cid = child_job_id(child.options, position)
            if args or kwargs:
                child = child.clone(args=args, kwargs=kwargs)
            child_queue = route_queue(app, child, shared)
            headers = {H_QUEUE: child_queue, H_PARENT: parent_id}
            if child_queue != queue:
                headers[H_PARENT_QUEUE] = queue
            job, ran = job_dict(child, shared, headers)
            job["options"].pop("parent_policy", None)
            job["options"]["task_id"] = cid
            if not child_results:
                job["options"].setdefault("ignore_result", True)
            elif store_results:
                mark_for_store(job)
            plan.children.append(PlannedJob(job, ran))
        if child_policy is not None:
            plan.child_policies[cid] = check_policy(child_policy, f"child {cid}")


def _nested(
    app: Any,
    plan: Plan,
    child: Signature,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    shared: dict[str, Any],
    child_results: bool,
    store_results: bool,
) -> Plan:
    """A flow among ``plan``'s children (or a chain's first step), planned as a nested level."""
    inner_opts = {**shared, **child.options}
    inner_opts.pop("parent_policy", None)
    inner_opts.pop("echomq_silent", None)
    chord_words = inner_opts.pop(CHORD_WORDS, None)
    inner_args = () if child.immutable else (*args, *child.args)
    inner = plan_flow(
        app,
        child.kwargs["parent"],
        child.kwargs["children"],
        policy=child.kwargs["policy"],
        args=inner_args,
        kwargs=kwargs,
        options=inner_opts,
        outer=plan.parent_id,
        outer_queue=plan.queue,
        child_results=child_results,
        store_results=store_results,
        single=child.single,
        spec=FlowSpec.of(child.kwargs),  # its own deadline, window, quorum or reducer
    )
    if chord_words:
        # A chord's failure, worded as Celery words it (worker/settle.py reads the mark).
        inner.parent["options"].setdefault("headers", {}).setdefault(H_CHORD, "1")
    return inner


def _step_queues(app: Any, chain: Signature, shared: dict[str, Any]) -> list[str]:
    """The queue each step of a linked chain is routed to (a flow step: its parent's)."""
    return [
        route_queue(app, t.kwargs["parent"], {**shared, **t.options})
        if is_flow(t)
        else route_queue(app, t, shared)
        for t in chain.tasks
    ]


def _steps(
    app: Any,
    plan: Plan,
    chain: Signature,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    shared: dict[str, Any],
    child_results: bool,
    store_results: bool,
) -> list[PlannedJob | Plan] | None:
    """A linked chain's steps as jobs, each naming the flow's parent and the step after it
    (:data:`H_NEXT`); None when its steps live on more than one queue's slot (one script
    cannot make the next step pending there: the chain is then planned as nested flows).
    The first step takes the flow's partial arguments, as a chain's first task does."""
    tasks = list(chain.tasks)
    head = tasks[0] if is_flow(tasks[0]) else None
    if head is None and (args or kwargs):
        tasks[0] = tasks[0].clone(args=args, kwargs=kwargs)
    queues = _step_queues(app, chain, shared)
    if len(set(queues)) > 1:
        return None
    step_queue = queues[0]
    ids = [job_id_of(task.options) for task in tasks[head is not None :]]
    jobs: list[PlannedJob | Plan] = []
    if head is not None:
        nested = _nested(app, plan, head, args, kwargs, shared, child_results, store_results)
        nested.parent["options"]["headers"][H_NEXT] = ids[0]
        ids.insert(0, nested.parent_id)
        jobs.append(nested)
    for i, task in enumerate(tasks):
        if i == 0 and head is not None:
            continue
        headers = {H_QUEUE: step_queue, H_PARENT: plan.parent_id}
        if step_queue != plan.queue:
            headers[H_PARENT_QUEUE] = plan.queue
        if i + 1 < len(tasks):
            headers[H_NEXT] = ids[i + 1]
        job, ran = job_dict(task, shared, headers)
        job["options"].pop("parent_policy", None)
        job["options"]["task_id"] = ids[i]
        if not child_results:
            job["options"].setdefault("ignore_result", True)
        elif store_results:
            mark_for_store(job)
        jobs.append(PlannedJob(job, ran))
    return jobs


def check_depth(plan: Plan, limit: int, above: int = 0) -> None:
    """Refuse a tree whose deepest path has more than ``limit`` flow levels (``above``: the
    levels over ``plan``'s parent, for children added to a nested flow)."""
    deepest, stack = 0, [(plan.children, above + 1)]
    while stack:
        children, depth = stack.pop()
        deepest = max(deepest, depth)
        heads = (child.head for child in children)
        stack.extend((head.children, depth + 1) for head in heads if isinstance(head, Plan))
    if deepest > limit:
        raise DepthError(
            f"flow {plan.parent_id} is {deepest} levels deep (flows nested in flows: a group, "
            "chord or flow step of a chain counts as a level, a run of tasks as none); "
            f"allowed: at most {limit} (the echomq_max_depth setting); nothing was sent"
        )


def too_deep(limit: int) -> DepthError:
    """What a tree too deep for Python to plan raises (its depth was never counted)."""
    return DepthError(
        f"flow tree too deep to plan; allowed: at most {limit} levels (the echomq_max_depth "
        "setting); nothing was sent"
    )
