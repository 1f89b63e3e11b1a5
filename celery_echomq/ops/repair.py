"""An operator's repairs of a flow: retry one that failed, release one that is held.

``retry_flow`` runs a flow failed under policy ``fail`` (or ``fail_at_end``) again: its
failed children are re-published as new attempts and the parent awaits them once more.
``release_flow`` runs a held parent now with the values so far, as ``continue`` does. Each step is
one script (``retry_flow``, ``retry_children``, ``release``); what follows it (clearing
Celery's stored failure, a publish) is repeated by recovery if the process dies in between:
a child left pending without a message is re-published once its message is seen gone.

What ``celery -A proj echomq retry|release`` and ``FlowResult.retry()|release()`` call.

A flow its deadline failed needs a new deadline to be retried (``retry_flow(state, job_id,
deadline=...)``, ``celery echomq retry JOBID --deadline S``): one script (retry_deadline.lua)
holds the parent again with the new deadline armed and makes its cut children, and those
failed under ``fail`` since, pending; then Celery's stored failures are cleared and the
children published (a nested flow's parent among them dispatched).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any

from celery_echomq.errors import NotRepairableError
from celery_echomq.ops.failures import FlowRoot, child_of, failed_chunks, flow_root
from celery_echomq.ops.outcomes import RetryOutcome
from celery_echomq.ops.release import release_flow
from celery_echomq.ops.views import JobNode, read_tree
from celery_echomq.send.dispatch import dispatch_parent
from celery_echomq.send.jobs import FAILING
from celery_echomq.send.join import against_own_flow
from celery_echomq.send.start import publish
from celery_echomq.store import deadlines as store
from celery_echomq.store.codec import Stored, load_job
from celery_echomq.store.deadline_spec import deadline_spec, spec_ms
from celery_echomq.store.reads import steps_after
from celery_echomq.store.replies import Status
from celery_echomq.store.state import EchoMQ
from celery_echomq.worker.unrevoke import unrevoke

__all__ = ["release_flow", "retry_flow"]


logger = logging.getLogger("celery_echomq")

RETRY_ALLOWS = (
    "retry applies to a flow that failed under policy 'fail' or 'fail_at_end' (or that failed "
    "its outer flow), and to a held flow with children failed under either"
)


def _settling(children: Iterable[JobNode]) -> list[JobNode]:
    """The jobs whose outcome settles one of ``children``: each child, or each step of a
    linked chain (the step that failed is the one to run again, with its input)."""
    return [job for c in children for job in (c.steps or (c,))]


def _retryable(state: EchoMQ, node: JobNode) -> tuple[list[JobNode], list[str]]:
    """The children whose failure failed (or would fail) ``node``: failed under policy fail,
    read from the flow's record of failed children a chunk at a time; and the ids that
    record names whose rows are gone (expired).

    Such a child was never counted under fail (settle_child returns before the DECR), and is
    counted back under fail_at_end; one counted under ignore/remove/continue is left alone.
    """
    found: list[JobNode] = []
    gone: list[str] = []
    for part in failed_chunks(state, flow_root(state, node.id, node.queue)):
        found += [c for c in _settling(part) if c.state == "failed" and c.policy in FAILING]
        gone += [c.id for c in part if c.state == "missing"]
    return found, gone


def _own_failure(node: JobNode) -> bool:
    """A flow parent failed by its own body, every child settled (not abandoned half-way, and
    none cut: a flow its deadline failed is retried with a new one)."""
    flow = node.flow
    return (
        node.state == "failed"
        and flow is not None
        and flow.failed_child is None
        and flow.outstanding == 0
        and flow.cut == 0
    )


def _failed_by_child(node: JobNode) -> bool:
    return node.state == "failed" and node.flow is not None and node.flow.failed_child is not None


def _flow(state: EchoMQ, job_id: str) -> FlowRoot:
    root = flow_root(state, job_id)
    node = root.node
    if node.flow is None:
        where = f" of flow {node.parent}" if node.parent else ""
        raise NotRepairableError(
            f"{job_id} is not a flow parent (a {node.state} child{where}); name its flow, "
            f"and one child with --child",
            node.state,
            job_id,
        )
    return root


def _plan(state: EchoMQ, node: JobNode, targets: list[JobNode]) -> None:
    """Refuse, before anything changes, a nested target that retry cannot run again."""
    for child in targets:
        if child.flow is None:
            continue
        if not _failed_by_child(child):
            if _own_failure(child):
                continue  # its own body failed: it runs again (_Retry.rerun)
            raise NotRepairableError(
                f"child {child.id} of flow {node.id} is a nested flow that failed on its own "
                f"(not by a child of its own); {RETRY_ALLOWS}",
                child.state,
                node.id,
            )
        _plan(state, child, _retryable(state, child)[0])


class _Retry:
    """One retry: the levels it re-holds, top down, each a chunk of children per script
    call, and what each chunk frees, published as soon as that chunk's scripts ran."""

    def __init__(self, state: EchoMQ) -> None:
        self.state = state
        self.payloads: list[tuple[str, Stored]] = []  # made pending, not yet published
        self.queue_of: dict[str, str] = {}  # child id -> the queue whose slot holds its row
        self.republished: list[str] = []
        self.held: list[str] = []
        self.released: list[tuple[str, str]] = []  # (queue, parent id)
        self.rerun_ids: list[str] = []  # parents whose own body failed, run again

    def level(self, node: JobNode, targets: list[JobNode], others: tuple[str, ...] = ()) -> None:
        """Re-hold ``node`` with ``targets`` retried, ``echomq_chunk_size`` of them per
        script call (the first call holds the parent again), then each nested target's own
        level. Top down, so that a parent's :settled entry for a child of another slot is
        gone before that child can finish and be credited again."""
        chunk = self.state.settings.chunk_size
        parts = [targets[i : i + chunk] for i in range(0, len(targets), chunk)] or [[]]
        for n, part in enumerate(parts):
            self._chunk(node, part, others if n == 0 else (), first=n == 0)
            self.flush()
            for child in (c for c in part if c.flow is not None):
                if _own_failure(child):
                    self.rerun(child, node.id)
                else:
                    self.level(child, _retryable(self.state, child)[0])

    def _chunk(
        self, node: JobNode, part: list[JobNode], others: tuple[str, ...], *, first: bool
    ) -> None:
        scripts = self.state.scripts
        local = [c.id for c in part if c.flow is None and c.queue == node.queue]
        remote: dict[str, list[str]] = {}
        for c in part:
            if c.flow is None and c.queue != node.queue:
                remote.setdefault(c.queue, []).append(c.id)
        nested = [c.id for c in part if c.flow is not None]
        elsewhere = [cid for ids in remote.values() for cid in ids] + nested
        status, pairs = scripts.retry_flow(node.queue, node.id, local, [*elsewhere, *others])
        self.queue_of.update((cid, node.queue) for cid, _ in pairs)
        # A later chunk finds the parent held already; none of its children retried (a
        # retry racing this one took them) changes nothing and is no refusal.
        later = () if first else (Status.AWAITING_CHILDREN,)
        if status not in (Status.RETRIED, Status.RELEASED, *later):
            raise NotRepairableError(
                f"flow {node.id} is {status}; nothing changed: {RETRY_ALLOWS}",
                str(status),
                node.id,
            )
        if first:
            self.held.append(node.id)
            # get() on the re-held parent must wait for its new outcome: its stored failure
            # goes before any child of it runs again.
            _forget_results(self.state, [node.id])
        for queue, ids in remote.items():
            there = scripts.retry_children(queue, node.id, ids)
            self.queue_of.update((cid, queue) for cid, _ in there)
            pairs += there
        self.payloads += pairs
        if status is Status.RELEASED:
            self.released.append((node.queue, node.id))

    def rerun(self, node: JobNode, outer: str) -> None:
        """Run again a flow parent whose own body failed (a chain's step): pending again,
        then dispatched with its children's values by :meth:`finish`."""
        status = self.state.scripts.retry_parent(node.queue, node.id, outer)
        if status is not Status.RETRIED:
            raise NotRepairableError(f"flow {node.id} is {status}; nothing changed", str(status))
        _forget_results(self.state, [node.id])
        self.rerun_ids.append(node.id)
        self.released.append((node.queue, node.id))

    def flush(self) -> None:
        """Publish the children made pending so far, their stored failures cleared first
        (recovery must not read a retried child's old FAILURE as its new attempt's)."""
        if not self.payloads:
            return
        ids = [cid for cid, _ in self.payloads]
        _forget_results(self.state, ids)
        templates: dict[str, bytes | None] = {}  # one read of each flow's template
        jobs = [
            load_job(self.state, self.queue_of[cid], cid, stored, templates)
            for cid, stored in against_own_flow(self.state, self.payloads, self.queue_of)
        ]
        # A retried chain step's later steps hold the error its failure stored for them: gone
        # too, or recovery would read one of them as failed before it ran again.
        for cid, job in zip(ids, jobs, strict=True):
            _forget_results(self.state, steps_after(self.state, self.queue_of[cid], job))
        publish(self.state.app, jobs)
        self.republished += ids
        self.payloads = []

    def finish(self) -> None:
        """Publish what is left, then dispatch the parents the levels freed."""
        self.flush()
        for queue, parent_id in self.released:
            dispatch_parent(self.state, queue, parent_id)


