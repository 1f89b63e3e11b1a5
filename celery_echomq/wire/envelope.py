"""What building a flow job's message reads: the ``send_task`` options that become message
fields, argument reprs, the broker TTL, the headers a template sets per message, strict
equality of message inputs, and how a template is keyed (``templates.py`` keeps them).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from celery import signals
from kombu.entity import Exchange, Queue

# The send_task arguments that become fields of the message rather than routing options.
MESSAGE_OPTIONS = (
    "countdown",
    "eta",
    "expires",
    "group_id",
    "group_index",
    "retries",
    "chord",
    "reply_to",
    "time_limit",
    "soft_time_limit",
    "root_id",
    "parent_id",
    "shadow",
    "chain",
    "replaced_task_nesting",
)


# Values whose repr is exactly Celery's saferepr, cheap, and short: a job's args and kwargs
# made only of these get their argsrepr/kwargsrepr from repr (saferepr walks every value
# through a generator of tokens: a sixth of a flow's enqueue for small arguments).
_PLAIN = (bool, float, type(None))
_PLAIN_MAX = 16  # items; with each item short, the repr stays far below Celery's 1024 limit


def _plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, int):
        return -(10**18) < value < 10**18
    # saferepr writes quotes and backslashes inside strings its own way: those take its path.
    return (
        isinstance(value, str)
        and len(value) <= 40
        and value.isascii()
        and value.isprintable()
        and "'" not in value
        and "\\" not in value
    )


def fast_repr(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, str] | None:
    """``(argsrepr, kwargsrepr)`` by plain repr when that is what saferepr would give."""
    if len(args) > _PLAIN_MAX or len(kwargs) > _PLAIN_MAX:
        return None
    if not all(_plain(a) for a in args):
        return None
    if not all(isinstance(k, str) and _plain(k) and _plain(v) for k, v in kwargs.items()):
        return None
    return repr(args), repr(kwargs)


def expiration_of(app: Any, expires: Any) -> float | None:
    """The broker TTL ``send_task`` derives from ``expires`` (0 for a time in the past)."""
    if expires is None:
        return None
    if isinstance(expires, str):
        expires = datetime.fromisoformat(expires)
    if isinstance(expires, datetime):
        seconds = float((expires - app.now()).total_seconds())
    else:
        seconds = float(expires)
    return max(seconds, 0.0)


# The header values that differ between the messages of one template (the rest is the same
# for every job of the group); a job whose own headers set one of them takes no template.
# ``group``/``group_index``: a chord's header tasks (celery_echomq/chords.py) each carry
# their chord's group id and their own place in it.
PER_MESSAGE = frozenset(
    {"id", "root_id", "parent_id", "argsrepr", "kwargsrepr", "group", "group_index"}
)
# Every header Celery writes itself (as_task_v2). A job's own header of another name whose
# value is a str or an int is copied into the message as it is: it may differ between the
# jobs of one template (a flow's children name their flow's parent), and is set per message.
CELERY_HEADERS = frozenset(
    {
        "lang", "task", "id", "shadow", "eta", "expires", "group", "group_index", "retries",
        "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin",
        "ignore_result", "replaced_task_nesting", "stamped_headers", "stamps",
    }
)  # fmt: skip
# Stands for a header value set per message, in a template's key.
PER_JOB = object()


_SCALARS = frozenset({str, int, float, bool, bytes, type(None)})


def same(a: Any, b: Any) -> bool:
    """Equal and encoded alike: same types and key order; other objects only when identical
    (``1 == True`` and ``{"a": 1, "b": 2} == {"b": 2, "a": 1}``, yet they encode apart).
    Written out rather than recursing per value: it runs for every job of a batch."""
    if a is b:
        return True
    kind = type(a)
    if kind is not type(b):
        return False
    if kind in _SCALARS:
        return bool(a == b)
    if isinstance(a, dict):  # a Signature too: JSON encodes its items alone
        if len(a) != len(b):
            return False
        pairs = zip(a.items(), b.items(), strict=True)
    elif kind is list or kind is tuple:
        if len(a) != len(b):
            return False
        pairs = zip(enumerate(a), enumerate(b), strict=True)
    else:
        # The router's Queue (and its Exchange) may be a new object per job: kombu's equality
        # compares what routing and the message read from it (name, exchange type and
        # delivery mode, routing key, arguments).
        return isinstance(a, Queue | Exchange) and bool(a == b)
    for (ka, va), (kb, vb) in pairs:
        if ka != kb or type(ka) is not type(kb):
            return False
        if va is vb:
            continue
        value_kind = type(va)
        if value_kind is not type(vb):
            return False
        if value_kind in _SCALARS:
            if va != vb:
                return False
        elif not same(va, vb):
            return False
    return True


def publish_receivers() -> bool:
    """Whether anything listens to the signals Celery sends around each publish."""
    return bool(
        signals.before_task_publish.receivers
        or signals.after_task_publish.receivers
        or signals.task_sent.receivers
    )


def queue_of(routed: dict[str, Any]) -> str:
    queue = routed.get("queue")
    return str(getattr(queue, "name", queue))


def key_routing(routed: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``routed`` as a template's key holds it ("declare" aside: the job the template was
    made from declared its queue), and the names of the job's own headers whose values are
    set per message: there, the key holds a marker instead of the value."""
    headers = routed.get("headers")
    varying: tuple[str, ...] = ()
    if isinstance(headers, dict):
        varying = tuple(
            name
            for name, value in headers.items()
            if name not in CELERY_HEADERS and (type(value) is str or type(value) is int)
        )
    if not varying and "declare" not in routed:
        return routed, ()
    keyed = {k: v for k, v in routed.items() if k != "declare"}
    if varying and isinstance(headers, dict):
        keyed["headers"] = {
            name: PER_JOB if name in varying else value for name, value in headers.items()
        }
    return keyed, varying
