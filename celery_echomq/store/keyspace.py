"""The key builder and id gate: the only place that makes a Redis key.

A script names a key it was not passed only through ``lua/includes/keys.lua``, by the forms
written here: each suffix it derives from a row (``<row>:failures``, ...) has its method
below (``<suffix>_key``).

Every key of a queue carries the queue as a hash tag (``emq:{queue}:...``), so every
key one script touches sits on one Redis Cluster slot. An id or queue name that could
escape its tag or name another key raises here, before any Redis command.

A job id is a Celery task id of one of two forms: a ``JOB`` id (what a flow gives a job
itself, ``JOB`` + a uuid4's hex, or any id the user gives that starts with ``JOB``), or a
uuid in Celery's own form (what ``freeze()`` and ``celery.utils.uuid()`` give). Messages,
results, callbacks and every read keep the id as given; only the keys are named by the
job's *row id* (:func:`row_id`): a ``JOB`` id as it is, a uuid ``u`` as ``JOB`` + ``u``.
So every key the store writes is in the JOB namespace, and ``u`` and ``JOB`` + ``u`` name
one row: a flow cannot hold both, and a store holds at most one of them at a time.
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
# A uuid as Celery writes a task id (``str(uuid.uuid4())``): lower-case hex, 8-4-4-4-12.
_CELERY_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
ALLOWED_KINDS = (
    "an id that starts with 'JOB', or a Celery task id: a uuid as celery.utils.uuid() and "
    "freeze() give it (36 lower-case characters, e.g. '3b241101-e2bb-4255-8caf-4136c566a962')"
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


def is_celery_uuid(text: str) -> bool:
    """Whether ``text`` is a uuid in Celery's own form (``celery.utils.uuid()``)."""
    return _CELERY_UUID.fullmatch(text) is not None


def check_id(job_id: object) -> str:
    """Return ``job_id`` if it is a well-formed job id (a ``JOB`` id or a Celery uuid), else
    raise."""
    text = _check_text(job_id, "job id")
    if not text.startswith(KIND) and not is_celery_uuid(text):
        raise KindError(f"job id {text!r} must be JOB-namespaced; allowed: {ALLOWED_KINDS}")
    return text


def row_id(job_id: object) -> str:
    """The id that names ``job_id``'s keys, gated: a ``JOB`` id as it is, a Celery uuid ``u``
    as ``JOB`` + ``u`` (never the form of an id a flow makes itself, ``JOB`` + hex)."""
    return _row(check_id(job_id))


def _row(text: str) -> str:
    return text if text.startswith(KIND) else KIND + text


def id_of_row(row: str) -> str:
    """The job id a row id was named from: ``JOB`` + a Celery uuid gives the uuid back (the id
    Celery knows the job by), any other row id is its job's id."""
    rest = row[len(KIND) :]
    return rest if row.startswith(KIND) and is_celery_uuid(rest) else row


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
    """Every id (gated already) names a row of its own: the same id twice, or a uuid beside
    ``JOB`` + that uuid (one row), is refused."""
    seen: dict[str, str] = {}
    for job_id in ids:
        row = _row(job_id)
        if row in seen:
            first = seen[row]
            if first == job_id:
                raise DuplicateIdError(f"job id {job_id!r} appears more than once in one flow")
            raise DuplicateIdError(
                f"job ids {first!r} and {job_id!r} name the same row ({row!r}: a Celery uuid's "
                "row is 'JOB' + the uuid) and cannot both be in one flow"
            )
        seen[row] = job_id


# The per-queue sorted sets that hold job ids: a job deleted leaves every one of them.
# (outbox: children of another slot's parent awaiting credit; open: flows not sealed yet;
# adding: flows with children staged for another slot; recent: the flows the dashboard lists,
# an index, not a state set; deadlines: the flows' deadlines not passed yet; joined: jobs
# joined to more parents, staged for their credit; reserved: jobs a live worker holds
# before it runs them, which its next lease tick writes again while it holds one.)
JOB_SETS = (
    "pending",
    "active",
    "failed",
    "outbox",
    "open",
    "recent",
    "adding",
    "deadlines",
    "joined",
    "reserved",
)


