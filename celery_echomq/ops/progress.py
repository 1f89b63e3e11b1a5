"""``celery echomq watch``: a flow's progress, read cheaply and often.

:func:`read_progress` reads a flow's counts (and a small flow's children's states), never its
values or payloads, so it can poll every half second; the command draws it as a bar.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass

import click

from celery_echomq.ops.cli_common import cli_state, plain_errors
from celery_echomq.ops.nodes import FINISHED, MISSING, json_default
from celery_echomq.ops.pages import child_positions, read_flow
from celery_echomq.store.connection import text
from celery_echomq.store.reads import locate, scan_queues
from celery_echomq.store.state import EchoMQ

EXIT_FAILED = 1
EXIT_TIMEOUT = 124  # what timeout(1) returns, so shell scripts can tell "still running"
BAR_WIDTH = 30
# The largest flow whose children's states watch reads one by one (one round trip).
STATES_MAX = 1000


@dataclass(frozen=True)
class Progress:
    """How far a flow's direct children have come, and where its parent stands."""

    flow_id: str
    parent_state: str
    total: int
    done: int
    failed: int
    cancelled: int | None  # None: not counted (a flow of more than STATES_MAX children)
    active: int | None
    pending: int
    outstanding: int | None
    finished: bool  # the parent itself finished (done, failed or cancelled)
    error: str | None = None  # the parent's error once it failed


def read_progress(
    state: EchoMQ,
    job_id: str,
    queue: str | None = None,
    child_queues: dict[str, str] | None = None,
) -> Progress:
    """Where ``job_id``'s children stand, read cheaply enough to poll: the counts of
    :func:`~celery_echomq.ops.pages.read_flow` (one page's worth of commands, whatever the
    flow's size) and, for a flow of at most :data:`STATES_MAX` children, each child's state
    (how many are active, pending, cancelled); a larger flow leaves ``active`` and
    ``cancelled`` unknown (None) and counts every outstanding child as ``pending``.

    ``child_queues`` (child id -> queue) is filled in and reused across calls, so a child that
    lives on another queue is searched for once, not on every poll.
    """
    node = read_flow(state, job_id, queue=queue, count=1, with_result=False)
    info = node.flow
    parent_state = node.state
    finished = parent_state in FINISHED
    if info is None:
        return Progress(job_id, parent_state, 0, 0, 0, 0, 0, 0, None, finished, node.error)
    outstanding = info.outstanding
    if info.total > STATES_MAX:
        return Progress(
            flow_id=job_id,
            parent_state=parent_state,
            total=info.total,
            done=info.done,
            failed=info.failed + info.ignored,
            cancelled=info.cut or None,
            active=None,
            pending=outstanding or 0,
            outstanding=outstanding,
            finished=finished,
            error=node.error,
        )
    states = _states(state, node.queue, job_id, info.total, child_queues)
    return Progress(
        flow_id=job_id,
        parent_state=parent_state,
        total=info.total,
        done=states.count("done"),
        failed=states.count("failed"),
        cancelled=states.count("cancelled"),
        active=states.count("active"),
        pending=states.count("pending") + states.count("awaiting_children"),
        outstanding=outstanding,
        finished=finished,
        error=node.error,
    )


def _states(
    state: EchoMQ, where: str, job_id: str, total: int, child_queues: dict[str, str] | None
) -> list[str]:
    """The state of each of a small flow's children (one HGET each, in one round trip)."""
    keys, client = state.keys, state.client
    child_ids = [cid for cid, _ in child_positions(state, where, job_id)]
    cache = {} if child_queues is None else child_queues
    pipe = client.pipeline(transaction=False)
    for cid in child_ids:
        pipe.hget(keys.job_key(cache.get(cid, where), cid), "state")
    states: list[str] = []
    for cid, raw in zip(child_ids, pipe.execute(), strict=True):
        if raw is None and cid not in cache:
            found = scan_queues(state, cid)
            cache[cid] = found or where
            if found is not None:
                raw = client.hget(keys.job_key(found, cid), "state")
        states.append(text(raw) or MISSING)
    return states


def render_progress(p: Progress) -> str:
    settled = p.done + p.failed + (p.cancelled or 0)
    filled = BAR_WIDTH if p.total == 0 and p.finished else 0
    if p.total:
        filled = BAR_WIDTH * settled // p.total
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    text = f"{p.flow_id} [{bar}] {p.done}/{p.total} done, {p.failed} failed"
    if p.active:
        text += f", {p.active} active"
    if p.cancelled:
        text += f", {p.cancelled} cancelled"
    return text + f" · parent {p.parent_state}"


@click.command()
@click.argument("job_id")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.01),
    default=0.5,
    show_default=True,
    help="Seconds between reads.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=None,
    help="Give up after this many seconds (exit status 124). Default: wait forever.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per change (JSON lines).")
@click.pass_context
@plain_errors
def watch(
    ctx: click.Context, job_id: str, interval: float, timeout: float | None, as_json: bool
) -> None:
    """Follow JOB_ID's children until its parent finishes.

    Exit status: 0 the parent is done, 1 it failed or was cancelled, 124 --timeout passed.
    """
    state = cli_state(ctx)
    queue = locate(state, job_id, verify=True)
    child_queues: dict[str, str] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    # On a terminal the bar redraws in place; into a pipe or a file, one line per change.
    tty = sys.stdout.isatty() and not as_json
    last: Progress | None = None
    while True:
        current = read_progress(state, job_id, queue, child_queues)
        if current != last:
            if as_json:
                click.echo(json.dumps(dataclasses.asdict(current), default=json_default))
            else:
                click.echo(("\r" if tty else "") + render_progress(current), nl=not tty)
            last = current
        if current.finished:
            break
        if deadline is not None and time.monotonic() >= deadline:
            if tty:
                click.echo()
            click.echo(f"timed out after {timeout}s; flow {job_id} is still running", err=True)
            ctx.exit(EXIT_TIMEOUT)
        time.sleep(interval)
    if tty:
        click.echo()
    if current.parent_state != "done":
        if not as_json:
            reason = f": {current.error}" if current.error else ""
            click.echo(f"flow {job_id} {current.parent_state}{reason}", err=True)
        ctx.exit(EXIT_FAILED)
    if not as_json:
        click.echo(f"flow {job_id} done")
