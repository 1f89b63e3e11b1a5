"""The home page's rates over time, per queue, from the ring of per-minute samples the
workers keep (store/pulse.py), and the time from a flow's enqueue to its parent's release.

One HGETALL of at most ``pulse.RING`` fields per queue for the series; for the release
times, one pipelined HGET of ``dispatched`` per flow of the recent-flow page already read
(its rows carry their enqueue time): O(page), whatever the store holds. Drawn as inline SVG
polylines by the template (points computed here, in a 0..100 box).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import pairwise

from celery_echomq.ops.listing import FlowRow
from celery_echomq.store.connection import text
from celery_echomq.store.pulse import Minute, read_minutes
from celery_echomq.store.state import EchoMQ

# (name, what it says, how it is read from two samples: a counter's rate or a gauge). Each
# title names what it counts (flows, children, jobs: a job is a child or a parent), as the
# counts table beside it does.
SERIES = (
    ("flows_released", "flows released / min", ("released",), True),
    # The queue's count of children failed under policy fail (each fails its flow if it still
    # waits): no counter counts the flows themselves.
    ("flows_failed", "children failed under fail / min", ("failed_fail",), True),
    ("children_done", "children done / min", (), True),
    (
        "children_failed",
        "children failed / min",
        ("failed_fail", "failed_ignore", "failed_remove", "failed_continue", "failed_fail_at_end"),
        True,
    ),
    ("held", "held flows (parents awaiting children)", ("held",), False),
    ("window_waiting", "children waiting in windows", ("window_waiting",), False),
    ("pending", "pending jobs", ("pending",), False),
    ("active", "active jobs", ("active",), False),
)
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Series:
    name: str
    title: str
    values: tuple[tuple[int, float], ...]  # (minute, value)
    points: str  # "x,y x,y ..." in a 100 x 40 box, for an SVG polyline
    last: float | None
    peak: float
    since: str = ""  # the time axis: its first and last sampled minute, "HH:MM" (UTC)
    until: str = ""


def _points(values: list[tuple[int, float]], first: int, span: int) -> tuple[str, float]:
    peak = max((v for _, v in values), default=0.0)
    top = peak or 1.0
    pts = " ".join(f"{100 * (m - first) / span:.2f},{40 - 38 * v / top:.2f}" for m, v in values)
    return pts, peak


def _hhmm(minute: int) -> str:
    return time.strftime("%H:%M", time.gmtime(minute * 60))


def series_of(
    samples: list[Minute], live: dict[str, int] | None = None, now: float | None = None
) -> list[Series]:
    """Each series over the samples: a counter's increase per minute between consecutive
    samples (a gap spread over its minutes; a counter that went down, a restored store,
    counts from zero), a gauge as sampled.

    ``live``: the gauges read now (the counts table's figures). A sample is taken once a
    minute, at the first pass of a worker's recovery loop in it, so the newest can be a minute
    old (hours, with no worker running): each gauge ends on its live reading, at the current
    minute, and its figure is the table's. With no sample at all there is no chart."""
    minute_now = int((time.time() if now is None else now) // 60)
    live = live if samples else None  # no sample, no chart: nothing beside the table
    first = samples[0].minute if samples else 0
    last_minute = samples[-1].minute if samples else 0
    if live is not None:
        last_minute = max(last_minute, minute_now)
    span = max(last_minute - first, 1)
    axis = (_hhmm(first), _hhmm(last_minute)) if samples else ("", "")
    out = []
    for name, title, fields, rate in SERIES:
        values: list[tuple[int, float]] = []
        if name == "children_done":  # not a counter: each minute's tally, as the workers add
            # them; the newest sampled minute's is still being added (each process adds a
            # minute's at its first completion of a later one): drawn once the next is sampled,
            # never as a drop to 0.
            values = [(s.minute, float(s.done)) for s in samples[:-1]]
            points, peak = _points(values, first, span)
            last = values[-1][1] if values else None
            out.append(Series(name, title, tuple(values), points, last, peak, *axis))
            continue
        for before, after in pairwise(samples if rate else []):
            then = sum(before.values.get(f, 0) for f in fields)
            now = sum(after.values.get(f, 0) for f in fields)
            gap = max(after.minute - before.minute, 1)
            values.append((after.minute, max(now - then, 0) / gap))
        if not rate:  # a running count (held, waiting): never below zero, as read_counts says
            values = [
                (s.minute, float(max(0, sum(s.values.get(f, 0) for f in fields)))) for s in samples
            ]
            if live is not None and name in live:
                values = [v for v in values if v[0] < minute_now]
                values.append((minute_now, float(max(0, live[name]))))
        points, peak = _points(values, first, span)
        last = values[-1][1] if values else None
        out.append(Series(name, title, tuple(values), points, last, peak, *axis))
    return out


def read_series(state: EchoMQ, queue: str, live: dict[str, int] | None = None) -> list[Series]:
    """The queue's series; ``live``: its gauges as read now (see :func:`series_of`)."""
    return series_of(read_minutes(state, queue), live)


def live_gauges(cards: list[int], counters: dict[str, int]) -> dict[str, int]:
    """The gauges of :func:`overview.read_counts`'s reading of a queue (its ``[pending, active,
    failed, indexed]`` and counters), by series name."""
    return {
        "held": counters["held"],
        "window_waiting": counters["window_waiting"],
        "pending": cards[0],
        "active": cards[1],
    }


def release_times(state: EchoMQ, rows: list[FlowRow]) -> list[int]:
    """From enqueue to release, in ms, of the flows among ``rows`` that were released."""
    timed = [r for r in rows if r.enqueued_ms is not None]
    if not timed:
        return []
    pipe = state.client.pipeline(transaction=False)
    for row in timed:
        pipe.hget(state.keys.job_key(row.queue, row.id), "dispatched")
    out = []
    for row, raw in zip(timed, pipe.execute(), strict=True):
        found = text(raw)
        if found and row.enqueued_ms is not None:
            out.append(max(0, int(found) - row.enqueued_ms))
    return sorted(out)


def percentiles(values: list[int]) -> dict[float, int]:
    """The nearest-rank percentiles of sorted ``values`` (none when empty)."""
    if not values:
        return {}
    return {
        q: values[min(len(values) - 1, max(0, round(q * len(values) + 0.5) - 1))] for q in QUANTILES
    }
