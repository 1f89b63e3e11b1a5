"""An operator's release of a held flow: its parent runs now with the values so far.

``release_flow`` reads the parent's row and counts only (ops/failures.py); ``--revoke`` also
walks its children from the index by position, ``echomq_chunk_size`` per script call, as
``cancel`` does: the release script with the first chunk of its slot's children, then
``cancel_elsewhere`` with each chunk after it and with the children of other slots. A child
that completes between two chunks is recorded and counted, and never releases the parent
again (it no longer waits); a crash between two leaves the rest outstanding, to run and be
recorded as they would under policy ``continue``.

What ``celery -A proj echomq release`` and ``FlowResult.release()`` call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from celery_echomq.errors import NotRepairableError
from celery_echomq.ops.cancel import cancel_flow, child_id_chunks, stored_job, where_children
from celery_echomq.ops.failures import flow_root
from celery_echomq.ops.outcomes import ReleaseOutcome
from celery_echomq.ops.views import JobNode
from celery_echomq.send.dispatch import dispatch_parent
from celery_echomq.store.connection import text
from celery_echomq.store.planned import held_of
from celery_echomq.store.replies import Status
from celery_echomq.store.state import EchoMQ

logger = logging.getLogger("celery_echomq")

# A child that has not settled: what the parent still waits for.
OUTSTANDING = frozenset({"pending", "active", "awaiting_children"})
RELEASE_ALLOWS = "release applies to a held parent (awaiting_children)"


def _fan_in(state: EchoMQ, node: JobNode) -> str:
    """The job holding the flow's own children, where its parent is a canvas; else ""."""
    try:
        # Its head where the row keeps one: a huge flow's payload is not read whole.
        job = stored_job(state, node.queue, node.id)
    except Exception:  # a payload this process cannot read names no fan-in
        return ""
    fan_in = held_of(job).fan_in
    return fan_in if fan_in != node.id else ""


@dataclass
class _Revoked:
    """What ``--revoke`` found and stopped, chunk by chunk."""

    outstanding: list[str] = field(default_factory=list)
    revoked: list[str] = field(default_factory=list)


def release_flow(
    state: EchoMQ, job_id: str, *, revoke: bool = False, terminate: bool = False
) -> ReleaseOutcome:
    """Run the held parent of flow ``job_id`` now, with the values completed so far.

    As under policy ``continue``: children that complete later are still recorded in the
    parent's ``:processed`` and counted, but never release it again. ``revoke``: also revoke
    the children that have not started, on every slot alike (Celery's revoke; their rows
    become cancelled, so no delivery runs them and nothing counts them), as BullMQ's
    ``removeUnprocessedChildren``: running ones finish and are recorded. Raises
    :class:`NotRepairableError` (nothing changed) unless the parent is held. ``terminate``
    (with ``revoke``): the children already running are revoked with ``terminate=True`` too,
    as Celery's ``revoke --terminate``; without it they are named in the outcome's ``running``.

    The outcome's ``left`` is how many children were unsettled when it was released (its
    counter); ``outstanding`` names them where ``revoke`` read every child, else is empty.
    """
    root = flow_root(state, job_id)
    node = root.node
    if node.flow is None:
        raise NotRepairableError(
            f"{job_id} is not a flow parent (a {node.state} job); {RELEASE_ALLOWS}",
            node.state,
            job_id,
        )
    fan_in = _fan_in(state, node)
    if fan_in:
        # Its parent is a chain, a group, a chord or a flow: what waits for the flow's own
        # children is the job that holds them (see send/shape.py); that is what runs now.
        return release_flow(state, fan_in, revoke=revoke, terminate=terminate)
    if node.state != "awaiting_children":
        raise NotRepairableError(
            f"flow {job_id} is {node.state}; nothing changed: {RELEASE_ALLOWS}",
            node.state,
            job_id,
        )
    left, values = node.flow.outstanding or 0, node.flow.done
    done = _revoke_all(state, node) if revoke else None
    if done is None:
        _release(state, node, [])
    dispatch_parent(state, node.queue, node.id)
    revoked = tuple(done.revoked) if done else ()
    running = tuple(c for c in done.outstanding if c not in set(revoked)) if done else ()
    if running and terminate:
        state.app.control.revoke(list(running), terminate=True)
    logger.info(
        "echomq: flow %s released by an operator with %d values; %d children outstanding, "
        "%d revoked",
        job_id, values, left, len(revoked),
    )  # fmt: skip
    return ReleaseOutcome(
        flow_id=job_id,
        values=values,
        outstanding=tuple(done.outstanding) if done else (),
        revoked=revoked,
        state=flow_root(state, job_id, node.queue).node.state,
        left=left,
        running=running,
        terminated=running if terminate else (),
    )


def _outstanding(child_state: str, chain_step: bool) -> bool:
    """Whether a child still counts as not finished: pending, running or held, or waiting for
    a slot of its flow's window (a chain's waiting last step is not: its chain has started)."""
    return child_state in OUTSTANDING or (child_state == "waiting" and not chain_step)


def _release(state: EchoMQ, node: JobNode, local: list[str]) -> list[str]:
    """The release script, with ``local`` (children of its slot) to revoke: what it cancelled."""
    status, cancelled = state.scripts.release(
        node.queue, node.id, local, revoke=bool(local), ttl=state.settings.result_ttl
    )
    if status is not Status.RELEASED:
        raise NotRepairableError(
            f"flow {node.id} is {status}; nothing changed: {RELEASE_ALLOWS}",
            str(status),
            node.id,
        )
    return list(cancelled)


def _revoke_all(state: EchoMQ, node: JobNode) -> _Revoked:
    """Release the parent and stop its children not started, a chunk at a time: a held
    nested flow is a flow of its own, cancelled whole (before its chunk is released)."""
    done = _Revoked()
    ttl, released = state.settings.result_ttl, False
    for part in child_id_chunks(state, node.queue, node.id, state.settings.chunk_size):
        where = where_children(state, node.queue, part)
        found = [cid for cid in part if cid in where]
        pipe = state.client.pipeline(transaction=False)
        for cid in found:
            pipe.hmget(state.keys.job_key(where[cid], cid), "state", "chain")
            pipe.exists(state.keys.flow_keys(where[cid], cid)[0])
        answers = iter(pipe.execute())
        plain: dict[str, list[str]] = {}
        for cid in found:
            (child_state, chain), nested = next(answers), next(answers)
            if not _outstanding(text(child_state) or "missing", chain is not None):
                continue
            done.outstanding.append(cid)
            if nested:
                done.revoked += cancel_flow(state, where[cid], cid, settle=False)
            else:
                plain.setdefault(where[cid], []).append(cid)
        cancelled: list[str] = []
        if not released:
            cancelled += _release(state, node, plain.pop(node.queue, []) or [])
            released = True
        for queue, ids in plain.items():
            cancelled += state.scripts.cancel_elsewhere(
                queue, node.id, ids, ttl=ttl, started=False, parent_queue=node.queue
            )
        if cancelled:
            state.app.control.revoke(cancelled)  # one broadcast per chunk of ids
        done.revoked += cancelled
    if not released:
        _release(state, node, [])  # a flow of no children
    return done
