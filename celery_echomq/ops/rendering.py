"""Flows as text for a terminal: the tree ``show`` prints and the table ``list`` prints."""

from __future__ import annotations

import json
from typing import Any

import click

from celery_echomq.errors import UnknownFlowError
from celery_echomq.ops.listing import FlowRow, QueueStats
from celery_echomq.ops.nodes import JobNode, json_default, node_dict
from celery_echomq.ops.pages import iter_children, read_flow
from celery_echomq.store.state import EchoMQ

VALUE_WIDTH = 60

_STATE_COLOURS = {
    "done": "green",
    "failed": "red",
    "cancelled": "red",
    "active": "yellow",
    "awaiting_children": "cyan",
    "missing": "magenta",
}


def short(value: Any, width: int = VALUE_WIDTH) -> str:
    try:
        text = json.dumps(value, default=json_default)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def seconds(ms: int | None) -> str:
    """A duration for people: ``0.25s``, ``42s``, ``3m05s``, ``2h10m``, ``4d3h``."""
    if ms is None:
        return "-"
    s = ms / 1000
    if s < 10:
        return f"{s:.2f}s"
    if s < 60:
        return f"{s:.0f}s"
    m, s = divmod(int(s), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h}h"


def job_line(node: JobNode, color: bool) -> str:
    colour = _STATE_COLOURS.get(node.state) if color else None
    parts = [
        ("flow " if node.flow else "") + node.id,
        node.task or "?",
        click.style(node.state, fg=colour) if colour else node.state,
        f"attempts={node.attempts}",
    ]
    if node.args not in (None, "()"):
        parts.append(f"args={node.args}")
    if node.kwargs not in (None, "{}"):
        parts.append(f"kwargs={node.kwargs}")
    if node.policy is not None and not node.policy_is_default:
        # Only a child's own policy: the flow's default is on its parent's line already.
        parts.append(f"policy={node.policy}")
    if node.flow is not None:
        f = node.flow
        counter = "expired" if f.outstanding is None else str(f.outstanding)
        parts.append(f"outstanding={counter}  done={f.done}/{f.total}")
        parts.append(f"failed={f.failed}  ignored={f.ignored}  cut={f.cut}")
        parts.append(f"default-policy={f.policy}")
        if f.max_active is not None:
            parts.append(f"max_active={f.max_active}  waiting={f.waiting}")
        if f.quorum is not None:
            parts.append(f"quorum={f.quorum}")
        if f.reduce is not None:
            name = f.reduce[0] if len(f.reduce) == 1 else repr(tuple(f.reduce))
            parts.append(f"reduce={name}  acc={short(f.acc)}")
    if node.replaced_by is not None:
        parts.append(f"replaced-by=flow {node.replaced_by}")
    if node.batch is not None:
        parts.append(f"batch={node.batch}")
    if node.runtime_ms is not None:
        parts.append(f"runtime={seconds(node.runtime_ms)}")
    if node.has_value:
        parts.append(f"value={short(node.value)}")
    if node.error:
        parts.append(f"error={node.error!r}")
    if node.outcome not in (None, "credited"):
        parts.append(f"[{node.outcome}]")
    if node.shared_by > 1:
        parts.append(f"[shared by {node.shared_by} parents]")
    return "  ".join(parts)


def _child_line(node: JobNode, color: bool) -> str:
    """A child's line; a linked chain's says so, with its state and the step that runs (its
    steps follow, one line each)."""
    if not node.steps:
        return job_line(node, color)
    running = node.running_step
    where = f", step {running} runs" if running else ""
    colour = _STATE_COLOURS.get(node.chain_state) if color else None
    state = click.style(node.chain_state, fg=colour) if colour else node.chain_state
    parts = [f"chain {node.id}", f"{len(node.steps)} steps{where}", state]
    if node.policy is not None and not node.policy_is_default:
        parts.append(f"policy={node.policy}")
    if node.has_value:
        parts.append(f"value={short(node.value)}")
    if node.outcome not in (None, "credited"):
        parts.append(f"[{node.outcome}]")
    return "  ".join(parts)


def render_tree(node: JobNode, *, color: bool = False) -> list[str]:
    """The tree as text lines: the root, then each child under ├─/└─, nested flows indented.

    ``color`` styles the states with ANSI codes (``click.echo`` drops them when not a tty).
    """
    head = job_line(node, color)
    if node.parent is not None:
        head += f"  parent={node.parent}"
    lines = [head + f"  queue={node.queue}"]

    def children(parent: JobNode, indent: str) -> None:
        for i, child in enumerate(parent.children):
            last = i == len(parent.children) - 1
            lines.append(indent + ("└─ " if last else "├─ ") + _child_line(child, color))
            steps(child, indent + ("   " if last else "│  "))
            children(child, indent + ("   " if last else "│  "))

    def steps(chain: JobNode, indent: str) -> None:
        for number, step in enumerate(chain.steps, 1):
            last = number == len(chain.steps)
            line = f"step {number}/{len(chain.steps)}  " + job_line(step, color)
            if number == chain.running_step:
                line += "  <- runs"
            lines.append(indent + ("└─ " if last else "├─ ") + line)
            if step is not chain:
                children(step, indent + ("   " if last else "│  "))  # a step held on its own

    children(node, "")
    return lines


