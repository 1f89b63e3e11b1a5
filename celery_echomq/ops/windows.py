"""A flow's fan-in as operators read it: its window's size and how many children wait for a
slot (``flow(..., max_active=N)``; see ``send/window.py``), its quorum, its reducer and the
accumulator so far. One LLEN for a window, one HGET for a reducer: a read costs the same
whatever the flow's size."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from celery_echomq.ops.nodes import FlowInfo
from celery_echomq.send.reducers import empty
from celery_echomq.store.state import EchoMQ


def with_fan_in(state: EchoMQ, queue: str, job_id: str, stored: Any, info: FlowInfo) -> FlowInfo:
    """``info`` (the flow parent ``job_id``'s counts on ``queue``, its stored job, payload or
    ``head``, ``stored``) with its window's size and waiting children, its quorum
    (``flow(..., quorum=K)``, send/quorum.py) and its reducer with the accumulator so far
    (``flow(..., reduce=R)``, send/reducers.py): one LLEN for a window, one HGET for a
    reducer, nothing more for a flow of any size."""
    try:
        job = state.loads(stored) if stored else None
    except Exception:  # a payload this app cannot read: no window to show
        return info
    if not isinstance(job, dict):
        return info
    if job.get("quorum"):
        info = replace(info, quorum=int(job["quorum"]))
    if job.get("reduce"):
        acc = state.client.hget(state.keys.job_key(queue, job_id), "acc")
        folded = empty(job["reduce"]) if acc is None else json.loads(acc)  # reduce.lua's JSON
        info = replace(info, reduce=list(job["reduce"]), acc=folded)
    if job.get("max_active"):
        where = str(job.get("window_queue") or queue)
        waiting = state.client.llen(state.keys.window_key(where, job_id))
        info = replace(info, max_active=int(job["max_active"]), waiting=int(waiting))
    return info
