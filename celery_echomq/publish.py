"""Send stored job dicts to the broker: one producer, one batch, no per-message overhead.

This builds each message exactly as ``Task.apply_async`` -> ``app.send_task`` would (the
task's own option defaults, root and parent ids, routing, ``before/after_task_publish``
signals) but leaves out what a flow does not need per child: a Signature, a Task and an
AsyncResult object, and the result backend's subscription to every child's result (the
producer never waits on a child: the parent does, through Redis). ``AsyncResult(child).get()``
still works; it subscribes when called. A custom ``Task.apply_async`` or ``shadow_name`` is
not called for flow jobs.

With kombu's ``Producer.batch()`` (kombu >= 5.7) the Redis transport sends all the messages in
one pipelined round trip instead of one LPUSH each; other transports publish as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from celery.utils.functional import maybe_list

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


def send_jobs(app: Any, jobs: Iterable[dict[str, Any]]) -> None:
    """Publish each job dict (task, args, kwargs, options with ``task_id``) in one batch."""
    amqp = app.amqp
    current = app.current_worker_task
    declared: set[str] = set()
    with app.producer_or_acquire(None) as producer, _batch(producer):
        for job in jobs:
            name = job["task"]
            args, kwargs = tuple(job["args"]), dict(job["kwargs"])
            options = dict(job["options"])
            task = app.tasks.get(name)
            if task is not None:
                # What Task.apply_async adds: the task's own defaults under the job's options.
                defaults = {k: v for k, v in task._get_exec_options().items() if v is not None}
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
            queue = routed.get("queue")
            queue_name = str(getattr(queue, "name", queue))
            if queue_name in declared:
                # Declared by an earlier message of this batch: kombu would copy and re-bind
                # the Queue entity for every message before its cache answers.
                routed["declare"] = []
            declared.add(queue_name)
            reprs = _fast_repr(args, kwargs)
            given = routed.keys() | named.keys()
            if reprs is not None and not {"argsrepr", "kwargsrepr"} & given:
                named["argsrepr"], named["kwargsrepr"] = reprs
            message = amqp.create_task_message(
                task_id,
                name,
                args,
                kwargs,
                callbacks=maybe_list(link),
                errbacks=maybe_list(link_error),
                create_sent_event=app.conf.task_send_sent_event,
                ignore_result=ignore_result,
                **named,
                **routed,
            )
            amqp.send_task_message(producer, name, message, **routed)


def publish(app: Any, jobs: Iterable[dict[str, Any]]) -> None:
    """Publish stored job dicts in one batch (a nested flow's entry resumes that flow)."""
    jobs = list(jobs)
    send_jobs(app, [job for job in jobs if "nested" not in job])
    for job in jobs:
        if "nested" in job:
            # A nested flow's entry: re-publishing it is finishing its start.
            from .plan import Plan
            from .start import resume_nested
            from .state import get_state

            resume_nested(get_state(app), Plan.from_dict(job["nested"]))
