"""Lists of flows for people: ``list_flows`` (``celery echomq list``) and per-queue counts.

Every read here goes through an index the scripts keep, never a SCAN of the keyspace, so one
call costs the same whatever the store holds:

- each queue's recent-flow index (``emq:{q}:recent``: parent id -> enqueue time, written by
  enqueue_flow and open_flow, trimmed to the result TTL and ``echomq_recent_flows``) for
  held, done, cancelled and recent flows, newest enqueued first;
- each queue's failed set (``emq:{q}:failed``: failed job -> failure time, trimmed to the
  result TTL) for failed flows, newest failure first: a failed flow is listed however many
  flows were enqueued since.

A page reads index entries in batches, then the rows of those entries (pipelined), until it
has ``limit`` flows or has looked at ``MAX_EXAMINED`` entries; it then returns what it found
and the cursor of the next page, as Redis's SCAN does: a page may hold fewer than ``limit``
flows (even none) while a cursor is given, and the last page's cursor is None. Only
top-level flows are listed (a nested flow is in its flow's tree: ``show``).
"""

from __future__ import annotations

import fnmatch
import re
import time
from dataclasses import dataclass
from typing import Any

from celery import current_app

from celery_echomq.errors import CursorError, ListingError
from celery_echomq.store.connection import text
from celery_echomq.store.cursor import Cursor
from celery_echomq.store.keyspace import check_queue, id_of_row
from celery_echomq.store.planned import held_of
from celery_echomq.store.reads import counts_of
from celery_echomq.store.state import EchoMQ, get_state

__all__ = ["FlowRow", "QueueStats", "held_parents", "list_flows", "queue_stats", "read_flows"]

# --state: the parent row's state each one lists (None: any).
STATES: dict[str, str | None] = {
    "held": "awaiting_children",
    "failed": "failed",
    "done": "done",
    "cancelled": "cancelled",
    "recent": None,
}
MAX_LIMIT = 1000
# Index entries one call looks at, at most, whatever the number of flows: what bounds it.
MAX_EXAMINED = 10_000
BATCH_MAX = 1000  # index entries (and rows) one round trip reads, at most
_ROW = ("state", "parent", "credited_failed", "failed_children", "error")


@dataclass(frozen=True)
class FlowRow:
    """One flow as ``list`` shows it."""

    id: str
    queue: str
    task: str | None  # the parent's task name
    state: str  # its parent row's state (awaiting_children, pending, active, done, ...)
    done: int  # Dependencies' counts of its children
    failed: int
    ignored: int
    outstanding: int
    cut: int  # the flow ended without them (cancelled, cut by a deadline, a quorum, a release)
    total: int
    enqueued_ms: int | None  # when it was enqueued (None: no longer in the recent index)
    failed_ms: int | None  # when it failed, for a failed flow
    age_s: float | None  # seconds since it was enqueued, at the time of the read
    error: str | None


@dataclass(frozen=True)
class QueueStats:
    """Counts for one queue that holds flows (a snapshot)."""

    queue: str
    pending: int  # claimable jobs, including released parents not yet started
    active: int  # claimed and running (or lost, until recovery notices)
    held: int  # parents awaiting their children
    failed: int  # jobs that failed for good within the result TTL
    republished: int = 0  # messages recovery re-published (or dispatched again), ever
    skipped: int = 0  # duplicate deliveries acknowledged without running their body, ever
    forged: int = 0  # deliveries refused: their message named another parent than the row's


def list_flows(
    state: str = "failed",
    queue: str | None = None,
    task: str | None = None,
    limit: int = 100,
    cursor: str | None = None,
    *,
    app: Any = None,
) -> tuple[list[FlowRow], str | None]:
    """A page of flows, newest first, and the cursor of the next page (None after the last).

    ``state``: ``held``, ``failed``, ``done``, ``cancelled`` or ``recent`` (any state);
    ``queue``: only that queue's flows; ``task``: only flows whose parent's task name is that
    (a glob: ``proj.*``); ``limit``: at most that many flows (1 to 1000); ``cursor``: the one
    a previous page returned, with the same ``state``. Bad input raises
    :class:`~celery_echomq.errors.ListingError` (a ``ValueError``) before anything is read.
    """
    return read_flows(get_state(app or current_app), state, queue, task, limit, cursor)


def read_flows(
    store: EchoMQ,
    state: str = "failed",
    queue: str | None = None,
    task: str | None = None,
    limit: int = 100,
    cursor: str | None = None,
) -> tuple[list[FlowRow], str | None]:
    """:func:`list_flows` on a given store (the CLI's, with its own timeouts)."""
    if state not in STATES:
        raise ListingError(f"state must be one of {', '.join(STATES)}, not {state!r}")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ListingError(f"limit must be a whole number from 1 to {MAX_LIMIT}, not {limit!r}")
    kind = "f" if state == "failed" else "r"
    start = _parse_cursor(cursor, kind)
    if queue is not None:
        check_queue(queue)
    names = [queue] if queue is not None else _queue_names(store)
    return _Pager(store, names, kind, STATES[state], task).page(start, limit)


