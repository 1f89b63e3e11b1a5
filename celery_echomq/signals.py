"""Worker signal receivers: each calls one transition script for a flow job.

Receivers run in the pool process (revocation in the main process), and Celery logs and
swallows their exceptions, so every transition is idempotent and recovery repairs the ones a
receiver could not make. A task without the flow headers costs nothing here: no Redis command.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections import OrderedDict
from typing import Any

from celery import signals

from .flows import (
    H_FLOW,
    H_QUEUE,
    error_text,
    parent_ref,
    settle_failure,
    settle_success,
)
from .state import EchoMQ, find_state

logger = logging.getLogger("celery_echomq")

# The token each running flow job was claimed with, by task id, in this (pool) process.
_tokens: dict[str, str] = {}

# In the worker's main process: the headers of flow jobs it received, by task id. A hard
# time limit reports the failure there, where no task request is on the stack.
_received: OrderedDict[str, Any] = OrderedDict()
_RECEIVED_MAX = 10_000


def _flow_state(task: Any, request: Any) -> EchoMQ | None:
    if request is None or not getattr(request, H_QUEUE, None):
        return None
    return find_state(task.app)


def on_prerun(sender: Any = None, task_id: str = "", task: Any = None, **_: Any) -> None:
    request = task.request
    state = _flow_state(task, request)
    if state is None:
        return
    token = f"{os.getpid()}-{uuid.uuid4().hex}"
    status, attempts = state.scripts.claim(
        getattr(request, H_QUEUE), task_id, token, state.settings.stall_ms
    )
    if status in ("claimed", "taken_over"):
        _tokens[task_id] = token
    if status == "claimed":
        logger.debug("echomq: claim %s (attempt %d)", task_id, attempts)
    else:
        # A redelivery (taken_over), or a delivery of a job already finished: its body runs
        # (bodies are at-least-once) but its completion will not be counted again.
        logger.info("echomq: claim %s -> %s (attempt %d)", task_id, status, attempts)


def on_success(sender: Any = None, result: Any = None, **_: Any) -> None:
    request = sender.request
    state = _flow_state(sender, request)
    if state is None:
        return
    token = _tokens.pop(request.id, None)
    if token is None:
        return
    settle_success(
        state,
        getattr(request, H_QUEUE),
        request.id,
        token,
        bool(getattr(request, H_FLOW, None)),
        parent_ref(request),
        state.dumps(result),
    )


def on_failure(
    sender: Any = None, task_id: str = "", exception: BaseException | None = None, **_: Any
) -> None:
    request = sender.request
    if getattr(request, "id", None) == task_id:
        token = _tokens.pop(task_id, None)
    else:
        # The main process after a hard time limit: the pool process that held the token is
        # gone, so the failure applies whatever token the row has.
        request, token = _received.pop(task_id, None), ""
    state = _flow_state(sender, request)
    if state is None or token is None:
        return
    settle_failure(
        state,
        getattr(request, H_QUEUE),
        task_id,
        token,
        error_text(exception) if exception is not None else "unknown error",
        bool(getattr(request, H_FLOW, None)),
        parent_ref(request),
    )


def on_retry(sender: Any = None, request: Any = None, **_: Any) -> None:
    state = _flow_state(sender, request)
    if state is None:
        return
    token = _tokens.pop(request.id, None)
    if token is not None:
        status = state.scripts.retry(getattr(request, H_QUEUE), request.id, token)
        logger.info("echomq: retry %s -> %s", request.id, status)


class _Headers:
    """Attribute access to a worker Request's message headers (task_revoked's request)."""

    def __init__(self, headers: dict[str, Any]) -> None:
        self.__dict__.update(headers)


def on_received(sender: Any = None, request: Any = None, **_: Any) -> None:
    headers = getattr(request, "request_dict", None) or {}
    if headers.get(H_QUEUE):
        _received[request.id] = _Headers(headers)
        while len(_received) > _RECEIVED_MAX:
            _received.popitem(last=False)


def on_revoked(
    sender: Any = None,
    request: Any = None,
    terminated: bool = False,
    expired: bool = False,
    **_: Any,
) -> None:
    # Celery passes the request's Context here: the message headers are its attributes.
    headers = request
    if sender is None or not getattr(headers, H_QUEUE, None):
        return
    _received.pop(request.id, None)
    state = find_state(sender.app)
    if state is None:
        return
    reason = "TaskRevokedError: expired" if expired else "TaskRevokedError: revoked"
    settle_failure(
        state,
        getattr(headers, H_QUEUE),
        request.id,
        "",
        reason,
        bool(getattr(headers, H_FLOW, None)),
        parent_ref(headers),
    )


def connect() -> None:
    """Connect the receivers (once per process; each checks the sender's app)."""
    signals.task_prerun.connect(on_prerun, weak=False, dispatch_uid="echomq_prerun")
    signals.task_success.connect(on_success, weak=False, dispatch_uid="echomq_success")
    signals.task_failure.connect(on_failure, weak=False, dispatch_uid="echomq_failure")
    signals.task_retry.connect(on_retry, weak=False, dispatch_uid="echomq_retry")
    signals.task_revoked.connect(on_revoked, weak=False, dispatch_uid="echomq_revoked")
    signals.task_received.connect(on_received, weak=False, dispatch_uid="echomq_received")