def _forget_results(state: EchoMQ, ids: Iterable[str]) -> None:
    backend = state.app.backend
    for job_id in ids:
        with contextlib.suppress(NotImplementedError):  # a backend that keeps nothing
            backend.forget(job_id)


def _state_now(state: EchoMQ, node: JobNode) -> str:
    return flow_root(state, node.id, node.queue).node.state


def _retry_counted(state: EchoMQ, node: JobNode, child: JobNode) -> RetryOutcome:
    """Retry one child failed under ignore, remove or continue: it was counted as resolved,
    and now counts toward its parent again (see retry_counted.lua)."""
    if child.flow is not None or child.queue != node.queue:
        raise NotRepairableError(
            f"child {child.id} of flow {node.id} failed under {child.policy}: only a task child "
            "on its parent's queue can be retried that way; nothing changed",
            child.state,
        )
    status, pairs = state.scripts.retry_counted(node.queue, node.id, child.id)
    if status is not Status.RETRIED:
        raise NotRepairableError(
            f"child {child.id} of flow {node.id} is {status}; nothing changed", str(status)
        )
    _forget_results(state, [child.id])
    publish(state.app, [load_job(state, node.queue, cid, stored) for cid, stored in pairs])
    logger.info("echomq: child %s of flow %s retried (policy %s)", child.id, node.id, child.policy)
    return RetryOutcome(
        flow_id=node.id, republished=(child.id,), held=(), state=_state_now(state, node)
    )


