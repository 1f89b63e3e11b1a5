"""A flow run eagerly: ``flow(...).apply()``, and ``apply_async`` under ``task_always_eager``.

Every child runs in this process, in order, then the parent, as ``chord(...).apply()`` does;
nothing touches Redis or the broker. The fan-in follows the rules
``store/fan_in_rules.py`` states for both ways, which ``lua/includes/settle_child.lua``
applies in the store, kept in memory (``result.py``'s ``FanIn``): a child's value is counted
once, a failed child's ``parent_policy`` (else the flow's ``policy``) decides what it means
for the parent, a deadline applies as deadline.lua does, and the result holds what the reads
give on a worker.

What differs from a worker: children run one after another, in the order given, so under
``continue`` the parent runs (at once, as on release) with the values of the children before
the failed one, then the remaining children run and are recorded; no store, lease, recovery or
exactly-once bookkeeping exists; the reads work on the result and in the parent's body.
``add_children`` works while the parent waits (from a child's body, or with ``parent_id=``);
once the parent has run it raises ``FlowClosedError``, as on a worker.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from celery import states
from celery.result import AsyncResult

from celery_echomq.config import Settings
from celery_echomq.errors import FlowClosedError, FlowFailed, ReduceError
from celery_echomq.result import EagerFlowResult, FanIn
from celery_echomq.send.errbacks import errbacks_left, ran_by_child, with_errbacks
from celery_echomq.send.fan_in import FlowSpec, empty, fold, refuse_growth
from celery_echomq.send.flow_reads import IN_PROCESS
from celery_echomq.send.join import EAGER_JOIN, check_on_exists, eager_joined, eager_ran
from celery_echomq.send.plan import (
    Plan,
    check_depth,
    parent_args,
    plan_children,
    plan_flow,
    too_deep,
)
from celery_echomq.send.shape import CALLBACKS, expand, is_linked, merge_callbacks, nested_chain
from celery_echomq.send.tasks import register_tasks
from celery_echomq.store.deadline_spec import exceeded, level_deadline
from celery_echomq.store.headers import H_REDUCE, H_RESULT
from celery_echomq.store.planned import Node, PlannedChain, PlannedJob, stored_message
from celery_echomq.store.state import find_state
from celery_echomq.worker.settle import error_text


@dataclass
class Growing:
    """The children an eager flow still has to run; ``add_children`` appends to them."""

    app: Any
    plan: Plan
    fanin: FanIn
    # (signature, id, planned job, args, kwargs) per child, in the order they run.
    entries: list[tuple[Any, str, Node, tuple[Any, ...], dict[str, Any]]]

    def add(self, sigs: Sequence[Any]) -> list[str]:
        """Append ``sigs`` as children (what ``grow_flow.lua`` does on a worker)."""
        if not self.fanin.waiting:
            state = "failed" if self.fanin.failure is not None else "released"
            raise FlowClosedError(
                f"flow {self.plan.parent_id} is {state}: its parent no longer waits for "
                "children, so none can be added (nothing was run)",
                self.plan.parent_id,
                state,
            )
        refuse_growth(self.plan.parent_id, self.plan.held)
        added = Plan.for_children(self.plan.queue, self.plan.parent_id)
        # Added children take no partial arguments, as on a worker.
        # A chain of tasks among them is held step by step, as on a worker (see grow.py).
        sigs = [
            nested_chain(s, self.app) if is_linked(s) else s for s in expand(list(sigs), self.app)
        ]
        plan_children(self.app, added, sigs, shared={"queue": self.plan.queue})
        listed = {cid for _, cid, _, _, _ in self.entries}
        fresh: list[str] = []
        for sig, cid, job in zip(sigs, added.child_ids(), added.children, strict=True):
            if cid in listed:  # a repeated add adds nothing twice
                continue
            listed.add(cid)
            self.entries.append((sig, cid, job, (), {}))
            self.fanin.outstanding += 1
            fresh.append(cid)
        return fresh


# When the eager run began (monotonic, epoch): every level's deadline counts from it.
STARTED: ContextVar[tuple[float, float] | None] = ContextVar("echomq_eager_t0", default=None)


def _deadline_of(plan: Plan) -> tuple[float, float, str] | None:
    """(monotonic time it passes, epoch seconds, on_deadline) of a level's deadline."""
    if (found := level_deadline(plan)) is None:
        return None
    spec, on_deadline = found
    mono0, wall0 = STARTED.get() or (time.monotonic(), time.time())
    wall = wall0 + spec["in"] if "in" in spec else spec["at"]
    return mono0 + (wall - wall0), wall, on_deadline


