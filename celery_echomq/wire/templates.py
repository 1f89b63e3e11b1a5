"""Templates: a message Celery and kombu built for one job, kept and reused for the further jobs
of its group (the same task, options and routing): per job only the id, ``correlation_id``,
``argsrepr``/``kwargsrepr``, the group id and index (a chord's header tasks), the job's own
plain headers, the body and the delivery tag change. Found by strict equality of their key
(:func:`~.envelope.same`).

A template's message as JSON text in pieces, prepared once: a further job's message is the
pieces joined around its own values (body, id, root and parent ids, reprs, headers, delivery
tag, group id and index), instead of its whole dict copied and encoded again for every job.

The pieces come from encoding the template's message with a marker in each place a job's own
value goes; they are kept only when joining them around the template's own values gives back
exactly the JSON that was pushed for it, so a message built from them is the one kombu would
have written.
"""

from __future__ import annotations

import operator
import os
import re
from json.encoder import encode_basestring_ascii as quoted
from typing import Any

from celery.utils.functional import maybe_list
from celery.utils.saferepr import saferepr

from celery_echomq.store.codec import serialize
from celery_echomq.store.keyspace import uuid4_hex
from celery_echomq.store.state import get_state
from celery_echomq.wire.envelope import PER_MESSAGE, queue_of, same
from celery_echomq.wire.pushes import REDIS_TRANSPORT, RedisPushes

__all__ = ["Prepared", "quoted", "token"]


# A setting not read yet.
_UNREAD = object()

# kombu's own delivery tag: a uuid4 as text, made per message.
_KOMBU_TAG = getattr(getattr(REDIS_TRANSPORT, "Channel", None), "_next_delivery_tag", None)