def _one_child(state: EchoMQ, root: FlowRoot, child: str) -> JobNode:
    """The failed child ``child`` of the flow, read alone: refused unless it failed."""
    node = root.node
    match = child_of(state, root, child)
    if match is None:
        raise NotRepairableError(f"{child} is not a child of flow {node.id}", node.state, node.id)
    if match.state != "failed":
        raise NotRepairableError(
            f"child {child} of flow {node.id} is {match.state} (policy {match.policy}); "
            "--child retries a failed child",
            match.state,
            node.id,
        )
    return match


def retry_flow(
    state: EchoMQ, job_id: str, *, child: str | None = None, deadline: Any = None
) -> RetryOutcome:
    """Run the flow ``job_id`` again after it failed under policy ``fail``.

    Its children that failed under ``fail`` are re-published as new attempts and the parent
    awaits them again (its counter already counts them: they were never counted); children
    that were still running when it failed, or finished since, keep their place. A nested
    flow among them is retried the same way, and a nested flow whose failure failed its
    outer flow puts that outer flow back to held too (and so on up). Celery's stored failure
    of every re-held parent is cleared, so ``get()`` waits for the new outcome.

    Whatever the flow's size, the children are read from its record of failed children and
    retried ``echomq_chunk_size`` per script call (ops/failures.py), never read whole.

    ``child``: retry that one failed child only, under any policy. One counted as resolved
    (``ignore``, ``remove``, ``continue``, ``fail_at_end`` while its parent waits) counts toward
    the parent again, which waits for it if it has not been released yet (a released parent
    keeps its course, and the child's new value is recorded). A held flow is accepted when it
    has children failed under ``fail`` (a partial retry, or one a crash cut short).
    Raises :class:`NotRepairableError` (nothing changed) for any other state.

    ``deadline`` (seconds, a timedelta or an aware datetime): the flow's new deadline; a flow
    whose deadline has passed (one failed by it, see retry_with_deadline below) needs one.
    """
    root = _flow(state, job_id)
    node = root.node
    case, failed = _classify(state, job_id, root, child, deadline)
    if case == "deadline":
        # Its cut children have no record of their own: read from the whole tree.
        tree = read_tree(state, job_id, with_result=False)
        return retry_with_deadline(state, tree, deadline)
    if case == "counted":
        return _retry_counted(state, node, failed[0])
    if case == "own body":
        return _rerun_body(state, job_id, node)
    return _retry_levels(state, job_id, node, failed, deadline)


