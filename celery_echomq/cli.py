"""``celery -A proj echomq ...``: see, follow, repair and clean up flows from a shell.

Celery loads this group through the ``celery.commands`` entry point and hands it the app it
loaded from ``-A`` as ``ctx.obj.app``. Every command takes ``--json`` for scripts; an unknown
or ill-formed job id, or a refused action, exits with status 1 and a message on stderr.

    show JOBID      the flow as a tree (nested flows indented)
    watch JOBID     a live progress bar until the parent finishes (exit 0 done, 1 failed or
                    cancelled, 124 timed out)
    recover         one recovery pass (what the worker step runs periodically)
    stats           per queue: pending, active, held parents, failed
    forget JOBID    delete a finished flow's keys (--force for an unfinished one)
    cancel JOBID    cancel a flow: its parent will never run
    retry JOBID     run a flow failed under policy fail again (--child JOBID: one child)
    release JOBID   run a held parent now with the values so far (--revoke: and revoke the rest)
    dashboard       a web page of queues and flows, and Prometheus metrics (the [dashboard]
                    extra)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import click
import redis

from .errors import EchoMQError
from .reads import locate
from .start import forget_flow
from .state import EchoMQ, get_state
from .views import (
    FINISHED,
    JobNode,
    Progress,
    json_default,
    node_dict,
    queue_stats,
    read_progress,
    read_tree,
    tree_json,
    walk,
)

F = TypeVar("F", bound=Callable[..., Any])
logger = logging.getLogger("celery_echomq")

EXIT_FAILED = 1
EXIT_TIMEOUT = 124  # what timeout(1) returns, so shell scripts can tell "still running"
VALUE_WIDTH = 60
BAR_WIDTH = 30


def _app(ctx: click.Context) -> Any:
    app = getattr(ctx.obj, "app", None)
    if app is None:
        # Run outside `celery` (e.g. click's CliRunner on this group): the current app.
        from celery import current_app

        app = current_app
    return app


def _state(ctx: click.Context) -> EchoMQ:
    return get_state(_app(ctx))


def _errors(func: F) -> F:
    """Turn the errors a user can cause (bad id, unknown flow, Redis down) into one clear line."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except EchoMQError as exc:  # UnknownFlowError, InvalidIdError, KindError, ConfigError
            raise click.ClickException(str(exc)) from None
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise click.ClickException(f"cannot reach the flow store in Redis: {exc}") from None

    return cast(F, wrapper)


# Task values are whatever the app's serializer returned; show what JSON cannot hold.
_json_default = json_default


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=_json_default))


__all__ = ["echomq", "node_dict", "render_progress", "render_tree"]


def _short(value: Any) -> str:
    try:
        text = json.dumps(value, default=_json_default)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= VALUE_WIDTH else text[: VALUE_WIDTH - 1] + "…"


_STATE_COLOURS = {
    "done": "green",
    "failed": "red",
    "cancelled": "red",
    "active": "yellow",
    "awaiting_children": "cyan",
    "missing": "magenta",
}


def _job_line(node: JobNode, color: bool) -> str:
    colour = _STATE_COLOURS.get(node.state) if color else None
    parts = [
        ("flow " if node.flow else "") + node.id,
        node.task or "?",
        click.style(node.state, fg=colour) if colour else node.state,
        f"attempts={node.attempts}",
    ]
    if node.policy is not None and not node.policy_is_default:
        # Only a child's own policy: the flow's default is on its parent's line already.
        parts.append(f"policy={node.policy}")
    if node.flow is not None:
        counter = "expired" if node.flow.outstanding is None else str(node.flow.outstanding)
        parts.append(f"outstanding={counter}")
        parts.append(f"credited={node.flow.credited}/{node.flow.total}")
        parts.append(f"default-policy={node.flow.policy}")
    if node.has_value:
        parts.append(f"value={_short(node.value)}")
    if node.error:
        parts.append(f"error={node.error!r}")
    if node.outcome not in (None, "credited"):
        parts.append(f"[{node.outcome}]")
    return "  ".join(parts)


def render_tree(node: JobNode, *, color: bool = False) -> list[str]:
    """The tree as text lines: the root, then each child under ├─/└─, nested flows indented.

    ``color`` styles the states with ANSI codes (``click.echo`` drops them when not a tty).
    """
    head = _job_line(node, color)
    if node.parent is not None:
        head += f"  parent={node.parent}"
    lines = [head + f"  queue={node.queue}"]

    def children(parent: JobNode, indent: str) -> None:
        for i, child in enumerate(parent.children):
            last = i == len(parent.children) - 1
            lines.append(indent + ("└─ " if last else "├─ ") + _job_line(child, color))
            children(child, indent + ("   " if last else "│  "))

    children(node, "")
    return lines


def render_progress(p: Progress) -> str:
    settled = p.done + p.failed + p.cancelled
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


