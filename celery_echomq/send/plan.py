"""A flow, planned: every id assigned and gated, every message built, before anything is
sent.

Pure: nothing here touches Redis or the broker. ``send/start.py`` sends a :class:`Plan`; the
headers it writes on each job are named in ``store/headers.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from celery.canvas import Signature

from celery_echomq.errors import DepthError, PolicyError
from celery_echomq.send.shapes import CALLBACKS, expand, merge_callbacks
from celery_echomq.store.deadline_spec import stamp
from celery_echomq.store.headers import (
    H_FLOW,
    H_PARENT,
    H_PARENT_QUEUE,
    H_QUEUE,
    H_RESULT,
    RESERVED,
)
from celery_echomq.store.keyspace import check_id, check_queue, check_unique, new_job_id

POLICIES = ("fail", "ignore", "remove", "continue")


# Options that belong to the flow's parent alone: the rest reach every child too.
PARENT_ONLY = frozenset(
    {"task_id", "link", "link_error", "chain", "chord", "group_id", "group_index", "reply_to"}
)
# Options that delay or expire the children's messages; the parent is sent when released.
CHILD_ONLY = frozenset({"task_id", "countdown", "eta", "expires"})
# Options a stored payload must not carry: they are per-send, not per-job.
NOT_STORED = frozenset({"producer", "connection", "router", "add_to_parent", "publisher"})


def job_id_of(options: dict[str, Any], fallback: str | None = None) -> str:
    """The signature's own ``task_id`` (gated: an empty one is an error, not a default)."""
    given = options.get("task_id")
    if given is None:
        given = fallback if fallback is not None else new_job_id()
    return check_id(given)


def _child_id(options: dict[str, Any], position: int) -> str:
    """A child's id, gated; a refusal names the child's place among its siblings."""
    try:
        return job_id_of(options)
    except ValueError as exc:
        raise type(exc)(
            f"flow child {position}: {exc}; allowed: a signature without task_id, a frozen "
            "one (freeze(), task_id=celery.utils.uuid()), or task_id='JOB' + uuid.uuid4().hex"
        ) from exc


def check_policy(policy: object, where: str) -> str:
    if policy not in POLICIES:
        raise PolicyError(
            f"{where}: unknown parent_policy {policy!r}; allowed: " + ", ".join(POLICIES)
        )
    return str(policy)


@dataclass
class Plan:
    """A flow with every id assigned and every message built, before anything is sent.

    A nested flow's entry in ``children`` is ``{"nested": <its Plan as a dict>}``; its
    ``outer`` is the id of the flow it is a child of.
    """

    queue: str
    parent_id: str
    parent: dict[str, Any]
    children: list[dict[str, Any]] = field(default_factory=list)
    policy: str = "fail"
    child_policies: dict[str, str] = field(default_factory=dict)
    outer: str = ""
    # The parent takes its one child's value as is, not as a list (a chain's step).
    single: bool = False
    # Children whose values the parent does not get (a spread, see shapes.py).
    silent: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        # Not dataclasses.asdict: it rebuilds every dict subclass it meets from a generator,
        # which a Signature (a link, an argument) cannot be made from. The values are the
        # plan's own, never shared with another.
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        return cls(**data)

    def levels(self) -> Iterator[Plan]:
        """This flow, then every nested flow, outer before inner."""
        yield self
        for job in self.children:
            if "nested" in job:
                yield from Plan.from_dict(job["nested"]).levels()

    def child_ids(self) -> list[str]:
        return [child_id(job) for job in self.children]

    def valued_ids(self) -> list[str]:
        """The children whose values the parent gets, in order."""
        silent = set(self.silent)
        return [cid for cid in self.child_ids() if cid not in silent]

    def chunked(self, chunk_size: int) -> bool:
        """Whether this level takes open/add/seal instead of one enqueue_flow script."""
        return len(self.children) > chunk_size or any(
            child_queue(job) != self.queue for job in self.children
        )


def child_queue(job: dict[str, Any]) -> str:
    return str(job["nested"]["queue"] if "nested" in job else job["options"]["headers"][H_QUEUE])


def child_id(job: dict[str, Any]) -> str:
    return str(job["nested"]["parent_id"] if "nested" in job else job["options"]["task_id"])


def route_queue(app: Any, sig: Signature, options: dict[str, Any]) -> str:
    """The Celery queue a signature is sent to: its ``queue`` option, else the app's router."""
    queue = sig.options.get("queue") or options.get("queue")
    if queue is None:
        route = app.amqp.router.route({}, sig.task, sig.args, sig.kwargs)
        queue = route.get("queue")
    name = getattr(queue, "name", queue) or app.conf.task_default_queue
    return check_queue(str(name))


