"""Recovery: nothing lost, nothing counted twice, and nothing re-run on a guess.

A signal receiver can fail (Redis unreachable), a worker can die mid-task or between two steps,
a producer can die between its EVAL and its publishes, and a broker can lose messages. None of
that may leave a flow waiting forever; and a job that is only waiting (a backlog, a long task,
a prefetched message) must never be taken for a lost one. So every repair acts on evidence:

- A **lease** says a holder is alive. A worker renews, every few seconds, the leases of the flow
  jobs it runs (their deadlines in the active set) and of those it has received but not started
  (prefetched, or waiting for an eta: the reserved set). A lease lapses a stall timeout after
  its holder's last renewal, and ends at once when the worker sees the pool process that held
  it die (drop.lua).
- A job's **message is gone** when the job is pending past the stall timeout, no live worker
  holds it, and either the queue has since delivered a job of the same priority that became
  pending more than a stall timeout after it (brokers deliver a queue in order: it was
  overtaken), or the broker reports the queue empty. Both must still hold, for the same job,
  at a second look at least :data:`HOLD_MS` later: a worker leases what it has just fetched
  within that time.

:func:`run_pass` looks at every queue in ``emq:queues`` and repairs what the evidence shows:

(a) a pending child whose message is gone: re-published from its stored payload;
(b) a job whose holder's lease lapsed: Celery's result backend says how its body ended:
    SUCCESS -> complete it with that value, FAILURE -> fail it (the child's policy applies),
    anything else -> re-publish it. A job handed over to a replacement (``Task.replace``) is
    completed or failed from the replacement's result as soon as the backend has it;
(c) a released parent never dispatched a stall timeout after its release, or dispatched and
    its message gone: dispatched (again);
(d) a parent failed by its child whose FAILURE never reached the result backend (its worker
    died between fail.lua and ``flows.parent_failed``), or a failed nested flow whose failure
    never reached its outer flow: record it, carry it;
(e) a child of another slot staged in its queue's outbox but never credited on its parent's
    slot (its worker died between the two steps): credit it (credit.lua is idempotent);
(f) a flow of the chunked path still open past the stall timeout (its producer died between
    open_flow and seal_flow): seal it if every child was written, else fail it.

No storm: a job is re-published at most once per stall timeout, doubling for each earlier
re-publish (requeue.lua), a pass re-publishes at most :data:`BUDGET` jobs per queue, and each
re-publish is logged and counted in the queue's ``republished`` counter (``echomq stats``).

Every repair is an atomic transition script that re-checks what the pass saw (state, token,
deadline, score), so two passes at once (two workers, or a worker and ``celery echomq
recover``) cost duplicate work at most, never a double credit.

:class:`RecoveryLoop` runs in every worker: it renews that worker's leases, ends those of its
dead pool processes, and runs the pass, one worker at a time under a Redis lease.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import redis
from celery import bootsteps, states

from .errors import FlowFailed, InvalidIdError
from .flows import (
    H_FLOW,
    H_PARENT,
    H_PARENT_QUEUE,
    H_QUEUE,
    _locator_ttl,
    credit_remote,
    dispatch_parent,
    error_text,
    follow,
    parent_ref,
    publish,
    settle_failure,
    settle_success,
)
from .keyspace import check_id, check_queue
from .scripts import ParentRef, Status
from .signals import holder_prefix, pid_alive
from .state import EchoMQ, find_state

logger = logging.getLogger("celery_echomq")

LEASE = "recovery"
# Entries read from each set of each queue per pass: a pass stays short; the next takes the rest.
BATCH = 500
# Re-publishes per queue per pass: recovery never floods a queue that is already struggling.
BUDGET = 100
# How often a worker looks at what it holds: a job it has just fetched is leased within this.
TICK = 0.5
# Evidence that a message is gone must hold at two looks this far apart (see above).
HOLD_MS = 1500
# The recovery lease outlives a pass by far; a holder that dies mid-pass delays the next pass
# by at most this long (or three intervals, if longer).
LEASE_MIN_MS = 10_000
# Where the scan of a queue's failed set resumes (d): entries before it have been checked.
FAILED_MARK = "failed_checked"
# Connection trouble aborts the whole pass (the next one retries); anything else is one job's.
STORE_ERRORS = (redis.ConnectionError, redis.TimeoutError)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _now_ms(client: Any) -> int:
    # The Redis server's clock, the one every script scores with: no skew with the host's.
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _valid_ids(raw: Iterable[Any], queue: str) -> list[str]:
    ids = []
    for item in raw:
        job_id = _text(item)
        try:
            ids.append(check_id(job_id))
        except InvalidIdError:
            # Nothing we write puts a bad id in a set; someone else did. Never build a key from it.
            logger.warning("echomq recovery: ignoring ill-formed id %r in queue %s", job_id, queue)
    return ids


class _Headers:
    """Attribute access to a stored job's headers: what ``flows.parent_ref`` reads."""

    def __init__(self, headers: dict[str, Any]) -> None:
        self.__dict__.update(headers)