def _outcome(res: Any) -> tuple[bool, Any]:
    """(succeeded, value or error text) of what a child's ``apply`` returned."""
    results = getattr(res, "results", None)
    if results is not None:  # a group (GroupResult of eager results)
        outcomes = [_outcome(r) for r in results]
        failed = next((value for ok, value in outcomes if not ok), None)
        if failed is not None:
            return False, failed
        return True, [value for _, value in outcomes]
    if res.state == states.SUCCESS:
        return True, res.result
    exc = res.result
    return False, error_text(exc) if isinstance(exc, BaseException) else str(exc)


def apply_flow(
    sig: Any,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    throw: bool | None = None,
    **options: Any,
) -> EagerFlowResult:
    """Run ``sig`` (a flow) in this process. ``throw`` (default ``task_eager_propagates``,
    as for ``Task.apply``): raise the parent's error instead of returning a failed result."""
    app = sig._get_app()
    register_tasks(app)  # a canvas parent runs the spread task, installed or not
    joins = check_on_exists(options.pop("on_exists", "raise")) == "join"
    merged = {k: v for k, v in {**sig.options, **options}.items() if v is not None}
    for name in ("producer", "connection", "add_to_parent", "publisher", "router"):
        merged.pop(name, None)
    if options.get("task_id") is not None and "_shape" not in sig.__dict__:
        sig = sig.clone(task_id=options["task_id"])
    state = find_state(app)
    limit = state.settings.max_depth if state is not None else Settings.max_depth
    try:
        # The same shape as on a worker: chains, groups and chords as flows of single tasks.
        sig, fan = sig.shape(shared=joins)
        own = {k: v for k, v in sig.options.items() if v is not None}
        merged = {
            **own,
            **merged,
            **{
                k: merge_callbacks(own[k], merged[k]) for k in CALLBACKS if k in own and k in merged
            },
        }
        sig = with_errbacks(sig, merged.get("link_error"))
        partial = () if sig.immutable else (*tuple(args or ()), *sig.args)
        plan = plan_flow(
            app,
            sig.parent,
            sig.children,
            policy=sig.policy,
            args=tuple(partial),
            kwargs=kwargs,
            options=merged,
            single=sig.single,
            shared_jobs=joins,  # one job listed by several flows of it: send/ids.py
            # Refused as on a worker; a window runs its children in order, one at a time.
            spec=FlowSpec.of(sig.kwargs),
        )
    except RecursionError:
        raise too_deep(limit) from None
    check_depth(plan, limit)
    seen: dict[str, FanIn] = {}
    started = STARTED.set((time.monotonic(), time.time()))
    joining = EAGER_JOIN.set(joins)
    try:
        result: EagerFlowResult = eager_joined(plan.parent_id, plan.parent)  # joined: ran before
        if result is None:
            result = _run(app, sig, plan, tuple(partial), kwargs or {}, merged, seen)
            eager_ran(plan.parent_id, plan.parent, result)
    finally:
        EAGER_JOIN.reset(joining)
        STARTED.reset(started)
    if fan and fan in seen:  # a joined run's own fan-in stays
        result.fanin = seen[fan]
    throw = bool(app.conf.task_eager_propagates) if throw is None else throw
    if throw and result.state in states.PROPAGATE_STATES:
        exc = result.result
        raise exc if isinstance(exc, BaseException) else Exception(exc)
    return result


def _run(
    app: Any,
    sig: Any,
    plan: Plan,
    partial: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: dict[str, Any],
    seen: dict[str, FanIn],
) -> EagerFlowResult:
    return _Level(app, sig, plan, partial, kwargs, options, seen).run()


