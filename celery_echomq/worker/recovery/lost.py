"""(a) and (c): a pending job whose message is gone, a released parent never published.

A job is taken for lost only on evidence (the queue's claim marks, or a broker that reports
the queue empty) seen twice, :data:`~.common.HOLD_MS` apart.

Before it is re-published, Celery's result backend is read: a job still pending in the store
whose body has a final state there was run by a worker without the extension (a worker with
it claims the job before its body runs, so its row is never pending then). Re-publishing it
would run the body again, on that same worker as likely as not; it is settled from that result
instead, as (b) settles a job whose holder's lease lapsed, and its flow goes on.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import datetime, timezone
from typing import Any

from celery import states

from celery_echomq import tracing
from celery_echomq.send.dispatch import dispatch_parent
from celery_echomq.send.start import publish
from celery_echomq.store.codec import read_stored
from celery_echomq.store.connection import text
from celery_echomq.store.headers import H_NEXT, Headers, parent_ref
from celery_echomq.store.planned import is_nested_entry, nested_plan
from celery_echomq.store.replies import STARTED, Status
from celery_echomq.store.state import EchoMQ
from celery_echomq.store.store_format import newer_than_known
from celery_echomq.worker.claims import new_token
from celery_echomq.worker.recovery.common import (
    BUDGET,
    HOLD_MS,
    STORE_ERRORS,
    decode_job,
    guarded,
    keep_locator,
    now_ms,
    overdue,
)
from celery_echomq.worker.recovery.stalled import (
    Lapsed,
    backend_outcome,
    complete_from_result,
    fail_from_result,
)

logger = logging.getLogger("celery_echomq")


def broker_backlog(app: Any, queue: str) -> int | None:
    """Messages ready in the broker's queue ``queue`` (a passive declare, which every kombu
    transport answers: AMQP's message count, the Redis transport's LLEN over its priority
    lists); 0 when the queue does not exist; None when the broker cannot be asked."""
    try:
        with app.connection_for_read() as conn:
            channel = conn.channel()
            try:
                _, count, _ = channel.queue_declare(queue=queue, passive=True)
                return int(count)
            except conn.channel_errors:
                return 0  # no such queue: nothing is waiting in it
            finally:
                with contextlib.suppress(Exception):
                    channel.close()
    except Exception as exc:
        logger.warning("echomq recovery: cannot read the backlog of %s: %r", queue, exc)
        return None


def _priority(job: dict[str, Any]) -> int:
    try:
        return int((job.get("options") or {}).get("priority") or 0)
    except (TypeError, ValueError):
        return 0


class _Evidence:
    """What one pass knows of one queue: claim marks, leases, and (asked once, lazily) whether
    the broker's queue is empty."""

    def __init__(self, state: EchoMQ, queue: str, now: int) -> None:
        self.state, self.queue, self.now = state, queue, now
        marks = state.client.hgetall(state.keys.queue_key(queue, "marks"))
        self.marks = {text(k): float(v) for k, v in marks.items()}
        self._empty: bool | None = None

    def overtaken(self, since: float, priority: int) -> bool:
        """The queue delivered a job of this priority that became pending more than a stall
        timeout after ``since``."""
        return self.marks.get(str(priority), 0.0) > since + self.state.settings.stall_ms

    def could_be_overtaken(self, since: float) -> bool:
        return max(self.marks.values(), default=0.0) > since + self.state.settings.stall_ms

    def empty(self) -> bool:
        if self._empty is None:
            self._empty = broker_backlog(self.state.app, self.queue) == 0
        return self._empty