def _delivery_tag(channel: Any) -> str:
    """The delivery tag kombu's channel would give the message (a random uuid4's text)."""
    if _KOMBU_TAG is None or type(channel)._next_delivery_tag is not _KOMBU_TAG:
        return str(channel._next_delivery_tag())
    h = uuid4_hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class Template:
    """A message Celery and kombu built for one job, reused for the jobs of its group: the
    same task, options and routing, differing only in id, arguments and the values of their
    own plain headers. Each further job's message is the template's with its own ``id`` (and
    ``correlation_id``), ``root_id`` (its flow's root, or the id where it has none),
    ``parent_id`` (the task that sent it, or a chain's step before it),
    ``argsrepr``/``kwargsrepr``, ``group``/``group_index`` (a chord's header task: its
    chord's group and its place in it), those headers, body and ``delivery_tag``, in the
    template's key order: the JSON ``as_task_v2`` and ``Producer.publish`` would give.
    """

    def __init__(
        self,
        key: tuple[Any, ...],
        message: dict[str, Any],
        serializer: str,
        list_key: Any,
        embed: dict[str, Any],
        own_reprs: bool,
        varying: tuple[str, ...],
        queue: str,
        declared: list[Any],
        sent: Any = None,
    ) -> None:
        self.key = key
        self.message = message
        self.serializer = serializer
        self.list_key = list_key
        self.embed = embed
        self.own_reprs = own_reprs
        self.varying = varying
        self.queue = queue
        # kombu's declaration cache (per connection) says whether a publish declares again:
        # the template stands for its message only while every entity it declared is there.
        self.idents = tuple(hash(entity) for entity in declared)
        # The batch (Templates.batch) in which valid_on last held.
        self.checked = -1
        # Its JSON in pieces (``sent``: the JSON pushed for it), and the values of its own
        # headers, for a job that gives none of them.
        self.prepared: Prepared | None = None
        self.defaults: dict[str, str] = {}
        # The pieces with the values the last job's message shared with its siblings filled
        # in, and those values (the job's root, parent, group and headers: see shared_values).
        self.bound: tuple[tuple[Any, ...], Prepared] | None = None
        try:
            self.prepared = Prepared.of(message, own_reprs, varying, sent)
            self.defaults = {f"h:{name}": token(message["headers"][name]) for name in varying}
        except (KeyError, TypeError, ValueError):  # an unusual message: encoded whole
            self.prepared = None

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
        self.maxlevels: Any = _UNREAD
        self.batch = 0

    @classmethod
    def of(cls, app: Any, channel: Any) -> Templates:
        """The channel's templates, for one more batch (new ones after a fork or for another
        app)."""
        kept = get_state(app).message_templates
        templates = kept.get(channel)
        if templates is None or templates.pid != os.getpid() or templates.amqp is not app.amqp:
            templates = kept[channel] = cls(app.amqp)
        templates.batch += 1
        templates.maxlevels = _UNREAD  # read where a repr needs it, once a batch
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
        if routed.get("root_id") or headers.get("root_id") != (named.get("root_id") or task_id):
            return
        if routed.get("parent_id") or headers.get("parent_id") != named.get("parent_id"):
            return
        group = (named.get("group_id"), named.get("group_index"))
        if not is_group(*group) or (headers.get("group"), headers.get("group_index")) != group:
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
            own_reprs,
            varying,
            queue_of(routed),
            declared,
            commands[0][1][1],
        )
        if key[0] not in self.by_task and len(self.by_task) >= self.TASKS:
            del self.by_task[next(iter(self.by_task))]
        found = self.by_task.setdefault(key[0], [])
        if len(found) >= self.PER_TASK:
            del found[0]
        template.checked = self.batch
        found.append(template)

    def find(self, key: tuple[Any, ...]) -> Template | None:
        """The template of ``key``'s group, if one was learnt."""
        for template in self.by_task.get(key[0]) or ():
            if same(key, template.key):
                return template
        return None

    def push(
        self,
        pushes: RedisPushes,
        template: Template,
        task_id: str,
        root_id: str | None,
        parent_id: str | None,
        group_id: Any,
        group_index: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        reprs: tuple[str, str] | None,
        headers_given: dict[str, Any] | None,
    ) -> bool:
        """Push the job's message built from ``template`` (``root_id``: the job's, None where
        it is its own root; ``parent_id``: the job's, None for none; ``group_id`` and
        ``group_index``: the job's, None for none); False where it cannot be (the template no
        longer stands for what a publish would give: it is dropped; or the job's group is of
        a type only Celery encodes)."""
        if not is_group(group_id, group_index):
            return False
        channel = pushes.channel
        if not self._current(template, channel):
            return False
        base = template.message
        content_type, content_encoding, body = serialize(
            (args, kwargs, template.embed), template.serializer
        )
        if content_type != base["content-type"] or content_encoding != base["content-encoding"]:
            return False
        if template.own_reprs and reprs is None:
            reprs = self._reprs(args, kwargs)
        encoded, _ = channel.encode_body(body, channel.body_encoding)
        tag = _delivery_tag(channel)
        prepared = template.prepared
        if prepared is not None:
            per_job = _per_job(template, encoded, task_id, root_id, reprs, tag)
            given: tuple[Any, ...] = ()
            if template.varying and headers_given:
                given = tuple(headers_given[name] for name in template.varying)
            shared = (root_id, parent_id, group_id, group_index, *given)
            bound = template.bound
            if bound is None or not _identical(bound[0], shared):
                values = shared_values(template, root_id, parent_id, group_id, group_index, given)
                bound = template.bound = (shared, prepared.bind(values))
            pushes.add("lpush", template.list_key, bound[1].render(per_job))
            return True
        headers = dict(base["headers"])
        headers["id"] = task_id
        headers["root_id"] = root_id or task_id
        headers["parent_id"] = parent_id
        headers["group"], headers["group_index"] = group_id, group_index
        if reprs is not None and template.own_reprs:
            headers["argsrepr"], headers["kwargsrepr"] = reprs
        if template.varying and headers_given:
            for name in template.varying:
                headers[name] = headers_given[name]
        properties = dict(base["properties"])
        properties["correlation_id"] = task_id
        properties["delivery_tag"] = tag
        message = dict(base)
        message["body"] = encoded
        message["headers"] = headers
        message["properties"] = properties
        pushes.add("lpush", template.list_key, REDIS_TRANSPORT.dumps(message))
        return True

    def push_again(
        self,
        pushes: RedisPushes,
        template: Template,
        task_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        reprs: tuple[str, str] | None,
    ) -> bool:
        """Push the message of a job whose task and options are those of the job pushed from
        ``template`` just before it (its caller compared them), its id aside: the same root,
        parent, group and headers, bound in the template already (:meth:`push` checked them
        for that job, in this batch); its own body, id, reprs and delivery tag. False where
        :meth:`push` must build it (no prepared JSON, or none bound in this batch)."""
        bound = template.bound
        if bound is None or template.checked != self.batch:
            return False
        _, _, body = serialize((args, kwargs, template.embed), template.serializer)
        if template.own_reprs and reprs is None:
            reprs = self._reprs(args, kwargs)
        channel = pushes.channel
        encoded, _ = channel.encode_body(body, channel.body_encoding)
        tag = _delivery_tag(channel)
        per_job = _per_job(template, encoded, task_id, bound[0][0], reprs, tag)
        pushes.add("lpush", template.list_key, bound[1].render(per_job))
        return True

    def _current(self, template: Template, channel: Any) -> bool:
        """Whether ``template`` still stands for what a publish on ``channel`` would give;
        one that no longer does is dropped. Asked once per batch (nothing a batch does
        undeclares an entity)."""
        if template.checked == self.batch:
            return True
        if not template.valid_on(channel):
            found = self.by_task.get(template.key[0]) or []
            if template in found:
                found.remove(template)
            return False
        template.checked = self.batch
        return True

    def _maxlevels(self) -> Any:
        """The app's ``task_repr_maxlevels``, read the first time a batch needs it."""
        if self.maxlevels is _UNREAD:
            # Celery before 5.7 has no such setting: its amqp keeps saferepr's depth, 3.
            self.maxlevels = self.amqp.app.conf.get("task_repr_maxlevels", 3)
        return self.maxlevels

    def _reprs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, str]:
        """The job's ``argsrepr`` and ``kwargsrepr``, as Celery's amqp writes them."""
        amqp, maxlevels = self.amqp, self._maxlevels()
        return (
            saferepr(args, amqp.argsrepr_maxsize, maxlevels=maxlevels),
            saferepr(kwargs, amqp.kwargsrepr_maxsize, maxlevels=maxlevels),
        )


