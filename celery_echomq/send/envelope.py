"""A flow job's message, built once per batch and reused: the jobs of a batch that differ
only in id and arguments share one message built by Celery (:class:`Template`); per job only
the id, ``correlation_id``, ``argsrepr``/``kwargsrepr``, the body and the delivery tag change.
"""

from __future__ import annotations

import os
import weakref
from datetime import datetime
from typing import Any

from celery import signals
from celery.utils.functional import maybe_list
from celery.utils.saferepr import saferepr
from kombu import serialization
from kombu.entity import Exchange, Queue

from celery_echomq.send.pushes import REDIS_TRANSPORT, RedisPushes

_serialize: Any = serialization.dumps

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
PER_MESSAGE = frozenset({"id", "root_id", "argsrepr", "kwargsrepr"})
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


def _same(a: Any, b: Any) -> bool:
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
        elif not _same(va, vb):
            return False
    return True


def publish_receivers() -> bool:
    """Whether anything listens to the signals Celery sends around each publish."""
    return bool(
        signals.before_task_publish.receivers
        or signals.after_task_publish.receivers
        or signals.task_sent.receivers
    )


class Template:
    """A message Celery and kombu built for one job, reused for the jobs of its group: the
    same task, options and routing, differing only in id, arguments and the values of their
    own plain headers. Each further job's message is the template's with its own ``id`` (and
    ``correlation_id``, and ``root_id`` where that defaulted to the id),
    ``argsrepr``/``kwargsrepr``, those headers, body and ``delivery_tag``, in the template's
    key order: the JSON ``as_task_v2`` and ``Producer.publish`` would give.
    """

    def __init__(
        self,
        key: tuple[Any, ...],
        message: dict[str, Any],
        serializer: str,
        list_key: Any,
        embed: dict[str, Any],
        own_root: bool,
        own_reprs: bool,
        varying: tuple[str, ...],
        queue: str,
        declared: list[Any],
    ) -> None:
        self.key = key
        self.message = message
        self.serializer = serializer
        self.list_key = list_key
        self.embed = embed
        self.own_root = own_root
        self.own_reprs = own_reprs
        self.varying = varying
        self.queue = queue
        # kombu's declaration cache (per connection) says whether a publish declares again:
        # the template stands for its message only while every entity it declared is there.
        self.idents = tuple(hash(entity) for entity in declared)
        # The batch (Templates.batch) in which valid_on last held.
        self.checked = -1

    def valid_on(self, channel: Any) -> bool:
        """Whether publishing through ``channel`` now gives this message: kombu would
        declare nothing (its cache has every entity), and the queue does not expire."""
        connection = channel.connection
        if connection is None:
            return False
        cached = connection.client.declared_entities
        if not all(ident in cached for ident in self.idents):
            return False
        expires = getattr(channel, "_expires", None)
        return not (expires and self.queue in expires)