def _classify(
    state: EchoMQ, job_id: str, root: FlowRoot, child: str | None, deadline: Any
) -> tuple[str, list[JobNode]]:
    """Which retry the flow takes, and the children it retries: ``deadline`` (failed by its
    deadline), ``counted`` (one child counted as resolved), ``own body`` (its body failed
    after its children settled) or ``levels`` (its failed children, and the outer flows its
    failure failed). Raises :class:`NotRepairableError` (nothing changed) for any other."""
    node = root.node
    if failed_by_deadline(state, node.queue, node.id):
        return "deadline", []
    if deadline is None and passed(state, node.queue, node.id):
        raise refuse(job_id, node.state)
    if child is not None:
        match = _one_child(state, root, child)
        # Counted as resolved, also under fail_at_end while the parent waits (not once failed).
        if match.policy not in FAILING or (match.policy != "fail" and node.state != "failed"):
            return "counted", [match]
        failed, gone = [match], list[str]()
    else:
        failed, gone = _retryable(state, node)
    if _own_failure(node) and node.parent is None:
        return "own body", []
    if not (_failed_by_child(node) or (node.state == "awaiting_children" and failed)):
        why = {
            "awaiting_children": "held, with no child failed under 'fail'",
            "failed": "failed by its own body (or abandoned), not by a child",
        }.get(node.state, node.state)
        raise NotRepairableError(
            f"flow {job_id} is {node.state} ({why}); nothing changed: {RETRY_ALLOWS}",
            node.state,
            job_id,
        )
    if node.flow is None or node.flow.outstanding is None or gone:
        # Held again with a counter nothing can bring to zero, the flow would wait forever.
        raise NotRepairableError(
            f"flow {job_id} cannot be retried: its keys have expired "
            f"({'children ' + ', '.join(gone[:10]) if gone else 'its counter'}); nothing changed",
            "missing",
            job_id,
        )
    return "levels", failed


def _rerun_body(state: EchoMQ, job_id: str, node: JobNode) -> RetryOutcome:
    """Its own body failed once its children had settled (a chain parent's step, say): that
    body runs again with the same values."""
    run = _Retry(state)
    try:
        run.rerun(node, "")
    finally:
        run.finish()
    return RetryOutcome(
        flow_id=job_id, republished=(), held=(), released=(job_id,), state="pending"
    )


def _retry_levels(
    state: EchoMQ, job_id: str, node: JobNode, failed: list[JobNode], deadline: Any
) -> RetryOutcome:
    """Re-hold the outer flows ``node`` failed, top first, each counting the flow below it;
    then ``node`` with its ``failed`` children pending again."""
    _plan(state, node, failed)
    chain = _failed_outer_flows(state, node)
    run = _Retry(state)
    if deadline is not None:
        rearm(state, node.queue, node.id, deadline)
    try:
        for outer, inner in reversed(chain):
            run.level(outer, [], others=(inner,))
        run.level(node, failed)
    finally:
        # A level refused half-way (another retry raced this one) still leaves the levels
        # above it re-held: publish what they freed rather than leave it to recovery.
        run.finish()
    logger.info(
        "echomq: flow %s retried: %d children re-published, %d parents held again",
        job_id, len(run.republished), len(run.held),
    )  # fmt: skip
    return RetryOutcome(
        flow_id=job_id,
        republished=tuple(run.republished),
        held=tuple(run.held),
        released=tuple(pid for _, pid in run.released),
        state=_state_now(state, node),
    )


def _failed_outer_flows(state: EchoMQ, node: JobNode) -> list[tuple[JobNode, str]]:
    """The outer flows this one failed, top last: each (outer, the flow below it), re-held
    counting the flow below it. Each read as its row and counts alone."""
    chain: list[tuple[JobNode, str]] = []
    below = node
    while below.parent is not None and below.state == "failed":
        outer = flow_root(state, below.parent).node
        if not (_failed_by_child(outer) and outer.flow and outer.flow.failed_child == below.id):
            break
        chain.append((outer, below.id))
        below = outer
    return chain


