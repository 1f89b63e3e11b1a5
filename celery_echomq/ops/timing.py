"""When the jobs of a flow ended, for people: ``show`` and the dashboard's runtimes.

A row keeps when its job last started (``started``: the claim's server time) but not when it
ended, and the transitions that end a job stay as they are (no command more per child). So
the end is read where it is already kept: a failed job's score in its queue's failed set (the
store's clock, written by the script that failed it), and a done job's ``date_done`` in
Celery's result backend, when that backend is a key-value store read with one MGET (Redis,
the usual case). A job whose result is not stored (``echomq_child_results = False``,
``ignore_result``, ``rpc://``, no backend) has no known end: it is shown without one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import Any

from celery_echomq.store.state import EchoMQ

# Result keys read per MGET: a tree of 100,000 jobs is read in bounded steps.
CHUNK = 1000


def finish_times(state: EchoMQ, nodes: Iterable[Any]) -> dict[str, int]:
    """``{job_id: ms since the epoch}`` for the finished jobs among ``nodes`` whose end is
    known. Never raises for a backend that cannot say: times are a courtesy."""
    nodes = list(nodes)
    ends: dict[str, int] = {}
    failed = [n for n in nodes if n.state == "failed"]
    if failed:
        pipe = state.client.pipeline(transaction=False)
        for n in failed:
            pipe.zscore(state.keys.queue_key(n.queue, "failed"), n.id)
        for n, score in zip(failed, pipe.execute(), strict=True):
            if score is not None:
                ends[n.id] = int(score)
    done = [n.id for n in nodes if n.state == "done"]
    with contextlib.suppress(Exception):  # a backend down or of another kind: no times
        ends.update(_done_times(state.app.backend, done))
    return ends


def _done_times(backend: Any, ids: list[str]) -> dict[str, int]:
    client = getattr(backend, "client", None)
    key_for = getattr(backend, "get_key_for_task", None)
    if not ids or client is None or key_for is None or not hasattr(client, "mget"):
        return {}
    ends: dict[str, int] = {}
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        for job_id, raw in zip(chunk, client.mget([key_for(i) for i in chunk]), strict=True):
            if raw is None:
                continue
            meta = backend.decode_result(raw)
            when = _ms(meta.get("date_done"))
            if when is not None:
                ends[job_id] = when
    return ends


def _ms(value: Any) -> int | None:
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = datetime.fromisoformat(value)
    if not isinstance(value, datetime):
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)  # Celery stores UTC
    return int(value.timestamp() * 1000)
