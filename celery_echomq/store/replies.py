"""What the scripts reply: every status as a :class:`Status` member, and the error replies
as Python errors (``EMQKIND`` -> :class:`KindError`, ``EMQEXISTS`` -> :class:`FlowExistsError`,
``EMQFORMAT`` -> ``StoreFormatError``).

Each script's header (``lua/<name>.lua``) lists the statuses it can give.
"""

from __future__ import annotations

import sys
from enum import Enum

import redis

from celery_echomq.errors import FlowExistsError, KindError
from celery_echomq.store.store_format import refused_format

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10

    class StrEnum(str, Enum):
        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return str(self.value).__format__(spec)


class Status(StrEnum):
    """Every status a script replies with (each script's header says which it can give).

    A member is a ``str``, so a reply compares equal to its text; code compares against the
    members, never against bare strings.
    """

    # a job's states, also the reply of a transition that found the job in another state
    PENDING = "pending"
    ACTIVE = "active"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    AWAITING_CHILDREN = "awaiting_children"
    WAITING = "waiting"  # a chain's step whose step before has not completed
    MISSING = "missing"  # no row
    # claim
    CLAIMED = "claimed"
    TAKEN_OVER = "taken_over"
    BUSY = "busy"
    HELD = "held"  # also requeue: a live worker holds the job it received
    # complete, fail, credit, seal_flow: the fan-in
    RELEASED = "released"
    CREDITED = "credited"
    STAGED = "staged"
    ADVANCED = "advanced"  # complete: a chain's step, the next one made pending
    UNFOLDABLE = "unfoldable"  # complete: its flow's reducer cannot fold the value; no write
    PARENT_FAILED = "parent_failed"
    DUPLICATE = "duplicate"
    FINISHED = "finished"
    SEALED = "sealed"
    # any transition that checks the caller's token
    STALE = "stale"
    # claim, complete, fail: the caller named another parent than the job row's own
    FORGED = "forged"
    NOOP = "noop"
    # retry, requeue, drop, hand_over, abandon_flow
    RETRIED = "retried"
    REQUEUED = "requeued"
    FRESH = "fresh"
    LAPSED = "lapsed"
    HANDED_OVER = "handed_over"
    ABANDONED = "abandoned"
    # grow_flow
    ADDED = "added"
    # cancel_shared: a parent was joined to the job since its edges were read
    JOINED = "joined"


# What a claim means for the delivery that made it.
STARTED = frozenset({Status.CLAIMED, Status.TAKEN_OVER})
DUPLICATE_DELIVERY = frozenset(
    {Status.BUSY, Status.DONE, Status.FAILED, Status.CANCELLED, Status.HELD, Status.WAITING}
)
# What settling a finished job can answer when it changed nothing for the parent.
# MISSING: no row (a flow forgotten while its messages, or a child's credit, were on their way).
UNSETTLED = frozenset(
    {Status.STALE, Status.FINISHED, Status.FAILED, Status.DUPLICATE, Status.FORGED, Status.MISSING}
)


def server_error(exc: redis.ResponseError, queue: str = "") -> Exception:
    """The Python error for a script's error reply (others come back unchanged); ``queue``:
    the one whose slot the script ran on, named where the reply names none."""
    message = str(exc)
    if message.startswith("EMQKIND"):
        return KindError(message)
    if message.startswith("EMQFORMAT"):
        return refused_format(message)
    if message.startswith("EMQWIDE"):
        return WideCheck(message)
    if message.startswith("EMQEXISTS"):
        # "EMQEXISTS <id>": a row on the script's own slot; "EMQEXISTS <id> <queue>": the id
        # is another queue's (includes/taken.lua).
        parts = message.split(" ", 2)
        job_id = parts[1] if len(parts) > 1 else "?"
        return exists_error(job_id, parts[2] if len(parts) > 2 else queue)
    return exc


def exists_error(job_id: str, queue: str = "") -> FlowExistsError:
    """The refusal of an id that names a job already, on ``queue`` when it is known."""
    where = f", on queue {queue!r}; an id names one job in the whole store, and" if queue else ";"
    refused = FlowExistsError(
        f"job id {job_id!r} already exists in Redis{where} a flow never overwrites a job "
        "(nothing was written or published)"
    )
    refused.job_id, refused.queue = job_id, queue
    return refused


class WideCheck(Exception):
    """enqueue_flow's check across queues would take more lookups than one script should
    make (``includes/taken.lua``): nothing was written; the host claims and checks the ids
    itself (``send/ids.py``) and enqueues again without the check."""