class _Level:
    """One level of a flow run eagerly: its fan-in, the children it still has to run (added
    ones too), its deadline, and its parent's result once the parent ran."""

    def __init__(
        self,
        app: Any,
        sig: Any,
        plan: Plan,
        partial: tuple[Any, ...],
        kwargs: dict[str, Any],
        options: dict[str, Any],
        seen: dict[str, FanIn],
    ) -> None:
        self.app, self.sig, self.plan, self.seen = app, sig, plan, seen
        # Children added while this runs are appended to the entries, and to child_ids (the
        # order the parent gets their values in).
        self.child_ids = plan.child_ids()
        n = len(self.child_ids)
        quorum = plan.held.quorum
        self.fanin = seen[plan.parent_id] = FanIn(
            plan.parent_id, n, plan.policy, quorum=quorum, total=n
        )
        self.parent_options = {
            k: merge_callbacks(sig.parent.options[k], v) if k in sig.parent.options else v
            for k, v in options.items()
            if k in CALLBACKS
        }
        self.parent_res: Any = None
        # The errors of the children that failed, by id (what their tasks raised).
        self.errors: dict[str, BaseException] = {}
        # Each child's result, by its id (the flow's result's ``parent``).
        self.results: dict[str, Any] = {}
        self.silent = set(plan.silent)
        self.root = str(plan.parent["options"].get("root_id") or plan.parent_id)
        self.growing = Growing(
            app,
            plan,
            self.fanin,
            [
                (child, cid, job, partial, kwargs)
                for child, cid, job in zip(sig.children, self.child_ids, plan.children, strict=True)
            ],
        )
        self.deadline = _deadline_of(plan)
        self.reducer: list[Any] | None = plan.held.reduce
        self.acc: Any = empty(self.reducer) if self.reducer is not None else None

    def run(self) -> EagerFlowResult:
        """The children in order, the parent once released; the flow's result."""
        if not self.child_ids:
            self.fanin.waiting = False
            self.run_parent()
        IN_PROCESS.growing[self.plan.parent_id] = self.growing
        try:
            self.run_children()
        finally:
            IN_PROCESS.growing.pop(self.plan.parent_id, None)
        return self.result()

    def run_parent(self) -> None:
        plan, sig = self.plan, self.sig
        values = self.fanin.released_values(
            [cid for cid in self.child_ids if cid not in self.silent]
        )
        if self.reducer is not None:
            values = self.acc  # the parent's first argument: the accumulator
        IN_PROCESS.readable[plan.parent_id] = self.fanin
        try:
            with under_root(self.root):
                self.parent_res = sig.parent.apply(
                    tuple(parent_args({"args": [], "single": plan.single}, values)),
                    task_id=plan.parent_id,
                    throw=False,
                    **self.parent_options,
                )
        finally:
            IN_PROCESS.readable.pop(plan.parent_id, None)

    def passed(self, running: list[str], at: int) -> bool:
        """The deadline passed while the parent waits: it fails, or runs with the values
        so far; the children not started (from ``at``) are cut."""
        deadline, fanin = self.deadline, self.fanin
        if deadline is None or not fanin.waiting or time.monotonic() < deadline[0]:
            return False
        fanin.waiting = False
        fanin.cut = [e[1] for e in self.growing.entries[at:]]
        if deadline[2] == "continue":
            self.run_parent()
        else:
            fanin.failure = exceeded(self.plan.parent_id, [*running, *fanin.cut], deadline[1])
        return True

    def run_children(self) -> None:
        i = 0
        while i < len(self.growing.entries):
            child, cid, job, c_args, c_kwargs = self.growing.entries[i]
            if self.passed([], i):
                break
            if i >= len(self.child_ids):
                self.child_ids.append(cid)
            i += 1
            token = IN_PROCESS.current.set(self.plan.parent_id)
            try:
                res = _run_child(self.app, child, job, c_args, c_kwargs, cid, self.seen, self.root)
            finally:
                IN_PROCESS.current.reset(token)
            self.results[cid] = res
            ok, data = _outcome(res)
            # A child still running when the deadline passed finishes and is recorded; its
            # value is not the released parent's (nor folded into its accumulator).
            cut = self.passed([cid], i)
            if ok and self.reducer is not None:  # folded as reduce.lua folds it, or failed
                ok, data = self.fold(cid, job, data)
            # A chain's failure is its failed step's, named by its own id (as on a worker).
            settled = cid if ok or not isinstance(job, PlannedChain) else str(res.id)
            if not ok and isinstance(getattr(res, "result", None), BaseException):
                self.errors[settled] = res.result
            if self.fanin.settle(settled, ok, data, child.options.get("parent_policy")):
                self.run_parent()
            if cut:
                break
            if self.fanin.quorum and self.parent_res is not None:
                # Its quorum met: the children not started never run, counted as cut.
                self.fanin.ended_without += [e[1] for e in self.growing.entries[i:]]
                break

    def fold(self, cid: str, job: Node, value: Any) -> tuple[bool, Any]:
        """``value`` folded into the accumulator (as reduce.lua folds it), or the child failed
        with the reason; its result stored as its worker stores it (_run_child kept Celery's
        trace from storing a SUCCESS before this), under ``task_store_eager_result``."""
        assert self.reducer is not None
        try:
            self.acc = fold(self.reducer, self.acc, value)
        except ValueError as exc:
            error = ReduceError(str(exc))
            self.errors[cid] = error
            _store_child(self.app, cid, job, error)
            return False, error_text(error)
        _store_child(self.app, cid, job, value)
        return True, value

    def result(self) -> EagerFlowResult:
        app, sig, plan, fanin, parent_res = (
            self.app,
            self.sig,
            self.plan,
            self.fanin,
            self.parent_res,
        )
        # A child that never ran (cut by the deadline, or left after a quorum): its id's
        # result, as on a worker.
        done = self.results
        fanin.results = [done[c] if c in done else AsyncResult(c, app=app) for c in self.child_ids]
        if parent_res is not None:
            return EagerFlowResult(
                plan.parent_id,
                parent_res.result,
                parent_res.state,
                getattr(parent_res, "traceback", None),
                sig.parent.task,
                fanin,
                app,
            )
        failure = fanin.failure or FlowFailed(f"flow {plan.parent_id}: never released")
        child = failure.child_id or ""
        exc: BaseException = failure
        if child and (plan.single or ran_by_child(stored_message(plan), child)):
            # A chain's step held on the step before it, or a group parent's task: that
            # task's own error, as a chord's chain or group body raises it (as on a worker).
            exc = self.errors.get(child) or failure
        _record_failure(app, plan, sig, exc, child)
        return EagerFlowResult(
            plan.parent_id, exc, states.FAILURE, None, sig.parent.task, fanin, app
        )


