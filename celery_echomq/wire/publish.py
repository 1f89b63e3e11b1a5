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

One round trip for a small flow: its enqueue script pushes the children's messages too.

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

import contextlib
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, TypeVar

from celery.app.routes import MapRoute
from celery.utils.functional import maybe_list

from celery_echomq.store.headers import H_SINCE
from celery_echomq.store.script_values import BrokerPushes
from celery_echomq.store.state import EchoMQ
from celery_echomq.wire.envelope import (
    MESSAGE_OPTIONS,
    expiration_of,
    fast_repr,
    key_routing,
    publish_receivers,
    queue_of,
    same,
)
from celery_echomq.wire.pushes import RedisPushes, client_of
from celery_echomq.wire.results import database_on_store_server
from celery_echomq.wire.templates import Template, Templates

T = TypeVar("T")

# A job's options that its template's message takes per job, left out of the template's key.
PER_JOB_OPTIONS = ("root_id", "parent_id", "group_id", "group_index")


def _batch(producer: Any) -> contextlib.AbstractContextManager[Any]:
    batch = getattr(producer, "batch", None)
    return batch() if batch is not None else contextlib.nullcontext()


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


class MessageBuilder:
    """Builds the messages publishing jobs would send, and sends none (a batch's children, run
    where their batch message was delivered): each task's defaults read once for all of them.
    The jobs' own lineage only: the task building them is not their sender."""

    def __init__(self, app: Any) -> None:
        self._sender = _Sender(app, None)
        self._sender.current, self._sender.sent_event = None, False

    def build(self, job: dict[str, Any]) -> Any:
        """Celery's ``task_message`` of ``job`` (headers, properties, and the body not yet
        serialized): the task's defaults, routing and reprs as a publish gives them."""
        prepared = self._sender._prepare(job)
        message = self._sender.message(prepared, prepared.routed)
        # As send_task_message merges them into the headers it publishes.
        message.headers.update(prepared.routed.get("headers") or {})
        return message


def built_pushes(
    app: Any,
    jobs: Iterable[dict[str, Any]],
    accept: Callable[[Any], T | None],
    alike: Sequence[bool] = (),
) -> tuple[T, list[tuple[str, str]]] | None:
    """The LPUSHes publishing ``jobs`` would send, ``(list key, message)`` in order, built
    and not sent, with what ``accept`` said of the kombu channel; None (nothing built) unless
    kombu's Redis transport publishes them, ``accept`` gives something for its channel, and
    every message comes from a template learnt before (the kombu steps of a first message may
    declare its queue: a write this must not make). ``alike``: per job, whether the caller
    found its task and options the same as every other job marked so, its id aside (the
    options of two such jobs in a row are not compared again)."""
    with app.producer_or_acquire(None) as producer:
        pushes = RedisPushes.of(app, producer)
        if pushes is None or publish_receivers():
            return None
        accepted = accept(pushes.channel)
        if accepted is None or not _push_templated(app, pushes, jobs, alike):
            return None
    if any(name != "lpush" or len(args) != 2 for name, args in pushes.commands):
        return None
    return accepted, [(str(args[0]), str(args[1])) for _, args in pushes.commands]


def _send(app: Any, producer: Any, jobs: Iterable[dict[str, Any]]) -> None:
    """Publish (or, on :class:`RedisPushes`, collect) every job's message."""
    sender = _Sender(app, producer)
    for job in jobs:
        sender.send(job)


def _push_templated(
    app: Any, pushes: RedisPushes, jobs: Iterable[dict[str, Any]], alike: Sequence[bool]
) -> bool:
    """Collect every job's message from a template learnt before; False at the first job
    without one (the kombu steps of a first message may declare its queue)."""
    sender = _Sender(app, pushes)
    if sender.templates is None:
        return False
    after_alike = False  # whether the job before was marked alike
    for at, job in enumerate(jobs):
        marked = at < len(alike) and alike[at]
        if not sender.push_templated(job, known_like_last=marked and after_alike):
            return False
        after_alike = marked
    return True


class _Prepared(NamedTuple):
    """A job's message before it is built: its task's defaults merged, routed, keyed."""

    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    task_id: str
    link: Any
    link_error: Any
    ignore_result: Any
    named: dict[str, Any]
    routed: dict[str, Any]
    reprs: Any
    own_reprs: bool
    # The template's key and the routing's varying parts (empty without templates).
    key: tuple[Any, ...]
    varying: tuple[str, ...]


