"""A due deadline, fired once (deadline.lua), and what follows it: the parent's FAILURE
recorded (with its errbacks, carried to an outer flow) or its dispatch, the cut children's
messages revoked (those of other slots cut there first), then the index entry ended.

What follows the script is repeated, by whichever worker finds the entry due again, if the
process that fired it dies before ``deadline_done``: every step checks before it acts.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any

from celery import states

from celery_echomq import tracing
from celery_echomq.errors import FlowDeadlineExceeded
from celery_echomq.send.dispatch import dispatch_parent
from celery_echomq.store import deadlines as store
from celery_echomq.store.connection import text
from celery_echomq.store.deadline_spec import exceeded
from celery_echomq.store.deadlines import Fired
from celery_echomq.store.headers import H_PARENT, outer_ref
from celery_echomq.store.planned import held_of
from celery_echomq.store.reads import indexed_children, scan_queues
from celery_echomq.store.scripts import ParentRef
from celery_echomq.store.state import EchoMQ
from celery_echomq.worker.settle import error_text, record_failure, settle_failure

logger = logging.getLogger("celery_echomq")

PREFIX = "FlowDeadlineExceeded: "
STALE_TRIES = 3


def _job(state: EchoMQ, payload: bytes | None) -> dict[str, Any] | None:
    if payload is None:
        return None
    try:
        job = state.loads(payload)
    except Exception:
        return None
    return job if isinstance(job, dict) else None


@dataclass
class Step:
    """A deadline this process fired (or must follow up again): what follows it."""

    queue: str
    parent_id: str
    job: dict[str, Any] | None
    fired: Fired
    local: list[str]  # every child (a linked chain's steps) on the parent's slot
    remote: list[str]  # every child on another slot
    children: list[str]  # the flow's children, in order


def finish(state: EchoMQ, steps: list[Step]) -> list[str]:
    """What follows the deadlines ``steps`` fired: each one's failure or dispatch, then one
    revoke of every child they cut, then their index entries ended."""
    revoke: list[str] = []
    lines = []
    followed = []
    for step in steps:
        again = step.fired.status == "fired"
        try:
            lines.append((follow_again if again else follow_up)(state, step, revoke))
        except Exception as exc:  # left to the next look, once its follow-up lease lapses
            logger.warning("echomq deadlines: follow-up of %s failed: %r", step.parent_id, exc)
            continue
        followed.append(step)
    if revoke:
        state.app.control.revoke(revoke)
    for step in followed:
        store.done(state, step.queue, step.parent_id, step.fired.fired_ms)
    return lines


def fire_one(state: EchoMQ, queue: str, parent_id: str) -> Step | None:
    """Run deadline.lua for one due entry: the step to follow up, or None (nothing to do)."""
    client, keys = state.client, state.keys
    for _ in range(STALE_TRIES):
        job, children, check = _flow_of(state, queue, parent_id)
        on_deadline = held_of(job).on_deadline
        here: list[Any] = []
        for start in range(0, len(children), store.CUT_CHUNK):
            pipe = client.pipeline(transaction=False)
            for cid in children[start : start + store.CUT_CHUNK]:
                pipe.hmget(keys.job_key(queue, cid), "state", "steps")
            here += pipe.execute()
        # A linked chain's steps stand for it: the one pending is cut, the one active runs.
        local = [
            step
            for cid, (there, steps) in zip(children, here, strict=True)
            if there is not None
            for step in (text(steps).split() if steps else [cid])
        ]
        remote = [c for c, (there, _) in zip(children, here, strict=True) if there is None]
        fired = store.fire(state, queue, parent_id, check, on_deadline, local, remote)
        if fired.status != "stale":
            break
    else:
        return None
    if fired.status in ("failed", "released", "fired"):
        return Step(queue, parent_id, job, fired, local, remote, children)
    return None


def _flow_of(
    state: EchoMQ, queue: str, parent_id: str
) -> tuple[dict[str, Any] | None, list[str], str]:
    """The flow's stored job, its children's ids in order, and what deadline.lua checks they
    are still all of them. From its index of children, a page per read, and its ``head`` (its
    job without the ids) where it keeps one: the length ``n:<count>``, so that the deadline of
    a flow of 100,000 children never reads or hashes its payload. A flow kept without an index:
    its payload and that payload's SHA1."""
    key = state.keys.job_key(queue, parent_id)
    ids = indexed_children(state, queue, parent_id)
    if ids is not None:
        head = state.client.hget(key, "head")
        job = _job(state, head if head is not None else state.client.hget(key, "payload"))
        return job, ids, f"n:{len(ids)}"
    payload = state.client.hget(key, "payload")
    job = _job(state, payload)
    children = [str(c) for c in held_of(job).children]
    return job, children, hashlib.sha1(payload or b"").hexdigest()


def deadline_error(parent_id: str, fired: Fired, children: list[str]) -> FlowDeadlineExceeded:
    """The error a flow failed by its deadline raises from ``get()``: its outstanding
    children named in the children's order, as eager mode names them."""
    order = {cid: i for i, cid in enumerate(children)}
    named = sorted(fired.outstanding, key=lambda cid: order.get(cid, len(order)))
    due = fired.due_ms / 1000 or None
    exc: FlowDeadlineExceeded = exceeded(parent_id, named, due, fired.count)
    return exc


