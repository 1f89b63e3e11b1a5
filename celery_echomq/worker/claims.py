"""A delivery's claim of its flow job: the token that names its holder, the claim script, and
a take-over when the holder it names is a pool process known dead on this host.

Tokens name their holder ("host|pid|random"), so a worker can end the lease of a pool process
it saw die (recovery/worker.py), and a claim can tell a dead holder on this host from a live
one.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable
from typing import Any

from celery_echomq.config import safe_url
from celery_echomq.store.headers import H_PARENT, H_QUEUE, H_SINCE, H_STORE, H_VIA
from celery_echomq.store.replies import Status
from celery_echomq.store.state import EchoMQ

logger = logging.getLogger("celery_echomq")

HOST = socket.gethostname().replace("|", "_")


def new_token() -> str:
    return f"{HOST}|{os.getpid()}|{uuid.uuid4().hex}"


def holder_prefix(pid: int) -> str:
    return f"{HOST}|{pid}|"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists. A number that cannot name one process (zero or less
    names a process group; a greenlet's address overflows a pid) is no evidence of a death:
    alive."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def holder_dead(token: str) -> bool:
    """Whether ``token``'s holder is a pool process of this host that no longer exists."""
    host, _, rest = token.partition("|")
    pid = rest.partition("|")[0]
    return host == HOST and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid))


def priority_of(request: Any) -> int:
    # Brokers deliver a queue in order within one priority: the claim mark is kept per priority.
    try:
        return int((getattr(request, "delivery_info", None) or {}).get("priority") or 0)
    except (TypeError, ValueError):
        return 0


def _delivered(request: Any) -> dict[str, Any]:
    """What a claim reads from the delivery's request: its priority, retry count, pending
    time (:data:`H_SINCE`) and the batch message that carried it (:data:`H_VIA`)."""
    since = getattr(request, H_SINCE, None)
    via = getattr(request, H_VIA, None)
    return {
        "priority": priority_of(request),
        "retries": int(getattr(request, "retries", 0) or 0),
        "since": since if isinstance(since, int) else None,
        "batch": str(via) if via else None,
    }


def named_by(request: Any) -> tuple[str, str, str]:
    """The delivery's queue, job id and parent, as its headers name them (the claim compares
    the parent with the row's own)."""
    return (
        str(getattr(request, H_QUEUE)),
        str(request.id),
        str(getattr(request, H_PARENT, None) or ""),
    )


def claim(
    state: EchoMQ, request: Any, token: str, first: tuple[Status, int, str] | None = None
) -> tuple[Status, int]:
    """The claim script for the delivery ``request``, and once more, forced, when the holder
    it names is a pool process known dead on this host. Returns the status and the attempt.
    ``first``: the reply of this claim, sent already with ``token`` (:func:`claim_riding`)."""
    (queue, task_id, named), delivered = named_by(request), _delivered(request)
    lease = state.settings.stall_ms
    if first is None:
        first = state.scripts.claim(queue, task_id, token, lease, parent=named, **delivered)
    status, attempts, holder = first
    if status is Status.BUSY and holder == token:
        # The store's client resent this claim after a lost reply (a failover), or its
        # round trip failed after it landed: the first attempt landed, so the job is this
        # delivery's.
        return Status.CLAIMED, attempts
    if status is Status.BUSY and holder_dead(holder):
        # Its pool process died on this host (acks late: this is the broker's redelivery):
        # the holder is known dead, so its lease does not have to lapse first.
        status, attempts, _ = state.scripts.claim(
            queue,
            task_id,
            token,
            lease,
            priority=delivered["priority"],
            force=True,
            retries=delivered["retries"],
            parent=named,
        )
    return status, attempts


def claim_riding(
    state: EchoMQ,
    request: Any,
    token: str,
    landed: Callable[[tuple[Status, int, str] | None], None],
    *,
    names_parent: bool = True,
) -> None:
    """The claim of the delivery ``request`` (as :func:`claim` makes it), sent with the next
    outcome this thread records: ``landed`` hears its reply (None: the round trip failed),
    for :func:`claim` to read as ``first``. ``names_parent`` False: a delivery built before
    its message was read, which names no parent (the row's own is not compared)."""
    queue, task_id, named = named_by(request)
    lease = state.settings.stall_ms
    parent = named if names_parent else None
    state.scripts.claim_riding(
        queue, task_id, token, lease, landed, parent=parent, **_delivered(request)
    )


def warn_no_row(state: EchoMQ, request: Any, task_id: str, queue: str) -> None:
    """A flow job's message with no row here: expired long ago, or (far likelier when it
    happens to every job) the producer writes to another store than this worker reads."""
    mine = safe_url(state.settings.redis_url or "")
    theirs = str(getattr(request, H_STORE, None) or "")
    elsewhere = theirs and theirs != mine
    logger.warning(
        "echomq: flow job %s (queue %s) has no row in this worker's store %s%s. Its body "
        "runs as a plain task, outside the flow",
        task_id,
        queue,
        mine,
        f"; its producer wrote it to {theirs}: point both at one store (echomq_redis_url)"
        if elsewhere
        else "; if the producer's echomq_redis_url names another store, point both at one",
    )