def _per_job(
    template: Template,
    encoded: str,
    task_id: str,
    root_id: str | None,
    reprs: tuple[str, str] | None,
    tag: str,
) -> dict[str, str]:
    """The JSON tokens of a message's own values: its body, id (and correlation id), root
    where it is its own, reprs and delivery tag."""
    values = {"body": quoted(encoded), "id": quoted(task_id), "tag": quoted(tag)}
    if not root_id:  # its own root
        values["root"] = values["id"]
    if reprs is not None and template.own_reprs:
        values["argsrepr"], values["kwargsrepr"] = quoted(reprs[0]), quoted(reprs[1])
    return values


def _identical(these: tuple[Any, ...], those: tuple[Any, ...]) -> bool:
    """Whether two tuples hold the very same objects: then the same value of the same type (a
    flow's children share their parent's id objects; equal values of other objects are
    bound again, which gives the same JSON)."""
    return len(these) == len(those) and all(map(operator.is_, these, those))


def shared_values(
    template: Template,
    root_id: str | None,
    parent_id: str | None,
    group_id: Any,
    group_index: Any,
    given: tuple[Any, ...],
) -> dict[str, str]:
    """The JSON tokens of a message's values that a flow's children share: its root (where
    it has one of its own), parent, group and index, and the template's own headers (the
    job's values, ``given`` in the order of ``template.varying``, where it gives them, else
    the template's: ``given`` empty)."""
    values = dict(template.defaults)
    if root_id:
        values["root"] = quoted(root_id)
    values["parent"] = token(parent_id)
    values["group"], values["group_index"] = token(group_id), token(group_index)
    if given:
        for name, value in zip(template.varying, given, strict=True):
            values[f"h:{name}"] = str(value) if type(value) is int else quoted(value)
    return values


