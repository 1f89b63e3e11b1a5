"""The key builder and id gate: the only place that makes a Redis key.

Every key of a queue carries the queue as a hash tag (``emq:{queue}:...``), so every
key one script touches sits on one Redis Cluster slot. An id or queue name that could
escape its tag or name another key raises here, before any Redis command.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from celery_echomq.errors import DuplicateIdError, InvalidIdError, KindError

KIND = "JOB"
MAX_ID_LENGTH = 200
# Printable, no whitespace, no hash-tag braces, no key separator.
_ALLOWED = re.compile(r"[^\s{}:\x00-\x1f\x7f]+")

ALLOWED_TEXT = (
    "1 to 200 printable characters without whitespace, control characters, '{', '}' or ':'"
)


def _check_text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise InvalidIdError(f"{what} must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidIdError(f"{what} is empty; allowed: {ALLOWED_TEXT}")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidIdError(f"{what} is {len(value)} characters long; allowed: {ALLOWED_TEXT}")
    # isprintable(): no Unicode category C (format characters such as U+200B and U+202E
    # included) and no separator but the ASCII space, which the pattern refuses.
    if not _ALLOWED.fullmatch(value) or not value.isprintable():
        raise InvalidIdError(f"{what} {value!r} has a forbidden character; allowed: {ALLOWED_TEXT}")
    return value


def check_id(job_id: object) -> str:
    """Return ``job_id`` if it is a well-formed ``JOB`` id, else raise."""
    text = _check_text(job_id, "job id")
    if not text.startswith(KIND):
        raise KindError(f"job id {text!r} must be JOB-namespaced (start with 'JOB')")
    return text


def uuid4_hex() -> str:
    """What ``uuid.uuid4().hex`` gives (random, version 4, RFC 4122 variant), made without a
    UUID object: a third of the time, and a flow makes one per child."""
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40
    raw[8] = (raw[8] & 0x3F) | 0x80
    return raw.hex()


def new_job_id() -> str:
    """A fresh id in the job namespace: ``JOB`` + a uuid4's hex."""
    return KIND + uuid4_hex()


def check_queue(queue: object) -> str:
    return _check_text(queue, "queue name")


def check_unique(ids: Iterable[str]) -> None:
    seen: set[str] = set()
    for job_id in ids:
        if job_id in seen:
            raise DuplicateIdError(f"job id {job_id!r} appears more than once in one flow")
        seen.add(job_id)


class Keyspace:
    """Builds ``{prefix}:{{{queue}}}:...`` keys after gating every part."""

    def __init__(self, prefix: str = "emq") -> None:
        self.prefix = _check_text(prefix, "key prefix")

    def job_key(self, queue: str, job_id: str) -> str:
        return f"{self.prefix}:{{{check_queue(queue)}}}:{check_id(job_id)}"

    def queue_key(self, queue: str, name: str) -> str:
        return f"{self.prefix}:{{{check_queue(queue)}}}:{name}"

    def flow_keys(self, queue: str, job_id: str) -> tuple[str, str, str]:
        """A parent's ``:dependencies``, ``:processed`` and ``:ignored`` keys."""
        row = self.job_key(queue, job_id)
        return f"{row}:dependencies", f"{row}:processed", f"{row}:ignored"

    def children_key(self, queue: str, job_id: str) -> str:
        """A parent's ``:children``: its children's ids by position (a list), what a page of
        them reads. Scripts derive it from the row's name (see ``includes/expire.lua``)."""
        return f"{self.job_key(queue, job_id)}:children"

    def failures_key(self, queue: str, job_id: str) -> str:
        """A parent's ``:failures``: the ids of its children failed under fail, remove or
        continue (id -> 1; their errors stay on its row), what a page of failed ones reads."""
        return f"{self.job_key(queue, job_id)}:failures"

    def settled_key(self, queue: str, job_id: str) -> str:
        """A parent's ``:settled``: which children of other slots were credited (and how)."""
        return f"{self.job_key(queue, job_id)}:settled"

    def adding_key(self, queue: str, job_id: str) -> str:
        """A held parent's ``:adding``: children of other slots added to it, staged (id ->
        payload) until their rows are written on their own slots."""
        return f"{self.job_key(queue, job_id)}:adding"

    def locator_key(self, job_id: str) -> str:
        """Where a flow parent lives: ``{prefix}:loc:{JOB...}`` holds its queue name.

        Lets a bare job id (CLI, ``FlowResult(id)``) find its queue's slot.
        """
        return f"{self.prefix}:loc:{{{check_id(job_id)}}}"

    def queues_key(self) -> str:
        """The set of queue names that hold flows: what recovery and ``stats`` scan."""
        return f"{self.prefix}:queues"

    def claim_key(self, job_id: str) -> str:
        """An id claimed by an enqueue in flight: ``{prefix}:id:{JOB...}`` holds the queue its
        row will live on, for the moments between the host's check across queues and the
        row's landing (see send/ids.py)."""
        return f"{self.prefix}:id:{{{check_id(job_id)}}}"

    def check_parts(self) -> list[str]:
        """What a script of a store of one server joins its keys from, for the check across
        queues (``includes/taken.lua``): a row is ``[0] + queue + [1] + id``, a claim
        ``[2] + id + [3]``: the forms of :meth:`job_key` and :meth:`claim_key`."""
        return [f"{self.prefix}:{{", "}:", f"{self.prefix}:id:{{", "}"]

    def lease_key(self, name: str) -> str:
        return f"{self.prefix}:lease:{_check_text(name, 'lease name')}"