def _run_child(
    app: Any,
    child: Any,
    job: Node,
    partial: tuple[Any, ...],
    kwargs: dict[str, Any],
    cid: str,
    seen: dict[str, FanIn],
    root: str,
) -> Any:
    if isinstance(job, PlannedChain):
        return _run_steps(app, child, job, partial, kwargs, seen, root)
    if isinstance(job, Plan):
        inner_partial = () if child.immutable else (*partial, *child.args)
        inner = job
        inner_opts = {k: v for k, v in child.options.items() if k in ("link", "link_error")}
        return _run(app, child, inner, inner_partial, kwargs, inner_opts, seen)
    message = job.message
    joined = eager_joined(cid, message)  # on_exists="join": a job run before is not run again
    if joined is not None:
        return joined
    run = child.clone(args=partial, kwargs=kwargs) if partial or kwargs else child
    # A child of a flow with a reducer stores its result once its value is folded (_Level's
    # fold), as on a worker: Celery's trace stores none.
    held = {"ignore_result": True} if _held(message) else {}
    with under_root(root):
        return eager_ran(cid, message, run.apply(task_id=cid, throw=False, **held))


def _held(job: Mapping[str, Any]) -> bool:
    """Whether a child's result waits for its flow's reducer (send/fan_in.py marks it)."""
    headers = (job.get("options") or {}).get("headers") or {}
    return bool(headers.get(H_REDUCE) and headers.get(H_RESULT))


