"""Every error celery-echomq raises derives from :class:`EchoMQError`.

Input errors are also ``ValueError`` so callers that already guard a canvas with
``except ValueError`` keep working.
"""

from __future__ import annotations

import re

import redis.exceptions
from celery.exceptions import ChordError, TaskRevokedError

# What every flow error's message starts with: "flow JOB...: ...". A FlowFailed built by
# code (or stored by a version) that did not name its flow still finds its id there.
# The id is a JOB id or a Celery uuid (see store/keyspace.py).
_FLOW_PREFIX = re.compile(r"^flow (JOB[^\s:]+|[0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12})")


def _flow_of(message: str) -> str:
    found = _FLOW_PREFIX.match(message)
    return found.group(1) if found else ""


class EchoMQError(Exception):
    """Base of every celery-echomq error."""


class ConfigError(EchoMQError):
    """The app's ``echomq_*`` settings cannot be used (e.g. no Redis URL)."""


class NoResultBackendError(ConfigError, NotImplementedError):
    """``FlowResult.get()`` on an app without a result backend (``result_backend`` unset).

    Also a ``NotImplementedError``, what Celery raises for ``AsyncResult.get()`` there.
    """


class InvalidIdError(EchoMQError, ValueError):
    """A job id or queue name cannot be made into a key (empty, too long, braces, colon, space)."""


class KindError(InvalidIdError):
    """A job id is not ``JOB``-namespaced; also what the scripts' ``EMQKIND`` reply becomes."""


class DuplicateIdError(InvalidIdError):
    """The same job id appears twice inside one flow."""


class FlowError(EchoMQError):
    """An error about one flow: ``flow_id`` names it (its parent's job id, ``res.id``)."""

    flow_id: str = ""


class FlowExistsError(EchoMQError, ValueError):
    """A job id of the flow already exists in Redis; nothing was written or published.

    ``job_id`` names that id and ``queue`` where its row lives, where the store said
    (empty otherwise)."""

    job_id: str = ""
    queue: str = ""


class OnExistsError(EchoMQError, ValueError):
    """An ``apply_async(on_exists=...)`` that is neither ``"raise"`` nor ``"join"``."""


class DepthError(EchoMQError, ValueError):
    """A flow tree deeper than ``echomq_max_depth`` levels (flows nested in flows; a run of a
    chain's tasks counts as none)."""


class PolicyError(EchoMQError, ValueError):
    """An unknown ``parent_policy`` name."""


class StoreUnavailableError(EchoMQError):
    """Redis could not be reached while starting a flow; nothing was published."""


class FlowFailed(FlowError, ChordError):  # type: ignore[misc]  # Celery is untyped
    """A child failed under policy ``fail``: the parent will never run.

    ``flow_id`` names the flow, ``child_id`` the failed child; ``error`` is its
    ``"ExcType: message"``. Also a ``celery.exceptions.ChordError``, what a chord's body and
    errbacks get when its header fails: code that catches one catches the other.
    """

    def __init__(
        self, message: str = "", child_id: str = "", error: str = "", flow_id: str = ""
    ) -> None:
        flow_id = flow_id or _flow_of(message)
        super().__init__(message, child_id, error, flow_id)
        self.child_id = child_id
        self.error = error
        self.flow_id = flow_id

    def __str__(self) -> str:
        return str(self.args[0])

    @classmethod
    def of_child(
        cls,
        flow_id: str,
        child_id: str,
        error: str,
        chord: bool = False,
        raised: BaseException | None = None,
    ) -> FlowFailed:
        """The failure of ``flow_id`` by its child ``child_id`` (``error``: its
        ``"ExcType: message"``); ``chord``: a chord on the flow engine, worded as Celery words
        a chord's (``Dependency <id> raised <repr of the error>``), which code may parse for
        the failed task's id. ``raised``: the child's error as its result holds it, which
        Celery's words are made of; without it, one rebuilt from ``error``."""
        if chord and raised is not None:
            message = f"Dependency {child_id} raised {raised!r}"
        elif chord:
            kind, _, text = error.partition(": ")
            message = f"Dependency {child_id} raised {kind}({text!r})"
        else:
            message = f"flow {flow_id}: child {child_id} failed: {error}"
        return cls(message, child_id, error, flow_id)


class FlowDeadlineExceeded(FlowFailed):
    """The flow's deadline passed while its parent still waited, under ``on_deadline="fail"``:
    the parent will never run.

    ``flow_id`` names the flow (the job that held its children), ``outstanding`` the children
    that had not settled when the deadline passed (at most 1,000 of them; ``count`` says how
    many there were), ``deadline`` when it passed (seconds since the epoch, the store's clock).
    """

    def __init__(
        self,
        message: str = "",
        flow_id: str = "",
        outstanding: tuple[str, ...] | list[str] = (),
        count: int | None = None,
        deadline: float | None = None,
    ) -> None:
        outstanding = tuple(outstanding)
        count = len(outstanding) if count is None else int(count)
        EchoMQError.__init__(self, message, flow_id, list(outstanding), count, deadline)
        self.child_id = ""
        self.error = message
        self.flow_id = flow_id
        self.outstanding = outstanding
        self.count = count
        self.deadline = deadline


class DeadlineError(EchoMQError, ValueError):
    """A flow's ``deadline`` or ``on_deadline`` cannot be used (refused before anything is
    sent)."""