def lost_pending(state: EchoMQ, queue: str, batch: int) -> list[str]:
    """(a) children whose message is gone, and (c) released parents not started."""
    client, keys, stall = state.client, state.keys, state.settings.stall_ms
    now = now_ms(client)
    client.zremrangebyscore(keys.queue_key(queue, "reserved"), "-inf", now)
    due = overdue(state, queue, "pending", now - stall, batch)
    if not due:
        return []
    fields = ("dispatched", "suspect", "format")
    pipe = client.pipeline(transaction=False)
    for job_id, _ in due:
        pipe.hmget(keys.job_key(queue, job_id), fields)
        pipe.zscore(keys.queue_key(queue, "reserved"), job_id)
        pipe.exists(keys.flow_keys(queue, job_id)[0])
    replies = pipe.execute()
    seen = _Evidence(state, queue, now)
    repairs: list[str] = []
    for i, (job_id, since) in enumerate(due):
        if len(repairs) >= BUDGET:
            logger.warning(
                "echomq recovery: %s: re-publish budget (%d) spent; the next pass goes on",
                queue,
                BUDGET,
            )
            break
        (dispatched, suspect, found), held, is_parent = replies[3 * i : 3 * i + 3]
        newer = newer_than_known(found, keys.job_key(queue, job_id))
        if newer is not None:  # a newer release's row: not even its evidence mark is written
            state.tell_newer(newer, f"recovery of pending job {job_id} on {queue}")
            continue
        if held is not None and float(held) > now:
            continue  # a live worker has it (prefetched, or waiting for its eta)
        if is_parent and dispatched is None:
            # Released and never published: its releaser died before dispatching it.
            line = guarded("released parent", _redispatch, state, queue, job_id, now, since, 0)
        else:
            if dispatched is not None:
                since = max(since, float(dispatched))  # its message is the latest dispatch's
                if now - since < stall:
                    continue
            # In a backlog this is where a pass ends: one broker question, no payload read.
            if not seen.could_be_overtaken(since) and not seen.empty():
                continue
            line = guarded(
                "pending job",
                _maybe_lost,
                state,
                queue,
                job_id,
                now,
                since,
                suspect,
                is_parent,
                seen,
            )
        if line:
            repairs.append(line)
    return repairs


def _maybe_lost(
    state: EchoMQ,
    queue: str,
    job_id: str,
    now: int,
    since: float,
    suspect: Any,
    is_parent: bool,
    seen: _Evidence,
) -> str | None:
    """Re-publish (dispatch, for a parent) a pending job if the evidence shows its message is
    gone, and held at an earlier look too."""
    stall = state.settings.stall_ms
    job = decode_job(state, queue, job_id, read_stored(state, queue, job_id))
    if job is not None:
        if now - since < stall + _delay_ms(job, since):
            return None  # a delayed message, not a late one (yet)
        if not (seen.overtaken(since, _priority(job)) or seen.empty()):
            return None  # waiting behind jobs of a higher priority, or in a backlog
        ran, line = _ran_without_extension(state, queue, job_id, job, is_parent)
        if ran:
            return line
    if not _confirmed(state, queue, job_id, suspect, now):
        return None
    if is_parent:
        return _redispatch(state, queue, job_id, now, since, stall)
    return _republish_pending(state, queue, job_id, now, since, job)


def _ran_without_extension(
    state: EchoMQ, queue: str, job_id: str, job: dict[str, Any], is_parent: bool
) -> tuple[bool, str | None]:
    """``(True, line)`` when the job must not be re-published: its body already ran outside
    the extension and has a final state in the result backend (it is settled from it here), or
    the backend cannot be read now (the next pass looks again). ``(False, None)``: no such
    evidence, the job may be re-published."""
    if is_nested_entry(job):
        return False, None  # a nested flow's entry: no body of its own, nothing in the backend
    try:
        status, result = backend_outcome(state, job_id)
    except STORE_ERRORS:
        raise
    except Exception as exc:
        # A body that may have run cannot be told from a lost message: wait, as (b) does.
        logger.warning("echomq recovery: result backend unreadable for %s: %s", job_id, exc)
        return True, None
    if status not in (states.SUCCESS, states.FAILURE):
        return False, None
    # The transition a worker with the extension makes before it runs a body, then the one it
    # makes after: the claim refuses a job taken meanwhile, the token makes the completion the
    # claim's own, so two passes at once settle it once.
    token = new_token()
    claimed, _, _ = state.scripts.claim(
        queue, job_id, token, state.settings.stall_ms, priority=_priority(job)
    )
    if claimed not in STARTED:
        return True, None
    headers = Headers.of_job(job)
    lapsed = Lapsed(
        state,
        queue,
        job_id,
        token,
        is_parent=is_parent,
        parent=parent_ref(headers),
        next_step=str(getattr(headers, H_NEXT, None) or ""),
        replaced_by="",
    )
    settled = (
        complete_from_result(lapsed, result)
        if status == states.SUCCESS
        else fail_from_result(lapsed, result)
    )
    return True, (
        f"{settled}; it was pending, never claimed: a worker without celery-echomq ran it "
        "(not re-published, which would run it again)"
    )