def _parse_cursor(cursor: str | None, kind: str) -> tuple[int, str] | None:
    """Where a list goes on: the score and id of the last flow a page returned."""
    if cursor is None:
        return None
    start = Cursor.parse(cursor, "list", "fr", after="id")
    if start.after is None:
        raise CursorError(f"not a list cursor: {str(cursor)[:80]!r} (pass the one a page gave)")
    if start.phase != kind:
        raise CursorError("that cursor is from a list of another state: pass the same --state")
    return start.at, start.after


def _queue_names(store: EchoMQ) -> list[str]:
    members = store.client.smembers(store.keys.queues_key())
    return sorted(filter(None, (text(q) for q in members)))


class _Pager:
    def __init__(
        self, store: EchoMQ, names: list[str], kind: str, wanted: str | None, task: str | None
    ) -> None:
        self.store, self.names, self.kind = store, names, kind
        self.wanted, self.task = wanted, task
        self.index = "failed" if kind == "f" else "recent"

    def page(self, start: tuple[int, str] | None, limit: int) -> tuple[list[FlowRow], str | None]:
        rows: list[FlowRow] = []
        examined = 0
        position: tuple[int, str] | None = start
        # The first batch is the page itself (every entry matches when nothing filters, or
        # most do); a later one is what the rest of the page needs at the rate seen so far,
        # so a dense state costs two round trips and a sparse one a few.
        batch = limit
        while examined < MAX_EXAMINED:
            batch = min(batch, MAX_EXAMINED - examined)
            entries, more = self._entries(position, batch)
            for k, row in enumerate(self._rows(entries)):
                examined += 1
                position = entries[k][:2]
                if row is not None:
                    rows.append(row)
                    if len(rows) == limit:
                        last = k == len(entries) - 1 and not more
                        return rows, None if last else self._cursor(position)
            if not more:
                return rows, None
            need = limit - len(rows)
            rate = max(len(rows) / examined, 0.01) if examined else 1.0
            batch = min(BATCH_MAX, max(need, int(need / rate * 1.2) + 1))
        return rows, self._cursor(position) if position else None

    def _cursor(self, position: tuple[int, str] | None) -> str | None:
        return None if position is None else str(Cursor(self.kind, *position))

    def _entries(
        self, after: tuple[int, str] | None, batch: int
    ) -> tuple[list[tuple[int, str, str]], bool]:
        """The next ``batch`` entries after ``after`` over every queue's index, newest first
        (score, then id, descending), and whether any queue has more."""
        keys, pipe = self.store.keys, self.store.client.pipeline(transaction=False)
        for name in self.names:
            key = keys.queue_key(name, self.index)
            if after is None:
                pipe.zrevrange(key, 0, batch - 1, withscores=True)
            else:
                # Ties on the cursor's score (rare: microseconds), then the strictly older.
                pipe.zrevrangebyscore(key, after[0], after[0], withscores=True)
                pipe.zrevrangebyscore(key, f"({after[0]}", "-inf", 0, batch, withscores=True)
        replies = pipe.execute()
        per = 1 if after is None else 2
        merged: list[tuple[int, str, str]] = []
        full = False
        for i, name in enumerate(self.names):
            got = [e for r in replies[per * i : per * i + per] for e in r]
            full = full or len(replies[per * i + per - 1]) >= batch
            for member, score in got:
                job_id = text(member)
                if after is not None and int(score) == after[0] and job_id >= after[1]:
                    continue
                merged.append((int(score), job_id, name))
        merged.sort(key=lambda e: (e[0], e[1]), reverse=True)
        return merged[:batch], full or len(merged) > batch

    def _rows(self, entries: list[tuple[int, str, str]]) -> list[FlowRow | None]:
        """The rows of those entries that are top-level flows in the wanted state."""
        keys, client = self.store.keys, self.store.client
        pipe = client.pipeline(transaction=False)
        for _, job_id, queue in entries:
            pipe.hmget(keys.job_key(queue, job_id), _ROW)
        fields = [[text(v) for v in r] for r in pipe.execute()]
        keep = [
            i
            for i, (st, parent, *_) in enumerate(fields)
            if st is not None and parent is None and (self.wanted is None or st == self.wanted)
        ]
        pipe = client.pipeline(transaction=False)
        for i in keep:
            _, job_id, queue = entries[i]
            pipe.hget(keys.job_key(queue, job_id), "payload")
            if self.kind == "f":
                pipe.zscore(keys.queue_key(queue, "recent"), job_id)
        replies = iter(pipe.execute())
        found: dict[int, tuple[str | None, str, int | None]] = {}
        for i in keep:
            score, job_id, _ = entries[i]
            task, fan_in = self._job(next(replies), job_id)
            enqueued = next(replies) if self.kind == "f" else score
            if self.task is None or (task is not None and fnmatch.fnmatchcase(task, self.task)):
                found[i] = (task, fan_in, None if enqueued is None else int(enqueued) // 1000)
        counts = self._counts([(entries[i][2], found[i][1]) for i in found])
        now = time.time() * 1000
        out: list[FlowRow | None] = [None] * len(entries)
        for (i, (task, _, enqueued)), deps in zip(found.items(), counts, strict=True):
            score, job_id, queue = entries[i]
            out[i] = FlowRow(
                id=job_id,
                queue=queue,
                task=task,
                state=fields[i][0] or "missing",
                done=deps.done,
                failed=deps.failed,
                ignored=deps.ignored,
                outstanding=deps.outstanding,
                cut=deps.cut,
                total=deps.total,
                enqueued_ms=enqueued,
                failed_ms=score if self.kind == "f" else None,
                age_s=None if enqueued is None else max(0.0, (now - enqueued) / 1000),
                error=fields[i][4],
            )
        return out

    def _job(self, payload: Any, job_id: str) -> tuple[str | None, str]:
        """The parent's task name and the job holding its children (itself, unless its parent
        is a canvas: see send/shape.py)."""
        try:
            job = self.store.loads(payload) if payload else None
        except Exception:
            return None, job_id  # content this process does not accept: listed unnamed
        if not isinstance(job, dict):
            return None, job_id
        return job.get("task"), held_of(job).fan_in or job_id

    def _counts(self, flows: list[tuple[str, str]]) -> list[Any]:
        keys, pipe = self.store.keys, self.store.client.pipeline(transaction=False)
        for queue, job_id in flows:
            deps, processed, ignored = keys.flow_keys(queue, job_id)
            pipe.get(deps)
            pipe.hlen(processed)
            pipe.hlen(ignored)
            pipe.hmget(
                keys.job_key(queue, job_id), "credited_failed", "failed_children", "cut_children"
            )
        replies = pipe.execute()
        return [
            counts_of(*replies[4 * i : 4 * i + 3], *replies[4 * i + 3]) for i in range(len(flows))
        ]


def held_parents(state: EchoMQ, queue: str) -> list[str]:
    """Ids of parents awaiting their children on ``queue``, found with a SCAN of the queue's
    ``:dependencies`` keys (no set tracks them): a slow read, for tests and audits."""
    keys, client = state.keys, state.client
    prefix = keys.queue_key(queue, "")
    pattern = re.sub(r"([*?\[\]\\])", r"\\\1", prefix) + "JOB*:dependencies"
    # The keys are named by row ids: a Celery uuid's row gives the uuid back.
    ids = [
        id_of_row((text(key) or "")[len(prefix) : -len(":dependencies")])
        for key in client.scan_iter(match=pattern, count=1000)
    ]
    if not ids:
        return []
    pipe = client.pipeline(transaction=False)
    for job_id in ids:
        pipe.hget(keys.job_key(queue, job_id), "state")
    states = pipe.execute()
    return sorted(j for j, s in zip(ids, states, strict=True) if text(s) == "awaiting_children")


def queue_stats(state: EchoMQ) -> list[QueueStats]:
    """Per queue that holds flows (``emq:queues``): pending, active, held and failed jobs, and
    how many messages recovery re-published and how many duplicate deliveries were skipped.
    Held parents are the queue's ``held`` counter (kept by the scripts): no SCAN."""
    keys, client = state.keys, state.client
    names = _queue_names(state)
    pipe = client.pipeline(transaction=False)
    for name in names:
        for set_name in ("pending", "active", "failed"):
            pipe.zcard(keys.queue_key(name, set_name))
        pipe.hmget(
            keys.queue_key(name, "counters"),
            "held",
            "republished",
            "duplicates_skipped",
            "forged_refused",
        )
    replies = pipe.execute()
    stats: list[QueueStats] = []
    for i, name in enumerate(names):
        pending, active, failed, (held, republished, skipped, forged) = replies[4 * i : 4 * i + 4]
        stats.append(
            QueueStats(
                name,
                int(pending),
                int(active),
                max(0, int(held or 0)),  # never below zero (a store restored from a snapshot)
                int(failed),
                int(republished or 0),
                int(skipped or 0),
                int(forged or 0),
            )
        )
    return stats
