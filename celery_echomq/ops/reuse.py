"""A Celery id sent again: what a chord on the engine does where Celery would run it again.

Celery lets a frozen canvas be applied more than once (each apply is a new run under the same
ids, its results overwritten), and its tests reuse a frozen task in a second chord. The store
keeps one job per id for the result TTL, and a flow refuses an id it still keeps
(``FlowExistsError``): that is what makes every credit exactly-once. A chord on the engine
sent with ids of a flow that has finished forgets that flow first (as ``echomq forget`` does),
then sends again; an id of a flow still running is refused as before, since its jobs' rows
are what settles the work in flight.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from celery.canvas import Signature

from celery_echomq.errors import FlowExistsError, UnknownFlowError
from celery_echomq.ops.forget import forget_flow
from celery_echomq.ops.pages import read_flow
from celery_echomq.ops.views import JobNode
from celery_echomq.send.ids import tasks_of
from celery_echomq.store.connection import text
from celery_echomq.store.state import EchoMQ

logger = logging.getLogger("celery_echomq")

# How long a reused id's earlier run may take to settle once its Celery result is stored (its
# worker stores the result, then finishes the row and credits the flow).
SETTLE_WAIT_S = 5.0
# The finished flows one send may forget: a canvas reusing the ids of more is refused.
MAX_FORGOTTEN = 16

T = TypeVar("T")


def send_reusing_finished(state: EchoMQ, send: Callable[[], T]) -> T:
    """``send()``; where it is refused for an id of a finished flow, forget that flow and send
    again. Each refusal wrote and published nothing, so the send is whole or not at all."""
    forgotten: set[str] = set()
    while True:
        try:
            return send()
        except FlowExistsError as exc:
            top = _finished_top(state, exc.job_id)
            if top is None or top.id in forgotten or len(forgotten) >= MAX_FORGOTTEN:
                raise
            _forget(state, top, exc.job_id, forgotten)


def forget_finished_holding(state: EchoMQ, body: Signature) -> None:
    """Before a chord whose body is a canvas is sent: the ids of that body's tasks that a
    finished flow holds, that flow forgotten now. A group body's tasks are written when the
    body is released, not when the chord is sent, so no refusal at the send would name them,
    and the add at the release would be refused."""
    if not getattr(body, "subtask_type", None):
        return  # a task: its id is the flow's parent's, which the send itself checks
    found: list[Signature] = []
    tasks_of(body, found)
    ids = [str(t.options["task_id"]) for t in found if t.options.get("task_id")]
    keys = state.keys
    queues = sorted(text(q) for q in state.client.smembers(keys.queues_key()))
    if not ids or not queues:
        return
    pipe = state.client.pipeline(transaction=False)
    for job_id in ids:
        for queue in queues:
            pipe.exists(keys.job_key(queue, job_id))
    there = pipe.execute()
    n = len(queues)
    held = [job_id for at, job_id in enumerate(ids) if any(there[at * n : (at + 1) * n])]
    forgotten: set[str] = set()
    for job_id in held:
        top = _finished_top(state, job_id)
        if top is not None and top.id not in forgotten:
            _forget(state, top, job_id, forgotten)


def _forget(state: EchoMQ, top: JobNode, reused: str, forgotten: set[str]) -> None:
    """Forget the finished flow ``top``, whose id ``reused`` a chord sent again reuses."""
    forget_flow(state, top)
    forgotten.add(top.id)
    logger.info("echomq: flow %s forgotten: a chord sent again reuses its id %s", top.id, reused)


def _finished_top(state: EchoMQ, job_id: str) -> JobNode | None:
    """The outermost flow holding ``job_id``, once it has finished (None: unknown, or
    running). A job whose Celery result is stored already is settled by its worker a moment
    later (its flow too): that moment is waited for, at most :data:`SETTLE_WAIT_S`."""
    if not job_id:
        return None
    deadline = time.monotonic() + SETTLE_WAIT_S
    while True:
        try:
            top = _top(state, job_id)
        except UnknownFlowError:
            return None
        if top.finished:
            return top if top.flow is not None else None
        if time.monotonic() > deadline or not state.app.AsyncResult(job_id).ready():
            return None
        time.sleep(0.05)


def _top(state: EchoMQ, job_id: str) -> JobNode:
    node = read_flow(state, job_id, count=1, with_result=False)
    while node.parent is not None:
        node = read_flow(state, node.parent, count=1, with_result=False)
    return node