def _headers(job: dict[str, Any]) -> _Headers:
    return _Headers((job.get("options") or {}).get("headers") or {})


def _decode(state: EchoMQ, queue: str, job_id: str, payload: Any) -> dict[str, Any] | None:
    """The stored job, or None when its payload is missing or refused (never executed)."""
    if payload is None:
        logger.warning("echomq recovery: %s on %s has no payload; left alone", job_id, queue)
        return None
    try:
        job = state.loads(payload)
    except Exception as exc:
        # Content the app does not accept (e.g. a pickle planted in a JSON app's store) is
        # refused by kombu before it is decoded, and is never published.
        logger.warning(
            "echomq recovery: the stored payload of %s on %s was refused: %s", job_id, queue, exc
        )
        return None
    # A job, or a nested flow's entry (``{"nested": plan}``: publishing it resumes the flow).
    if not isinstance(job, dict) or not (
        isinstance(job.get("options"), dict) or isinstance(job.get("nested"), dict)
    ):
        logger.warning(
            "echomq recovery: the stored payload of %s on %s is not a job", job_id, queue
        )
        return None
    return job


def _with_values(state: EchoMQ, queue: str, parent_id: str, job: dict[str, Any]) -> dict[str, Any]:
    """A flow parent's message: its children's values first, as ``flows.dispatch_parent`` does.

    Read in chunks (HSCAN), not in one reply: a large flow's values must not block Redis.
    """
    _, processed, _ = state.keys.flow_keys(queue, parent_id)
    chunk = state.settings.chunk_size
    stored = {_text(k): v for k, v in state.client.hscan_iter(processed, count=chunk)}
    values = [state.loads(stored[cid]) for cid in job["children"] if cid in stored]
    if not job.get("immutable"):
        job["args"] = [values, *job["args"]]
    return job


def _keep_locator(state: EchoMQ, queue: str, parent_id: str) -> None:
    # A producer killed right after its EVAL never wrote the flow's locator; without it a bare
    # FlowResult(id) cannot find the flow. NX: a locator that exists is the producer's own.
    state.client.set(state.keys.locator_key(parent_id), queue, nx=True, ex=_locator_ttl(state))


def _queues(state: EchoMQ, queues: Iterable[str] | None) -> list[str]:
    """The queues in ``emq:queues`` (those of them in ``queues``), well-formed ones only."""
    names = sorted(_text(raw) for raw in state.client.smembers(state.keys.queues_key()))
    if queues is not None:
        wanted = set(queues)
        names = [name for name in names if name in wanted]
    valid = []
    for name in names:
        try:
            valid.append(check_queue(name))
        except InvalidIdError:
            logger.warning("echomq recovery: ignoring ill-formed queue name %r", name)
    return valid


