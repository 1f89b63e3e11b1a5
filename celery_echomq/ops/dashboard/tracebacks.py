"""A failed child's traceback, as Celery's result backend keeps it (``AsyncResult.traceback``).

Read for the failed jobs on the page in view only: one MGET of their result keys where the
backend is a key-value store (Redis, the usual case), else ``AsyncResult(id).traceback`` for
each (a page's worth at most). Never raises: a traceback is a courtesy, as the times are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from celery_echomq.ops.nodes import JobNode
from celery_echomq.store.state import EchoMQ

MAX_CHARS = 20_000  # of one traceback shown: its last lines, where the error is


def failed_jobs(nodes: Iterable[JobNode | None]) -> list[str]:
    """The ids of the failed jobs among ``nodes``' children and chains' steps."""
    ids: list[str] = []
    for node in nodes:
        if node is None:
            continue
        for child in node.children:
            for job in child.steps or (child,):
                if job.state == "failed" and job.id not in ids:
                    ids.append(job.id)
    return ids


def tracebacks(state: EchoMQ, ids: list[str]) -> dict[str, str]:
    """``{job_id: traceback}`` for those of ``ids`` whose result holds one."""
    found: dict[str, str] = {}
    if not ids:
        return found
    with contextlib.suppress(Exception):  # a backend down or of another kind: none
        backend = state.app.backend
        client = getattr(backend, "client", None)
        key_for = getattr(backend, "get_key_for_task", None)
        if client is not None and key_for is not None and hasattr(client, "mget"):
            for job_id, raw in zip(ids, client.mget([key_for(i) for i in ids]), strict=True):
                if raw is not None:
                    _keep(found, job_id, backend.decode_result(raw).get("traceback"))
        else:
            for job_id in ids:
                _keep(found, job_id, state.app.AsyncResult(job_id).traceback)
    return found


def _keep(found: dict[str, str], job_id: str, value: Any) -> None:
    if isinstance(value, str) and value.strip():
        found[job_id] = value if len(value) <= MAX_CHARS else "…" + value[-MAX_CHARS:]