def _confirmed(state: EchoMQ, queue: str, job_id: str, suspect: Any, now: int) -> bool:
    """Whether the evidence against ``job_id`` held at an earlier look, :data:`HOLD_MS` to a
    few stall timeouts ago; else this look is recorded as the first one."""
    first = float(suspect) if suspect is not None else None
    if first is not None and HOLD_MS <= now - first <= HOLD_MS + 4 * state.settings.stall_ms:
        return True
    if first is None or now - first > HOLD_MS:
        state.client.hset(state.keys.job_key(queue, job_id), "suspect", now)
    return False


def _redispatch(
    state: EchoMQ, queue: str, parent_id: str, now: int, since: float, after_ms: int
) -> str | None:
    if not dispatch_parent(state, queue, parent_id, redispatch_after_ms=after_ms):
        return None
    keep_locator(state, queue, parent_id)
    state.client.hdel(state.keys.job_key(queue, parent_id), "suspect")
    state.client.hincrby(state.keys.queue_key(queue, "counters"), "republished", 1)
    waited = (now - since) / 1000
    why = "never dispatched" if after_ms == 0 else "its message is gone"
    return f"{queue}: dispatched parent {parent_id} (released {waited:.1f}s ago, {why})"


def _delay_ms(job: dict[str, Any], since_ms: float) -> int:
    """How long after ``since_ms`` (when it became pending) the job's message asks to wait.

    A child sent with ``countdown`` or ``eta`` is not late until that delay and a stall timeout
    have passed; re-publishing it sooner would only run it twice.
    """
    options = job.get("options") or {}
    delay = 0.0
    countdown = options.get("countdown")
    if countdown:
        delay = float(countdown) * 1000
    eta = options.get("eta")
    if isinstance(eta, str):
        eta = datetime.fromisoformat(eta)
    if isinstance(eta, datetime):
        aware = eta if eta.tzinfo is not None else eta.replace(tzinfo=timezone.utc)
        delay = max(delay, aware.timestamp() * 1000 - since_ms)
    return max(0, int(delay))


def _republish_pending(
    state: EchoMQ, queue: str, job_id: str, now: int, since: float, seen: dict[str, Any] | None
) -> str | None:
    stall = state.settings.stall_ms
    delay = _delay_ms(seen, since) if seen is not None else 0
    # The script re-checks the age (with the same delay, and its backoff) and the leases:
    # another pass may have requeued it, a worker may have fetched it since. A refused payload
    # is re-scored too, so it is reported once per stall timeout and never blocks the head of
    # the pending set.
    status, payload = state.scripts.requeue(queue, job_id, stall + delay, Status.PENDING)
    if status is not Status.REQUEUED or seen is None:
        return None
    job = decode_job(state, queue, job_id, payload)
    if job is None:
        return None
    tracing.republished(job, job_id, queue, "message gone")
    with tracing.job_context(job):
        publish(state.app, [job])
    waited = (now - since) / 1000
    if (nested := nested_plan(job)) is not None:
        outer = nested.outer
        return f"{queue}: resumed nested flow {job_id} of parent {outer} (pending {waited:.1f}s)"
    ref = parent_ref(Headers.of_job(job))
    of = ""
    if ref is not None:
        keep_locator(state, ref.queue, ref.id)
        of = f" of parent {ref.id}"
    return f"{queue}: re-published {job_id}{of} (pending {waited:.1f}s; its message is gone)"
