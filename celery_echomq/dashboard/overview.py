"""What the dashboard's front page reads: per queue, its counts and pages of its flows.

Bounded by construction, whatever the keyspace holds: the counts are ZCARDs and one HMGET of
the queue's counters hash (held parents are counted there by the scripts, not scanned for);
the flows come from the queue's recent-flow index (``emq:{q}:recent``, written by
enqueue_flow and open_flow, trimmed to the result TTL and ``echomq_recent_flows``), of which
one page of ``PAGE`` entries is read (the newest, or those older than a cursor), and the newest
``FAILED_WINDOW`` of the failed set. Three pipelined round trips per page, whatever the number
of queues.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..state import EchoMQ
from ..store import text

# Entries of each queue's recent index whose rows one page reads: the recent list, and the
# held and failed lists, are those of them that are held or failed.
PAGE = 100
# Newest entries of the failed set looked at for failed flows (it also holds failed children).
FAILED_WINDOW = 100

# credited = the values in :processed (HLEN, read beside the row) + credited_failed.
_FIELDS = ("state", "attempts", "credited_failed", "error", "policy")
COUNTERS = (
    "held",
    "released",
    "dispatched",
    "republished",
    "duplicates_skipped",
    "forged_refused",
    "failed_fail",
    "failed_ignore",
    "failed_remove",
    "failed_continue",
)


@dataclass(frozen=True)
class FlowRow:
    """One flow as the lists show it (its parent's row; no payload, no children read)."""

    id: str
    queue: str
    state: str
    enqueued_ms: int | None
    attempts: int
    credited: int
    policy: str
    error: str | None


@dataclass(frozen=True)
class QueueView:
    queue: str
    pending: int
    active: int
    held: int
    failed: int
    indexed: int  # flows in the recent index
    older: int | None  # the cursor of the next page (an index score), None on the last page
    counters: dict[str, int]
    recent: list[FlowRow]
    held_flows: list[FlowRow]
    failed_flows: list[FlowRow]


def _int(value: Any) -> int:
    found = text(value)
    return int(found) if found not in (None, "") else 0


def queue_names(state: EchoMQ) -> list[str]:
    return sorted(filter(None, (text(q) for q in state.client.smembers(state.keys.queues_key()))))


def read_counts(state: EchoMQ, names: list[str]) -> list[tuple[str, list[int], dict[str, int]]]:
    """Per queue: ``[pending, active, failed, indexed]`` and its counters. One round trip."""
    keys = state.keys
    pipe = state.client.pipeline(transaction=False)
    for name in names:
        for set_name in ("pending", "active", "failed", "recent"):
            pipe.zcard(keys.queue_key(name, set_name))
        pipe.hmget(keys.queue_key(name, "counters"), COUNTERS)
    replies = pipe.execute()
    out = []
    for i, name in enumerate(names):
        cards = [int(v) for v in replies[5 * i : 5 * i + 4]]
        values = replies[5 * i + 4]
        # 'held' is a running count (up at a hold, down at its release/failure/cancel): a
        # store restored from an older snapshot could leave it below zero; never show that.
        counters = {c: _int(v) for c, v in zip(COUNTERS, values, strict=True)}
        counters["held"] = max(0, counters["held"])
        out.append((name, cards, counters))
    return out


def _row(queue: str, job_id: str, score: Any, fields: list[Any], values_count: Any) -> FlowRow:
    values = [text(v) for v in fields]
    return FlowRow(
        id=job_id,
        queue=queue,
        state=values[0] or "missing",
        enqueued_ms=int(float(score)) // 1000 if score is not None else None,
        attempts=_int(values[1]),
        credited=_int(values_count) + _int(values[2]),
        policy=values[4] or "fail",
        error=values[3],
    )


def read_overview(
    state: EchoMQ, *, queue: str | None = None, before: int | None = None
) -> list[QueueView]:
    """Every queue that holds flows (or only ``queue``), with its counts and a page of its
    recent, held and failed flows: the newest, or those enqueued before the cursor ``before``
    (a page's ``older``)."""
    keys, client = state.keys, state.client
    names = [n for n in queue_names(state) if queue is None or n == queue]
    counts = read_counts(state, names)
    # Round trip 2: a page of each recent index, and the newest of each failed set.
    pipe = client.pipeline(transaction=False)
    for name in names:
        recent_key = keys.queue_key(name, "recent")
        if before is None:
            pipe.zrevrange(recent_key, 0, PAGE - 1, withscores=True)
        else:
            pipe.zrevrangebyscore(
                recent_key, f"({before}", "-inf", start=0, num=PAGE, withscores=True
            )
        pipe.zrevrange(keys.queue_key(name, "failed"), 0, FAILED_WINDOW - 1)
    listed = pipe.execute()
    # Round trip 3: the rows of those flows; for each failed id, whether it is a flow
    # (in the index) and its row.
    pipe = client.pipeline(transaction=False)
    plan: list[tuple[str, list[tuple[str, float]], list[str]]] = []
    for i, name in enumerate(names):
        window = [(text(m) or "", s) for m, s in listed[2 * i]]
        failed_ids = [text(m) or "" for m in listed[2 * i + 1]]
        seen = {job_id for job_id, _ in window}
        failed_ids = [f for f in failed_ids if f not in seen]
        for job_id, _ in window:
            pipe.hmget(keys.job_key(name, job_id), _FIELDS)
            pipe.hlen(keys.flow_keys(name, job_id)[1])
        for job_id in failed_ids:
            pipe.zscore(keys.queue_key(name, "recent"), job_id)
            pipe.hmget(keys.job_key(name, job_id), _FIELDS)
            pipe.hlen(keys.flow_keys(name, job_id)[1])
        plan.append((name, window, failed_ids))
    replies = iter(pipe.execute())
    views = []
    for (name, window, failed_ids), (_, cards, counters) in zip(plan, counts, strict=True):
        rows = [_row(name, job_id, score, next(replies), next(replies)) for job_id, score in window]
        older_failed = []
        for job_id in failed_ids:
            score, fields, values_count = next(replies), next(replies), next(replies)
            if score is not None:  # a flow's parent, not a failed child
                older_failed.append(_row(name, job_id, score, fields, values_count))
        failed_flows = [r for r in rows if r.state == "failed"] + older_failed
        older = int(float(window[-1][1])) if len(window) == PAGE else None
        views.append(
            QueueView(
                queue=name,
                pending=cards[0],
                active=cards[1],
                held=counters["held"],
                failed=cards[2],
                indexed=cards[3],
                older=older,
                counters=counters,
                recent=rows,
                held_flows=[r for r in rows if r.state == "awaiting_children"],
                failed_flows=failed_flows[:PAGE],
            )
        )
    return views
