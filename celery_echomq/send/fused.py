"""One round trip for a small flow: its enqueue script pushes the children's messages too.

Where the broker is kombu's Redis transport on the flow store's own server (any database of
it), a flow of one level whose children's messages can all be built from templates (every
flow of a shape after the first one this process sent, see ``envelope.py``) has them built
before its enqueue, and ``enqueue_flow`` LPUSHes them into the broker's database after its
own writes. The flow lands with its messages or not at all: a refused flow returns before any
write, so it publishes nothing, and no crash leaves a landed flow whose children were never
published. Everywhere else the messages are published after the enqueue, as before.

Each message carries the time its children became pending (``echomq_t``), which only the
script knows: the message is built with a mark there, and the script writes its time in its
place.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from celery_echomq.send.publish import built_pushes
from celery_echomq.send.pushes import client_of
from celery_echomq.store.headers import H_SINCE
from celery_echomq.store.results import database_on_store_server
from celery_echomq.store.script_values import BrokerPushes
from celery_echomq.store.state import EchoMQ

# The enqueue time a prepared message carries until the script writes its own.
SINCE_MARK = -1
_MARK = f'"{H_SINCE}": {SINCE_MARK}'
_VALUE_AT = len(_MARK) - len(str(SINCE_MARK))

# kombu channel -> the broker's database on the store's server, or None (asked once a channel).
_databases: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()


def _broker_database(state: EchoMQ, channel: Any) -> int | None:
    try:
        return _databases[channel]
    except KeyError:
        pass
    try:
        found = database_on_store_server(state, client_of(channel))
    except Exception:  # an unusual transport client: publish after the enqueue, as always
        found = None
    _databases[channel] = found
    return found


def prepare(
    state: EchoMQ, jobs: Iterable[dict[str, Any]], alike: Sequence[bool] = ()
) -> BrokerPushes | None:
    """The messages of ``jobs`` (each with :data:`SINCE_MARK` as its ``echomq_t`` header) for
    the enqueue script to push, or None where they must be published after it. ``alike``:
    per job, whether its task and options are those of every other job marked so, its id
    aside (as its encoding found: ``Encoded.alike``)."""
    if state.settings.min_replicas:
        return None  # the publish waits for the replicas, after the enqueue
    built = built_pushes(state.app, jobs, lambda channel: _broker_database(state, channel), alike)
    if built is None:
        return None
    database, pushes = built
    lists: dict[str, int] = {}
    messages: list[tuple[int, str, str]] = []
    for key, message in pushes:
        at = message.find(_MARK)
        if at < 0 or message.find(_MARK, at + 1) >= 0:
            return None  # not JSON as kombu writes it: publish as always
        index = lists.setdefault(key, len(lists) + 1)
        messages.append((index, message[: at + _VALUE_AT], message[at + len(_MARK) :]))
    return BrokerPushes(database, list(lists), messages)
