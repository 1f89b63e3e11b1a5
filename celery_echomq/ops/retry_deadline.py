"""An operator's retry of a flow its deadline failed: it needs a new deadline.

``retry_flow(state, job_id, deadline=...)`` (``celery echomq retry JOBID --deadline S``,
``FlowResult.retry(deadline=...)``) comes here for a flow failed by its deadline: one script
(retry_deadline.lua) holds the parent again with the new deadline armed and makes its cut
children, and those failed under ``fail`` since, pending; then Celery's stored failures are
cleared and the children published (a nested flow's parent among them dispatched).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from celery_echomq.errors import NotRepairableError
from celery_echomq.ops.outcomes import RetryOutcome
from celery_echomq.send.dispatch import dispatch_parent
from celery_echomq.send.start import publish
from celery_echomq.store import deadlines as store
from celery_echomq.store.codec import load_job
from celery_echomq.store.deadline_spec import deadline_spec, spec_ms
from celery_echomq.store.state import EchoMQ
from celery_echomq.worker.unrevoke import unrevoke

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