class ReduceError(EchoMQError, ValueError):
    """A flow child's value its flow's reducer (``flow(..., reduce=R)``) cannot fold: the
    child's own failure (its Celery result's), named by the reducer and the value's type, as
    in ``sum folds numbers, not str "x"``. Its policy decides what it means for the flow."""


class FlowCancelled(FlowError, TaskRevokedError):  # type: ignore[misc]
    """The flow was cancelled (``FlowResult.revoke()``, ``echomq cancel|revoke``); the parent
    will never run. Its result's state is ``REVOKED``, and this is also Celery's
    ``TaskRevokedError``, what ``get()`` raises for any revoked task."""

    def __init__(self, message: str = "", flow_id: str = "") -> None:
        flow_id = flow_id or _flow_of(message)
        super().__init__(message, flow_id)
        self.flow_id = flow_id

    def __str__(self) -> str:
        return str(self.args[0])


class FlowClosedError(FlowError):
    """Children were added to a flow whose parent no longer waits for them (released, failed,
    cancelled, finished or expired); nothing was written or published. ``flow_id`` names it
    (``parent_id`` too, its earlier name); ``state`` says what became of it.
    """

    def __init__(self, message: str = "", parent_id: str = "", state: str = "") -> None:
        super().__init__(message, parent_id, state)
        self.flow_id = self.parent_id = parent_id
        self.state = state

    def __str__(self) -> str:
        return str(self.args[0])


class StoreConnectionError(StoreUnavailableError, redis.exceptions.ConnectionError):
    """Redis stayed unreachable (or read-only) for longer than ``echomq_store_retry_timeout``.

    Also a ``redis.ConnectionError``, so code that already treats a connection error as "the
    store is down" (recovery passes, the CLI) treats this one the same way.
    """


class StoreWriteRefusedError(StoreUnavailableError, redis.exceptions.ResponseError):
    """The flow store answers but refuses writes: out of memory under a ``maxmemory-policy``
    that evicts nothing it may (``OOM``), a read-only replica (``READONLY``), a failed RDB save
    with ``stop-writes-on-bgsave-error`` (``MISCONF``), too few replicas for
    ``min-replicas-to-write`` (``NOREPLICAS``).

    The message names the store (its URL without a password), the refusal, what heals it and
    what was or was not written. ``store`` is that URL, ``code`` the reply's first word,
    ``cause`` and ``heal`` the refusal and its remedy in words (store/refusals.py). Also a
    ``redis.ResponseError``, what redis-py raised for the refusal, so code that catches one
    still does.
    """

    def __init__(
        self, message: str = "", store: str = "", code: str = "", cause: str = "", heal: str = ""
    ) -> None:
        super().__init__(message)
        self.store, self.code, self.cause, self.heal = store, code, cause, heal

    def __str__(self) -> str:
        return str(self.args[0])


class StoreFormatError(EchoMQError):
    """A row of the store is in a newer format than this release knows (the scripts'
    ``EMQFORMAT`` reply): a newer celery-echomq wrote it. Nothing was written; the row is left
    for a worker of that release. ``found`` is the row's format, ``known`` this release's,
    ``row`` the row's key.
    """

    def __init__(self, found: str, known: int, row: str) -> None:
        super().__init__(found, known, row)
        self.found, self.known, self.row = found, known, row

    def __str__(self) -> str:
        return (
            f"row {self.row} is in store format {self.found}, newer than format {self.known}, "
            "the newest this celery-echomq knows: a newer release wrote it, and this one "
            "leaves it untouched (nothing was written). Upgrade celery-echomq on this process "
            "to the release that wrote it (docs/operations.md: the store's format)"
        )


class ReplicationError(EchoMQError):
    """Fewer than ``echomq_min_replicas`` replicas acknowledged a transition in time.

    The transition was applied on the primary (it is not taken back) but may not survive a
    failover; if a failover loses it, recovery repairs it as it repairs a crashed worker.
    ``acked`` is how many replicas acknowledged it, ``wanted`` the setting; ``reply`` the
    script's own reply (what the primary did).
    """

    def __init__(
        self, message: str = "", acked: int = 0, wanted: int = 0, reply: object = None
    ) -> None:
        super().__init__(message, acked, wanted)
        self.acked = acked
        self.wanted = wanted
        self.reply = reply

    def __str__(self) -> str:
        return str(self.args[0])


class NotRepairableError(FlowError):
    """A retry or release was refused: the flow is not in a state that action repairs.

    The message says the flow's current state and what the action accepts; nothing changed.
    ``state`` is the state that was found (``"missing"`` for an unknown id); ``flow_id`` the
    flow the action named.
    """

    def __init__(self, message: str = "", state: str = "", flow_id: str = "") -> None:
        super().__init__(message, state, flow_id)
        self.state = state
        self.flow_id = flow_id

    def __str__(self) -> str:
        return str(self.args[0])


class UnknownFlowError(FlowError, LookupError):
    """No flow with that id is known to Redis (never started, or expired). ``flow_id`` is the
    id asked for."""

    def __init__(self, message: str = "", flow_id: str = "") -> None:
        super().__init__(message, flow_id)
        self.flow_id = flow_id

    def __str__(self) -> str:
        return str(self.args[0])


class ListingError(EchoMQError, ValueError):
    """A read of flows asked for something it cannot give (an unknown state, a limit out of
    range); nothing was read."""


class CursorError(ListingError):
    """A page cursor that no read gave (``list_flows``, ``children_values``): nothing was read."""
