"""What every part of a pass shares: its limits, the server's clock, reading stored jobs."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import redis

from celery_echomq.errors import InvalidIdError, StoreFormatError
from celery_echomq.send.plan import parent_args
from celery_echomq.store.codec import Stored, TemplateMissingError, load_job
from celery_echomq.store.connection import text
from celery_echomq.store.keyspace import check_id
from celery_echomq.store.planned import held_of, is_row_job
from celery_echomq.store.state import EchoMQ

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


def now_ms(client: Any) -> int:
    # The Redis server's clock, the one every script scores with: no skew with the host's.
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def valid_ids(raw: Iterable[Any], queue: str) -> list[str]:
    ids = []
    for item in raw:
        job_id = text(item)
        try:
            ids.append(check_id(job_id))
        except InvalidIdError:
            # Nothing we write puts a bad id in a set; someone else did. Never build a key from it.
            logger.warning("echomq recovery: ignoring ill-formed id %r in queue %s", job_id, queue)
    return ids


def decode_job(
    state: EchoMQ, queue: str, job_id: str, payload: Stored | None
) -> dict[str, Any] | None:
    """The stored job (a payload, or a delta joined with its flow's template), or None when
    it is missing or refused (never executed)."""
    if payload is None:
        logger.warning("echomq recovery: %s on %s has no payload; left alone", job_id, queue)
        return None
    try:
        job = load_job(state, queue, job_id, payload)
    except TemplateMissingError as exc:
        logger.warning("echomq recovery: %s on %s: %s; left alone", job_id, queue, exc)
        return None
    except Exception as exc:
        # Content the app does not accept (e.g. a pickle planted in a JSON app's store) is
        # refused by kombu before it is decoded, and is never published.
        logger.warning(
            "echomq recovery: the stored payload of %s on %s was refused: %s", job_id, queue, exc
        )
        return None
    if not is_row_job(job):
        logger.warning(
            "echomq recovery: the stored payload of %s on %s is not a job", job_id, queue
        )
        return None
    return job


def with_values(state: EchoMQ, queue: str, parent_id: str, job: dict[str, Any]) -> dict[str, Any]:
    """A flow parent's message: its children's values first, as ``settle.dispatch_parent`` does.

    Read in chunks (HSCAN), not in one reply: a large flow's values must not block Redis.
    """
    _, processed, _ = state.keys.flow_keys(queue, parent_id)
    chunk = state.settings.chunk_size
    stored = {text(k): v for k, v in state.client.hscan_iter(processed, count=chunk)}
    values = [state.loads(stored[cid]) for cid in held_of(job).valued() if cid in stored]
    job["args"] = parent_args(job, values)
    return job


def keep_locator(state: EchoMQ, queue: str, parent_id: str) -> None:
    # A producer killed right after its EVAL never wrote the flow's locator; without it a bare
    # FlowResult(id) cannot find the flow. NX: a locator that exists is the producer's own.
    state.client.set(state.keys.locator_key(parent_id), queue, nx=True, ex=state.locator_ttl)


def overdue(
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
    scores = {text(item): float(score) for item, score in found}
    return [(job_id, scores[job_id]) for job_id in valid_ids(scores, queue)]


def guarded(
    what: str, repair: Callable[..., str | None], state: EchoMQ, queue: str, job_id: str, *args: Any
) -> str | None:
    """``repair(state, queue, job_id, *args)``, for one job: store trouble ends the pass,
    anything else ends only this repair."""
    try:
        return repair(state, queue, job_id, *args)
    except STORE_ERRORS:
        raise
    except StoreFormatError as exc:  # a newer release's row: left to that release's workers
        state.tell_newer(exc, f"recovery of {what} {job_id} on {queue}")
        return None
    except Exception:
        logger.exception("echomq recovery: could not repair %s %s on %s", what, job_id, queue)
        return None


def repair_stalled(
    state: EchoMQ,
    queue: str,
    set_name: str,
    what: str,
    repair: Callable[[EchoMQ, str, str], str | None],
    batch: int,
) -> list[str]:
    """``repair(state, queue, id)`` (guarded) for each entry of one of the queue's sets that
    has waited there longer than a stall timeout: a step its writer never finished."""
    due = overdue(state, queue, set_name, now_ms(state.client) - state.settings.stall_ms, batch)
    lines = (guarded(what, repair, state, queue, job_id) for job_id, _ in due)
    return [line for line in lines if line]