@click.group(name="echomq")
def echomq() -> None:
    """Inspect, follow and repair celery-echomq flows."""


@echomq.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print the tree as JSON.")
@click.pass_context
@_errors
def show(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """Show the flow under JOB_ID as a tree: states, attempts, values, errors, policies."""
    node = read_tree(_state(ctx), job_id)
    if as_json:
        click.echo(tree_json(node))
        return
    for line in render_tree(node, color=True):
        click.echo(line)


@echomq.command()
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
@_errors
def watch(
    ctx: click.Context, job_id: str, interval: float, timeout: float | None, as_json: bool
) -> None:
    """Follow JOB_ID's children until its parent finishes.

    Exit status: 0 the parent is done, 1 it failed or was cancelled, 124 --timeout passed.
    """
    state = _state(ctx)
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
                click.echo(json.dumps(dataclasses.asdict(current), default=_json_default))
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


@echomq.command()
@click.option(
    "--queue",
    "queues",
    multiple=True,
    metavar="NAME",
    help="Only this queue (repeatable). Default: every queue that holds flows.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the repairs as JSON.")
@click.pass_context
@_errors
def recover(ctx: click.Context, queues: tuple[str, ...], as_json: bool) -> None:
    """Run one recovery pass: what the worker step runs every echomq_recovery_interval.

    Re-publishes jobs whose message is gone, settles jobs whose worker died (from Celery's
    result backend) and dispatches released parents that never started. It looks twice, a
    moment apart: evidence that a message is gone must hold at both looks. Prints one line
    per repair. Safe beside running workers: every repair is an idempotent transition.
    """
    from .recovery import recover_now

    repairs = recover_now(_state(ctx), queues=queues or None)
    if as_json:
        _emit_json({"repairs": repairs})
        return
    for line in repairs:
        click.echo(line)
    click.echo(f"{len(repairs)} repair(s)" if repairs else "nothing to repair")


@echomq.command()
@click.option("--json", "as_json", is_flag=True, help="Print the counts as JSON.")
@click.pass_context
@_errors
def stats(ctx: click.Context, as_json: bool) -> None:
    """Per queue that holds flows: pending, active, held parents and failed jobs; messages
    recovery re-published and duplicate deliveries skipped (both counted since the start)."""
    rows = queue_stats(_state(ctx))
    if as_json:
        _emit_json({"queues": [dataclasses.asdict(row) for row in rows]})
        return
    if not rows:
        click.echo("no queue holds flows yet")
        return
    width = max(len("queue"), *(len(row.queue) for row in rows))
    click.echo(
        f"{'queue':<{width}}  {'pending':>7}  {'active':>6}  {'held':>6}  {'failed':>6}  "
        f"{'republished':>11}  {'skipped':>7}"
    )
    for row in rows:
        click.echo(
            f"{row.queue:<{width}}  {row.pending:>7}  {row.active:>6}  {row.held:>6}  "
            f"{row.failed:>6}  {row.republished:>11}  {row.skipped:>7}"
        )


@echomq.command()
@click.argument("job_id")
@click.option("--force", is_flag=True, help="Also forget a flow that has not finished.")
@click.option("--json", "as_json", is_flag=True, help="Print what was deleted as JSON.")
@click.pass_context
@_errors
def forget(ctx: click.Context, job_id: str, force: bool, as_json: bool) -> None:
    """Delete a finished flow's keys now instead of at the result TTL.

    Removes the parent row, its counter, values, ignored errors and cross-slot credits, every
    child row (nested flows too) and the flow's locators. An unfinished flow is refused
    unless --force: its running children would find no row and its parent would never be
    released.
    """
    state = _state(ctx)
    node = read_tree(state, job_id, with_result=False)
    if node.flow is None:
        hint = f"; forget its flow instead: echomq forget {node.parent}" if node.parent else ""
        raise click.ClickException(f"{job_id} is not a flow parent{hint}")
    if node.parent is not None and not force:
        raise click.ClickException(
            f"flow {job_id} is nested in flow {node.parent}; forget {node.parent} instead "
            "(or pass --force)"
        )
    running = [job.id for job in walk(node) if job.state not in FINISHED]
    if node.state not in FINISHED and not force:
        raise click.ClickException(
            f"flow {job_id} has not finished (parent {node.state}, {len(running)} job(s) "
            "not finished); pass --force to forget it anyway"
        )
    deleted = forget_flow(state, node)
    jobs = [job.id for job in walk(node)]
    # An audit line: deleting a flow's keys by hand is worth a trace wherever logs are kept.
    logger.info(
        "echomq: flow %s forgotten (%d jobs, %d keys, %d unfinished)",
        job_id, len(jobs), len(deleted), len(running),
    )  # fmt: skip
    if as_json:
        _emit_json({"forgotten": job_id, "jobs": jobs, "unfinished": running, "keys": deleted})
        return
    click.echo(f"forgot flow {job_id}: {len(jobs)} job(s), {len(deleted)} key(s) deleted")
    if running:
        click.echo(f"warning: {len(running)} job(s) had not finished", err=True)


@echomq.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.pass_context
@_errors
def cancel(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """Cancel the flow JOB_ID: its parent will never run and its unfinished children are revoked."""
    from .canvas import FlowResult

    state = _state(ctx)
    before = read_tree(state, job_id, with_result=False)
    if before.flow is None:
        raise click.ClickException(f"{job_id} is not a flow parent")
    if before.finished:
        raise click.ClickException(
            f"flow {job_id} already finished ({before.state}); nothing to cancel"
        )
    FlowResult(job_id, app=state.app).revoke()
    after = read_tree(state, job_id, with_result=False)
    unfinished = [job.id for job in walk(after) if job.state not in FINISHED]
    if as_json:
        _emit_json({"cancelled": job_id, "state": after.state, "unfinished": unfinished})
        return
    click.echo(f"flow {job_id}: {after.state}")
    if after.state != "cancelled":
        # The parent had already started: the flow is past cancelling, and revoke() sent
        # Celery's revoke for the running parent instead.
        click.echo(
            f"the parent was already {after.state}; Celery's revoke was sent for it", err=True
        )
    for line in render_tree(after, color=True):
        click.echo(line)


def _report_repair(state: EchoMQ, job_id: str, outcome: Any, as_json: bool, summary: str) -> None:
    """What retry and release print: the outcome and the flow's tree as it now stands."""
    after = read_tree(state, job_id, with_result=False)
    if as_json:
        _emit_json({**dataclasses.asdict(outcome), "tree": node_dict(after)})
        return
    click.echo(summary)
    for line in render_tree(after, color=True):
        click.echo(line)


@echomq.command()
@click.argument("job_id")
@click.option("--child", "child", default=None, help="Retry this one failed child only.")
@click.option(
    "--deadline",
    type=float,
    default=None,
    help="A new deadline, in seconds from now (needed once the flow's deadline has passed).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.pass_context
@_errors
def retry(
    ctx: click.Context, job_id: str, child: str | None, deadline: float | None, as_json: bool
) -> None:
    """Run the flow JOB_ID again after it failed under policy fail.

    Its children that failed under fail are re-published as new attempts and the parent
    awaits them again; Celery's stored failure of the parent is cleared, so get() waits for
    the new outcome. A nested flow that failed its outer flow puts the outer flow back to
    held too. Refused (exit 1, nothing changed) for a flow that is not failed.
    """
    from .repair import retry_flow

    state = _state(ctx)
    outcome = retry_flow(state, job_id, child=child, deadline=deadline)
    _report_repair(
        state,
        job_id,
        outcome,
        as_json,
        f"flow {job_id}: {outcome.state}; re-published {len(outcome.republished)} child(ren)"
        + (f", held again: {', '.join(outcome.held)}" if len(outcome.held) > 1 else ""),
    )


@echomq.command()
@click.argument("job_id")
@click.option("--revoke", is_flag=True, help="Also revoke the children still outstanding.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.pass_context
@_errors
def release(ctx: click.Context, job_id: str, revoke: bool, as_json: bool) -> None:
    """Run the held parent of flow JOB_ID now, with the values its children returned so far.

    As under policy continue, children that complete later are recorded but never release it
    again. Refused (exit 1, nothing changed) unless the parent is held (awaiting_children).
    """
    from .repair import release_flow

    state = _state(ctx)
    outcome = release_flow(state, job_id, revoke=revoke)
    _report_repair(
        state,
        job_id,
        outcome,
        as_json,
        f"flow {job_id}: released with {outcome.values} value(s); "
        f"{len(outcome.outstanding)} child(ren) outstanding"
        + (f", {len(outcome.revoked)} revoked" if revoke else ""),
    )


@echomq.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", type=click.IntRange(1, 65535), default=8008, show_default=True, help="TCP port."
)
@click.option(
    "--allow-actions",
    is_flag=True,
    help="Add cancel, retry and release buttons (POST routes; refused with 403 without this).",
)
@click.pass_context
@_errors
def dashboard(ctx: click.Context, host: str, port: int, allow_actions: bool) -> None:
    """Serve a web page of queues and flows, each flow's live tree, and /metrics.

    Read-only unless --allow-actions. Listens on loopback unless --host says otherwise: the
    pages show task values and errors, so put an authenticating proxy in front of anything
    wider.
    """
    try:
        from .dashboard import serve
    except ImportError as exc:
        raise click.ClickException(
            f"the dashboard needs the [dashboard] extra: pip install 'celery-echomq[dashboard]' "
            f"({exc})"
        ) from None
    mode = "cancel, retry and release enabled" if allow_actions else "read-only"
    click.echo(f"echomq dashboard on http://{host}:{port}/ ({mode}); Ctrl-C to stop")
    serve(_app(ctx), host=host, port=port, allow_actions=allow_actions)
