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
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, TypeVar

from celery.app.routes import MapRoute
from celery.utils.functional import maybe_list

from celery_echomq.send.envelope import (
    MESSAGE_OPTIONS,
    expiration_of,
    fast_repr,
    key_routing,
    publish_receivers,
    queue_of,
    same,
)
from celery_echomq.send.pushes import RedisPushes
from celery_echomq.send.templates import Template, Templates

T = TypeVar("T")


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


def built_pushes(
    app: Any, jobs: Iterable[dict[str, Any]], accept: Callable[[Any], T | None]
) -> tuple[T, list[tuple[str, str]]] | None:
    """The LPUSHes publishing ``jobs`` would send, ``(list key, message)`` in order, built
    and not sent, with what ``accept`` said of the kombu channel; None (nothing built) unless
    kombu's Redis transport publishes them, ``accept`` gives something for its channel, and
    every message comes from a template learnt before (the kombu steps of a first message may
    declare its queue: a write this must not make)."""
    with app.producer_or_acquire(None) as producer:
        pushes = RedisPushes.of(app, producer)
        if pushes is None or publish_receivers():
            return None
        accepted = accept(pushes.channel)
        if accepted is None or not _send(app, pushes, jobs, templates_only=True):
            return None
    if any(name != "lpush" or len(args) != 2 for name, args in pushes.commands):
        return None
    return accepted, [(str(args[0]), str(args[1])) for _, args in pushes.commands]


def _send(
    app: Any, producer: Any, jobs: Iterable[dict[str, Any]], templates_only: bool = False
) -> bool:
    """Publish (or, on :class:`RedisPushes`, collect) every job's message. ``templates_only``:
    stop at the first job without a template, and say so (False)."""
    amqp = app.amqp
    current = app.current_worker_task
    sent_event = app.conf.task_send_sent_event
    templates = None
    pushes = producer if isinstance(producer, RedisPushes) else None
    if pushes is not None and not publish_receivers():
        templates = Templates.of(app, pushes.channel)
    if templates_only and templates is None:
        return False
    # The entities each queue's first message of the batch declared.
    declared: dict[str, list[Any]] = {}
    task_defaults: dict[str, dict[str, Any]] = {}
    # The last job pushed from a template, where its routing read its options alone: a job
    # of the same task whose options are the same but for its id takes the same template
    # (a flow's children), without merging defaults, routing and keying again.
    last: _Last | None = None
    reusable = all(isinstance(route, MapRoute) for route in amqp.router.routes)
    for job in jobs:
        name = job["task"]
        args, kwargs = tuple(job["args"]), dict(job["kwargs"])
        if (
            templates is not None
            and last is not None
            and name == last.name
            and same_but_id(job["options"], last.options)
        ):
            reprs = fast_repr(args, kwargs) if last.template.own_reprs else None
            task_id = job["options"]["task_id"]
            if templates.push(
                producer, last.template, task_id, last.root, args, kwargs, reprs, last.headers
            ):
                continue
            last = None
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
        expiration = expiration_of(app, named.get("expires"))
        if expiration is not None:
            options["expiration"] = expiration
        routed = amqp.router.route(options, name, args, kwargs, task)
        reprs = fast_repr(args, kwargs)
        own_reprs = not {"argsrepr", "kwargsrepr"} & (routed.keys() | named.keys())
        key: tuple[Any, ...] = ()
        varying: tuple[str, ...] = ()
        if templates is not None:
            # Everything the message is built from but the id, the root id (each flow has its
            # own), the arguments and the values of the job's own plain headers.
            keyed, varying = key_routing(routed)
            root = named.get("root_id")
            key = (name, ignore_result, link, link_error, _without(named, "root_id"), keyed)
            template = templates.find(key)
            given = routed.get("headers")
            if template is not None and templates.push(
                producer,
                template,
                task_id,
                root,
                args,
                kwargs,
                reprs if own_reprs else None,
                given,
            ):
                if reusable:
                    last = _Last(name, job["options"], template, given, root)
                continue
            if templates_only:
                return False
        queue_name = queue_of(routed)
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
    return True


class _Last(NamedTuple):
    name: str
    options: dict[str, Any]
    template: Template
    headers: dict[str, Any] | None
    # The root id its message took (None: its own id): a job alike but for its id takes it
    # too, as its options (or the task sending it) give the same.
    root: str | None


def same_but_id(options: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether two jobs' options are the same, key order and types included, but for their
    ``task_id``."""
    if len(options) != len(other) or list(options) != list(other):
        return False
    return all(name == "task_id" or same(value, other[name]) for name, value in options.items())


def _without(options: dict[str, Any], name: str) -> dict[str, Any]:
    """``options`` less ``name``: a template's key leaves out what each message sets itself."""
    return {k: v for k, v in options.items() if k != name} if name in options else options