class Keyspace:
    """Builds ``{prefix}:{{{queue}}}:...`` keys after gating every part."""

    def __init__(self, prefix: str = "emq") -> None:
        self.prefix = _check_text(prefix, "key prefix")

    def job_key(self, queue: str, job_id: str) -> str:
        return f"{self.prefix}:{{{check_queue(queue)}}}:{row_id(job_id)}"

    def job_keys(self, queue: str, job_ids: Iterable[str]) -> list[str]:
        """:meth:`job_key` of each id, the queue gated once (a flow names thousands)."""
        head = f"{self.prefix}:{{{check_queue(queue)}}}:"
        return [head + row_id(job_id) for job_id in job_ids]

    def queue_key(self, queue: str, name: str) -> str:
        return f"{self.prefix}:{{{check_queue(queue)}}}:{name}"

    def unused_key(self, queue: str) -> str:
        """The queue's placeholder: what a script is passed on a KEYS slot whose key cannot be
        named on the queue's slot in this call (a parent on another slot, no parent, no next
        step, no result to write). No script writes it, so it never exists."""
        return self.queue_key(queue, "unused")

    def flow_keys(self, queue: str, job_id: str) -> tuple[str, str, str]:
        """A parent's ``:dependencies``, ``:processed`` and ``:ignored`` keys."""
        row = self.job_key(queue, job_id)
        return f"{row}:dependencies", f"{row}:processed", f"{row}:ignored"

    def dependencies_key(self, queue: str, job_id: str) -> str:
        """A parent's ``:dependencies``: how many of its children are outstanding, the first
        of :meth:`flow_keys` (what ``includes/expire.lua`` finds a flow's indexes by)."""
        return f"{self.job_key(queue, job_id)}:dependencies"

    def ignored_key(self, queue: str, job_id: str) -> str:
        """A parent's ``:ignored``: the errors of its children failed under ignore (id ->
        error), the third of :meth:`flow_keys`."""
        return f"{self.job_key(queue, job_id)}:ignored"

    def quorum_key(self, queue: str, job_id: str) -> str:
        """A parent's ``:quorum`` under ``flow(..., quorum=K)``: its children's ids in the
        order they succeeded (a list), which its values follow (``includes/quorum.lua``)."""
        return f"{self.job_key(queue, job_id)}:quorum"

    def children_key(self, queue: str, job_id: str) -> str:
        """A parent's ``:children``: its children's ids by position (a list), what a page of
        them reads. Scripts derive it from the row's name (see ``includes/expire.lua``)."""
        return f"{self.job_key(queue, job_id)}:children"

    def failures_key(self, queue: str, job_id: str) -> str:
        """A parent's ``:failures``: the ids of its children failed under fail, remove or
        continue (id -> 1), or fail_at_end (id -> 'late'; their errors stay on its row), what a
        page of failed ones reads."""
        return f"{self.job_key(queue, job_id)}:failures"

    def window_key(self, queue: str, parent_id: str) -> str:
        """A windowed flow's ``:window`` on ``queue``'s slot (its children's): the ids of its
        children there that wait for a slot, in order (a list; see
        ``includes/window.lua``, which derives its ``:slots`` from it). On the parent's own
        slot scripts derive it from the row."""
        return f"{self.job_key(queue, parent_id)}:window"

    def slots_key(self, queue: str, parent_id: str) -> str:
        """A windowed flow's ``:slots`` beside its ``:window``: its freed slots not taken yet
        and how many are taken at once (a hash)."""
        return f"{self.job_key(queue, parent_id)}:slots"

    def settled_key(self, queue: str, job_id: str) -> str:
        """A parent's ``:settled``: which children of other slots were credited (and how)."""
        return f"{self.job_key(queue, job_id)}:settled"

    def parents_key(self, queue: str, job_id: str) -> str:
        """A job's ``:parents``: the parents it was joined to after it was written
        (``on_exists="join"``, send/join.py), parent id -> ``policy|queue``; its first parent
        stays its row's ``parent``."""
        return f"{self.job_key(queue, job_id)}:parents"

    def adding_key(self, queue: str, job_id: str) -> str:
        """A held parent's ``:adding``: children of other slots added to it, staged (id ->
        payload) until their rows are written on their own slots."""
        return f"{self.job_key(queue, job_id)}:adding"

    def flow_own_keys(self, queue: str, job_id: str) -> list[str]:
        """Every key a flow keeps beside its parent's row, on its queue's slot: what a forget
        deletes with the row (forget.lua; which deletes each row's ``:parents`` with it)."""
        return [
            *self.flow_keys(queue, job_id),
            self.settled_key(queue, job_id),
            self.adding_key(queue, job_id),
            self.children_key(queue, job_id),
            self.failures_key(queue, job_id),
            self.window_key(queue, job_id),
            self.slots_key(queue, job_id),
            self.quorum_key(queue, job_id),
        ]

    def job_set_keys(self, queue: str) -> list[str]:
        """The queue's sorted sets that hold job ids (:data:`JOB_SETS`), in that order."""
        return [self.queue_key(queue, name) for name in JOB_SETS]

    def locator_key(self, job_id: str) -> str:
        """Where a flow parent lives: ``{prefix}:loc:{JOB...}`` (its row id) holds its queue
        name.

        Lets a bare job id (CLI, ``FlowResult(id)``) find its queue's slot.
        """
        return f"{self.prefix}:loc:{{{row_id(job_id)}}}"

    def queues_key(self) -> str:
        """The set of queue names that hold flows: what recovery and ``stats`` scan."""
        return f"{self.prefix}:queues"

    def claim_key(self, job_id: str) -> str:
        """An id claimed by an enqueue in flight: ``{prefix}:id:{JOB...}`` holds the queue its
        row will live on, for the moments between the host's check across queues and the
        row's landing (see send/ids.py)."""
        return f"{self.prefix}:id:{{{row_id(job_id)}}}"

    def check_parts(self) -> list[str]:
        """What a script of a store of one server joins its keys from, for the check across
        queues (``includes/taken.lua``): a row is ``[0] + queue + [1] + id``, a claim
        ``[2] + id + [3]``: the forms of :meth:`job_key` and :meth:`claim_key`."""
        return [f"{self.prefix}:{{", "}:", f"{self.prefix}:id:{{", "}"]

    def probe_key(self) -> str:
        """The doctor's write probe, on a slot of its own (``{doctor}``): written and deleted
        to see that every command the package sends is allowed."""
        return f"{self.prefix}:{{doctor}}:probe"

    def lease_key(self, name: str, queue: str | None = None) -> str:
        """The lease ``name``: the store's (``emq:lease:<name>``), or ``queue``'s, in its slot
        (``emq:{<queue>}:lease:<name>``)."""
        name = _check_text(name, "lease name")
        if queue is None:
            return f"{self.prefix}:lease:{name}"
        return self.queue_key(queue, f"lease:{name}")
