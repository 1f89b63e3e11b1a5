"""A windowed flow's window as operators read it: its size and how many children wait for a
slot (``flow(..., max_active=N)``; see ``send/window.py``). One LLEN, only for a flow that has
a window: a read costs the same whatever the flow's size."""

from __future__ import annotations

from typing import Any

from celery_echomq.store.state import EchoMQ


def window_counts(
    state: EchoMQ, queue: str, job_id: str, stored: Any
) -> tuple[int | None, int, int | None]:
    """``(max_active, waiting, quorum)`` of the flow parent ``job_id`` on ``queue`` whose
    stored job (its payload, or its ``head``) is ``stored``; ``(None, 0, None)`` for a flow
    without a window or a quorum (``flow(..., quorum=K)``, send/quorum.py)."""
    try:
        job = state.loads(stored) if stored else None
    except Exception:  # a payload this app cannot read: no window to show
        return None, 0, None
    if not isinstance(job, dict):
        return None, 0, None
    quorum = int(job["quorum"]) if job.get("quorum") else None
    if not job.get("max_active"):
        return None, 0, quorum
    where = str(job.get("window_queue") or queue)
    waiting = state.client.llen(state.keys.window_key(where, job_id))
    return int(job["max_active"]), int(waiting), quorum
