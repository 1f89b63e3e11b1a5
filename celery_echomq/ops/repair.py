"""An operator's repairs of a flow: retry one that failed, release one that is held.

``retry_flow`` runs a flow failed under policy ``fail`` again: its failed children are
re-published as new attempts and the parent awaits them once more. ``release_flow`` runs a
held parent now with the values completed so far, as policy ``continue`` does. Each step is
one script (``retry_flow``, ``retry_children``, ``release``); what follows it (clearing
Celery's stored failure, a publish) is repeated by recovery if the process dies in between:
a child left pending without a message is re-published once its message is seen gone.

What ``celery -A proj echomq retry|release`` and ``FlowResult.retry()|release()`` call.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from celery_echomq.errors import NotRepairableError
from celery_echomq.ops import retry_deadline as by_deadline
from celery_echomq.ops.cancel import cancel_flow
from celery_echomq.ops.outcomes import ReleaseOutcome, RetryOutcome
from celery_echomq.ops.views import JobNode, read_tree
from celery_echomq.send.dispatch import dispatch_parent
from celery_echomq.send.start import publish
from celery_echomq.store.codec import Stored, load_job
from celery_echomq.store.replies import Status
from celery_echomq.store.state import EchoMQ

logger = logging.getLogger("celery_echomq")

# A child that has not settled: what the parent still waits for.
OUTSTANDING = frozenset({"pending", "active", "awaiting_children"})
RETRY_ALLOWS = (
    "retry applies to a flow that failed under policy 'fail' (or that failed its outer "
    "flow), and to a held flow with children failed under 'fail'"
)
RELEASE_ALLOWS = "release applies to a held parent (awaiting_children)"


def _settling(node: JobNode) -> list[JobNode]:
    """The jobs whose outcome settles one of ``node``'s children: each child, or each step of
    a linked chain (the step that failed is the one to run again, with its input)."""
    return [job for c in node.children for job in (c.steps or (c,))]


def _retryable(node: JobNode) -> list[JobNode]:
    """The children whose failure failed (or would fail) ``node``: failed under policy fail.

    Such a child was never counted (settle_child returns before the DECR), so retrying it
    leaves the counter right; a child counted under ignore/remove/continue is left alone.
    """
    return [c for c in _settling(node) if c.state == "failed" and c.policy == "fail"]


def _own_failure(node: JobNode) -> bool:
    """A flow parent failed by its own body, every child settled (not abandoned half-way)."""
    flow = node.flow
    return (
        node.state == "failed"
        and flow is not None
        and flow.failed_child is None
        and flow.outstanding == 0
    )


def _failed_by_child(node: JobNode) -> bool:
    return node.state == "failed" and node.flow is not None and node.flow.failed_child is not None


def _flow(state: EchoMQ, job_id: str) -> JobNode:
    node = read_tree(state, job_id, with_result=False)
    if node.flow is None:
        where = f" of flow {node.parent}" if node.parent else ""
        raise NotRepairableError(
            f"{job_id} is not a flow parent (a {node.state} child{where}); name its flow, "
            f"and one child with --child",
            node.state,
            job_id,
        )
    return node


def _fan_in(state: EchoMQ, node: JobNode) -> str:
    """The job holding the flow's own children, where its parent is a canvas; else ""."""
    payload = state.client.hget(state.keys.job_key(node.queue, node.id), "payload")
    try:
        fan_in = state.loads(payload).get("fan_in") if payload else None
    except Exception:  # a payload this process cannot read names no fan-in
        return ""
    return str(fan_in) if fan_in and fan_in != node.id else ""


def _plan(node: JobNode, targets: list[JobNode]) -> None:
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
        _plan(child, _retryable(child))