class Templates:
    """The templates of one kombu channel, found by strict equality of their key; kept from
    one batch to the next while the process, the channel and the app's ``amqp`` are the same
    (a message names its process in ``origin``)."""

    # Templates kept per task name: a batch seldom mixes more than a few kinds of job of one
    # task; past this many, the oldest goes.
    PER_TASK = 4
    # Task names kept: past this many, the oldest name goes with its templates.
    TASKS = 64

    def __init__(self, amqp: Any) -> None:
        self.amqp = amqp
        self.pid = os.getpid()
        self.by_task: dict[Any, list[Template]] = {}
        self.maxlevels: Any = None
        self.batch = 0

    @classmethod
    def of(cls, app: Any, channel: Any) -> Templates:
        """The channel's templates, for one more batch (new ones after a fork or for another
        app)."""
        templates = TEMPLATES.get(channel)
        if templates is None or templates.pid != os.getpid() or templates.amqp is not app.amqp:
            templates = TEMPLATES[channel] = cls(app.amqp)
        templates.batch += 1
        templates.maxlevels = app.conf.task_repr_maxlevels
        return templates

    def learn(
        self,
        pushes: RedisPushes,
        key: tuple[Any, ...],
        task_id: str,
        named: dict[str, Any],
        routed: dict[str, Any],
        link: Any,
        link_error: Any,
        own_reprs: bool,
        varying: tuple[str, ...],
        declared: list[Any],
    ) -> None:
        """Keep the message just published for ``key``'s group, when a template can be it."""
        last = pushes.last
        if last is None:
            return
        message, serializer, commands = last
        # Time read per message (countdown, expires: eta and the broker TTL), or a header set
        # by the job itself where Celery writes the id: those are built per message.
        if named.get("countdown") or named.get("expires") is not None:
            return
        if PER_MESSAGE & (routed.get("headers") or {}).keys():
            return
        if len(commands) != 1 or commands[0][0] != "lpush" or len(commands[0][1]) != 2:
            return  # fanout, an expiring queue: built per message
        headers, properties = message["headers"], message["properties"]
        if headers.get("id") != task_id or properties.get("correlation_id") != task_id:
            return
        own_root = not (named.get("root_id") or routed.get("root_id"))
        if own_root and headers.get("root_id") != task_id:
            return
        if not all(name in headers for name in varying):
            return
        if not all(entity.can_cache_declaration for entity in declared):
            return  # kombu declares it again for every message
        embed = {
            "callbacks": maybe_list(link),
            "errbacks": maybe_list(link_error),
            "chain": named.get("chain"),
            "chord": named.get("chord"),
        }
        template = Template(
            key,
            message,
            serializer,
            commands[0][1][0],
            embed,
            own_root,
            own_reprs,
            varying,
            queue_of(routed),
            declared,
        )
        if key[0] not in self.by_task and len(self.by_task) >= self.TASKS:
            del self.by_task[next(iter(self.by_task))]
        found = self.by_task.setdefault(key[0], [])
        if len(found) >= self.PER_TASK:
            del found[0]
        template.checked = self.batch
        found.append(template)

    def push(
        self,
        pushes: RedisPushes,
        key: tuple[Any, ...],
        task_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        reprs: tuple[str, str] | None,
        headers_given: dict[str, Any] | None,
    ) -> bool:
        """Push the job's message from its group's template; False when it has none."""
        found = self.by_task.get(key[0])
        if not found:
            return False
        for template in found:
            if _same(key, template.key):
                break
        else:
            return False
        channel = pushes.channel
        if template.checked != self.batch:
            # Learnt in an earlier batch: still what a publish would give? (Once per batch:
            # nothing this batch does undeclares an entity.)
            if not template.valid_on(channel):
                found.remove(template)
                return False
            template.checked = self.batch
        base = template.message
        content_type, content_encoding, body = _serialize(
            (args, kwargs, template.embed), serializer=template.serializer
        )
        if content_type != base["content-type"] or content_encoding != base["content-encoding"]:
            return False
        headers = dict(base["headers"])
        headers["id"] = task_id
        if template.own_root:
            headers["root_id"] = task_id
        if template.own_reprs:
            if reprs is None:
                amqp = self.amqp
                reprs = (
                    saferepr(args, amqp.argsrepr_maxsize, maxlevels=self.maxlevels),
                    saferepr(kwargs, amqp.kwargsrepr_maxsize, maxlevels=self.maxlevels),
                )
            headers["argsrepr"], headers["kwargsrepr"] = reprs
        if template.varying and headers_given:
            for name in template.varying:
                headers[name] = headers_given[name]
        properties = dict(base["properties"])
        properties["correlation_id"] = task_id
        properties["delivery_tag"] = channel._next_delivery_tag()
        message = dict(base)
        message["body"], _ = channel.encode_body(body, channel.body_encoding)
        message["headers"] = headers
        message["properties"] = properties
        pushes.add("lpush", template.list_key, REDIS_TRANSPORT.dumps(message))
        return True


# The templates of each kombu channel (see Templates.of).
TEMPLATES: weakref.WeakKeyDictionary[Any, Templates] = weakref.WeakKeyDictionary()


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
