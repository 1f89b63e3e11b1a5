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
from collections.abc import Callable
from typing import TypeVar

from celery_echomq.errors import FlowExistsError, UnknownFlowError
from celery_echomq.ops.forget import forget_flow
from celery_echomq.ops.pages import read_flow
from celery_echomq.ops.views import JobNode
from celery_echomq.store.state import EchoMQ

logger = logging.getLogger("celery_echomq")

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
            forget_flow(state, top)
            forgotten.add(top.id)
            logger.info(
                "echomq: flow %s forgotten: a chord sent again reuses its id %s",
                top.id,
                exc.job_id,
            )


def _finished_top(state: EchoMQ, job_id: str) -> JobNode | None:
    """The outermost flow holding ``job_id``, if it has finished (None: unknown, or running)."""
    if not job_id:
        return None
    try:
        node = read_flow(state, job_id, count=1, with_result=False)
        while node.parent is not None:
            node = read_flow(state, node.parent, count=1, with_result=False)
    except UnknownFlowError:
        return None
    return node if node.finished and node.flow is not None else None
