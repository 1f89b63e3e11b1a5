"""``celery echomq forget|cancel|revoke|retry|release``: the commands that change a flow.

Each is refused with the reason (exit status 1, nothing changed) when the flow is not in the
state it acts on, and prints the flow's tree after (``--json`` for scripts).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import click

from celery_echomq.ops.cancel import cancel_flow
from celery_echomq.ops.cli_common import cli_state, emit_json, plain_errors
from celery_echomq.ops.forget import forget_flow
from celery_echomq.ops.pages import MAX_PAGE, read_flow
from celery_echomq.ops.rendering import render_tree
from celery_echomq.ops.views import FINISHED, node_dict
from celery_echomq.store.state import EchoMQ

logger = logging.getLogger("celery_echomq")

COMMANDS = ("forget", "cancel", "revoke", "retry", "release")


@click.command()
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


@click.command()
@click.argument("job_id")
@_TERMINATE
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.pass_context
@plain_errors
def cancel(ctx: click.Context, job_id: str, terminate: bool, as_json: bool) -> None:
    """Cancel the flow JOB_ID: its parent will never run and its unfinished children are
    revoked. Its result's state becomes REVOKED (get() raises FlowCancelled)."""
    _cancel(ctx, job_id, terminate, as_json)


@click.command()
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


@click.command()
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


@click.command()
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
