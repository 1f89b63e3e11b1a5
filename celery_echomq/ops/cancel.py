"""Cancelling a flow: every job of its tree not yet finished, on every slot it spans.

The parent first (on its own slot, with its children there), so that a child of another
slot that completes meanwhile is credited to a parent that no longer waits; then the
children of every other slot (``cancel_elsewhere``); nested flows, inner before outer, are
flows of their own. A nested flow cancelled on its own settles against its outer flow under
its ``parent_policy``, as a failure (``FlowCancelled``). A parent already released (under
``continue``, or by an operator) is not stopped here, but its children still outstanding are.

A cancelled flow's children that other flows were joined to (``on_exists="join"``) are
left running by the cancel (includes/cancel_children.lua), since another flow may wait for
them; one that no parent waits for any more is stopped here (``cut_shared``,
cancel_shared.lua), read a chunk at a time: whether each is shared (its ``:parents``, its
row's own parent), then every one of its parents' states. A parent waits while it is
``awaiting_children``; any other state (cancelled, failed, released) needs the job no more.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from celery_echomq import tracing
from celery_echomq.errors import FlowCancelled
from celery_echomq.ops.pages import child_positions
from celery_echomq.store.connection import text
from celery_echomq.store.headers import H_PARENT, outer_ref
from celery_echomq.store.replies import Status
from celery_echomq.store.scripts import ParentRef
from celery_echomq.store.state import EchoMQ
from celery_echomq.worker.settle import record_failure, settle_failure

logger = logging.getLogger("celery_echomq")


def where_children(state: EchoMQ, queue: str, children: list[str]) -> dict[str, str]:
    """The queue whose slot holds each child's row: the parent's when it is there, else the
    one among the queues that hold flows (children missing everywhere are left out)."""
    keys, client = state.keys, state.client
    found: dict[str, str] = {}
    chunk = state.settings.chunk_size
    for start in range(0, len(children), chunk):
        part = children[start : start + chunk]
        pipe = client.pipeline(transaction=False)
        for cid in part:
            pipe.exists(keys.job_key(queue, cid))
        found.update((cid, queue) for cid, there in zip(part, pipe.execute(), strict=True) if there)
    elsewhere = [cid for cid in children if cid not in found]
    if elsewhere:
        names = sorted(
            n for n in (text(q) for q in client.smembers(keys.queues_key())) if n and n != queue
        )
        pipe = client.pipeline(transaction=False)
        for cid in elsewhere:
            for name in names:
                pipe.exists(keys.job_key(name, cid))
        there = iter(pipe.execute())
        for cid in elsewhere:
            hits = [name for name in names if next(there)]
            if hits:
                found[cid] = hits[0]
    return found


def with_steps(
    state: EchoMQ, children: list[str], where: dict[str, str]
) -> tuple[list[str], list[str]]:
    """``children`` with the steps of each linked chain among them before it (its last
    step's ``steps``), each step found where its chain is: cancel reaches the one that runs
    and those that wait. And the ids of every chain's steps, its last included."""
    found = [cid for cid in children if cid in where]
    pipe = state.client.pipeline(transaction=False)
    for cid in found:
        pipe.hget(state.keys.job_key(where[cid], cid), "steps")
    listed = dict(zip(found, pipe.execute(), strict=True))
    out: list[str] = []
    every: list[str] = []
    for cid in children:
        steps = text(listed.get(cid) or "").split()
        every += steps
        for step in steps[:-1]:
            where[step] = where[cid]
            out.append(step)
        out.append(cid)
    return out, every


def _never_started(state: EchoMQ, where: dict[str, str], ids: list[str]) -> list[str]:
    """Of the cancelled steps ``ids``, those no delivery ever claimed: they will never run, so
    their results say so (REVOKED), as a cancelled held parent's do. A step handed out by the
    completion before it counts its attempt at once but has no token until a delivery takes
    it: without a token, it never started."""
    if not ids:
        return []
    pipe = state.client.pipeline(transaction=False)
    for sid in ids:
        pipe.hmget(state.keys.job_key(where[sid], sid), "attempts", "token")
    rows = pipe.execute()
    return [sid for sid, (n, token) in zip(ids, rows, strict=True) if n == b"0" or token is None]


def stored_job(state: EchoMQ, queue: str, parent_id: str) -> Any:
    """The parent's stored job, without its children's ids where its row keeps a ``head``
    (what the chunked path writes: a huge flow's payload is not read whole)."""
    row = state.keys.job_key(queue, parent_id)
    raw = state.client.hget(row, "head") or state.client.hget(row, "payload")
    return state.loads(raw) if raw else None


def child_id_chunks(state: EchoMQ, queue: str, parent_id: str, chunk: int) -> Iterator[list[str]]:
    """The parent's children's ids, ``chunk`` at a time, from its index by position."""
    part: list[str] = []
    for cid, _ in child_positions(state, queue, parent_id, batch=chunk):
        part.append(cid)
        if len(part) == chunk:
            yield part
            part = []
    if part:
        yield part


def _by_queue(where: dict[str, str], ids: Iterable[str]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for cid in ids:
        if cid in where:
            groups.setdefault(where[cid], []).append(cid)
    return groups


@dataclass
class _Cut:
    """What cancelling a flow's parent and children did: the cancel script's answer for the
    parent, the children it stopped, and the linked chains' steps among them."""

    status: Status = Status.MISSING
    was: Status = Status.MISSING
    outstanding: list[str] = field(default_factory=list)
    steps: dict[str, str] = field(default_factory=dict)  # a chain's step -> its row's queue

    @property
    def cancelled(self) -> bool:
        return self.status is Status.CANCELLED


def cancel_flow(
    state: EchoMQ, queue: str, parent_id: str, terminate: bool = False, *, settle: bool = True
) -> list[str]:
    """Cancel the flow ``parent_id``: the ids of the jobs it revoked.

    ``settle``: a nested flow cancelled on its own (not as part of its outer flow's cancel)
    counts as a failed child of its outer flow. Returns what was revoked (empty when nothing
    was outstanding).

    The children are read from the parent's index and cancelled a chunk
    (``echomq_chunk_size``) per script call, whatever the flow's size: the parent with the
    first chunk of its slot's children (``cancel``), then the rest (``cancel_elsewhere``). A
    child that completes between two chunks is credited to a parent that no longer waits;
    a crash between two leaves the parent cancelled and the rest outstanding, which a cancel
    run again (the parent no longer waits: every outstanding child) finishes.
    """
    job = stored_job(state, queue, parent_id)
    revoked, running = _cancel_nested(state, queue, parent_id, terminate)
    cut = _cut(state, queue, parent_id)
    if cut.status is Status.MISSING:
        return revoked
    _revoke(state, parent_id, cut, running, terminate)
    if not cut.cancelled:
        if cut.outstanding:
            logger.info(
                "echomq: flow %s (%s): revoked %d outstanding children",
                parent_id,
                cut.status,
                len(cut.outstanding),
            )
        return revoked + cut.outstanding
    _record_cancelled(state, queue, parent_id, job, len(cut.outstanding), settle)
    return revoked + cut.outstanding


def _cancel_nested(
    state: EchoMQ, queue: str, parent_id: str, terminate: bool
) -> tuple[list[str], set[str]]:
    """The nested flows among the children, each cancelled as a flow of its own (inner before
    outer); and which children run now."""
    revoked: list[str] = []
    running: set[str] = set()
    for part in child_id_chunks(state, queue, parent_id, state.settings.chunk_size):
        where = where_children(state, queue, part)
        pipe = state.client.pipeline(transaction=False)
        for cid in part:
            if cid in where:
                pipe.hget(state.keys.job_key(where[cid], cid), "state")
                pipe.exists(state.keys.flow_keys(where[cid], cid)[0])
        answers = iter(pipe.execute())
        for cid in [c for c in part if c in where]:
            child_state, nested = next(answers), next(answers)
            if child_state == b"active":
                running.add(cid)
            if nested and child_state in (b"awaiting_children", b"pending"):
                revoked += cancel_flow(state, where[cid], cid, terminate, settle=False)
    return revoked, running


def _cut(state: EchoMQ, queue: str, parent_id: str) -> _Cut:
    """The parent and its children cancelled, a chunk per script call: the first chunk with
    the parent (``cancel``), every other one, and the children of other slots, after it."""
    ttl = state.settings.result_ttl
    cut = _Cut()
    for n, part in enumerate(child_id_chunks(state, queue, parent_id, state.settings.chunk_size)):
        where = where_children(state, queue, part)
        part, chain_steps = with_steps(state, part, where)
        cut.steps.update((sid, where[sid]) for sid in chain_steps if sid in where)
        rest = part
        if n == 0:
            local = [cid for cid in part if where.get(cid) == queue]
            cut.status, cut.was, first = state.scripts.cancel(queue, parent_id, local, ttl=ttl)
            if cut.status is Status.MISSING:
                return cut
            cut.outstanding += first
            # For a parent already released, its outstanding children on its own slot too
            # (the cancel script stops none of them then).
            if cut.cancelled:
                rest = [cid for cid in part if where.get(cid) != queue]
        for other, ids in _by_queue(where, rest).items():
            cut.outstanding += state.scripts.cancel_elsewhere(
                other, parent_id, ids, ttl=ttl, started=True, parent_queue=queue
            )
        if cut.cancelled:  # a job other flows were joined to: stopped if none waits for it
            cut.outstanding += cut_shared(state, where, part)
    if cut.status is Status.MISSING:
        # A flow of no children: the parent alone.
        cut.status, cut.was, cut.outstanding = state.scripts.cancel(queue, parent_id, [], ttl=ttl)
    return cut


def _revoke(state: EchoMQ, parent_id: str, cut: _Cut, running: set[str], terminate: bool) -> None:
    """Tell the workers (and the result backend) what will not run."""
    # Without terminate a running child cannot be stopped, and its cancelled row already
    # turns any later delivery away: its id is not broadcast, since Celery's workers (5.6
    # and later) that do not run it would store REVOKED over the result it is about to store.
    to_revoke = [cid for cid in cut.outstanding if terminate or cid not in running]
    # A chain's step no delivery ever claimed gets its result here (REVOKED, FlowCancelled):
    # its id is not broadcast either (a worker would store TaskRevokedError over it), and its
    # cancelled row turns away any message of it still on its way.
    stopped = set(cut.outstanding)
    unstarted = _never_started(state, cut.steps, [sid for sid in cut.steps if sid in stopped])
    if unstarted:
        quiet = set(unstarted)
        to_revoke = [cid for cid in to_revoke if cid not in quiet]
    # A released parent's message is on its way: revoke it too, so it never runs.
    if cut.cancelled and cut.was is Status.PENDING:
        to_revoke.append(parent_id)
    chunk = state.settings.chunk_size
    for start in range(0, len(to_revoke), chunk):  # one broadcast per chunk of ids
        state.app.control.revoke(to_revoke[start : start + chunk], terminate=terminate)
    for sid in unstarted:
        gone = FlowCancelled(f"flow {parent_id} was cancelled; its step {sid} will not run")
        record_failure(state, sid, gone, None, call_errbacks=False, status="REVOKED")


def _record_cancelled(
    state: EchoMQ, queue: str, parent_id: str, job: Any, stopped: int, settle: bool
) -> None:
    """The cancelled parent's result, its trace, and (cancelled on its own) its outer flow's
    failed child."""
    exc = FlowCancelled(f"flow {parent_id} was cancelled; it will not run", parent_id)
    # REVOKED: Celery's state for a revoked task (get() raises FlowCancelled).
    record_failure(state, parent_id, exc, job, call_errbacks=False, status="REVOKED")
    logger.info("echomq: flow %s cancelled; revoked %d outstanding children", parent_id, stopped)
    tracing.cancelled(job, parent_id, stopped)
    headers = ((job or {}).get("options") or {}).get("headers") or {}
    outer = headers.get(H_PARENT)
    if settle and outer:
        # Cancelled on its own: to the flow it belongs to, a child that failed.
        ref = outer_ref(headers, queue) or ParentRef(str(outer), queue)
        settle_failure(state, queue, parent_id, "", f"FlowCancelled: {exc}", True, ref, carry=True)


def _parents(state: EchoMQ, queue: str, job_id: str, first: str, pq: str) -> list[str]:
    """The row keys of every parent of a shared job: its first, then its edges."""
    keys = state.keys
    found = [keys.job_key(pq or queue, first)] if first else []
    for raw_id, spec in state.client.hscan_iter(keys.parents_key(queue, job_id), count=100):
        found.append(keys.job_key(text(spec).partition("|")[2], text(raw_id)))
    return found


def cut_shared(state: EchoMQ, where: dict[str, str], ids: Iterable[str]) -> list[str]:
    """Cancel those of ``ids`` (children of a flow just cancelled, ``where``: each one's
    queue) that are shared and that none of their parents waits for: the ids cancelled."""
    client, keys = state.client, state.keys
    ids = [cid for cid in ids if cid in where]
    pipe = client.pipeline(transaction=False)
    for cid in ids:
        pipe.hlen(keys.parents_key(where[cid], cid))
        pipe.hmget(keys.job_key(where[cid], cid), ("state", "parent", "pq"))
    answers = iter(pipe.execute())
    cancelled: list[str] = []
    for cid in ids:
        edges, (found, first, pq) = next(answers), next(answers)
        if not edges or found not in (b"pending", b"waiting", b"active"):
            continue
        rows = _parents(state, where[cid], cid, text(first or b""), text(pq or b""))
        pipe = client.pipeline(transaction=False)
        for row in rows:
            pipe.hget(row, "state")
        if b"awaiting_children" in pipe.execute():
            continue  # another flow still waits for it
        ttl = state.settings.result_ttl
        if state.scripts.cancel_shared(where[cid], cid, edges, ttl=ttl) is Status.CANCELLED:
            cancelled.append(cid)
    return cancelled