def _store_child(app: Any, cid: str, node: Node, outcome: Any) -> None:
    """A folded child's result, SUCCESS or (``outcome`` a ReduceError) FAILURE, stored as
    Celery's eager trace would have stored it: only with ``task_store_eager_result`` (a
    nested flow's parent stores its own)."""
    from celery.app.task import Context

    if not isinstance(node, PlannedJob):
        return
    job = node.message
    task = app.tasks.get(str(job.get("task")))
    if not _held(job) or task is None or task.ignore_result or not task.store_eager_result:
        return
    request = Context(id=cid, task=task.name, args=job.get("args", []), is_eager=True)
    if isinstance(outcome, BaseException):
        request.errbacks = job["options"].get("link_error")
        app.backend.mark_as_failure(cid, outcome, request=request)
    else:
        app.backend.store_result(cid, outcome, states.SUCCESS, request=request)


class _Lineage:
    """What ``Task.apply`` reads of the task it runs under: its request's ids."""

    def __init__(self, request: Any) -> None:
        self.request = request


@contextmanager
def under_root(root: str) -> Iterator[None]:
    """Run an eager job with its flow's root as its ``request.root_id``, as on a worker.

    ``Task.apply`` takes ``root_id`` and ``parent_id`` from the task on top of Celery's task
    stack, and has no option for them: a stand-in carrying the flow's root and the id of the
    task beneath (the caller, if any: the job's ``parent_id`` stays what it was) is on top
    while ``apply`` starts. It says it is eager, so ``current_worker_task`` passes over it.
    """
    from celery._state import _task_stack
    from celery.app.task import Context

    below = getattr(_task_stack.top, "request", None)
    caller = getattr(below, "id", None)
    _task_stack.push(_Lineage(Context(id=caller, root_id=root, is_eager=True)))
    try:
        yield
    finally:
        _task_stack.pop()


def _run_steps(
    app: Any,
    chain: Any,
    job: PlannedChain,
    partial: tuple[Any, ...],
    kwargs: dict[str, Any],
    seen: dict[str, FanIn],
    root: str,
) -> Any:
    """A linked chain's steps, one after another in a loop (no recursion, whatever its
    length), each given the value of the one before: the last step's result, or the result
    of the step that failed (the chain's failure, as on a worker). A first step that is a
    flow runs as one, its children given the partial arguments."""
    res: Any = None
    for i, (step, planned) in enumerate(zip(chain.tasks, job.steps, strict=True)):
        if i == 0:
            res = _run_child(app, step, planned, partial, kwargs, planned.id, seen, root)
        else:
            run = step if step.immutable else step.clone(args=(res.result,))
            with under_root(root):
                res = run.apply(task_id=planned.id, throw=False)
        if res.state != states.SUCCESS:
            break
    return res


def _record_failure(app: Any, plan: Plan, sig: Any, failure: BaseException, child: str) -> None:
    """What a worker does for a parent failed by its child, as Celery's eager trace does for a
    failed task: run its ``link_error`` callbacks; store it only with
    ``task_store_eager_result``."""
    from celery.app.task import Context
    from celery.utils.functional import maybe_list

    # A group parent's tasks, or a chain parent's steps, ran its errbacks themselves
    # (send/errbacks.py).
    left = errbacks_left(stored_message(plan), child)
    request = Context(
        id=plan.parent_id,
        task=sig.parent.task,
        errbacks=maybe_list(left) or None,
        args=plan.parent.get("args", []),
        kwargs=plan.parent.get("kwargs", {}),
        delivery_info={"is_eager": True},
        is_eager=True,
    )
    app.backend.mark_as_failure(
        plan.parent_id,
        failure,
        request=request,
        store_result=bool(app.conf.task_store_eager_result),
        call_errbacks=bool(left),
    )