def anything_due(state: EchoMQ, queues: Iterable[str] | None = None) -> bool:
    """Whether a pass would find anything to look at: two read-only round trips.

    The worker step checks this before it takes the lease, so an idle system's passes are pure
    reads: no lease written every interval (which an fsync-always AOF would pay for), nothing
    for a person watching the store to mistake for activity.
    """
    client, keys, stall = state.client, state.keys, state.settings.stall_ms
    names = _queues(state, queues)
    if not names:
        return False
    now = _now_ms(client)
    due = {"outbox": now - stall, "open": now - stall, "pending": now - stall, "active": now}
    pipe = client.pipeline(transaction=False)
    for queue in names:
        for set_name, before in due.items():
            pipe.zrangebyscore(keys.queue_key(queue, set_name), "-inf", before, start=0, num=1)
        pipe.get(keys.queue_key(queue, FAILED_MARK))
    replies = pipe.execute()
    width = len(due) + 1
    if any(any(replies[i * width : i * width + len(due)]) for i in range(len(names))):
        return True
    # Failed entries are due (d) past the queue's mark, and past a stall timeout.
    pipe = client.pipeline(transaction=False)
    for i, queue in enumerate(names):
        mark = int(float(replies[i * width + len(due)] or 0))
        low = max(mark, now - state.settings.result_ttl * 1000)
        pipe.zrangebyscore(keys.queue_key(queue, "failed"), f"({low}", now - stall, start=0, num=1)
    return any(pipe.execute())


def run_pass(
    state: EchoMQ, *, queues: Iterable[str] | None = None, batch: int = BATCH
) -> list[str]:
    """One recovery pass over every queue in ``emq:queues`` (or only those of them named in
    ``queues``): one line per repair, with ids."""
    repairs: list[str] = []
    for queue in _queues(state, queues):
        # Outbox and open flows first: they can release parents that (c) then finds pending.
        for step in (
            _uncredited_outbox,
            _unsealed_flows,
            _lost_pending,
            _lost_active,
            _unrecorded_failures,
        ):
            for line in step(state, queue, batch):
                logger.warning("echomq recovery: %s", line)
                repairs.append(line)
    return repairs


def recover_now(state: EchoMQ, *, queues: Iterable[str] | None = None) -> list[str]:
    """Two passes :data:`HOLD_MS` apart: what ``celery echomq recover`` runs. The first look
    records the evidence that a message is gone; the second confirms it and re-publishes."""
    repairs = run_pass(state, queues=queues)
    time.sleep(HOLD_MS / 1000 + 0.1)
    return repairs + run_pass(state, queues=queues)


def _overdue(
    state: EchoMQ, queue: str, set_name: str, before_ms: int, batch: int
) -> list[tuple[str, float]]:
    """``(id, score)`` of the entries of one of the queue's sets scored at most ``before_ms``."""
    found = state.client.zrangebyscore(
        state.keys.queue_key(queue, set_name),
        "-inf",
        before_ms,
        start=0,
        num=batch,
        withscores=True,
    )
    scores = {_text(item): float(score) for item, score in found}
    return [(job_id, scores[job_id]) for job_id in _valid_ids(scores, queue)]


def _guarded(
    what: str, repair: Callable[..., str | None], state: EchoMQ, queue: str, job_id: str, *args: Any
) -> str | None:
    """``repair(state, queue, job_id, *args)``, for one job: store trouble ends the pass,
    anything else ends only this repair."""
    try:
        return repair(state, queue, job_id, *args)
    except STORE_ERRORS:
        raise
    except Exception:
        logger.exception("echomq recovery: could not repair %s %s on %s", what, job_id, queue)
        return None


# --- (a) and (c) -------------------------------------------------------------------------------


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
        self.marks = {_text(k): float(v) for k, v in marks.items()}
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


