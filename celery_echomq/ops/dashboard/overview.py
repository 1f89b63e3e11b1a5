"""What the dashboard's front page reads: per queue, its counts and a page of each list.

Bounded by construction, whatever the keyspace holds: the counts are ZCARDs and one HMGET of
the queue's counters hash (held parents are counted there by the scripts, not scanned for);
the lists are pages of :func:`celery_echomq.ops.listing.read_flows` (the recent-flow index, and
the failed set for failed flows), each of at most ``PAGE`` flows. Each list's caption counts
the rows it shows, and says when a further page exists: the failed count beside the failed
flows is theirs, while the counts table says "failed jobs" (children included).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from celery_echomq.ops.dashboard.charts import (
    Series,
    live_gauges,
    percentiles,
    read_series,
    release_times,
)
from celery_echomq.ops.listing import FlowRow, read_flows
from celery_echomq.send.jobs import POLICIES
from celery_echomq.store.connection import text
from celery_echomq.store.state import EchoMQ

PAGE = 100
LISTS = ("held", "failed", "recent")
COUNTERS = (
    "held",
    "window_waiting",
    "released",
    "dispatched",
    "republished",
    "duplicates_skipped",
    "forged_refused",
    "children_cut",
    *(f"failed_{policy}" for policy in POLICIES),
)


@dataclass(frozen=True)
class FlowList:
    state: str  # held, failed, recent, ...
    rows: list[FlowRow]
    more: str | None  # the cursor of the next page, None on the last


@dataclass(frozen=True)
class QueueView:
    queue: str
    pending: int
    active: int
    held: int  # parents awaiting their children (nested flows' too): the counter
    failed_jobs: int  # the failed set: children and parents failed within the result TTL
    indexed: int  # flows in the recent index
    counters: dict[str, int]
    lists: dict[str, FlowList] = field(default_factory=dict)
    series: list[Series] = field(default_factory=list)  # rates over time (charts.py)
    release: dict[float, int] = field(default_factory=dict)  # quantile -> ms, recent flows
    released: int = 0  # how many of the recent flows in view those quantiles are of


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
        counters["window_waiting"] = max(0, counters["window_waiting"])
        out.append((name, cards, counters))
    return out


def read_overview(
    state: EchoMQ,
    *,
    queue: str | None = None,
    only: str | None = None,
    cursor: str | None = None,
) -> list[QueueView]:
    """Every queue that holds flows (or only ``queue``), with its counts and a page of each
    list; ``only`` (with ``cursor``): that one list, from that page on. A bad cursor raises
    :class:`~celery_echomq.errors.CursorError` before anything is listed."""
    names = [n for n in queue_names(state) if queue is None or n == queue]
    views = []
    for name, cards, counters in read_counts(state, names):
        lists = {}
        for wanted in (only,) if only else LISTS:
            rows, more = read_flows(state, wanted, name, None, PAGE, cursor)
            lists[wanted] = FlowList(wanted, rows, more)
        recent = lists.get("recent")
        times = release_times(state, recent.rows) if recent else []
        views.append(
            QueueView(
                queue=name,
                pending=cards[0],
                active=cards[1],
                held=counters["held"],
                failed_jobs=cards[2],
                indexed=cards[3],
                counters=counters,
                lists=lists,
                # Its gauges end on the counts table's figures, read in the same round trip.
                series=[] if only else read_series(state, name, live_gauges(cards, counters)),
                release=percentiles(times),
                released=len(times),
            )
        )
    return views