def is_group(group_id: Any, group_index: Any) -> bool:
    """Whether a job's group id and index are values a template sets per message (a chord's
    header task has both, any other job neither): a str or None, an int or None (a bool, or
    another type, is left to Celery's encoding)."""
    return (group_id is None or type(group_id) is str) and (
        group_index is None or type(group_index) is int
    )


def _marker(slot: str) -> str:
    # A NUL cannot come out of JSON encoding unescaped, and no value kombu writes holds one.
    return f"\x00emq:{slot}\x00"


class Prepared:
    """The JSON of a message with its per-job values cut out: ``parts`` around ``slots``."""

    def __init__(self, parts: list[str], slots: list[str]) -> None:
        self.parts = parts
        self.slots = slots

    @classmethod
    def of(
        cls,
        message: dict[str, Any],
        own_reprs: bool,
        varying: tuple[str, ...],
        sent: Any,
    ) -> Prepared | None:
        """The pieces of ``message`` (a template's, as pushed: ``sent``), or None where they
        would not give ``sent`` back."""
        if REDIS_TRANSPORT is None or not isinstance(sent, str):
            return None
        headers, properties = dict(message["headers"]), dict(message["properties"])
        values: dict[str, str] = {}

        def cut(where: dict[str, Any], name: str, slot: str) -> None:
            values[slot] = token(where[name])
            where[name] = _marker(slot)

        marked = dict(message)
        cut(marked, "body", "body")
        cut(headers, "id", "id")
        cut(headers, "root_id", "root")
        cut(headers, "parent_id", "parent")
        cut(headers, "group", "group")
        cut(headers, "group_index", "group_index")
        if own_reprs:
            cut(headers, "argsrepr", "argsrepr")
            cut(headers, "kwargsrepr", "kwargsrepr")
        for name in varying:
            if type(headers.get(name)) not in (str, int):
                return None
            cut(headers, name, f"h:{name}")
        cut(properties, "correlation_id", "id")
        cut(properties, "delivery_tag", "tag")
        marked["headers"], marked["properties"] = headers, properties
        text = REDIS_TRANSPORT.dumps(marked)
        tokens = {quoted(_marker(slot)): slot for slot in values}
        pieces = re.split("(" + "|".join(re.escape(t) for t in tokens) + ")", text)
        prepared = cls(pieces[0::2], [tokens[t] for t in pieces[1::2]])
        return prepared if prepared.render(values) == sent else None

    def bind(self, values: dict[str, str]) -> Prepared:
        """These pieces with the slots ``values`` names filled in: what the messages of one
        flow's children share (their root, parent, group, headers) joined once, so that each
        message joins only its own values."""
        parts, slots = [self.parts[0]], []
        for slot, part in zip(self.slots, self.parts[1:], strict=True):
            if slot in values:
                parts[-1] += values[slot] + part
            else:
                slots.append(slot)
                parts.append(part)
        return Prepared(parts, slots)

    def render(self, values: dict[str, str]) -> str:
        """The message with ``values`` (slot -> JSON token) in their places."""
        parts = self.parts
        out = [parts[0]]
        for slot, part in zip(self.slots, parts[1:], strict=True):
            out.append(values[slot])
            out.append(part)
        return "".join(out)


def token(value: Any) -> str:
    """``value`` as JSON encodes it: a str quoted (ASCII), an int as its digits, None as
    null."""
    if type(value) is int:
        return str(value)
    if value is None:
        return "null"
    return quoted(value)
