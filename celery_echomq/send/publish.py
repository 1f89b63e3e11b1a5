"""Send stored job dicts to the broker: one producer, one batch, no per-message overhead.

This builds each message exactly as ``Task.apply_async`` -> ``app.send_task`` would (the
task's own option defaults, root and parent ids, routing, ``before/after_task_publish``
signals) but leaves out what a flow does not need per child: a Signature, a Task and an
AsyncResult object, and the result backend's subscription to every child's result (the
producer never waits on a child: the parent does, through Redis). ``AsyncResult(child).get()``
still works; it subscribes when called. A custom ``Task.apply_async`` or ``shadow_name`` is
not called for flow jobs.

On kombu's Redis transport (kombu >= 5.7, whose transport batches), the messages do not go
through ``Producer.publish`` one by one: :class:`RedisPushes` takes kombu's own steps for each
and sends every queue's messages in one LPUSH of one pipeline, and the jobs of a batch that
differ only in id and arguments share one message built by Celery (:class:`Template`). The
bytes a worker reads are the same (a random ``delivery_tag`` aside). Elsewhere (another
transport, ``task_send_sent_event``, a caller's own ``Producer.batch()``), the producer
publishes them in one ``Producer.batch()``; with ``before/after_task_publish`` receivers, the
signals are sent per message and no template is used.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from celery import signals
from celery.utils.functional import maybe_list
from celery.utils.saferepr import saferepr
from kombu import serialization
from kombu.entity import Exchange, Queue


def _redis_transport() -> Any:
    try:
        from kombu.transport import redis as transport
    except ImportError:  # pragma: no cover - kombu's Redis transport needs redis-py
        return None
    return transport


REDIS_TRANSPORT: Any = _redis_transport()
_serialize: Any = serialization.dumps

try:
    from celery.app.amqp import _callback_publish_retry
except ImportError:  # a Celery that does not retry a worker's callback publishes
    _callback_publish_retry = None

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


def _fast_repr(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, str] | None:
    """``(argsrepr, kwargsrepr)`` by plain repr when that is what saferepr would give."""
    if len(args) > _PLAIN_MAX or len(kwargs) > _PLAIN_MAX:
        return None
    if not all(_plain(a) for a in args):
        return None
    if not all(isinstance(k, str) and _plain(k) and _plain(v) for k, v in kwargs.items()):
        return None
    return repr(args), repr(kwargs)


def _batch(producer: Any) -> contextlib.AbstractContextManager[Any]:
    batch = getattr(producer, "batch", None)
    return batch() if batch is not None else contextlib.nullcontext()


def _expiration(app: Any, expires: Any) -> float | None:
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


# Values one LPUSH carries at most: a flow of 10,000 children is ten commands, not one
# 10,000-argument command held whole in Redis's query buffer.
PUSH_CHUNK = 1000


class RedisPushes:
    """A stand-in for kombu's ``Producer`` (its ``publish`` alone) on kombu's Redis transport:
    each message is built by the same kombu steps ``Producer.publish`` takes (serialize,
    ``prepare_message``, declare, the channel's ``basic_publish`` down to ``_put``), and the
    final Redis commands are collected instead of sent; :meth:`flush` sends them in one
    pipeline, each queue's messages in one LPUSH.

    What a worker reads is what ``Producer.publish`` inside ``Producer.batch()`` leaves: the
    same JSON per message (its random ``delivery_tag`` aside), in the same order per list.
    Skipped: kombu's per-message layers (``Connection.ensure``, the batch session) and one
    command per message. Taken only where :meth:`of` finds it exact; else ``send_jobs``
    publishes through the producer as before.
    """

    def __init__(self, producer: Any, channel: Any) -> None:
        self.producer = producer
        self.channel = channel
        self.commands: list[tuple[str, tuple[Any, ...]]] = []
        # The last message published, for a Template: (message dict as pushed, serializer,
        # the commands it added), or None when it cannot be one (compressed, pre-serialized).
        self.last: tuple[dict[str, Any], str, list[tuple[str, tuple[Any, ...]]]] | None = None
        # The entities the last message declared (kombu's cache decides whether it does).
        self.last_declared: list[Any] = []

    @classmethod
    def of(cls, app: Any, producer: Any) -> RedisPushes | None:
        """The stand-in for ``producer``, or None where publishing through it would differ."""
        if app.conf.task_send_sent_event:
            return None  # the task-sent event is published through the producer itself
        if _callback_publish_retry is not None and _callback_publish_retry.get():
            return None  # a worker's callback publish retries each message on its own
        if REDIS_TRANSPORT is None or not hasattr(producer, "batch"):
            return None
        if getattr(producer._batch_local, "current", None) is not None:
            return None  # inside the caller's own batch: its messages stay in its order
        channel = producer.channel
        # The kombu versions whose Redis transport batches: _put takes the collector below
        # (an older one would ignore it and LPUSH at once). Where the transport may retry a
        # pipeline (retry_on_timeout), kombu does not batch, and neither does this.
        if not isinstance(channel, REDIS_TRANSPORT.Channel):
            return None
        if not hasattr(channel, "create_publish_batch"):
            return None
        if not channel.supports_batch_publish:
            return None
        return cls(producer, channel)

    def publish(
        self,
        body: Any,
        routing_key: str | None = None,
        delivery_mode: Any = None,
        mandatory: bool = False,
        immediate: bool = False,
        priority: int = 0,
        content_type: str | None = None,
        content_encoding: str | None = None,
        serializer: str | None = None,
        headers: dict[str, Any] | None = None,
        compression: str | None = None,
        exchange: Any = None,
        retry: bool = False,
        retry_policy: dict[str, Any] | None = None,
        declare: list[Any] | None = None,
        expiration: float | None = None,
        timeout: float | None = None,
        confirm_timeout: float | None = None,
        **properties: Any,
    ) -> None:
        """kombu's ``Producer.publish`` then ``Producer._publish``, step for step."""
        producer, channel = self.producer, self.channel
        declare = [] if declare is None else declare
        headers = {} if headers is None else headers
        retry_policy = {} if retry_policy is None else retry_policy
        routing_key = producer.routing_key if routing_key is None else routing_key
        compression = producer.compression if compression is None else compression
        exchange_name, properties["delivery_mode"] = producer._delivery_details(
            exchange or producer.exchange, delivery_mode
        )
        if expiration is not None:
            properties["expiration"] = str(int(expiration * 1000))
        serialized_here = content_type is None
        body, content_type, content_encoding = producer._prepare(
            body, serializer, content_type, content_encoding, compression, headers
        )
        if producer.auto_declare and producer.exchange.name and producer.exchange not in declare:
            declare.append(producer.exchange)
        message = channel.prepare_message(
            body, priority, content_type, content_encoding, headers, properties
        )
        for entity in declare:
            # Binds the queue (_kombu.binding.*) once per connection, as kombu does.
            producer.maybe_declare(entity, retry=retry, **retry_policy)
        self.last_declared = declare
        reply_to = properties.get("reply_to")
        if isinstance(reply_to, Queue):
            properties["reply_to"] = reply_to.name
        first = len(self.commands)
        channel.basic_publish(
            message,
            exchange=exchange_name,
            routing_key=routing_key,
            mandatory=mandatory,
            immediate=immediate,
            timeout=timeout,
            confirm_timeout=confirm_timeout,
            _publish_batch=self,
        )
        self.last = None
        if serialized_here and not compression:
            self.last = (message, serializer or producer.serializer, self.commands[first:])

    def add(self, name: str, *args: Any) -> None:
        """What the channel's ``_put``/``_put_fanout`` would send: kept for :meth:`flush`."""
        self.commands.append((name, args))

    def flush(self) -> None:
        """Send the collected commands in one pipeline: each list's values in one LPUSH
        (chunked), in the order they came, which leaves each list as one LPUSH per message
        would; a queue's PEXPIREs (an ``x-expires`` queue) once, after its pushes."""
        pushes: dict[Any, list[Any]] = {}
        others: list[tuple[str, tuple[Any, ...]]] = []
        for name, args in self.commands:
            if name == "lpush" and len(args) == 2:
                pushes.setdefault(args[0], []).append(args[1])
            elif name != "pexpire" or (name, args) not in others:
                others.append((name, args))
        self.commands = []
        if not pushes and not others:
            return
        with _client(self.channel).pipeline(transaction=False) as pipe:
            for key, values in pushes.items():
                for start in range(0, len(values), PUSH_CHUNK):
                    pipe.lpush(key, *values[start : start + PUSH_CHUNK])
            for name, args in others:
                getattr(pipe, name)(*args)
            try:
                pipe.execute()
            except Exception as exc:
                # As kombu's batch reports it: some pushes may have landed. Imported here: the
                # kombu versions without it (before 5.7) never take this path (of() above).
                from kombu.exceptions import BatchPublishError

                raise BatchPublishError(
                    "Redis publish batch failed; delivery is uncertain"
                ) from exc


# A redis-py client per kombu channel, on the channel's own connection pool: what kombu's
# conn_or_acquire() gives, without building a client object per batch (a fifth of a small
# flow's publish).
_CLIENTS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _client(channel: Any) -> Any:
    client = _CLIENTS.get(channel)
    if client is None:
        with channel.conn_or_acquire() as client:
            _CLIENTS[channel] = client
    return client


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
_PER_JOB = object()


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


def _publish_receivers() -> bool:
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
        templates = _TEMPLATES.get(channel)
        if templates is None or templates.pid != os.getpid() or templates.amqp is not app.amqp:
            templates = _TEMPLATES[channel] = cls(app.amqp)
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
            _queue_name(routed),
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
_TEMPLATES: weakref.WeakKeyDictionary[Any, Templates] = weakref.WeakKeyDictionary()


def _queue_name(routed: dict[str, Any]) -> str:
    queue = routed.get("queue")
    return str(getattr(queue, "name", queue))


def _key_routing(routed: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
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
            name: _PER_JOB if name in varying else value for name, value in headers.items()
        }
    return keyed, varying


def send_jobs(app: Any, jobs: Iterable[dict[str, Any]]) -> None:
    """Publish each job dict (task, args, kwargs, options with ``task_id``) in one batch."""
    with app.producer_or_acquire(None) as producer:
        pushes = RedisPushes.of(app, producer)
        if pushes is None:
            with _batch(producer):
                _send(app, producer, jobs)
        else:
            _send(app, pushes, jobs)
            pushes.flush()


def _send(app: Any, producer: Any, jobs: Iterable[dict[str, Any]]) -> None:
    amqp = app.amqp
    current = app.current_worker_task
    sent_event = app.conf.task_send_sent_event
    templates = None
    pushes = producer if isinstance(producer, RedisPushes) else None
    if pushes is not None and not _publish_receivers():
        templates = Templates.of(app, pushes.channel)
    # The entities each queue's first message of the batch declared.
    declared: dict[str, list[Any]] = {}
    task_defaults: dict[str, dict[str, Any]] = {}
    for job in jobs:
        name = job["task"]
        args, kwargs = tuple(job["args"]), dict(job["kwargs"])
        options = dict(job["options"])
        task = app.tasks.get(name)
        if task is not None:
            # What Task.apply_async adds: the task's own defaults under the job's options
            # (read once per task and batch: a dozen descriptor reads each).
            defaults = task_defaults.get(name)
            if defaults is None:
                defaults = task_defaults[name] = {
                    k: v for k, v in task._get_exec_options().items() if v is not None
                }
            options = {**defaults, **options}
            options.setdefault("ignore_result", task.ignore_result)
            if task.priority:
                options.setdefault("priority", task.priority)
        task_id = options.pop("task_id")
        link, link_error = options.pop("link", None), options.pop("link_error", None)
        ignore_result = options.pop("ignore_result", None)
        named = {k: options.pop(k) for k in MESSAGE_OPTIONS if k in options}
        if current is not None:
            named.setdefault("root_id", current.request.root_id or current.request.id)
            named.setdefault("parent_id", current.request.id)
        named.setdefault("reply_to", app.thread_oid)
        expiration = _expiration(app, named.get("expires"))
        if expiration is not None:
            options["expiration"] = expiration
        routed = amqp.router.route(options, name, args, kwargs, task)
        reprs = _fast_repr(args, kwargs)
        own_reprs = not {"argsrepr", "kwargsrepr"} & (routed.keys() | named.keys())
        key: tuple[Any, ...] = ()
        varying: tuple[str, ...] = ()
        if templates is not None:
            # Everything the message is built from but the id, the arguments and the values
            # of the job's own plain headers.
            keyed, varying = _key_routing(routed)
            key = (name, ignore_result, link, link_error, named, keyed)
            if templates.push(
                producer,
                key,
                task_id,
                args,
                kwargs,
                reprs if own_reprs else None,
                routed.get("headers"),
            ):
                continue
        queue_name = _queue_name(routed)
        first = queue_name not in declared
        if not first:
            # Declared by an earlier message of this batch: kombu would copy and re-bind
            # the Queue entity for every message before its cache answers.
            routed = {**routed, "declare": []}  # a copy: a template's key holds the dict
        given = dict(named)
        if reprs is not None and own_reprs:
            given["argsrepr"], given["kwargsrepr"] = reprs
        message = amqp.create_task_message(
            task_id,
            name,
            args,
            kwargs,
            callbacks=maybe_list(link),
            errbacks=maybe_list(link_error),
            create_sent_event=sent_event,
            ignore_result=ignore_result,
            **given,
            **routed,
        )
        amqp.send_task_message(producer, name, message, **routed)
        if pushes is not None:
            if first:
                declared[queue_name] = list(pushes.last_declared)
            if templates is not None:
                templates.learn(
                    pushes,
                    key,
                    task_id,
                    named,
                    routed,
                    link,
                    link_error,
                    own_reprs,
                    varying,
                    [*declared[queue_name], *pushes.last_declared],
                )
        else:
            declared.setdefault(queue_name, [])


def _without(options: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k != name} if name in options else options
