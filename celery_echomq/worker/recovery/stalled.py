"""(b), (d), (e): a job whose lease lapsed, and a failure that never reached the result
backend. The cross-slot path's repairs are in ``unfinished.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from celery import states

from celery_echomq import tracing
from celery_echomq.errors import FlowFailed, StoreFormatError
from celery_echomq.send.start import publish
from celery_echomq.store.codec import STORED_FIELDS, Stored, stored_of
from celery_echomq.store.connection import text
from celery_echomq.store.headers import (
    H_FLOW,
    H_NEXT,
    Headers,
    outer_ref,
    parent_ref,
)
from celery_echomq.store.replies import Status
from celery_echomq.store.scripts import ParentRef
from celery_echomq.store.state import EchoMQ
from celery_echomq.wire.results import backend_readable
from celery_echomq.worker.recovery.common import (
    BUDGET,
    FAILED_MARK,
    STORE_ERRORS,
    decode_job,
    guarded,
    now_ms,
    overdue,
    valid_ids,
    with_values,
)
from celery_echomq.worker.settle import (
    error_text,
    follow,
    record_failure,
    settle_failure,
    settle_success,
)

logger = logging.getLogger("celery_echomq")


def backend_outcome(state: EchoMQ, job_id: str) -> tuple[str | None, Any]:
    """The job's status and result in Celery's result backend; (None, None) if it keeps none
    that this process can read."""
    backend = state.app.backend
    if not backend_readable(state.app):
        return None, None
    meta = backend.get_task_meta(job_id)
    return meta.get("status"), meta.get("result")


def lost_active(state: EchoMQ, queue: str, batch: int) -> list[str]:
    """(b) jobs whose holder's lease lapsed (its worker died, or could not reach Redis), and
    jobs handed over to a replacement task, due for a look at the result backend."""
    client = state.client
    due = overdue(state, queue, "active", now_ms(client), batch)
    if not due:
        return []
    pipe = client.pipeline(transaction=False)
    for job_id, _ in due:
        pipe.hmget(
            state.keys.job_key(queue, job_id),
            "state",
            "token",
            "replaced",
            "replaced_by",
            *STORED_FIELDS,
        )
    rows = pipe.execute()
    repairs: list[str] = []
    for (job_id, _), (row_state, token, replaced, by, *stored) in zip(due, rows, strict=True):
        if row_state is None or text(row_state) != Status.ACTIVE:
            continue
        if len(repairs) >= BUDGET:
            break
        if token is None:
            # A chain's step handed out active that no delivery took: a lapsed lease says
            # nothing of a holder here, only that its message waits or is lost. Back to
            # pending, where the evidence of (a) tells which (never re-published on a lapse).
            line = guarded("handed step", _unhand, state, queue, job_id)
            if line:
                repairs.append(line)
            continue
        line = guarded(
            "active job",
            _repair_active,
            state,
            queue,
            job_id,
            text(token or b""),
            stored_of(*stored),
            text(by) if by else (job_id if replaced is not None else ""),
        )
        if line:
            repairs.append(line)
    return repairs


def _unhand(state: EchoMQ, queue: str, job_id: str) -> str | None:
    if state.scripts.unhand(queue, job_id) is not Status.PENDING:
        return None
    return f"{queue}: handed step {job_id} not taken within its lease: pending again"


@dataclass(frozen=True)
class Lapsed:
    """A job whose holder's lease lapsed (or that handed over to a replacement): what settling
    it needs."""

    state: EchoMQ
    queue: str
    job_id: str
    token: str
    is_parent: bool
    parent: ParentRef | None
    next_step: str
    replaced_by: str


def _repair_active(
    state: EchoMQ,
    queue: str,
    job_id: str,
    token: str,
    payload: Stored | None,
    replaced_by: str = "",
) -> str | None:
    """Settle a job whose lease lapsed, from its result in Celery's backend; or a job handed
    over to a replacement (``replaced_by``: the id the replacement stores its result under).
    First what the backend says of it, then what that asks for."""
    job = decode_job(state, queue, job_id, payload)
    if job is None:
        # Refused: push its deadline back, so it is reported once per stall timeout.
        state.scripts.extend(queue, [job_id], state.settings.stall_ms)
        return None
    headers = Headers.of_job(job)
    lapsed = Lapsed(
        state,
        queue,
        job_id,
        token,
        is_parent=bool(getattr(headers, H_FLOW, None)),
        parent=parent_ref(headers),
        next_step=str(getattr(headers, H_NEXT, None) or ""),
        replaced_by=replaced_by,
    )
    try:
        status, result = backend_outcome(state, replaced_by or job_id)
    except STORE_ERRORS:
        raise
    except Exception as exc:
        # Without the backend we cannot tell a finished body from a lost one; re-running a
        # finished one would be safe for the credit but not for its side effects: wait.
        logger.warning("echomq recovery: result backend unreadable for %s: %s", job_id, exc)
        return None
    if replaced_by and replaced_by != job_id and status in (states.SUCCESS, states.FAILURE):
        _resolve_replaced(state, job_id, status, result)
    if status == states.SUCCESS:
        return complete_from_result(lapsed, result)
    if status == states.FAILURE:
        return fail_from_result(lapsed, result)
    if replaced_by:
        return _await_replacement(lapsed)
    return _republish(lapsed, status)


def _resolve_replaced(state: EchoMQ, job_id: str, status: str | None, result: Any) -> None:
    # A flow replaced it under an id of its own: the replaced id resolves too, as
    # Task.replace promises.
    if status == states.SUCCESS:
        state.app.backend.mark_as_done(job_id, result)
    else:
        state.app.backend.mark_as_failure(job_id, result)


def complete_from_result(lapsed: Lapsed, result: Any) -> str:
    # The body finished and stored its result (or its replacement did); only the success
    # signal's transition was lost. The token makes this the very completion the signal
    # would have made.
    state, queue, job_id = lapsed.state, lapsed.queue, lapsed.job_id
    done = settle_success(
        state,
        queue,
        job_id,
        lapsed.token,
        lapsed.is_parent,
        lapsed.parent,
        state.dumps(result),
        next_step=lapsed.next_step,
    )
    whose = "its replacement's" if lapsed.replaced_by else "its"
    return f"{queue}: completed {job_id} from {whose} SUCCESS result ({done})"


def fail_from_result(lapsed: Lapsed, result: Any) -> str:
    error = error_text(result) if isinstance(result, BaseException) else str(result)
    failed = _settle_failure(lapsed, error)
    return f"{lapsed.queue}: failed {lapsed.job_id} from its FAILURE result ({failed}): {error}"


def _settle_failure(lapsed: Lapsed, error: str) -> Any:
    return settle_failure(
        lapsed.state,
        lapsed.queue,
        lapsed.job_id,
        lapsed.token,
        error,
        lapsed.is_parent,
        lapsed.parent,
    )


def _await_replacement(lapsed: Lapsed) -> str | None:
    """A replacement that has not finished: looked at again next pass, or failed once when
    its outcome can never be read here."""
    state, queue, job_id = lapsed.state, lapsed.queue, lapsed.job_id
    if not backend_readable(state.app):
        # Its replacement's outcome can never be read here: fail it (under its policy) once,
        # rather than look again every pass for ever.
        error = (
            f"HandOverError: {job_id} replaced itself (Task.replace), but the result backend "
            f"({type(state.app.backend).__name__}) keeps no result this process can read; set "
            "result_backend to one that stores results (redis://, a database) to replace a "
            "flow job"
        )
        failed = _settle_failure(lapsed, error)
        return f"{queue}: failed {job_id}: its replacement's result cannot be read ({failed})"
    # Its replacement has not finished: look again next pass. Whether the replacement's
    # messages arrive is Celery's business, as for a chord whose header task replaced
    # itself; this job is not re-run.
    state.scripts.extend(queue, [job_id], int(state.settings.recovery_interval * 1000))
    return None


def _republish(lapsed: Lapsed, status: str | None) -> str | None:
    """No outcome in the backend: the body never finished; the job is pending again and
    re-published."""
    state, queue, job_id = lapsed.state, lapsed.queue, lapsed.job_id
    requeued, stored = state.scripts.requeue(
        queue, job_id, state.settings.stall_ms, Status.ACTIVE, lapsed.token
    )
    if requeued is not Status.REQUEUED:
        return None
    job = decode_job(state, queue, job_id, stored)
    if job is None:
        return None
    if "children" in job:
        job = with_values(state, queue, job_id, job)
    tracing.republished(job, job_id, queue, "lease lapsed")
    with tracing.job_context(job):
        publish(state.app, [job])
    return (
        f"{queue}: re-published {job_id} (its holder's lease lapsed; result backend: "
        f"{status or 'none'})"
    )


def unrecorded_failures(state: EchoMQ, queue: str, batch: int) -> list[str]:
    """(d) failed parents whose FAILURE never reached the backend or their outer flow."""
    keys, client, settings = state.keys, state.client, state.settings
    now = now_ms(client)
    mark_key = keys.queue_key(queue, FAILED_MARK)
    # fail.lua trims the failed set to the result TTL; entries younger than a stall timeout are
    # left to the worker that is recording them right now.
    low = max(int(float(client.get(mark_key) or 0)), now - settings.result_ttl * 1000)
    high = now - settings.stall_ms
    if high <= low:
        return []
    found = client.zrangebyscore(
        keys.queue_key(queue, "failed"), f"({low}", high, start=0, num=batch, withscores=True
    )
    scores = {text(item): float(score) for item, score in found}
    # A full batch resumes at the last score read (entries sharing it are checked again).
    checked_to = high if len(found) < batch else int(max(scores.values(), default=high)) - 1
    ids = valid_ids(scores, queue)
    repairs: list[str] = []
    if ids:
        fields = ("state", "failed_child", "error", "abandoned", "parent", "propagated")
        pipe = client.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(keys.job_key(queue, job_id), fields)
        for job_id, values in zip(ids, pipe.execute(), strict=True):
            row = {name: text(v) for name, v in zip(fields, values, strict=True) if v is not None}
            if row.get("state") != Status.FAILED or not (
                row.get("failed_child") or row.get("abandoned")
            ):
                continue  # a failed child, or a parent whose own body failed (Celery recorded it)
            try:
                line = _record_failed_parent(state, queue, job_id, row)
            except STORE_ERRORS:
                raise
            except StoreFormatError as exc:  # a newer release's row: that release records it
                state.tell_newer(exc, f"recovery of failed parent {job_id} on {queue}")
                # The scan's mark is the queue's, shared with that release's workers: kept
                # before this row, so that their next pass looks at it.
                checked_to = min(checked_to, int(scores[job_id]) - 1)
                continue
            except Exception:
                logger.exception("echomq recovery: could not record the failure of %s", job_id)
                checked_to = min(checked_to, int(scores[job_id]) - 1)  # the next pass retries
                continue
            if line:
                repairs.append(line)
    if found:
        # Only when something was read: an idle pass writes nothing (no AOF growth, no noise).
        client.set(mark_key, checked_to, ex=settings.result_ttl)
    return repairs


def _record_failed_parent(
    state: EchoMQ, queue: str, parent_id: str, row: dict[str, str]
) -> str | None:
    """Finish what the worker that failed this parent did not: the FAILURE in Celery's result
    backend (with the errbacks), then, for a nested flow, the failure of its outer flow's child.
    """
    status, _ = backend_outcome(state, parent_id)
    now_state, payload = state.client.hmget(
        state.keys.job_key(queue, parent_id), "state", "payload"
    )
    if now_state != Status.FAILED.encode():
        # An operator's retry held it again since the row was read (and cleared the stored
        # FAILURE): recording the failure now would make get() raise for a flow that runs on.
        return None
    child = row.get("failed_child", "")
    if child:
        prefix = f"child {child} failed: "
        error = row.get("error", "")
        reason = error[len(prefix) :] if error.startswith(prefix) else error
        exc = FlowFailed(f"flow {parent_id}: child {child} failed: {reason}", child, reason)
    else:
        reason = row.get("error", "its producer stopped before the flow was sealed")
        exc = FlowFailed(f"flow {parent_id}: {reason}", "", reason)
    if status not in (None, states.FAILURE):
        if child:
            # What the failing child's worker would have done: record, run the errbacks, and
            # carry a nested flow's failure to its outer flow.
            follow(state, Status.PARENT_FAILED, child, ParentRef(parent_id, queue), reason)
        else:
            mark_abandoned(state, queue, parent_id, exc, payload)
        why = f"child {child} failed: {reason}" if child else reason
        return f"{queue}: recorded FAILURE of parent {parent_id} ({why})"
    if row.get("parent") and not row.get("propagated"):
        outer = _outer_ref(state, queue, parent_id, payload)
        if outer is not None:
            settled = settle_failure(
                state, queue, parent_id, "", error_text(exc), True, outer, carry=True
            )
            if settled is not Status.FINISHED:
                return f"{queue}: carried the failure of {parent_id} to its flow {outer.id}"
    return None


def _outer_ref(state: EchoMQ, queue: str, parent_id: str, payload: Any) -> ParentRef | None:
    job = decode_job(state, queue, parent_id, payload) if payload is not None else None
    if job is None:
        return None
    headers = (job.get("options") or {}).get("headers") or {}
    return outer_ref(headers, queue)


def mark_abandoned(
    state: EchoMQ, queue: str, parent_id: str, exc: FlowFailed, payload: Any
) -> None:
    job = decode_job(state, queue, parent_id, payload) if payload is not None else None
    record_failure(state, parent_id, exc, job, call_errbacks=False)
    outer = _outer_ref(state, queue, parent_id, payload)
    if outer is not None:
        settle_failure(state, queue, parent_id, "", error_text(exc), True, outer, carry=True)
