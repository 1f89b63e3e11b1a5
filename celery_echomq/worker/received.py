"""Receivers in the worker's main process for flow messages Celery drops before any task
runs: an unregistered task, a message it rejects. And the evidence a revocation for an
expired delivery is checked against. Each acts on the job's stored row, never on a
message's word alone."""

from __future__ import annotations

import logging
from typing import Any

from celery_echomq.store.codec import load_job, read_stored
from celery_echomq.store.headers import H_FLOW, H_QUEUE, Headers, parent_ref
from celery_echomq.store.state import EchoMQ, find_state
from celery_echomq.worker.settle import settle_failure

logger = logging.getLogger("celery_echomq")


def on_unknown(
    sender: Any = None, message: Any = None, exc: Any = None, name: str = "", id: str = "", **_: Any
) -> None:
    """A flow job naming a task this worker has not registered: Celery drops its message and
    stores NotRegistered, so it fails now, under its policy, rather than wait for recovery to
    re-publish it for ever. The row decides: only a job whose stored task is ``name``."""
    _fail_rejected(
        sender,
        message,
        id,
        name,
        f"NotRegistered: task {name!r} is not registered on the worker that received it "
        "(start the worker with the module that defines it)",
    )


def on_rejected(sender: Any = None, message: Any = None, exc: Any = None, **_: Any) -> None:
    """A flow job's message the worker refused as invalid (content type not accepted, a body
    it cannot decode): dropped by Celery, so it fails now, under its policy."""
    headers = getattr(message, "headers", None) or {}
    _fail_rejected(
        sender,
        message,
        str(headers.get("id") or ""),
        str(headers.get("task") or ""),
        f"{type(exc).__name__}: the worker rejected the message: {exc}",
    )


def _fail_rejected(sender: Any, message: Any, job_id: str, name: str, error: str) -> None:
    headers = getattr(message, "headers", None) or {}
    app = getattr(sender, "app", None)
    queue = headers.get(H_QUEUE)
    if not job_id or not queue or app is None:
        return
    state = find_state(app)
    if state is None:
        return
    try:
        stored = read_stored(state, str(queue), job_id)
        job = load_job(state, str(queue), job_id, stored) if stored is not None else None
        if job is None or (name and job.get("task") != name):
            # Not this row's job (a forged message, or another store's): nothing changes.
            logger.warning("echomq: a rejected message for %s is not its stored job", job_id)
            return
        settle_failure(
            state,
            str(queue),
            job_id,
            "",
            error,
            bool(headers.get(H_FLOW)),
            parent_ref(Headers(headers)),
        )
        logger.warning("echomq: %s failed at once: %s", job_id, error)
    except Exception:
        # A receiver's error is swallowed by Celery: log it; recovery still sees the job.
        logger.exception("echomq: could not fail rejected job %s", job_id)


def may_expire(state: EchoMQ, queue: str, job_id: str) -> bool:
    """Whether the job's own stored message carries an expiry (``expires``)."""
    try:
        stored = read_stored(state, queue, job_id)
        job = load_job(state, queue, job_id, stored) if stored is not None else None
    except Exception:  # unreadable: the message's word is all there is
        return True
    return job is None or bool((job.get("options") or {}).get("expires"))
