"""Publishing a released parent, once: the ``dispatch`` script decides which process may.

Called where a parent is released: a flow with nothing to wait for (``send/start.py``), a
child of another slot credited (``worker/settle.py``), recovery and the repairs. The completion
of a last child on its parent's slot is handed the parent by its own script, and publishes it
with :func:`publish_handed`. Before any of that, :func:`declare_reply_queue` readies the queue
an ``rpc://`` backend answers the parent's caller on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery_echomq import tracing
from celery_echomq.send.fan_in import accumulated, cut_rest, quorum_values
from celery_echomq.send.plan import parent_args
from celery_echomq.store.codec import with_input
from celery_echomq.store.headers import H_HANDED, H_SINCE
from celery_echomq.store.planned import held_of
from celery_echomq.store.script_values import Handed
from celery_echomq.store.state import EchoMQ
from celery_echomq.wire.publish import send_jobs

logger = logging.getLogger("celery_echomq")


def declare_reply_queue(app: Any, parent_id: str) -> None:
    """Declare the queue an ``rpc://`` result backend replies to, as ``send_task`` does before
    it publishes: the parent's result may come back before the caller asks for it."""
    from celery.backends.rpc import RPCBackend

    backend = app.backend
    if isinstance(backend, RPCBackend):
        with app.producer_or_acquire(None) as producer:
            backend.on_task_call(producer, parent_id)


def dispatch_parent(
    state: EchoMQ,
    queue: str,
    parent_id: str,
    redispatch_after_ms: int = 0,
    released_by: str = "",
) -> bool:
    """Publish a released parent, once: the dispatch script decides who may.

    ``released_by``: the child that released it, the parent's ``parent_id`` (a chord's body
    is the child of the header task that completed it)."""
    claimed = state.scripts.dispatch(
        queue, parent_id, redispatch_after_ms, inline_max=state.settings.chunk_size
    )
    if claimed is None:
        return False
    publish_handed(state, parent_id, claimed, released_by)
    return True


def publish_step(
    state: EchoMQ,
    step_id: str,
    payload: bytes,
    value: bytes,
    previous: str = "",
    since: int | None = None,
    handed: bool = False,
) -> None:
    """Publish a chain's step that the completion of the step before it made pending: its
    stored message with that step's value first among its arguments; ``since``, its pending
    score, in its headers (:data:`H_SINCE`: its claim need not read it); ``handed``: the
    completion handed it out active, which its headers say (:data:`H_HANDED`: its first
    delivery takes it without the claim script)."""
    job = with_input(state.loads(payload), state.loads(value))
    if previous:
        job["options"]["parent_id"] = previous  # the lineage a Celery chain gives its step
    extra: dict[str, object] = {} if since is None else {H_SINCE: since}
    if handed:
        extra[H_HANDED] = "1"
    if extra:
        options = job["options"]
        options["headers"] = {**(options.get("headers") or {}), **extra}
    with tracing.job_context(job):
        send_jobs(state.app, [job])
    logger.debug("echomq: chain step %s published after %s", step_id, previous)


def publish_handed(
    state: EchoMQ,
    parent_id: str,
    handed: Handed,
    released_by: str = "",
    runs_here: Callable[[dict[str, Any]], bool] | None = None,
) -> None:
    """Publish a released parent handed to this caller (by ``dispatch``, or by the completion
    that released it): its payload with its children's values as its arguments. ``runs_here``:
    asked with that message, True when this process runs it itself instead (a batch's runner,
    worker/batches.py); a parent released by a quorum is always published."""
    payload, stored = handed
    job = state.loads(payload)
    held = held_of(job)
    values: Any
    if held.reduce:
        values = accumulated(state, job)  # its first argument: the accumulator
    elif held.quorum:
        values = quorum_values(state, job, stored)
    else:
        values = [state.loads(stored[cid]) for cid in held.valued() if cid in stored]
    job["args"] = parent_args(job, values)
    if released_by:
        job["options"]["parent_id"] = released_by
    if runs_here is not None and not held.quorum and runs_here(job):
        logger.info("echomq: parent %s runs where it was released", parent_id)
        return
    with tracing.job_context(job):
        send_jobs(state.app, [job])
    logger.info("echomq: parent %s dispatched", parent_id)
    if held.quorum:
        cut_rest(state, job)  # the children not started never run
