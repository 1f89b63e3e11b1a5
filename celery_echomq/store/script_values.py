"""What the script calls take and give: where a job's parent lives (:class:`ParentRef`), a
result to write for Celery (:class:`ResultWrite`), messages the enqueue pushes itself
(:class:`BrokerPushes`), a released parent handed out (:data:`Handed`), a child of a window
made pending (:class:`Freed`), and reading replies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack

from celery_echomq.store.codec import Stored, stored_of
from celery_echomq.store.connection import text
from celery_echomq.store.replies import Status
from celery_echomq.store.runner import Value

# The recent-flow index's bounds when a caller gives none (``install`` passes the app's
# result TTL and ``echomq_recent_flows``).
RECENT_TTL_MS = 86400 * 1000
RECENT_MAX = 10000


def packed(value: Any) -> bytes:
    """``value`` as one packed argument of a script, msgpack that the script reads with
    ``cmsgpack.unpack``: a list or a map of any size in one argument, rather than one argument
    per item (packing each costs the client more than the script's one unpack). In msgpack's
    older form, where a str and bytes are both raw strings: Redis's cmsgpack reads no other
    (it refuses the bin and str8 types of the newer one)."""
    return msgpack.packb(value, use_bin_type=False)  # type: ignore[no-any-return]


def packed_options(**options: Value | None) -> bytes:
    """A script's options as its last ARGV, one packed map (``lua/README.md``, "ARGV"): each
    given one (a string or bytes, as the positional ARGV are), keyed by its name in the
    script's header; None is not given, and is left out of the map, which the script reads as
    nil (a caller passes ``x or None`` where an empty value means none). No position is padded
    and none is read as ``''`` for being absent."""
    return packed({name: value for name, value in options.items() if value is not None})


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
    # "K/N": the parent is released by the K-th success of its N children (a quorum); ''.
    quorum: str = ""
    # The reducer its children's values are folded with (JSON, send/fan_in.py); ''.
    reduce: str = ""


@dataclass(frozen=True)
class ResultWrite:
    """A job's result for Celery's Redis backend, as ``RedisBackend._set`` would send it for a
    SUCCESS: SET (EX ``expires`` when set) of ``meta`` under ``key``, then PUBLISH of it on
    ``channel``. Every piece computed by wire/results.py: complete.lua writes them as given."""

    key: str
    meta: Value
    expires: int | None
    channel: str


@dataclass(frozen=True)
class BrokerPushes:
    """Messages for the enqueue script to push into the broker's database ``db`` of the
    store's own server: per message, the 1-based index of its list in ``lists``, and its JSON
    before and after the enqueue time the script writes between them."""

    db: int
    lists: list[str]
    messages: list[tuple[int, str, str]]


# A released parent handed to one caller to publish: its payload, and its children's values.
Handed = tuple[bytes, dict[str, bytes]]


class Freed(NamedTuple):
    """A child of a flow's window made pending by the transition that finished one of its
    siblings (``includes/window.lua``): the caller publishes it."""

    id: str
    stored: Stored
    since: int  # its pending score (the store's ms), which its message carries


def window_freed(reply: list[Any], freed: list[Freed] | None) -> list[Any]:
    """``reply`` without its window part (its last element, when a list: ``window``, the
    time, then id, payload, delta, parent per child), whose children go into ``freed``."""
    if not reply or not isinstance(reply[-1], list):
        return reply
    taken = reply[-1]
    now = int(taken[1])
    for i in range(2, len(taken), 4):
        cid, payload, delta, parent = taken[i : i + 4]
        stored = stored_of(payload, delta, parent)
        if freed is not None and stored is not None:
            freed.append(Freed(str(text(cid)), stored, now))
    return reply[:-1]