logger = logging.getLogger("celery_echomq")

NEEDS = (
    "its deadline passed: retry it with a new one (--deadline SECONDS, or "
    "retry_flow(..., deadline=...)), which the flow then keeps"
)


def failed_by_deadline(state: EchoMQ, queue: str, job_id: str) -> bool:
    return bool(state.client.hget(state.keys.job_key(queue, job_id), "failed_by") == b"deadline")


def passed(state: EchoMQ, queue: str, job_id: str) -> bool:
    """Whether ``job_id``'s deadline has come and gone (it fired, or came due while the flow
    no longer waited): what a retry without a new deadline refuses."""
    fields = state.client.hmget(state.keys.job_key(queue, job_id), "deadline_at", "failed_by")
    return fields[1] == b"deadline" or fields[0] is not None


def refuse(job_id: str, state_: str) -> NotRepairableError:
    return NotRepairableError(f"flow {job_id} is {state_}; nothing changed: {NEEDS}", state_)


def retry_with_deadline(state: EchoMQ, node: Any, deadline: Any) -> RetryOutcome:
    """Retry the flow ``node`` (a JobNode) failed by its deadline, until ``deadline``."""
    spec = deadline_spec(deadline)
    if spec is None:
        raise refuse(node.id, node.state)
    queue = node.queue
    remote = [c for c in node.children if c.queue != queue and c.outcome == "deadline"]
    if remote:
        raise NotRepairableError(
            f"flow {node.id}: children of another queue were cut by its deadline "
            f"({', '.join(c.id for c in remote[:5])}); a retry of those is not supported: "
            "nothing changed",
            node.state,
        )
    kind, ms = spec_ms(spec)
    # A linked chain's cut step is among its steps (the ones after it still wait).
    local = [s.id for c in node.children if c.queue == queue for s in (c.steps or (c,))]
    status, at, pairs = store.retry(state, queue, node.id, local, kind, ms)
    if status not in ("retried", "released"):
        raise NotRepairableError(
            f"flow {node.id} is {status}; nothing changed: a retry with --deadline applies to "
            "a flow failed by its deadline",
            status,
        )
    backend = state.app.backend
    for job_id in [node.id, *(cid for cid, _ in pairs)]:
        with contextlib.suppress(NotImplementedError):
            backend.forget(job_id)
    # The deadline revoked the cut children's messages: every worker forgets that first.
    unrevoke(state.app, [cid for cid, _ in pairs])
    templates: dict[str, bytes | None] = {}
    jobs = [load_job(state, queue, cid, stored, templates) for cid, stored in pairs]
    publish(state.app, [job for job in jobs if "children" not in job])
    for cid, job in zip((cid for cid, _ in pairs), jobs, strict=True):
        if "children" in job:
            # A nested flow's released parent cut before it started: dispatched again.
            dispatch_parent(state, queue, cid, redispatch_after_ms=1)
    if status == "released":
        dispatch_parent(state, queue, node.id)
    logger.info(
        "echomq: flow %s retried with a new deadline (%d ms): %d children re-published",
        node.id, at, len(pairs),
    )  # fmt: skip
    return RetryOutcome(
        flow_id=node.id,
        republished=tuple(cid for cid, _ in pairs),
        held=(node.id,),
        released=(node.id,) if status == "released" else (),
        state="pending" if status == "released" else "awaiting_children",
    )


def rearm(state: EchoMQ, queue: str, job_id: str, deadline: Any) -> None:
    """A new deadline for a flow held again by an ordinary retry (failed by a child)."""
    spec = deadline_spec(deadline)
    if spec is None:
        return
    kind, ms = spec_ms(spec)
    keys = [state.keys.job_key(queue, job_id), store.index_key(state, queue)]
    at = ms if kind == "at" else None
    if at is None:
        seconds, micros = state.client.time()
        at = int(seconds) * 1000 + int(micros) // 1000 + ms
    pipe = state.client.pipeline(transaction=True)
    pipe.zadd(keys[1], {job_id: at})
    pipe.hdel(keys[0], "deadline_at", "deadline_fired", "deadline_outstanding")
    pipe.execute()
