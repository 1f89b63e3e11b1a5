"""What every script call shares: where a job's parent lives (:class:`ParentRef`), a result
to write for Celery (:class:`ResultWrite`), the parent's keys, and reading replies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from celery_echomq.store.codec import Stored, stored_of
from celery_echomq.store.connection import text
from celery_echomq.store.replies import Status
from celery_echomq.store.runner import ScriptRunner, Value

# The recent-flow index's bounds when a caller gives none (``install`` passes the app's
# result TTL and ``echomq_recent_flows``).
RECENT_TTL_MS = 86400 * 1000
RECENT_MAX = 10000


def status_of(value: Any) -> Status:
    return Status(text(value))


def stored_children(reply: Sequence[Any], parent_id: str) -> list[tuple[str, Stored]]:
    """``(id, stored job)`` from a retry script's flat reply ``id, payload, delta, input, ...``
    (includes/repend.lua)."""
    found = []
    for i in range(0, len(reply), 4):
        stored = stored_of(reply[i + 1], reply[i + 2], parent_id, reply[i + 3])
        if stored is not None:
            found.append((text(reply[i]), stored))
    return found


@dataclass(frozen=True)
class ParentRef:
    """Where a job's parent lives: its id and the queue whose slot holds its keys."""

    id: str
    queue: str


@dataclass(frozen=True)
class ResultWrite:
    """A job's result for Celery's Redis backend, as ``RedisBackend._set`` would send it for a
    SUCCESS: SET (EX ``expires`` when set) and PUBLISH of ``meta`` under ``key``."""

    key: str
    meta: Value
    expires: int | None


@dataclass(frozen=True)
class BrokerPushes:
    """Messages for the enqueue script to push into the broker's database ``db`` of the
    store's own server: per message, the 1-based index of its list in ``lists``, and its JSON
    before and after the enqueue time the script writes between them."""

    db: int
    lists: list[str]
    messages: list[tuple[int, str, str]]


class ScriptsBase(ScriptRunner):
    """Bound to one Redis client and one keyspace: what the script calls build on."""

    # (queue, priority) -> a claim mark this process has seen the queue reach. Marks only
    # grow, so a claim of a job pending since no later than that need not read them (the
    # children of one flow share one pending time: one read per flow and process, not per
    # child). A stale value (marks deleted) only leaves a mark lower, which delays recovery's
    # evidence and never makes a false one.
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._known_marks: dict[tuple[str, int], int] = {}

    def held_keys(self, queue: str, parent_id: str, entry: str = "pending") -> list[str]:
        """The first eight KEYS of the scripts that settle a whole flow on its slot (retry_flow,
        abandon_flow, deadline, retry_deadline): its row, counter, values, ignored errors and
        cross-slot credits, then its queue's ``entry`` set, failed set and counters."""
        keys = self.keys
        return [
            keys.job_key(queue, parent_id),
            *keys.flow_keys(queue, parent_id),
            keys.settled_key(queue, parent_id),
            keys.queue_key(queue, entry),
            keys.queue_key(queue, "failed"),
            keys.queue_key(queue, "counters"),
        ]

    def _parent_keys(self, parent: ParentRef | None, *names: str) -> list[str]:
        if parent is None:
            return []
        row = self.keys.job_key(parent.queue, parent.id)
        deps, processed, ignored = self.keys.flow_keys(parent.queue, parent.id)
        known = {
            "row": row,
            "dependencies": deps,
            "processed": processed,
            "ignored": ignored,
            "pending": self.keys.queue_key(parent.queue, "pending"),
            "failed": self.keys.queue_key(parent.queue, "failed"),
            "counters": self.keys.queue_key(parent.queue, "counters"),
        }
        return [known[name] for name in names]