class _Sender:
    """One batch's messages: what they share (the app's amqp, the task being run, the
    templates learnt, the entities each queue's first message declared, each task's
    defaults), and the last template pushed."""

    def __init__(self, app: Any, producer: Any) -> None:
        self.app, self.producer = app, producer
        self.amqp = app.amqp
        self.current = app.current_worker_task
        self.pushes = producer if isinstance(producer, RedisPushes) else None
        # RedisPushes.of found it off: not read again (a setting read costs microseconds).
        self.sent_event = self.pushes is None and app.conf.task_send_sent_event
        self.templates: Templates | None = None
        if self.pushes is not None and not publish_receivers():
            self.templates = Templates.of(app, self.pushes.channel)
        # The entities each queue's first message of the batch declared.
        self.declared: dict[str, list[Any]] = {}
        self.task_defaults: dict[str, dict[str, Any]] = {}
        # The last job pushed from a template, where its routing read its options alone: a
        # job of the same task whose options are the same but for its id takes the same
        # template (a flow's children), without merging defaults, routing and keying again.
        self.last: _Last | None = None
        self.reusable = all(isinstance(route, MapRoute) for route in self.amqp.router.routes)

    def send(self, job: dict[str, Any]) -> None:
        """Push ``job`` like the last, or from a template, else build and send its message."""
        if self._push_like_last(job):
            return
        prepared = self._prepare(job)
        if not self._push_from_template(job, prepared):
            self._build_and_send(prepared)

    def push_templated(self, job: dict[str, Any], known_like_last: bool = False) -> bool:
        """Push ``job`` like the last or from a template; False when neither has it.
        ``known_like_last``: the caller knows its task and options are the job before's, its
        id aside (compared once already)."""
        return self._push_like_last(job, known_like_last) or self._push_from_template(
            job, self._prepare(job)
        )

    def _push_like_last(self, job: dict[str, Any], known: bool = False) -> bool:
        """Push ``job`` from the last job's template, where its task and options are the
        last's (``known``: the caller found them so; else compared here). The last is the
        job before, or one whose options that job's were found the same as."""
        last, templates = self.last, self.templates
        if templates is None or last is None:
            return False
        if not known and (
            job["task"] != last.name or not same_but_id(job["options"], last.options)
        ):
            return False
        args, kwargs = tuple(job["args"]), dict(job["kwargs"])
        reprs = fast_repr(args, kwargs) if last.template.own_reprs else None
        options = job["options"]
        if known and templates.push_again(
            self.producer, last.template, options["task_id"], args, kwargs, reprs
        ):
            return True
        if templates.push(
            self.producer,
            last.template,
            options["task_id"],
            last.root,
            last.parent,
            options.get("group_id"),
            options.get("group_index"),
            args,
            kwargs,
            reprs,
            last.headers,
        ):
            return True
        self.last = None
        return False

    def _options_of(self, name: str, job: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """The job's options under its task's own defaults (what Task.apply_async adds),
        and its task."""
        options = dict(job["options"])
        task = self.app.tasks.get(name)
        if task is not None:
            # Read once per task and batch: a dozen descriptor reads each.
            defaults = self.task_defaults.get(name)
            if defaults is None:
                defaults = self.task_defaults[name] = {
                    k: v for k, v in task._get_exec_options().items() if v is not None
                }
            options = {**defaults, **options}
            options.setdefault("ignore_result", task.ignore_result)
            if task.priority:
                options.setdefault("priority", task.priority)
        return options, task

    def _prepare(self, job: dict[str, Any]) -> _Prepared:
        name = job["task"]
        args, kwargs = tuple(job["args"]), dict(job["kwargs"])
        options, task = self._options_of(name, job)
        task_id = options.pop("task_id")
        link, link_error = options.pop("link", None), options.pop("link_error", None)
        ignore_result = options.pop("ignore_result", None)
        named = {k: options.pop(k) for k in MESSAGE_OPTIONS if k in options}
        current = self.current
        if current is not None:
            named.setdefault("root_id", current.request.root_id or current.request.id)
            named.setdefault("parent_id", current.request.id)
        named.setdefault("reply_to", self.app.thread_oid)
        expiration = expiration_of(self.app, named.get("expires"))
        if expiration is not None:
            options["expiration"] = expiration
        routed = self.amqp.router.route(options, name, args, kwargs, task)
        reprs = fast_repr(args, kwargs)
        own_reprs = not {"argsrepr", "kwargsrepr"} & (routed.keys() | named.keys())
        key: tuple[Any, ...] = ()
        varying: tuple[str, ...] = ()
        if self.templates is not None:
            # Everything the message is built from but the id, the root and parent ids (each
            # flow has its own root; a chain's step names the step before it, and a job sent
            # from a task that task), the group id and index (a chord's header tasks: each
            # chord has its own group, each task its place in it), the arguments and the
            # values of the job's own plain headers.
            keyed, varying = key_routing(routed)
            key = (
                name,
                ignore_result,
                link,
                link_error,
                _without(named, *PER_JOB_OPTIONS),
                keyed,
            )
        return _Prepared(
            name,
            args,
            kwargs,
            task_id,
            link,
            link_error,
            ignore_result,
            named,
            routed,
            reprs,
            own_reprs,
            key,
            varying,
        )

    def _push_from_template(self, job: dict[str, Any], p: _Prepared) -> bool:
        templates = self.templates
        if templates is None:
            return False
        template = templates.find(p.key)
        root, parent = p.named.get("root_id"), p.named.get("parent_id")
        given = p.routed.get("headers")
        if template is None or not templates.push(
            self.producer,
            template,
            p.task_id,
            root,
            parent,
            p.named.get("group_id"),
            p.named.get("group_index"),
            p.args,
            p.kwargs,
            p.reprs if p.own_reprs else None,
            given,
        ):
            return False
        if self.reusable:
            self.last = _Last(p.name, job["options"], template, given, root, parent)
        return True

    def message(self, p: _Prepared, routed: dict[str, Any]) -> Any:
        """Celery's message of a prepared job, routed by ``routed``."""
        given = dict(p.named)
        if p.reprs is not None and p.own_reprs:
            given["argsrepr"], given["kwargsrepr"] = p.reprs
        return self.amqp.create_task_message(
            p.task_id,
            p.name,
            p.args,
            p.kwargs,
            callbacks=maybe_list(p.link),
            errbacks=maybe_list(p.link_error),
            create_sent_event=self.sent_event,
            ignore_result=p.ignore_result,
            **given,
            **routed,
        )

    def _build_and_send(self, p: _Prepared) -> None:
        """Build the message as Celery does and send it; learn its template on the way."""
        routed = p.routed
        queue_name = queue_of(routed)
        first = queue_name not in self.declared
        if not first:
            # Declared by an earlier message of this batch: kombu would copy and re-bind
            # the Queue entity for every message before its cache answers.
            routed = {**routed, "declare": []}  # a copy: a template's key holds the dict
        message = self.message(p, routed)
        self.amqp.send_task_message(self.producer, p.name, message, **routed)
        pushes = self.pushes
        if pushes is None:
            self.declared.setdefault(queue_name, [])
            return
        if first:
            self.declared[queue_name] = list(pushes.last_declared)
        if self.templates is not None:
            self.templates.learn(
                pushes,
                p.key,
                p.task_id,
                p.named,
                routed,
                p.link,
                p.link_error,
                p.own_reprs,
                p.varying,
                [*self.declared[queue_name], *pushes.last_declared],
            )


class _Last(NamedTuple):
    name: str
    options: dict[str, Any]
    template: Template
    headers: dict[str, Any] | None
    # The root id its message took (None: its own id): a job alike but for its id takes it
    # too, as its options (or the task sending it) give the same; its parent id likewise.
    root: str | None
    parent: str | None


def same_but_id(options: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether two jobs' options are the same, key order and types included, but for their
    ``task_id`` and ``group_index`` (a chord's header tasks: each its own place in its
    group), which a template's message takes per job."""
    if len(options) != len(other) or list(options) != list(other):
        return False
    return all(
        name == "task_id" or name == "group_index" or same(value, other[name])
        for name, value in options.items()
    )


def _without(options: dict[str, Any], *names: str) -> dict[str, Any]:
    """``options`` less ``names``: a template's key leaves out what each message sets itself."""
    if not any(name in options for name in names):
        return options
    return {k: v for k, v in options.items() if k not in names}


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
