"""(f), (g) and the cross-slot path: a child staged but never credited, a flow never sealed,
children added to a held flow but never written on their slot.
"""

from __future__ import annotations

import logging
from typing import Any

from celery_echomq.errors import FlowFailed
from celery_echomq.send.dispatch import dispatch_parent
from celery_echomq.send.grow import write_staged
from celery_echomq.store.codec import STORED_FIELDS, stored_of
from celery_echomq.store.connection import text
from celery_echomq.store.headers import Headers, is_open_header, parent_ref
from celery_echomq.store.planned import held_of
from celery_echomq.store.replies import Status
from celery_echomq.store.scripts import ParentRef
from celery_echomq.store.state import EchoMQ
from celery_echomq.store.store_format import newer_than_known
from celery_echomq.worker.recovery.common import (
    decode_job,
    guarded,
    now_ms,
    overdue,
    repair_stalled,
)
from celery_echomq.worker.recovery.stalled import mark_abandoned
from celery_echomq.worker.settle import (
    credit_edges,
    credit_remote,
    follow,
)

logger = logging.getLogger("celery_echomq")


def uncredited_outbox(state: EchoMQ, queue: str, batch: int) -> list[str]:
    """(e) children of another slot finished but never credited on their parent's slot."""
    client = state.client
    due = overdue(state, queue, "outbox", now_ms(client) - state.settings.stall_ms, batch)
    if not due:
        return []
    fields = ("state", "value", "error", "parent_policy", *STORED_FIELDS)
    pipe = client.pipeline(transaction=False)
    for job_id, _ in due:
        pipe.hmget(state.keys.job_key(queue, job_id), fields)
    repairs = []
    for (job_id, _), values in zip(due, pipe.execute(), strict=True):
        row = dict(zip(fields, values, strict=True))
        line = guarded("staged child", _credit, state, queue, job_id, row)
        if line:
            repairs.append(line)
    return repairs


def _credit(state: EchoMQ, queue: str, job_id: str, row: dict[str, Any]) -> str | None:
    outbox = state.keys.queue_key(queue, "outbox")
    stored = stored_of(row["payload"], row["delta"], row["parent"])
    job = decode_job(state, queue, job_id, stored) if stored is not None else None
    parent = parent_ref(Headers.of_job(job)) if job is not None else None
    row_state = text(row["state"]) if row["state"] is not None else Status.MISSING
    if parent is None or row_state not in (Status.DONE, Status.FAILED):
        state.client.zrem(outbox, job_id)  # expired, or nothing to credit
        return None
    if row_state == Status.DONE:
        status, _ = credit_remote(
            state, queue, job_id, parent, Status.DONE, row["value"] or b"", ""
        )
        error = ""
    else:
        error = text(row["error"] or b"")
        policy = text(row["parent_policy"] or b"")
        status, _ = credit_remote(state, queue, job_id, parent, Status.FAILED, error, policy)
    if status is Status.DUPLICATE:
        return None
    follow(state, status, job_id, parent, error)
    return f"{queue}: credited staged {job_id} ({row_state}) to parent {parent.id} ({status})"


def uncredited_edges(state: EchoMQ, queue: str, batch: int) -> list[str]:
    """(e) jobs joined to more parents (on_exists="join") that finished, their other parents
    never credited: the host that finished them died first. credit.lua counts each once."""
    due = overdue(state, queue, "joined", now_ms(state.client) - state.settings.stall_ms, batch)
    repairs = []
    for job_id, _ in due:
        found, value, error = state.client.hmget(
            state.keys.job_key(queue, job_id), ("state", "value", "error")
        )
        if found in (b"done", b"failed"):
            outcome = Status.DONE if found == b"done" else Status.FAILED
            data = (value or b"") if found == b"done" else text(error or b"")
            if credit_edges(state, queue, job_id, outcome, data):
                repairs.append(
                    f"{queue}: credited the other parents of joined {job_id} ({outcome})"
                )
        else:
            state.client.zrem(state.keys.queue_key(queue, "joined"), job_id)  # expired
    return repairs


def unsealed_flows(state: EchoMQ, queue: str, batch: int) -> list[str]:
    """(f) flows open past the stall timeout: their producer died before sealing them."""
    return repair_stalled(state, queue, "open", "open flow", _seal_or_abandon, batch)