def follow_up(state: EchoMQ, step: Step, revoke: list[str]) -> str:
    """What follows a deadline that fired just now (the script's reply says what it did);
    the ids to revoke go into ``revoke``."""
    queue, parent_id, job, fired = step.queue, step.parent_id, step.job, step.fired
    exc = deadline_error(parent_id, fired, step.children)
    late = fired.fired_ms - fired.due_ms
    tracing.deadline_event(job, parent_id, fired.status, fired.count, late)
    if fired.status == "failed":
        _record(state, queue, parent_id, job, exc)
    else:
        dispatch_parent(state, queue, parent_id)
    # The script cut the first chunk of each kind; the rest, a chunk per call.
    revoked = list(fired.cut)
    rest = step.local[store.CUT_CHUNK :]
    if rest:
        revoked += store.cut_children(
            state, queue, parent_id, rest, store.before_start(parent_id), queue
        )
    remote = (*fired.remote, *step.remote[store.CUT_CHUNK :])
    if remote:
        revoked += _cut_remote(state, queue, parent_id, remote, PREFIX + str(exc))
    revoke += revoked
    what = "failed" if fired.status == "failed" else "released with the values so far"
    line = (
        f"{queue}: flow {parent_id} passed its deadline ({late} ms late): {what}; "
        f"{fired.count} children outstanding, {len(revoked)} cut"
    )
    logger.info("echomq: %s", line)
    return line


def follow_again(state: EchoMQ, step: Step, revoke: list[str]) -> str:
    """The follow-up of a deadline fired by a process that died before ending it."""
    queue, parent_id, job, fired, local = (
        step.queue, step.parent_id, step.job, step.fired, step.local
    )  # fmt: skip
    client, keys = state.client, state.keys
    # The cuts after the script's own chunk, which the process that died may not have made
    # (each cuts only a child still pending: again, none twice).
    rest = local[store.CUT_CHUNK :]
    if rest:
        store.cut_children(state, queue, parent_id, rest, store.before_start(parent_id), queue)
    pipe = client.pipeline(transaction=False)
    pipe.hmget(keys.job_key(queue, parent_id), "error", "deadline_outstanding")
    for cid in local:
        pipe.hget(keys.job_key(queue, cid), "cut")
    (error, count), *cuts = pipe.execute()
    cut = tuple(c for c, mark in zip(local, cuts, strict=True) if mark == b"deadline")
    if step.remote:
        why = text(error) or store.before_start(parent_id)
        revoke += _cut_remote(state, queue, parent_id, tuple(step.remote), why)
    if fired.outcome == "failed":
        meta = state.app.backend.get_task_meta(parent_id) if _readable(state) else {}
        # Its outstanding children are no longer known here: the row's error names them.
        message = (text(error) or "").removeprefix(PREFIX)
        exc = FlowDeadlineExceeded(message, parent_id, (), int(count or 0), fired.due_ms / 1000)
        if meta.get("status") != states.FAILURE:
            _record(state, queue, parent_id, job, exc)
        else:
            _carry(state, queue, parent_id, job, exc)
    else:
        dispatch_parent(state, queue, parent_id)
    revoke += cut
    return f"{queue}: finished what followed the deadline of flow {parent_id} ({fired.outcome})"


def _readable(state: EchoMQ) -> bool:
    from celery_echomq.wire.results import backend_readable

    return backend_readable(state.app)


def _record(
    state: EchoMQ,
    queue: str,
    parent_id: str,
    job: dict[str, Any] | None,
    exc: FlowDeadlineExceeded,
) -> None:
    """Store the parent's FAILURE (its errbacks run) and carry it to an outer flow."""
    record_failure(state, parent_id, exc, job)
    _carry(state, queue, parent_id, job, exc)


def _carry(
    state: EchoMQ,
    queue: str,
    parent_id: str,
    job: dict[str, Any] | None,
    exc: FlowDeadlineExceeded,
) -> None:
    headers = ((job or {}).get("options") or {}).get("headers") or {}
    outer = headers.get(H_PARENT)
    if outer:
        # A nested flow failed by its deadline is a failed child of its outer flow, under
        # its own parent_policy (fail.lua carries it once).
        ref = outer_ref(headers, queue) or ParentRef(str(outer), queue)
        settle_failure(state, queue, parent_id, "", error_text(exc), True, ref, carry=True)


def _cut_remote(
    state: EchoMQ, queue: str, parent_id: str, remote: tuple[str, ...], error: str
) -> list[str]:
    """Cut the unsettled children of other slots that have not started, on their slots (each
    counted as cut on the parent's slot, ``queue``'s)."""
    by_queue: dict[str, list[str]] = {}
    for cid in remote:
        where = scan_queues(state, cid)
        if where is not None:
            by_queue.setdefault(where, []).append(cid)
    cut: list[str] = []
    for where, ids in by_queue.items():
        cut += store.cut_children(state, where, parent_id, ids, error, queue)
    return cut
