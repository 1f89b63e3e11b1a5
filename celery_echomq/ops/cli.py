"""``celery -A proj echomq ...``: find, see, follow, repair and clean up flows from a shell.

Celery loads this group through the ``celery.commands`` entry point and hands it the app it
loaded from ``-A`` as ``ctx.obj.app``. Every command but ``dashboard`` takes ``--json`` for
scripts; an unknown or ill-formed job id, a refused action or any Redis error exits with
status 1 and one line on stderr; an unreachable store is given up after ``--timeout``.

    list            flows, newest first: held, failed, done, cancelled or recent (paged)
    show JOBID      the flow as a tree (nested flows indented)
    watch JOBID     a live progress bar until the parent finishes (exit 0 done, 1 failed or
                    cancelled, 124 timed out)
    recover         one recovery pass (what the worker step runs periodically)
    stats           per queue: pending, active, held parents, failed
    doctor          the deployment checked: memory policy, persistence, version, replicas,
                    ACL, Cluster or Sentinel, the result backend's fast path, clocks (exit 1
                    when any is wrong)
    forget JOBID    delete a finished flow's keys (--force for an unfinished one)
    cancel JOBID    cancel a flow: its parent will never run (revoke JOBID: the same)
    retry JOBID     run a flow failed under policy fail again (--child JOBID: one child)
    release JOBID   run a held parent now with the values so far (--revoke: and revoke the rest)
    dashboard       a web page of queues and flows, and Prometheus metrics (the [dashboard]
                    extra)

The commands that change a flow (forget, cancel, revoke, retry, release) are each refused
with the reason (exit status 1, nothing changed) when the flow is not in the state it acts
on, and print the flow's tree after (``--json`` for scripts).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import click

from celery_echomq.ops import doctor, progress
from celery_echomq.ops.cancel import cancel_flow
from celery_echomq.ops.cli_common import (
    DEFAULT_TIMEOUT,
    cli_app,
    cli_state,
    emit_json,
    plain_errors,
    set_timeout,
)
from celery_echomq.ops.forget import forget_flow
from celery_echomq.ops.listing import MAX_LIMIT, STATES, queue_stats, read_flows
from celery_echomq.ops.pages import FILTERS, MAX_PAGE, PAGE, read_flow
from celery_echomq.ops.progress import render_progress
from celery_echomq.ops.rendering import (
    list_title,
    render_rows,
    render_stats,
    render_tree,
    show_every,
    stats_json,
)
from celery_echomq.ops.replication import replication_wait, store_refusal
from celery_echomq.ops.views import FINISHED, node_dict, shown_dict
from celery_echomq.store.connection import describe
from celery_echomq.store.state import EchoMQ

logger = logging.getLogger("celery_echomq")

__all__ = ["echomq", "node_dict", "render_progress", "render_tree"]


AUTH_ENV = "ECHOMQ_DASHBOARD_AUTH"


@click.group(name="echomq")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0.1),
    default=DEFAULT_TIMEOUT,
    show_default=True,
    help="Seconds to keep trying an unreachable flow store before giving up.",
)
@click.pass_context
def echomq(ctx: click.Context, timeout: float) -> None:
    """Find, inspect, follow and repair celery-echomq flows."""
    set_timeout(ctx, timeout)


@echomq.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print the flow as JSON.")
@click.option(
    "--state", "only", type=click.Choice(FILTERS), default=None,
    help="Only the children in this state (failed: failed for good, under any policy).",
)  # fmt: skip
@click.option("--cursor", default=None, help="The next page: the cursor a page printed.")
@click.option(
    "--count", type=click.IntRange(1, MAX_PAGE), default=PAGE, show_default=True,
    help="Children per page.",
)  # fmt: skip
@click.option(
    "--all", "every", is_flag=True, help="Every child, read and printed a page at a time."
)
@click.pass_context
@plain_errors
def show(
    ctx: click.Context,
    job_id: str,
    as_json: bool,
    only: str | None,
    cursor: str | None,
    count: int,
    every: bool,
) -> None:
    """Show the flow under JOB_ID: its parent, its counts and a page of its children (states,
    arguments, runtimes, values, errors). A nested flow is one line with its own counts:
    show it by its id. --all prints every child, a page at a time."""
    state = cli_state(ctx)
    node = read_flow(state, job_id, cursor=cursor, count=count, only=only, with_times=True)
    if every:
        show_every(state, node, only, count, as_json)
        return
    if as_json:
        # What the text's last line says, for scripts: "" while the store takes writes.
        emit_json(shown_dict(node, store_refusal(state)))
        return
    for line in render_tree(node, color=True):
        click.echo(line)
    page = node.page
    if page is not None and page.next_cursor is not None:
        state_opt = f" --state {page.only}" if page.only else ""
        click.echo(f"more: echomq show {job_id}{state_opt} --cursor {page.next_cursor}")
    more = page is not None and page.next_cursor is not None
    if more and node.flow and (node.flow.failed or node.flow.ignored) and only is None:
        failed = node.flow.failed + node.flow.ignored
        click.echo(f"{failed} failed: echomq show {job_id} --state failed")
    waits = replication_wait(state, node.queue, job_id, node.state)
    if waits:
        click.echo(waits)
    refusing = store_refusal(state)
    if refusing:
        click.echo(refusing)


@echomq.command(name="list")
@click.option(
    "--state",
    "wanted",
    type=click.Choice(list(STATES)),
    default="failed",
    show_default=True,
    help="Which flows: failed (the default: what needs a look), held (awaiting children), "
    "done, cancelled, or recent (every flow, in any state).",
)
@click.option("--queue", default=None, metavar="Q", help="Only flows of this queue.")
@click.option("--task", default=None, metavar="NAME", help="Only flows whose parent task is "
              "NAME (a glob: 'proj.*').")  # fmt: skip
@click.option(
    "--limit", type=click.IntRange(1, MAX_LIMIT), default=100, show_default=True,
    help="At most this many flows.",
)  # fmt: skip
@click.option("--cursor", default=None, help="The next page: the cursor a page printed.")
@click.option("--json", "as_json", is_flag=True, help="Print the flows as JSON.")
@click.pass_context
@plain_errors
def list_command(
    ctx: click.Context,
    wanted: str,
    queue: str | None,
    task: str | None,
    limit: int,
    cursor: str | None,
    as_json: bool,
) -> None:
    """List flows, newest first, one a line: id, task, state, its children done/total,
    failed, ignored and cut, age.

    Without --state, only the failed flows (what needs a look); --state recent lists every
    flow, in any state.

    Reads the store's indexes (each queue's recent-flow index; its failed set for failed
    flows), never a scan: a page costs the same whatever the store holds. A page may hold
    fewer flows than --limit while more remain: follow the cursor it prints.
    """
    rows, after = read_flows(cli_state(ctx), wanted, queue, task, limit, cursor)
    if as_json:
        emit_json({"flows": [dataclasses.asdict(r) for r in rows], "next_cursor": after})
        return
    if rows:
        click.echo(list_title(len(rows), wanted, after is not None))
        for line in render_rows(rows):
            click.echo(line)
    else:
        click.echo(f"no {wanted} flows" + (" on this page" if after else ""))
        if wanted != "recent" and not after:
            click.echo("(--state recent lists every flow, in any state)")
    if after:
        click.echo(f"more: echomq list --state {wanted} --cursor {after}")


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
@plain_errors
def recover(ctx: click.Context, queues: tuple[str, ...], as_json: bool) -> None:
    """Run one recovery pass: what the worker step runs every echomq_recovery_interval.

    Re-publishes jobs whose message is gone, settles jobs whose worker died (from Celery's
    result backend) and dispatches released parents that never started. It looks twice, a
    moment apart: evidence that a message is gone must hold at both looks. Prints one line
    per repair. Safe beside running workers: every repair is an idempotent transition.
    """
    from celery_echomq.worker.recovery import recover_now

    repairs = recover_now(cli_state(ctx), queues=queues or None)
    if as_json:
        emit_json({"repairs": repairs})
        return
    for line in repairs:
        click.echo(line)
    click.echo(f"{len(repairs)} repair(s)" if repairs else "nothing to repair")


@echomq.command()
@click.option("--json", "as_json", is_flag=True, help="Print the counts as JSON.")
@click.pass_context
@plain_errors
def stats(ctx: click.Context, as_json: bool) -> None:
    """Per queue that holds flows: pending, active and failed jobs (a job is a child or a
    parent), held flows (parents awaiting their children); messages recovery re-published,
    duplicate deliveries skipped and forged ones refused (counted since the start)."""
    rows = queue_stats(cli_state(ctx))
    if as_json:
        emit_json({"queues": [stats_json(row) for row in rows]})
        return
    if not rows:
        click.echo("no queue holds flows yet")
        return
    for line in render_stats(rows):
        click.echo(line)


@echomq.command(name="doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@click.pass_context
@plain_errors
def doctor_command(ctx: click.Context, as_json: bool) -> None:
    """Check the deployment: one line per check, each wrong one with what to change.

    The store's memory policy, persistence, server version and the Lua advisories it is
    open to (a note), whether it refuses writes now, replicas against echomq_min_replicas,
    the ACL user's rights, Cluster or Sentinel, whether the result
    backend takes the fast path, and the clocks of this host and of every live worker against
    the store's. Reads only. Exit status 1 when any check is wrong (a note is not).
    """
    state = cli_state(ctx, check_version=False)
    findings = doctor.diagnose(doctor.read_facts(state))
    report = doctor.as_json(describe(state.settings), findings)
    if as_json:
        emit_json(report)
    else:
        click.echo(f"flow store {report['store']}")
        for finding in findings:
            click.echo(finding.line())
    if not report["ok"]:
        ctx.exit(1)


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
@click.option(
    "--allow-host",
    "allow_hosts",
    multiple=True,
    metavar="NAME",
    help="Also answer requests for this Host name (repeatable); loopback names always.",
)
@click.option(
    "--basic-auth",
    default=None,
    metavar="USER:PASSWORD",
    help=f"Ask every request for this user and password (or set {AUTH_ENV}).",
)
@click.pass_context
@plain_errors
def dashboard(
    ctx: click.Context,
    host: str,
    port: int,
    allow_actions: bool,
    allow_hosts: tuple[str, ...],
    basic_auth: str | None,
) -> None:
    """Serve a web page of queues and flows, each flow's live tree, and /metrics.

    Read-only unless --allow-actions. Listens on loopback unless --host says otherwise;
    beyond loopback, actions need --basic-auth, and a page without it is open to anyone who
    reaches the port (a warning says so).
    """
    try:
        from celery_echomq.ops.dashboard import Exposure, serve
    except ImportError as exc:
        raise click.ClickException(
            f"the dashboard needs the [dashboard] extra: pip install 'celery-echomq[dashboard]' "
            f"({exc})"
        ) from None
    exposure = Exposure.of(host, allow_hosts, basic_auth or os.environ.get(AUTH_ENV), allow_actions)
    if exposure.warning:
        click.echo(f"warning: {exposure.warning}", err=True)
    mode = "cancel, retry and release enabled" if allow_actions else "read-only"
    click.echo(f"echomq dashboard on http://{host}:{port}/ ({mode}); Ctrl-C to stop")
    serve(cli_app(ctx), host=host, port=port, allow_actions=allow_actions, exposure=exposure)


echomq.add_command(progress.watch)


@echomq.command()
@click.argument("job_id")
@click.option("--force", is_flag=True, help="Also forget a flow that has not finished.")
@click.option("--json", "as_json", is_flag=True, help="Print what was deleted as JSON.")
@click.pass_context
@plain_errors
def forget(ctx: click.Context, job_id: str, force: bool, as_json: bool) -> None:
    """Delete a finished flow's keys now instead of at the result TTL.

    Removes the parent row, its counter, values, ignored errors and cross-slot credits, every
    child row (nested flows and every step of a chain child too) and the flow's locators. An
    unfinished flow is refused unless --force: its running children would find no row and
    its parent would never be released.
    """
    state = cli_state(ctx)
    node = read_flow(state, job_id, count=1, with_result=False)
    if node.flow is None:
        hint = f"; forget its flow instead: echomq forget {node.parent}" if node.parent else ""
        raise click.ClickException(f"{job_id} is not a flow parent{hint}")
    if node.parent is not None and not force:
        raise click.ClickException(
            f"flow {job_id} is nested in flow {node.parent}; forget {node.parent} instead "
            "(or pass --force)"
        )
    if node.state not in FINISHED and not force:
        left = node.flow.outstanding or 0
        raise click.ClickException(
            f"flow {job_id} has not finished (parent {node.state}, {left} child(ren) "
            "outstanding); pass --force to forget it anyway"
        )
    done = forget_flow(state, node)
    # An audit line: deleting a flow's keys by hand is worth a trace wherever logs are kept.
    logger.info(
        "echomq: flow %s forgotten (%d jobs, %d keys, %d unfinished)",
        job_id, len(done.jobs), len(done.keys), len(done.unfinished),
    )  # fmt: skip
    if as_json:
        emit_json(
            {"forgotten": job_id, "jobs": done.jobs, "unfinished": done.unfinished,
             "keys": done.keys, "kept": done.kept}
        )  # fmt: skip
        return
    click.echo(f"forgot flow {job_id}: {len(done.jobs)} job(s), {len(done.keys)} key(s) deleted")
    if done.kept:
        click.echo(
            f"kept {len(done.kept)} cancelled child row(s), cut down to their state, until they "
            "expire: a message of theirs still queued is turned away, never run"
        )
    if done.unfinished:
        click.echo(f"warning: {len(done.unfinished)} job(s) had not finished", err=True)


def _cancel(ctx: click.Context, job_id: str, terminate: bool, as_json: bool) -> None:
    state = cli_state(ctx)
    before = read_flow(state, job_id, count=1, with_result=False)
    if before.flow is None:
        raise click.ClickException(f"{job_id} is not a flow parent")
    if before.finished:
        raise click.ClickException(
            f"flow {job_id} already finished ({before.state}); nothing to cancel"
        )
    cancel_flow(state, before.queue, job_id, terminate=terminate)
    after = read_flow(state, job_id, with_result=False)
    if after.state != "cancelled":
        # The parent had already started: the flow is past cancelling; the parent is revoked
        # like any running task (--terminate: its process is signalled).
        state.app.control.revoke(job_id, terminate=terminate)
    # The jobs still running (a page of them, and the parent if it had started).
    running = read_flow(state, job_id, count=MAX_PAGE, only="active", with_result=False)
    unfinished = ([] if after.finished else [job_id]) + [c.id for c in running.children]
    if as_json:
        emit_json({"cancelled": job_id, "state": after.state, "unfinished": unfinished})
        return
    click.echo(f"flow {job_id}: {after.state}")
    if after.state != "cancelled":
        click.echo(
            f"the parent was already {after.state}; Celery's revoke was sent for it", err=True
        )
    for line in render_tree(after, color=True):
        click.echo(line)


_TERMINATE = click.option(
    "--terminate",
    is_flag=True,
    help="Also terminate children (and a started parent) already running, as Celery's "
    "revoke --terminate does.",
)


@echomq.command()
@click.argument("job_id")
@_TERMINATE
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.pass_context
@plain_errors
def cancel(ctx: click.Context, job_id: str, terminate: bool, as_json: bool) -> None:
    """Cancel the flow JOB_ID: its parent will never run and its unfinished children are
    revoked. Its result's state becomes REVOKED (get() raises FlowCancelled)."""
    _cancel(ctx, job_id, terminate, as_json)