def _job_dict(sig: Signature, options: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    opts = {k: v for k, v in {**options, **sig.options}.items() if k not in NOT_STORED}
    for name in CALLBACKS:
        if name in options and name in sig.options:
            # Both run, as a chord runs its body's own callbacks and those it was sent with.
            opts[name] = merge_callbacks(sig.options[name], options[name])
    given = opts.get("headers") or {}
    if any(str(name).startswith(RESERVED) for name in given):
        # The flow's own headers are the plan's alone: one a signature brings (copied from a
        # request, or from untrusted JSON) must not name another flow's job.
        given = {k: v for k, v in given.items() if not str(k).startswith(RESERVED)}
    opts["headers"] = {**given, **headers}
    return {
        "task": sig.task,
        "args": list(sig.args),
        "kwargs": dict(sig.kwargs),
        "options": opts,
        "subtask_type": None,
        "immutable": sig.immutable,
    }


def is_flow(sig: Any) -> bool:
    return getattr(sig, "subtask_type", None) == "flow"


def check_depth(plan: Plan, limit: int, above: int = 0) -> None:
    """Refuse a tree whose deepest path has more than ``limit`` flow levels (``above``: the
    levels over ``plan``'s parent, for children added to a nested flow)."""
    deepest, stack = 0, [(plan.children, above + 1)]
    while stack:
        children, depth = stack.pop()
        deepest = max(deepest, depth)
        stack.extend((job["nested"]["children"], depth + 1) for job in children if "nested" in job)
    if deepest > limit:
        raise DepthError(
            f"flow {plan.parent_id} is {deepest} levels deep (a chain's steps count as levels); "
            f"allowed: at most {limit} (the echomq_max_depth setting); nothing was sent"
        )


def too_deep(limit: int) -> DepthError:
    """What a tree too deep for Python to plan raises (its depth was never counted)."""
    return DepthError(
        f"flow tree too deep to plan; allowed: at most {limit} levels (the echomq_max_depth "
        "setting); nothing was sent"
    )


def parent_args(job: dict[str, Any], values: list[Any]) -> list[Any]:
    """A released parent's arguments: the values of its children (the one value as is, for a
    chain's step), then its own; an immutable parent's own alone."""
    if job.get("immutable"):
        return list(job["args"])
    if job.get("single"):
        return [values[0] if values else None, *job["args"]]
    return [values, *job["args"]]


def valued(job: dict[str, Any]) -> list[str]:
    """The ids of a stored parent's children whose values it gets, in order."""
    silent = job.get("silent")
    if not silent:
        return list(job["children"])
    return [cid for cid in job["children"] if cid not in set(silent)]


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
) -> Plan:
    """Assign and gate every id and build every message; touches neither Redis nor the broker.

    Each job's keys live on the slot of the queue it is sent to: a child routed elsewhere
    than its parent is credited across slots (see ``start_flow``). ``child_results`` False
    (``echomq_child_results``): a child task whose signature does not say otherwise is sent
    with ``ignore_result``; its value reaches the parent through the store alone.
    ``store_results`` (the app's result backend is on the store's server and database, see
    store/results.py): every job whose options leave ``ignore_result`` unset is marked for the
    store to write its result (:func:`mark_for_store`).
    """
    parent_id = job_id_of(parent.options, options.get("task_id"))
    queue = route_queue(app, parent, options)
    shared = {k: v for k, v in options.items() if k not in PARENT_ONLY}
    plan = Plan(
        queue=queue, parent_id=parent_id, parent={}, policy=policy, outer=outer, single=single
    )
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
    plan.parent = _job_dict(parent, parent_opts, headers)
    plan.parent["options"]["task_id"] = parent_id
    if store_results:
        mark_for_store(plan.parent)
    plan.parent["children"] = plan.child_ids()
    if single:
        plan.parent["single"] = True
    if plan.silent:
        plan.parent["silent"] = list(plan.silent)
    if not outer:
        # Every id of the tree once: a nested parent is listed as its outer flow's child.
        check_unique([parent_id, *(cid for level in plan.levels() for cid in level.child_ids())])
    return plan


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
) -> None:
    """Plan ``children`` as children of ``plan``'s parent: append them (ids assigned and
    gated, messages built) to ``plan.children`` and their policies to ``plan.child_policies``.

    What a flow does for its children at start, and what ``add_children`` does for children
    added while it runs. Pure.
    """
    shared = shared or {}
    parent_id, queue = plan.parent_id, plan.queue
    for position, child in enumerate(expand(list(children), app), len(plan.children) + 1):
        child_policy = child.options.get("parent_policy")
        if is_flow(child):
            inner_opts = {**shared, **child.options}
            inner_opts.pop("parent_policy", None)
            silent = inner_opts.pop("echomq_silent", False)
            inner_args = () if child.immutable else (*args, *child.args)
            inner = plan_flow(
                app,
                child.kwargs["parent"],
                child.kwargs["children"],
                policy=child.kwargs["policy"],
                args=inner_args,
                kwargs=kwargs,
                options=inner_opts,
                outer=parent_id,
                outer_queue=queue,
                child_results=child_results,
                store_results=store_results,
                single=child.single,
            )
            stamp(inner, child.kwargs)  # its own deadline, if it has one
            cid = inner.parent_id
            if silent:
                plan.silent.append(cid)
            plan.children.append({"nested": inner.to_dict()})
        else:
            cid = _child_id(child.options, position)
            if args or kwargs:
                child = child.clone(args=args, kwargs=kwargs)
            child_queue = route_queue(app, child, shared)
            headers = {H_QUEUE: child_queue, H_PARENT: parent_id}
            if child_queue != queue:
                headers[H_PARENT_QUEUE] = queue
            job = _job_dict(child, shared, headers)
            job["options"].pop("parent_policy", None)
            job["options"]["task_id"] = cid
            if not child_results:
                job["options"].setdefault("ignore_result", True)
            elif store_results:
                mark_for_store(job)
            plan.children.append(job)
        if child_policy is not None:
            plan.child_policies[cid] = check_policy(child_policy, f"child {cid}")


def mark_for_store(job: dict[str, Any]) -> None:
    """Send ``job`` with ``ignore_result`` and the :data:`H_RESULT` header: the store writes
    its result when it completes, in the same script call (see store/results.py).

    Not for a job whose options decide ``ignore_result`` themselves, nor for one that is part
    of a chord (a flow in a chord's header): Celery's ``mark_as_done`` must store its result
    before ``on_chord_part_return`` counts it.
    """
    options = job["options"]
    if "ignore_result" in options or options.get("chord"):
        return
    options["ignore_result"] = True
    options["headers"][H_RESULT] = "1"
