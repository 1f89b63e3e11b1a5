"""Children added to a flow in the store while its parent is held (``add_children``).

Order of the steps, and what a crash between two of them leaves:

1. ``grow_flow`` on the parent's slot, atomically: the new ids appended to the parent's payload
   (the order its values reach it in), the counter raised by every new child, the children of
   the parent's slot written ``pending``, the children of other slots staged in the parent's
   ``:adding`` hash (their payloads) and the parent put in its queue's ``adding`` set.
2. For children of other slots: ``add_children`` writes their rows on their own slots (a row
   that already names this parent is left as it is), then ``grow_done`` unstages them.
3. Nested flows added as children start (their placeholder rows were written in 1 or 2).
4. The new leaves are published.

A crash after 1 leaves the parent held by children staged but not written: recovery's pass
(``unwritten_children``) writes them from the staged payloads and unstages them, a stall
timeout later. The counter moved once, in 1, so nothing is counted twice however often 2 is
repeated. A crash after 2 (or a failed publish) leaves rows ``pending`` with their payloads,
which recovery re-publishes on evidence that their messages are gone, as after ``apply_async``;
a nested flow whose placeholder is re-published resumes (see ``start.resume_nested``).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from celery import current_app

from celery_echomq.errors import EchoMQError, FlowClosedError, FlowExistsError
from celery_echomq.send.fan_in import refuse_growth, windowed
from celery_echomq.send.ids import claim_ids, release_claims
from celery_echomq.send.plan import Plan, check_depth, plan_children, set_root
from celery_echomq.send.start import publish, start_flow
from celery_echomq.store.connection import describe, text
from celery_echomq.store.headers import H_PARENT, H_PARENT_QUEUE, H_QUEUE, parent_ref
from celery_echomq.store.keyspace import check_unique
from celery_echomq.store.planned import (
    Node,
    PlannedJob,
    held_of,
    node_of,
    stored_message,
    stored_node,
    with_children,
)
from celery_echomq.store.reads import locate
from celery_echomq.store.refusals import named_refusal
from celery_echomq.store.replies import Status
from celery_echomq.store.scripts import ParentRef
from celery_echomq.store.state import EchoMQ, get_state
from celery_echomq.wire.results import writes_results

logger = logging.getLogger("celery_echomq")

# How often a concurrent add may rewrite the parent's payload under us before we give up.
MAX_STALE = 50


def _running_parent() -> ParentRef:
    """The parent of the flow child whose body is running."""
    from celery import current_task

    request = getattr(current_task, "request", None)
    ref = parent_ref(request) if request is not None and getattr(request, H_QUEUE, None) else None
    if ref is None:
        raise EchoMQError(
            "add_children() without parent_id adds siblings of the running flow child, but no "
            "flow child is running here; pass parent_id= (the flow's id) instead"
        )
    return ref


def add_to_stored(
    sigs: list[Any], parent_id: str | None, *, app: Any = None, queue: str | None = None
) -> list[str]:
    """Add ``sigs`` (checked already: ``fanin.add_children``) to the held flow ``parent_id``
    in the store, or, without it, to the parent of the flow child whose body runs here."""
    if parent_id is None:
        parent = _running_parent()
        state = get_state(app or current_app)
    else:
        state = get_state(app or current_app)
        parent = ParentRef(parent_id, locate(state, parent_id, queue))
    return grow(state, parent, sigs)


def _closed(parent: ParentRef, state: str) -> FlowClosedError:
    return FlowClosedError(
        f"flow {parent.id} is {state}: its parent no longer waits for children, so none can be "
        "added (nothing was written or published)",
        parent.id,
        state,
    )


def grow(state: EchoMQ, parent: ParentRef, sigs: list[Any]) -> list[str]:
    """Plan ``sigs`` as children of ``parent`` and add them (see the module's steps)."""
    # Every id assigned and gated before anything reaches Redis. Added children go to their
    # parent's queue unless they name their own.
    plan = Plan.for_children(parent.queue, parent.id)
    plan_children(
        state.app,
        plan,
        sigs,
        shared={"queue": parent.queue},
        child_results=state.settings.child_results,
        store_results=writes_results(state),
        linked=False,
    )
    check_unique([parent.id, *(cid for level in plan.levels() for cid in level.child_ids())])
    if any(isinstance(j, Plan) for j in plan.children):
        check_depth(plan, state.settings.max_depth, _levels_above(state, parent))
    claims: list[str] = []
    landed: list[str] = []
    try:
        with named_refusal(describe(state.settings), lambda: _refused_outcome(parent, landed)):
            return _grow(state, parent, plan, claims, landed)
    finally:
        # Landed or refused: the rows stand for their ids from now on.
        release_claims(state, claims)


def _refused_outcome(parent: ParentRef, landed: list[str]) -> str:
    if not landed:
        return f"no child was added to flow {parent.id}: nothing was written or published"
    return (
        f"{len(landed)} children were added to flow {parent.id}, but not every one of them was "
        "written or published: recovery finishes adding them once the store takes writes"
    )


def _grow(
    state: EchoMQ, parent: ParentRef, plan: Plan, claims: list[str], landed: list[str]
) -> list[str]:
    keys, client, scripts = state.keys, state.client, state.scripts
    row_key = keys.job_key(parent.queue, parent.id)
    for _ in range(MAX_STALE):
        row_state, payload = client.hmget(row_key, "state", "payload")
        if row_state != b"awaiting_children" or payload is None:
            raise _closed(parent, text(row_state) if row_state is not None else "missing")
        job = state.loads(payload)
        held = held_of(job)
        children = held.children
        listed = set(children)
        fresh = [j for j in plan.children if j.id not in listed]
        if not fresh:
            return []
        refuse_growth(str((job.get("options") or {}).get("task_id")), held)
        size = windowed(job, parent.queue, fresh)
        root = (job.get("options") or {}).get("root_id")
        if root:
            # The flow's own root, whoever adds them: one tree in every monitor.
            set_root(fresh, str(root))
        local: list[tuple[str, bytes, str]] = []
        remote: list[tuple[str, bytes, str]] = []
        for j in fresh:
            row = (j.id, state.dumps(stored_node(j)), plan.child_policies.get(j.id, ""))
            (local if j.queue == parent.queue else remote).append(row)
        _refuse_taken(state, [j for j in fresh if j.queue != parent.queue])
        claims += claim_ids(state, {j.id: j.queue for j in fresh})
        queues = {parent.queue, *(j.queue for j in fresh)}
        for level in (lv for j in fresh if isinstance(j, Plan) for lv in j.levels()):
            queues.update([level.queue, *(c.queue for c in level.children)])
        # Before the rows land, as in start_flow: recovery must find their queues.
        client.sadd(keys.queues_key(), *sorted(queues))
        with_children(job, [*children, *(j.id for j in fresh)])
        status, counter, started = scripts.grow_flow_windowed(
            parent, hashlib.sha1(payload).hexdigest(), state.dumps(job), local, remote, size
        )
        if status is Status.ADDED:
            landed += [j.id for j in fresh]
            break
        if status is not Status.STALE:
            raise _closed(parent, str(status))
    else:
        raise EchoMQError(
            f"flow {parent.id}: its children kept changing under {MAX_STALE} attempts to add "
            "to them; nothing was added"
        )
    if remote:
        write_staged(state, parent, [(cid, p, pol) for cid, p, pol in remote])
    # A windowed flow's children past its room wait: their turn publishes them.
    out = fresh[:started] if size else fresh
    for j in out:
        if isinstance(j, Plan):
            start_flow(state, j)
    leaves = [stored_message(j) for j in out if isinstance(j, PlannedJob)]
    if leaves:
        publish(state.app, leaves)
    logger.info(
        "echomq: %d children added to flow %s (%d on other queues); counter %d",
        len(fresh),
        parent.id,
        len(remote),
        counter,
    )
    return [j.id for j in fresh]


def _levels_above(state: EchoMQ, parent: ParentRef) -> int:
    """How many flows ``parent`` is nested in, read up its rows' stored headers."""
    above, ref = 0, parent
    while above <= state.settings.max_depth:
        payload = state.client.hget(state.keys.job_key(ref.queue, ref.id), "payload")
        headers = (
            (state.loads(payload).get("options") or {}).get("headers") or {} if payload else {}
        )
        outer = headers.get(H_PARENT)
        if not outer:
            break
        above += 1
        ref = ParentRef(str(outer), str(headers.get(H_PARENT_QUEUE) or ref.queue))
    return above


def _refuse_taken(state: EchoMQ, remote: list[Node]) -> None:
    """A child of another slot whose id another flow already uses is refused here, before the
    parent's step: grow_flow can check only its own slot's rows."""
    if not remote:
        return
    pipe = state.client.pipeline(transaction=False)
    for j in remote:
        pipe.exists(state.keys.job_key(j.queue, j.id))
    for j, there in zip(remote, pipe.execute(), strict=True):
        if there:
            raise FlowExistsError(
                f"job id {j.id!r} already exists in Redis; a flow never overwrites a "
                "job (nothing was written or published)"
            )


def write_staged(state: EchoMQ, parent: ParentRef, staged: list[tuple[str, bytes, str]]) -> None:
    """Write children of other slots staged on ``parent``'s slot, then unstage them.

    Idempotent: add_children leaves a row that already names this parent as it is, and
    grow_done only removes. What the host runs right after grow_flow, and recovery after a
    crash.
    """
    by_queue: dict[str, list[tuple[str, bytes, str]]] = {}
    for cid, payload, policy in staged:
        queue = node_of(state.loads(payload)).queue
        by_queue.setdefault(queue, []).append((cid, payload, policy))
    chunk = state.settings.chunk_size
    for queue, rows in by_queue.items():
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            state.scripts.add_children(queue, parent, part)
            state.scripts.grow_done(parent, [cid for cid, _, _ in part])