@echomq.command()
@click.argument("job_id")
@_TERMINATE
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.pass_context
@plain_errors
def revoke(ctx: click.Context, job_id: str, terminate: bool, as_json: bool) -> None:
    """Revoke the flow JOB_ID, as Celery revokes a task: the same as cancel."""
    _cancel(ctx, job_id, terminate, as_json)


def _report_repair(state: EchoMQ, job_id: str, outcome: Any, as_json: bool, summary: str) -> None:
    """What retry and release print: the outcome and the flow's tree as it now stands."""
    after = read_flow(state, job_id, with_result=False)
    if as_json:
        emit_json({**dataclasses.asdict(outcome), "tree": node_dict(after)})
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
@plain_errors
def retry(
    ctx: click.Context, job_id: str, child: str | None, deadline: float | None, as_json: bool
) -> None:
    """Run the flow JOB_ID again after it failed under policy fail.

    Its children that failed under fail are re-published as new attempts and the parent
    awaits them again; Celery's stored failure of the parent is cleared, so get() waits for
    the new outcome. A nested flow that failed its outer flow puts the outer flow back to
    held too. Refused (exit 1, nothing changed) for a flow that is not failed.
    """
    from celery_echomq.ops.repair import retry_flow

    state = cli_state(ctx)
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
@click.option(
    "--revoke", is_flag=True, help="Also revoke the children not started (running ones finish)."
)
@click.option(
    "--terminate",
    is_flag=True,
    help="With --revoke: also terminate the children already running, as Celery's "
    "revoke --terminate does.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.pass_context
@plain_errors
def release(ctx: click.Context, job_id: str, revoke: bool, terminate: bool, as_json: bool) -> None:
    """Run the held parent of flow JOB_ID now, with the values its children returned so far.

    As under policy continue, children that complete later are recorded but never release it
    again. Refused (exit 1, nothing changed) unless the parent is held (awaiting_children).
    """
    from celery_echomq.ops.release import release_flow

    if terminate and not revoke:
        raise click.UsageError("--terminate goes with --revoke (release --revoke --terminate)")
    state = cli_state(ctx)
    outcome = release_flow(state, job_id, revoke=revoke, terminate=terminate)
    running = len(outcome.running)
    _report_repair(
        state,
        job_id,
        outcome,
        as_json,
        f"flow {job_id}: released with {outcome.values} value(s); "
        f"{outcome.left} child(ren) outstanding"
        + (f", {len(outcome.revoked)} revoked" if revoke else "")
        + (f", {running} running terminated" if outcome.terminated else "")
        + (
            f"; {running} already running, not revoked (a revoke stops only children not "
            "started; a running one finishes and is recorded): add --terminate to stop them"
            if running and not outcome.terminated
            else ""
        ),
    )