def _lost_pending(state: EchoMQ, queue: str, batch: int) -> list[str]:
    """(a) children whose message is gone, and (c) released parents not started."""
    client, keys, stall = state.client, state.keys, state.settings.stall_ms
    now = _now_ms(client)
    client.zremrangebyscore(keys.queue_key(queue, "reserved"), "-inf", now)
    due = _overdue(state, queue, "pending", now - stall, batch)
    if not due:
        return []
    fields = ("dispatched", "suspect")
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
        (dispatched, suspect), held, is_parent = replies[3 * i : 3 * i + 3]
        if held is not None and float(held) > now:
            continue  # a live worker has it (prefetched, or waiting for its eta)
        if is_parent and dispatched is None:
            # Released and never published: its releaser died before dispatching it.
            line = _guarded("released parent", _redispatch, state, queue, job_id, now, since, 0)
        else:
            if dispatched is not None:
                since = max(since, float(dispatched))  # its message is the latest dispatch's
                if now - since < stall:
                    continue
            # In a backlog this is where a pass ends: one broker question, no payload read.
            if not seen.could_be_overtaken(since) and not seen.empty():
                continue
            line = _guarded(
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
    job = _decode(
        state, queue, job_id, state.client.hget(state.keys.job_key(queue, job_id), "payload")
    )
    if job is not None:
        if now - since < stall + _delay_ms(job, since):
            return None  # a delayed message, not a late one (yet)
        if not (seen.overtaken(since, _priority(job)) or seen.empty()):
            return None  # waiting behind jobs of a higher priority, or in a backlog
    if not _confirmed(state, queue, job_id, suspect, now):
        return None
    if is_parent:
        return _redispatch(state, queue, job_id, now, since, stall)
    return _republish_pending(state, queue, job_id, now, since, job)


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
    _keep_locator(state, queue, parent_id)
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
    job = _decode(state, queue, job_id, payload)
    if job is None:
        return None
    publish(state.app, [job])
    waited = (now - since) / 1000
    if "nested" in job:
        outer = job["nested"].get("outer")
        return f"{queue}: resumed nested flow {job_id} of parent {outer} (pending {waited:.1f}s)"
    ref = parent_ref(_headers(job))
    of = ""
    if ref is not None:
        _keep_locator(state, ref.queue, ref.id)
        of = f" of parent {ref.id}"
    return f"{queue}: re-published {job_id}{of} (pending {waited:.1f}s; its message is gone)"


# --- (b) ---------------------------------------------------------------------------------------


def _backend_outcome(state: EchoMQ, job_id: str) -> tuple[str | None, Any]:
    """The job's status and result in Celery's result backend; (None, None) if it keeps none."""
    from celery.backends.base import DisabledBackend

    backend = state.app.backend
    if isinstance(backend, DisabledBackend):
        return None, None
    meta = backend.get_task_meta(job_id)
    return meta.get("status"), meta.get("result")


def _lost_active(state: EchoMQ, queue: str, batch: int) -> list[str]:
    """(b) jobs whose holder's lease lapsed (its worker died, or could not reach Redis), and
    jobs handed over to a replacement task, due for a look at the result backend."""
    client = state.client
    due = _overdue(state, queue, "active", _now_ms(client), batch)
    if not due:
        return []
    pipe = client.pipeline(transaction=False)
    for job_id, _ in due:
        pipe.hmget(
            state.keys.job_key(queue, job_id),
            "state",
            "token",
            "payload",
            "replaced",
            "replaced_by",
        )
    rows = pipe.execute()
    repairs: list[str] = []
    for (job_id, _), (row_state, token, payload, replaced, by) in zip(due, rows, strict=True):
        if row_state is None or _text(row_state) != Status.ACTIVE:
            continue
        if len(repairs) >= BUDGET:
            break
        line = _guarded(
            "active job",
            _repair_active,
            state,
            queue,
            job_id,
            _text(token or b""),
            payload,
            _text(by) if by else (job_id if replaced is not None else ""),
        )
        if line:
            repairs.append(line)
    return repairs


def _repair_active(
    state: EchoMQ, queue: str, job_id: str, token: str, payload: Any, replaced_by: str = ""
) -> str | None:
    """Settle a job whose lease lapsed, from its result in Celery's backend; or a job handed
    over to a replacement (``replaced_by``: the id the replacement stores its result under)."""
    job = _decode(state, queue, job_id, payload)
    if job is None:
        # Refused: push its deadline back, so it is reported once per stall timeout.
        state.scripts.extend(queue, [job_id], state.settings.stall_ms)
        return None
    headers = _headers(job)
    parent = parent_ref(headers)
    is_parent = bool(getattr(headers, H_FLOW, None))
    try:
        status, result = _backend_outcome(state, replaced_by or job_id)
    except STORE_ERRORS:
        raise
    except Exception as exc:
        # Without the backend we cannot tell a finished body from a lost one; re-running a
        # finished one would be safe for the credit but not for its side effects: wait.
        logger.warning("echomq recovery: result backend unreadable for %s: %s", job_id, exc)
        return None
    if replaced_by and replaced_by != job_id and status in (states.SUCCESS, states.FAILURE):
        # A flow replaced it under an id of its own: the replaced id resolves too, as
        # Task.replace promises.
        if status == states.SUCCESS:
            state.app.backend.mark_as_done(job_id, result)
        else:
            state.app.backend.mark_as_failure(job_id, result)
    if status == states.SUCCESS:
        # The body finished and stored its result (or its replacement did); only the success
        # signal's transition was lost. The token makes this the very completion the signal
        # would have made.
        done = settle_success(state, queue, job_id, token, is_parent, parent, state.dumps(result))
        whose = "its replacement's" if replaced_by else "its"
        return f"{queue}: completed {job_id} from {whose} SUCCESS result ({done})"
    if status == states.FAILURE:
        error = error_text(result) if isinstance(result, BaseException) else str(result)
        failed = settle_failure(state, queue, job_id, token, error, is_parent, parent)
        return f"{queue}: failed {job_id} from its FAILURE result ({failed}): {error}"
    if replaced_by:
        # Its replacement has not finished: look again next pass. Whether the replacement's
        # messages arrive is Celery's business, as for a chord whose header task replaced
        # itself; this job is not re-run.
        state.scripts.extend(queue, [job_id], int(state.settings.recovery_interval * 1000))
        return None
    requeued, stored = state.scripts.requeue(
        queue, job_id, state.settings.stall_ms, Status.ACTIVE, token
    )
    if requeued is not Status.REQUEUED:
        return None
    job = _decode(state, queue, job_id, stored)
    if job is None:
        return None
    if "children" in job:
        job = _with_values(state, queue, job_id, job)
    publish(state.app, [job])
    return (
        f"{queue}: re-published {job_id} (its holder's lease lapsed; result backend: "
        f"{status or 'none'})"
    )


# --- (d) ---------------------------------------------------------------------------------------


def _unrecorded_failures(state: EchoMQ, queue: str, batch: int) -> list[str]:
    """(d) failed parents whose FAILURE never reached the backend or their outer flow."""
    keys, client, settings = state.keys, state.client, state.settings
    now = _now_ms(client)
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
    scores = {_text(item): float(score) for item, score in found}
    # A full batch resumes at the last score read (entries sharing it are checked again).
    checked_to = high if len(found) < batch else int(max(scores.values(), default=high)) - 1
    ids = _valid_ids(scores, queue)
    repairs: list[str] = []
    if ids:
        fields = ("state", "failed_child", "error", "abandoned", "parent", "propagated")
        pipe = client.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(keys.job_key(queue, job_id), fields)
        for job_id, values in zip(ids, pipe.execute(), strict=True):
            row = {name: _text(v) for name, v in zip(fields, values, strict=True) if v is not None}
            if row.get("state") != Status.FAILED or not (
                row.get("failed_child") or row.get("abandoned")
            ):
                continue  # a failed child, or a parent whose own body failed (Celery recorded it)
            try:
                line = _record_failed_parent(state, queue, job_id, row)
            except STORE_ERRORS:
                raise
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
    status, _ = _backend_outcome(state, parent_id)
    payload = state.client.hget(state.keys.job_key(queue, parent_id), "payload")
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
            _mark_abandoned(state, queue, parent_id, exc, payload)
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
    job = _decode(state, queue, parent_id, payload) if payload is not None else None
    if job is None:
        return None
    headers = (job.get("options") or {}).get("headers") or {}
    outer = headers.get(H_PARENT)
    return ParentRef(str(outer), str(headers.get(H_PARENT_QUEUE) or queue)) if outer else None


def _mark_abandoned(
    state: EchoMQ, queue: str, parent_id: str, exc: FlowFailed, payload: Any
) -> None:
    state.app.backend.mark_as_failure(parent_id, exc)
    outer = _outer_ref(state, queue, parent_id, payload)
    if outer is not None:
        settle_failure(state, queue, parent_id, "", error_text(exc), True, outer, carry=True)


# --- (e) and (f): the chunked, cross-slot path --------------------------------------------------


def _uncredited_outbox(state: EchoMQ, queue: str, batch: int) -> list[str]:
    """(e) children of another slot finished but never credited on their parent's slot."""
    client = state.client
    due = _overdue(state, queue, "outbox", _now_ms(client) - state.settings.stall_ms, batch)
    if not due:
        return []
    fields = ("state", "value", "error", "parent_policy", "payload")
    pipe = client.pipeline(transaction=False)
    for job_id, _ in due:
        pipe.hmget(state.keys.job_key(queue, job_id), fields)
    repairs = []
    for (job_id, _), values in zip(due, pipe.execute(), strict=True):
        row = dict(zip(fields, values, strict=True))
        line = _guarded("staged child", _credit, state, queue, job_id, row)
        if line:
            repairs.append(line)
    return repairs


def _credit(state: EchoMQ, queue: str, job_id: str, row: dict[str, Any]) -> str | None:
    outbox = state.keys.queue_key(queue, "outbox")
    job = _decode(state, queue, job_id, row["payload"]) if row["payload"] is not None else None
    parent = parent_ref(_headers(job)) if job is not None else None
    row_state = _text(row["state"]) if row["state"] is not None else Status.MISSING
    if parent is None or row_state not in (Status.DONE, Status.FAILED):
        state.client.zrem(outbox, job_id)  # expired, or nothing to credit
        return None
    if row_state == Status.DONE:
        status, _ = credit_remote(
            state, queue, job_id, parent, Status.DONE, row["value"] or b"", ""
        )
        error = ""
    else:
        error = _text(row["error"] or b"")
        policy = _text(row["parent_policy"] or b"")
        status, _ = credit_remote(state, queue, job_id, parent, Status.FAILED, error, policy)
    if status is Status.DUPLICATE:
        return None
    follow(state, status, job_id, parent, error)
    return f"{queue}: credited staged {job_id} ({row_state}) to parent {parent.id} ({status})"


def _unsealed_flows(state: EchoMQ, queue: str, batch: int) -> list[str]:
    """(f) flows open past the stall timeout: their producer died before sealing them."""
    client = state.client
    stall = state.settings.stall_ms
    due = _overdue(state, queue, "open", _now_ms(client) - stall, batch)
    repairs = []
    for parent_id, _ in due:
        line = _guarded("open flow", _seal_or_abandon, state, queue, parent_id)
        if line:
            repairs.append(line)
    return repairs


def _seal_or_abandon(state: EchoMQ, queue: str, parent_id: str) -> str | None:
    client, keys = state.client, state.keys
    payload = client.hget(keys.job_key(queue, parent_id), "payload")
    job = _decode(state, queue, parent_id, payload)
    children: list[str] = list(job.get("children") or []) if job else []
    # The children of one flow may live on any queue's slot; a row that names this parent is
    # one add_children wrote.
    queues = sorted(_text(q) for q in client.smembers(keys.queues_key()))
    pipe = client.pipeline(transaction=False)
    for cid in children:
        for name in queues:
            pipe.hget(keys.job_key(name, cid), "parent")
    owners = pipe.execute()
    written = {
        cid
        for i, cid in enumerate(children)
        if any(_text(o) == parent_id for o in owners[i * len(queues) : (i + 1) * len(queues)] if o)
    }
    if job is not None and len(written) == len(children):
        status = state.scripts.seal_flow(queue, parent_id)
        if status is Status.NOOP:
            return None
        if status is Status.RELEASED:
            dispatch_parent(state, queue, parent_id)
        return f"{queue}: sealed flow {parent_id} (every child was written; {status})"
    reason = (
        f"its producer stopped while starting it ({len(written)} of {len(children)} children "
        "written)"
    )
    status = state.scripts.abandon_flow(
        queue, parent_id, state.settings.stall_ms, reason, ttl=state.settings.result_ttl
    )
    if status is not Status.ABANDONED:
        return None
    exc = FlowFailed(f"flow {parent_id}: {reason}", "", reason)
    _mark_abandoned(state, queue, parent_id, exc, payload)
    return f"{queue}: failed flow {parent_id}: {reason}"


# --- the worker step ---------------------------------------------------------------------------


def leased_pass(
    state: EchoMQ, holder: str, queues: Iterable[str] | None = None
) -> list[str] | None:
    """:func:`run_pass` under the recovery lease; None when another process holds it.

    Nothing due (:func:`anything_due`): an empty list, without taking the lease.
    """
    if not anything_due(state, queues):
        return []
    settings = state.settings
    ttl_ms = max(LEASE_MIN_MS, int(settings.recovery_interval * 3000))
    if not state.client.set(state.keys.lease_key(LEASE), holder, nx=True, px=ttl_ms):
        return None
    try:
        return run_pass(state, queues=queues)
    finally:
        # If Redis is gone the lease expires on its own.
        with contextlib.suppress(*STORE_ERRORS):
            state.scripts.lease_release(LEASE, holder)


@dataclass(frozen=True)
class Held:
    """A flow job this worker holds: running in pool process ``pid``, or received, not started."""

    queue: str
    running: bool
    pid: int | None


def held_jobs() -> dict[str, Held]:
    """The flow jobs this worker holds now, by id (Celery's worker state, read in its main
    process): running, prefetched and waiting for a pool process, or waiting for an eta."""
    from celery.worker import state as worker_state

    held: dict[str, Held] = {}
    # Copies: the worker's event loop adds and removes requests while this thread reads.
    groups = (
        (True, list(worker_state.active_requests)),
        (False, list(worker_state.reserved_requests)),
        (False, list(getattr(worker_state, "scheduled_requests", ()))),
    )
    for running, requests in groups:
        for request in requests:
            headers = getattr(request, "request_dict", None) or {}
            queue = headers.get(H_QUEUE)
            if queue and str(request.id) not in held:
                pid = getattr(request, "worker_pid", None) if running else None
                held[str(request.id)] = Held(str(queue), running, pid)
    return held


def renew(state: EchoMQ, jobs: dict[str, Held]) -> int:
    """Renew this worker's leases on ``jobs``; how many moved."""
    by_queue: dict[str, tuple[list[str], list[str]]] = {}
    for job_id, job in jobs.items():
        running, waiting = by_queue.setdefault(job.queue, ([], []))
        (running if job.running else waiting).append(job_id)
    moved = 0
    for queue, (running, waiting) in by_queue.items():
        moved += state.scripts.extend(queue, running, state.settings.stall_ms, waiting)
    return moved


def drop_dead(state: EchoMQ, jobs: dict[str, Held]) -> list[str]:
    """End the leases of ``jobs``, whose pool processes this worker saw die; one line each."""
    lines = []
    for job_id, job in jobs.items():
        if job.pid is None:
            continue
        status, payload = state.scripts.drop(job.queue, job_id, holder_prefix(job.pid))
        if status is Status.NOOP:
            continue
        if status is Status.REQUEUED:
            # A duplicate was skipped while this holder looked alive: no message is left.
            found = _decode(state, job.queue, job_id, payload)
            if found is not None:
                if "children" in found:
                    found = _with_values(state, job.queue, job_id, found)
                publish(state.app, [found])
            line = f"{job.queue}: re-published {job_id} (its pool process {job.pid} died)"
        else:
            line = f"{job.queue}: lease of {job_id} ended (its pool process {job.pid} died)"
        logger.warning("echomq recovery: %s", line)
        lines.append(line)
    return lines


class RecoveryLoop:
    """A daemon thread in the worker's main process: leases and leased recovery passes.

    Every :data:`TICK` it compares the flow jobs the worker holds with the last look: a job it
    has just received is leased at once, a job whose pool process died has its lease ended at
    once; every third of a stall timeout it renews all its leases; every recovery interval it
    runs a pass. A thread rather than the worker's timer: the timer's callbacks run on the
    event loop, and a pass makes blocking calls to Redis, the broker and the result backend.
    """

    def __init__(self, state: EchoMQ, name: str, app: Any = None) -> None:
        self.state = state
        self.app = app
        self.holder = f"{name}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        settings = state.settings
        self.interval = settings.recovery_interval
        # Renew at least three times per stall timeout, so one slow renewal never lets the
        # lease of a live job lapse.
        self.renew_every = min(settings.recovery_interval, settings.stall_timeout / 3)
        self.tick = min(TICK, self.renew_every)
        self._held: dict[str, Held] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="echomq-recovery", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def queues(self) -> set[str] | None:
        """The queues this worker consumes (read each pass: ``add_consumer`` can change them).

        A worker recovers only the flows of its own queues: it runs their tasks, so its
        ``echomq_stall_timeout`` is the one that fits them, and a worker for a queue of
        hour-long jobs is not second-guessed by one for a queue of quick ones.
        """
        if self.app is None:
            return None
        return {str(name) for name in self.app.amqp.queues.consume_from}

    def look(self, renew_all: bool) -> None:
        """One tick: lease what is new (or everything), end the leases of dead holders."""
        now = held_jobs()
        before, self._held = self._held, now
        gone = {
            job_id: job
            for job_id, job in before.items()
            if job.running
            and job.pid is not None
            and (job_id not in now or now[job_id].pid != job.pid)
            and not pid_alive(job.pid)
        }
        if gone:
            drop_dead(self.state, gone)
        fresh = (
            now
            if renew_all
            else {job_id: job for job_id, job in now.items() if before.get(job_id) != job}
        )
        if fresh:
            renew(self.state, fresh)

    def _run(self) -> None:
        start = time.monotonic()
        next_pass = start  # a worker that starts after a crash repairs at once
        next_renew = start
        while not self._stop.is_set():
            renew_all = time.monotonic() >= next_renew
            if renew_all:
                next_renew = time.monotonic() + self.renew_every
            try:
                self.look(renew_all)
            except Exception as exc:
                logger.warning("echomq recovery: could not renew leases: %s", exc)
                self._held = {}  # lease everything again at the next tick
            if time.monotonic() >= next_pass:
                next_pass = time.monotonic() + self.interval
                try:
                    leased_pass(self.state, self.holder, self.queues())
                except Exception as exc:
                    logger.warning("echomq recovery: pass failed: %r", exc)
            self._stop.wait(self.tick)


class RecoveryStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """The worker step that runs :class:`RecoveryLoop` (added by ``celery_echomq.install``)."""

    label = "echomq recovery"
    # After the pool: the loop reads the requests the pool is running.
    requires = ("celery.worker.components:Pool",)

    def create(self, worker: Any) -> RecoveryLoop | None:
        state = find_state(worker.app)
        if state is None:
            return None
        return RecoveryLoop(state, str(worker.hostname), worker.app)