def show_every(state: EchoMQ, node: JobNode, only: str | None, count: int, as_json: bool) -> None:
    """``show --all``: ``node``'s line, then every child's (those in state ``only``), read and
    printed a page at a time, each nested flow's own children under it: memory and each read
    stay a page, whatever the flow's size. ``as_json``: one JSON object per line (the root's
    without children, then each job's with its ``parent``)."""

    def line(job: JobNode, indent: str) -> None:
        if as_json:
            data = node_dict(job)
            data.pop("children")
            data.pop("page", None)
            click.echo(json.dumps(data, default=json_default))
        else:
            click.echo(indent + job_line(job, True))

    def under(job: JobNode, indent: str, depth: int) -> None:
        if depth >= state.settings.max_depth:
            return
        for child in iter_children(state, job.id, count=count, only=only if depth == 0 else None):
            line(child, indent + "├─ ")
            if child.flow is not None:
                under(child, indent + "│  ", depth + 1)
            for replaced in (child, *child.steps):
                if replaced.replaced_by is not None:
                    replacement(replaced.replaced_by, indent + "│  ", depth + 1)

    def replacement(job_id: str, indent: str, depth: int) -> None:
        # A flow that runs in a job's place (Task.replace): under the job, as its own.
        if depth >= state.settings.max_depth:
            return
        try:
            flow = read_flow(state, job_id, count=1, with_times=True)
        except UnknownFlowError:
            return  # forgotten or expired before the job it replaced
        line(flow, indent + "└─ ")
        if flow.flow is not None:
            under(flow, indent + "   ", depth + 1)

    if as_json:
        line(node, "")
    else:
        click.echo(job_line(node, True) + f"  queue={node.queue}")
    if node.flow is not None:
        under(node, "", 0)
    if node.replaced_by is not None:
        replacement(node.replaced_by, "", 0)


LIST_HEADER = ("flow", "task", "state", "done/total", "failed", "ignored", "cut", "age", "queue")


def list_title(n: int, wanted: str, more: bool) -> str:
    """The line above ``list``'s table: what its rows are (flows), and what the counts on a
    row count (that flow's children)."""
    flows = "flow" if n == 1 else "flows"
    page = " on this page" if more else ""
    return (
        f"{n} {wanted} {flows}{page}, newest first; done/total, failed, ignored and cut count "
        "each flow's children"
    )


def render_rows(rows: list[FlowRow]) -> list[str]:
    """``list``'s table: one line per flow, columns aligned."""
    table = [LIST_HEADER] + [
        (
            row.id,
            row.task or "?",
            row.state,
            f"{row.done}/{row.total}",
            str(row.failed),
            str(row.ignored),
            str(row.cut),
            seconds(None if row.age_s is None else int(row.age_s * 1000)),
            row.queue,
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(LIST_HEADER))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in table
    ]


# ``stats``'s columns after the queue's: (what it counts, in what); its --json keys join the
# two (``failed_jobs``, ``held_flows``), so that no figure leaves its unit to be guessed.
STATS_COLUMNS = (
    ("pending", "jobs"),
    ("active", "jobs"),
    ("held", "flows"),
    ("failed", "jobs"),
    ("republished", "messages"),
    ("skipped", "messages"),
    ("forged", "messages"),
)


def _stats_values(row: QueueStats) -> tuple[int, ...]:
    return (
        row.pending,
        row.active,
        row.held,
        row.failed,
        row.republished,
        row.skipped,
        row.forged,
    )


def stats_json(row: QueueStats) -> dict[str, Any]:
    """One queue's counts for ``stats --json``, each key naming what it counts."""
    keys = [f"{name}_{unit}" for name, unit in STATS_COLUMNS]
    return {"queue": row.queue, **dict(zip(keys, _stats_values(row), strict=True))}


def render_stats(rows: list[QueueStats]) -> list[str]:
    """``stats``'s table: a header of two lines (what a column counts, then in what: jobs,
    flows, messages), then one line per queue, columns aligned."""
    head = [("queue", ""), *STATS_COLUMNS]
    table = [[name for name, _ in head], [unit for _, unit in head]] + [
        [row.queue, *(str(v) for v in _stats_values(row))] for row in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    return [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in table
    ]