class _Retry:
    """One retry: the levels it re-holds, top down, then what it publishes."""

    def __init__(self, state: EchoMQ) -> None:
        self.state = state
        self.payloads: list[tuple[str, Stored]] = []
        self.queue_of: dict[str, str] = {}  # child id -> the queue whose slot holds its row
        self.held: list[str] = []
        self.released: list[tuple[str, str]] = []  # (queue, parent id)
        self.rerun_ids: list[str] = []  # parents whose own body failed, run again

    def level(self, node: JobNode, targets: list[JobNode], others: tuple[str, ...] = ()) -> None:
        """Re-hold ``node`` with ``targets`` retried: this level's script first, then each
        nested target's own level. Top down, so that a parent's :settled entry for a child of
        another slot is gone before that child can finish and be credited again."""
        scripts = self.state.scripts
        local = [c.id for c in targets if c.flow is None and c.queue == node.queue]
        remote: dict[str, list[str]] = {}
        for c in targets:
            if c.flow is None and c.queue != node.queue:
                remote.setdefault(c.queue, []).append(c.id)
        nested = [c for c in targets if c.flow is not None]
        elsewhere = [cid for ids in remote.values() for cid in ids] + [c.id for c in nested]
        status, pairs = scripts.retry_flow(node.queue, node.id, local, [*elsewhere, *others])
        self.queue_of.update((cid, node.queue) for cid, _ in pairs)
        if status not in (Status.RETRIED, Status.RELEASED):
            raise NotRepairableError(
                f"flow {node.id} is {status}; nothing changed: {RETRY_ALLOWS}",
                str(status),
                node.id,
            )
        self.held.append(node.id)
        for queue, ids in remote.items():
            there = scripts.retry_children(queue, node.id, ids)
            self.queue_of.update((cid, queue) for cid, _ in there)
            pairs += there
        self.payloads += pairs
        if status is Status.RELEASED:
            self.released.append((node.queue, node.id))
        for child in nested:
            if _own_failure(child):
                self.rerun(child, node.id)
            else:
                self.level(child, _retryable(child))

    def rerun(self, node: JobNode, outer: str) -> None:
        """Run again a flow parent whose own body failed (a chain's step): pending again,
        then dispatched with its children's values by :meth:`finish`."""
        status = self.state.scripts.retry_parent(node.queue, node.id, outer)
        if status is not Status.RETRIED:
            raise NotRepairableError(f"flow {node.id} is {status}; nothing changed", str(status))
        self.rerun_ids.append(node.id)
        self.released.append((node.queue, node.id))

    def finish(self) -> None:
        """Clear Celery's stored failures, then publish and dispatch what the levels freed."""
        backend = self.state.app.backend
        # get() on a re-held parent must wait for its new outcome, and recovery must not read
        # a retried child's old FAILURE as the outcome of its new attempt.
        for job_id in [*self.held, *self.rerun_ids, *(cid for cid, _ in self.payloads)]:
            with contextlib.suppress(NotImplementedError):  # a backend that keeps nothing
                backend.forget(job_id)
        if self.payloads:
            templates: dict[str, bytes | None] = {}  # one read of each flow's template
            jobs = [
                load_job(self.state, self.queue_of[cid], cid, stored, templates)
                for cid, stored in self.payloads
            ]
            publish(self.state.app, jobs)
        for queue, parent_id in self.released:
            dispatch_parent(self.state, queue, parent_id)


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
    with contextlib.suppress(NotImplementedError):  # a backend that keeps nothing
        state.app.backend.forget(child.id)
    publish(state.app, [load_job(state, node.queue, cid, stored) for cid, stored in pairs])
    logger.info("echomq: child %s of flow %s retried (policy %s)", child.id, node.id, child.policy)
    after = read_tree(state, node.id, with_result=False)
    return RetryOutcome(flow_id=node.id, republished=(child.id,), held=(), state=after.state)


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

    ``child``: retry that one failed child only, under any policy. One failed under
    ``ignore``, ``remove`` or ``continue`` was counted as resolved: it counts toward the
    parent again, which waits for it if it has not been released yet (a released parent keeps
    its course, and the child's new value is recorded). A held flow is accepted when it has
    children failed under ``fail`` (a partial retry, or one a crash cut short): those are
    retried.
    Raises :class:`NotRepairableError` (nothing changed) for any other state.

    ``deadline`` (seconds, a timedelta or an aware datetime): the flow's new deadline; a flow
    whose deadline has passed (one failed by it, see ops/retry_deadline.py) needs one.
    """
    node = _flow(state, job_id)
    if by_deadline.failed_by_deadline(state, node.queue, node.id):
        return by_deadline.retry_with_deadline(state, node, deadline)
    if deadline is None and by_deadline.passed(state, node.queue, node.id):
        raise by_deadline.refuse(job_id, node.state)
    failed = _retryable(node)
    if child is not None:
        match = [c for c in _settling(node) if c.id == child]
        if not match:
            raise NotRepairableError(f"{child} is not a child of flow {job_id}", node.state, job_id)
        if match[0].state == "failed" and match[0].policy != "fail":
            return _retry_counted(state, node, match[0])
        if match[0] not in failed:
            raise NotRepairableError(
                f"child {child} of flow {job_id} is {match[0].state} (policy "
                f"{match[0].policy}); --child retries a failed child",
                match[0].state,
                job_id,
            )
        failed = match
    if _own_failure(node) and node.parent is None:
        # Its own body failed once its children had settled (a chain parent's step, say):
        # that body runs again with the same values.
        run = _Retry(state)
        try:
            run.rerun(node, "")
        finally:
            run.finish()
        return RetryOutcome(
            flow_id=job_id, republished=(), held=(), released=(job_id,), state="pending"
        )
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
    gone = [c.id for c in node.children if c.state == "missing"]
    if node.flow is None or node.flow.outstanding is None or gone:
        # Held again with a counter nothing can bring to zero, the flow would wait forever.
        raise NotRepairableError(
            f"flow {job_id} cannot be retried: its keys have expired "
            f"({'children ' + ', '.join(gone) if gone else 'its counter'}); nothing changed",
            "missing",
            job_id,
        )
    _plan(node, failed)
    # Outer flows this one failed, top first: each is re-held counting the flow below it.
    chain: list[tuple[JobNode, str]] = []
    below = node
    while below.parent is not None and below.state == "failed":
        outer = read_tree(state, below.parent, with_result=False)
        if not (_failed_by_child(outer) and outer.flow and outer.flow.failed_child == below.id):
            break
        chain.append((outer, below.id))
        below = outer
    run = _Retry(state)
    if deadline is not None:
        by_deadline.rearm(state, node.queue, node.id, deadline)
    try:
        for outer, inner in reversed(chain):
            run.level(outer, [], others=(inner,))
        run.level(node, failed)
    finally:
        # A level refused half-way (another retry raced this one) still leaves the levels
        # above it re-held: publish what they freed rather than leave it to recovery.
        run.finish()
    after = read_tree(state, job_id, with_result=False)
    republished = tuple(cid for cid, _ in run.payloads)
    logger.info(
        "echomq: flow %s retried: %d children re-published, %d parents held again",
        job_id, len(republished), len(run.held),
    )  # fmt: skip
    return RetryOutcome(
        flow_id=job_id,
        republished=republished,
        held=tuple(run.held),
        released=tuple(pid for _, pid in run.released),
        state=after.state,
    )


def release_flow(state: EchoMQ, job_id: str, *, revoke: bool = False) -> ReleaseOutcome:
    """Run the held parent of flow ``job_id`` now, with the values completed so far.

    As under policy ``continue``: children that complete later are still recorded in the
    parent's ``:processed`` and counted, but never release it again. ``revoke``: also revoke
    the children that have not started, on every slot alike (Celery's revoke; their rows
    become cancelled, so no delivery runs them and nothing counts them), as BullMQ's
    ``removeUnprocessedChildren``: running ones finish and are recorded. Raises
    :class:`NotRepairableError` (nothing changed) unless the parent is held.
    """
    node = _flow(state, job_id)
    fan_in = _fan_in(state, node)
    if fan_in:
        # Its parent is a chain, a group, a chord or a flow: what waits for the flow's own
        # children is the job that holds them (see send/shapes.py); that is what runs now.
        return release_flow(state, fan_in, revoke=revoke)
    if node.state != "awaiting_children":
        raise NotRepairableError(
            f"flow {job_id} is {node.state}; nothing changed: {RELEASE_ALLOWS}",
            node.state,
            job_id,
        )
    outstanding = [c for c in node.children if c.state in OUTSTANDING]
    revoked: list[str] = []
    if revoke:
        # A held nested flow is a flow of its own: cancelled whole, its children revoked.
        for c in outstanding:
            if c.flow is not None:
                revoked += cancel_flow(state, c.queue, c.id, settle=False)
    # With revoke, its slot's children a chunk per script call: the release with the first
    # (the script reads them only then), cancel_elsewhere with the others once it is released.
    chunk, ttl = state.settings.chunk_size, state.settings.result_ttl
    local = (
        [c.id for c in outstanding if c.queue == node.queue and c.flow is None] if revoke else []
    )
    status, cancelled = state.scripts.release(
        node.queue, node.id, local[:chunk], revoke=revoke, ttl=ttl
    )
    if status is not Status.RELEASED:
        raise NotRepairableError(
            f"flow {job_id} is {status}; nothing changed: {RELEASE_ALLOWS}",
            str(status),
            job_id,
        )
    if revoke:
        # Children of other slots alike: those not started are cancelled there; running
        # ones, on every slot, finish and are recorded.
        remote: dict[str, list[str]] = {node.queue: local[chunk:]}
        for c in outstanding:
            if c.queue != node.queue and c.flow is None:
                remote.setdefault(c.queue, []).append(c.id)
        for queue, ids in remote.items():
            for start in range(0, len(ids), chunk):
                cancelled += state.scripts.cancel_elsewhere(
                    queue, node.id, ids[start : start + chunk], ttl=ttl, started=False
                )
        revoked += cancelled
        for start in range(0, len(cancelled), chunk):  # one broadcast per chunk of ids
            state.app.control.revoke(cancelled[start : start + chunk])
    dispatch_parent(state, node.queue, node.id)
    values = sum(1 for c in node.children if c.outcome == "credited")
    after = read_tree(state, job_id, with_result=False)
    logger.info(
        "echomq: flow %s released by an operator with %d values; %d children outstanding, "
        "%d revoked",
        job_id, values, len(outstanding), len(revoked),
    )  # fmt: skip
    return ReleaseOutcome(
        flow_id=job_id,
        values=values,
        outstanding=tuple(c.id for c in outstanding),
        revoked=tuple(revoked),
        state=after.state,
    )
