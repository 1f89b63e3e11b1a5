"""kombu's own steps for each message, its LPUSH collected: every queue's messages of a batch
go in one LPUSH (chunked) of one pipeline, on kombu's Redis transport (kombu >= 5.7)."""

from __future__ import annotations

import weakref
from typing import Any

from kombu.entity import Queue


def _redis_transport() -> Any:
    try:
        from kombu.transport import redis as transport
    except ImportError:  # pragma: no cover - kombu's Redis transport needs redis-py
        return None
    return transport


REDIS_TRANSPORT: Any = _redis_transport()

try:
    from celery.app.amqp import _callback_publish_retry
except ImportError:  # a Celery that does not retry a worker's callback publishes
    _callback_publish_retry = None


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
        with client_of(self.channel).pipeline(transaction=False) as pipe:
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


def client_of(channel: Any) -> Any:
    """The redis-py client kombu's ``channel`` publishes with (one per channel)."""
    client = _CLIENTS.get(channel)
    if client is None:
        with channel.conn_or_acquire() as client:
            _CLIENTS[channel] = client
    return client