def _seal_or_abandon(state: EchoMQ, queue: str, parent_id: str) -> str | None:
    client, keys = state.client, state.keys
    payload = client.hget(keys.job_key(queue, parent_id), "payload")
    job = decode_job(state, queue, parent_id, payload)
    children = list(held_of(job).children)
    # The children of one flow may live on any queue's slot; a row that names this parent is
    # one add_children wrote.
    queues = sorted(text(q) for q in client.smembers(keys.queues_key()))
    pipe = client.pipeline(transaction=False)
    for cid in children:
        for name in queues:
            pipe.hget(keys.job_key(name, cid), "parent")
    owners = pipe.execute()
    written = {
        cid
        for i, cid in enumerate(children)
        if any(text(o) == parent_id for o in owners[i * len(queues) : (i + 1) * len(queues)] if o)
    }
    if job is not None and is_open_header(job):
        # A chord's header that was read as it yielded: how many tasks it would have had is
        # unknown, so whatever was written is not the whole of it.
        reason = (
            f"its producer stopped while reading its chord's header ({len(written)} tasks "
            "written, the header not read to its end)"
        )
        return abandon_open_flow(state, queue, parent_id, reason, payload)
    if job is not None and len(written) == len(children):
        status = state.scripts.seal_flow(queue, parent_id)
        if status is Status.NOOP:
            return None
        if status is Status.RELEASED:
            dispatch_parent(state, queue, parent_id)
        return f"{queue}: sealed flow {parent_id} (every child was written; {status})"
    reason = (
        f"its producer stopped while starting it ({len(written)} of {len(children)} children "
        "written)"
    )
    return abandon_open_flow(state, queue, parent_id, reason, payload)


def abandon_open_flow(
    state: EchoMQ,
    queue: str,
    parent_id: str,
    reason: str,
    payload: bytes | None,
    *,
    now: bool = False,
) -> str | None:
    """Fail an open flow whose children will never all be written, for ``reason``, once it
    was left open a stall timeout (``now``: its producer knows it stopped); what was done
    (None if it was no longer open)."""
    after_ms = 0 if now else state.settings.stall_ms
    status = state.scripts.abandon_flow(
        queue, parent_id, after_ms, reason, ttl=state.settings.result_ttl
    )
    if status is not Status.ABANDONED:
        return None
    exc = FlowFailed(f"flow {parent_id}: {reason}", "", reason)
    mark_abandoned(state, queue, parent_id, exc, payload)
    return f"{queue}: failed flow {parent_id}: {reason}"


def unwritten_children(state: EchoMQ, queue: str, batch: int) -> list[str]:
    """(g) children of other slots added to a held flow (grow_flow) but never written on their
    own slots: the adder died between its two steps."""
    return repair_stalled(state, queue, "adding", "added children", _write_added, batch)


def _write_added(state: EchoMQ, queue: str, parent_id: str) -> str | None:
    parent = ParentRef(parent_id, queue)
    parent_row = state.keys.job_key(queue, parent_id)
    parent_state, found = state.client.hmget(parent_row, ("state", "format"))
    newer = newer_than_known(found, parent_row)
    if newer is not None:
        # A newer release's flow: its staged children are written by its workers, in its
        # format (add_children and grow_done do not read the parent's row).
        raise newer
    fields = state.client.hgetall(state.keys.adding_key(queue, parent_id))
    staged = {text(k): v for k, v in fields.items()}
    rows = [
        (cid, payload, text(staged.get(f"{cid}:policy") or b""))
        for cid, payload in staged.items()
        if ":" not in cid
    ]
    if not rows:
        state.scripts.grow_done(parent, [])
        return None
    if parent_state != b"awaiting_children":
        # Cancelled or failed meanwhile: children written now would run for nothing.
        state.scripts.grow_done(parent, [cid for cid, _, _ in rows])
        return (
            f"{queue}: dropped {len(rows)} children staged for flow {parent_id}, which is "
            f"{text(parent_state) if parent_state else 'gone'}"
        )
    # Their rows are then pending with their payloads: (a) publishes them on evidence that
    # their messages are gone (they may have been published before the crash).
    write_staged(state, parent, rows)
    return f"{queue}: wrote {len(rows)} children added to flow {parent_id} on other queues"
