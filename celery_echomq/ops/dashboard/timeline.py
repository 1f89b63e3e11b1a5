"""A flow's timeline: the page of children in view as bars on one time axis, then its parent.

Drawn from what the page already read (each row's ``started``, the ends timing.py finds, the
parent's ``dispatched``) and two commands more: the flow's enqueue time in its queue's
recent-flow index and the store's clock (``TIME``, the clock the rows were written with).
A child not started yet waits from the flow's enqueue to now; a running one runs from its
start to now; a finished one whose end is not known is a short mark at its start. A nested
flow is one bar that links to its own page; a linked chain's steps are bars of their own
under it. Geometry only (percentages of the axis): the template draws it as inline SVG.
"""

from __future__ import annotations

from dataclasses import dataclass

from celery_echomq.ops.nodes import JobNode
from celery_echomq.store.state import EchoMQ

# What a bar's colour says: a row's state, as the legend names it.
KINDS = ("waiting", "running", "done", "failed", "cancelled")
_KIND = {
    "pending": "waiting",
    "waiting": "waiting",
    "missing": "waiting",
    "active": "running",
    "awaiting_children": "running",
    "done": "done",
    "failed": "failed",
    "cancelled": "cancelled",
}
# Percent of the axis: a bar of no known length still shows. A bar starts where its job did,
# even at the axis's end (its short width drawn past it): moved left, it would seem to start
# before a job that ended just before it did (a parent run in a few ms after its release).
MIN_WIDTH = 0.4


@dataclass(frozen=True)
class Bar:
    id: str
    label: str
    kind: str  # one of KINDS, or "release" for the parent's release mark
    state: str  # the row's own state
    x: float  # percent of the axis
    width: float
    link: str | None = None  # a nested flow's page
    step: bool = False  # a linked chain's step (drawn indented)


@dataclass(frozen=True)
class Timeline:
    bars: tuple[Bar, ...]
    start_ms: int
    span_ms: int
    release_x: float | None  # where the parent was released, percent of the axis
    ticks: tuple[tuple[float, str], ...]  # (percent, label) along the axis


def _label(node: JobNode) -> str:
    task = (node.task or "?").rsplit(".", 1)[-1]
    return f"{'flow ' if node.flow else ''}{task} {node.id[:8]}"


def _times(node: JobNode, enqueued: int, now: int) -> tuple[int, int]:
    if node.started_ms is None:
        if node.finished:
            end = node.finished_ms or enqueued
            return end, end
        return enqueued, now  # waiting since the flow began
    if node.finished_ms is not None:
        return node.started_ms, node.finished_ms
    return node.started_ms, now if not node.finished else node.started_ms


def build_timeline(state: EchoMQ, root: JobNode) -> Timeline | None:
    """The timeline of ``root``'s page of children (None for a job that is no flow)."""
    if root.flow is None:
        return None
    # A nested flow's bar begins at its own enqueue (one ZSCORE each, the page's at most), or,
    # not indexed on its own (enqueued with its outer flow), at the outer flow's.
    nested = [c for c in root.children if c.flow is not None]
    pipe = state.client.pipeline(transaction=False)
    for job in (root, *nested):
        pipe.zscore(state.keys.queue_key(job.queue, "recent"), job.id)
    pipe.time()
    *scores, (secs, micros) = pipe.execute()
    # The index's scores are the server's time in microseconds (includes/recent.lua).
    ms = [int(s) // 1000 if s is not None else None for s in scores]
    score, began = ms[0], {c.id: s for c, s in zip(nested, ms[1:], strict=True) if s}
    now = int(secs) * 1000 + int(micros) // 1000
    known = [t for n in (root, *root.children) for t in (n.started_ms, n.finished_ms) if t]
    # Its index's score, or the first start seen where that is later (a flow sealed after
    # its first children started, a window's).
    enqueued = min(([score] if score is not None else []) + known, default=now)
    rows: list[tuple[JobNode, bool]] = []
    handed: dict[str, int] = {}  # a chain's step: the start of the step after it
    for child in root.children:
        # A linked chain: each step in order, the first as the child's row, the rest under it.
        rows.extend((step, i > 0) for i, step in enumerate(child.steps or (child,)))
        for step, after in zip(child.steps, child.steps[1:], strict=False):
            if after.started_ms is not None:
                handed[step.id] = after.started_ms
    spans = [(node, step, *_times(node, enqueued, now)) for node, step in rows]
    # A done step's end is not kept (its result is its next step's input): the next's start.
    spans = [
        (n, st, s, handed[n.id] if n.finished_ms is None and n.id in handed else e)
        for n, st, s, e in spans
    ]
    spans = [
        (n, st, min(s, began.get(n.id, enqueued)) if n.flow else s, e) for n, st, s, e in spans
    ]
    parent = _times(root, enqueued, now) if root.started_ms or root.finished else None
    ends = [end for *_, end in spans] + ([parent[1]] if parent else [])
    start = min([enqueued] + [s for *_, s, _ in spans])
    span = max(max(ends, default=now) - start, 1)

    def pct(ms: int) -> float:
        return round(100 * (ms - start) / span, 3)

    bars = [
        Bar(
            id=node.id,
            label=_label(node),
            kind=_KIND.get(node.state, "waiting"),
            state=node.state,
            x=pct(s),
            width=max(pct(e) - pct(s), MIN_WIDTH),
            link=f"/flows/{node.id}" if node.flow else None,
            step=step,
        )
        for node, step, s, e in spans
    ]
    if parent:
        bars.append(
            Bar(
                id=root.id,
                label="parent " + _label(root),
                kind=_KIND.get(root.state, "waiting"),
                state=root.state,
                x=pct(parent[0]),
                width=max(pct(parent[1]) - pct(parent[0]), MIN_WIDTH),
            )
        )
    release = pct(root.dispatched_ms) if root.dispatched_ms else None
    ticks = tuple((100 * i / 4, f"+{span * i / 4000:.2f}s") for i in range(5))
    return Timeline(tuple(bars), start, span, release, ticks)
