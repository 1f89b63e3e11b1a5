"""Every chord of an app on the flow engine: ``app.conf.echomq_chords = True``.

Celery runs a chord in ``chord.run``: it freezes the body and the header, asks the result
backend to keep the count (``apply_chord``, then ``on_chord_part_return`` from each header
task) and sends the header. With the setting on, ``run`` keeps every step a caller can see
(the ids Celery gives, the body's options and callbacks, the ``AsyncResult`` of the body
whose ``parent`` is the header's ``GroupResult``) and hands the fan-in to the flow engine
instead of the backend: the body is held in the store as a flow's parent, each header task
is one of its children, credited once by the script that completes it, and recovered like
any flow job. A header failure fails the body once every header task has settled (the
policy ``fail_at_end``), as Celery's does; what the engine records then is a ``FlowFailed``,
which is a ``ChordError``, worded as Celery words it.

Eager chords (``task_always_eager``, ``chord.apply``) are Celery's: nothing is held there.
``self.add_to_chord(sig)`` in a header task on the engine adds ``sig`` to the flow
(``add_children``), as Celery's adds it to the backend's count. A frozen chord applied again
runs again under its ids, as Celery's does: the finished flow that holds them is forgotten
first (a flow still running refuses them, as any flow does).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from copy import deepcopy
from typing import Any, TypeVar

from celery.app.task import Task
from celery.backends.redis import RedisBackend
from celery.canvas import Signature, _chain, _chord, group, maybe_signature
from celery.utils import uuid
from celery.utils.functional import _regen

from celery_echomq.errors import ConfigError, FlowExistsError, UnknownFlowError
from celery_echomq.ops.forget import forget_flow
from celery_echomq.ops.pages import read_flow
from celery_echomq.ops.views import JobNode
from celery_echomq.send.accepts import CHILD_OPTIONS, SEND_OPTIONS, check_spelling
from celery_echomq.send.fan_in import check_max_active
from celery_echomq.send.ids import tasks_of
from celery_echomq.send.jobs import check_policy
from celery_echomq.send.shape import CHORD_POLICY
from celery_echomq.store.connection import text
from celery_echomq.store.deadline_spec import check_on_deadline, deadline_spec
from celery_echomq.store.headers import CHORD_OPTION, H_PARENT, OPEN_OPTION
from celery_echomq.store.replies import Status
from celery_echomq.store.scripts import ParentRef
from celery_echomq.store.state import EchoMQ, find_state, get_state

logger = logging.getLogger("celery_echomq")

SETTING = "echomq_chords"
# A chord's own options that the engine reads (``chord(h, b, deadline=60)`` or
# ``apply_async(max_active=10)``), and that never reach a task's message.
ENGINE_OPTIONS = ("policy", "deadline", "on_deadline", "max_active")

# The options of a chord's send that override its header tasks' own.
ROUTING = ("queue", "routing_key", "exchange", "priority")

_celery_run = _chord.run
_celery_apply = _chord.apply
_celery_add_to_chord = Task.add_to_chord


def on_engine(app: Any) -> bool:
    """Whether ``app``'s chords run on the flow engine: the setting on, the extension
    installed on the app."""
    value = app.conf.get(SETTING, False)
    if not isinstance(value, bool):
        raise ConfigError(f"{SETTING} must be True or False, got {value!r}")
    return value and find_state(app) is not None


def run(
    self: _chord,
    header: group,
    body: Signature,
    partial_args: Any,
    app: Any = None,
    interval: Any = None,
    countdown: Any = 1,
    max_retries: Any = None,
    eager: bool = False,
    task_id: str | None = None,
    kwargs: dict[str, Any] | None = None,
    header_delay: dict[str, Any] | None = None,
    **options: Any,
) -> Any:
    """``chord.run`` for every chord: Celery's own unless the app's chords are on the engine."""
    app = app or self._get_app(body)
    if not on_engine(app):
        return _celery_run(
            self,
            header,
            body,
            partial_args,
            app=app,
            interval=interval,
            countdown=countdown,
            max_retries=max_retries,
            eager=eager,
            task_id=task_id,
            kwargs=kwargs,
            # Celery 5.7's; before, run takes no such argument (it would become an option)
            **({} if header_delay is None else {"header_delay": header_delay}),
            **options,
        )
    return _run_as_flow(
        self, header, body, partial_args, app, task_id, kwargs, header_delay, options
    )


def apply(
    self: _chord,
    args: Any = None,
    kwargs: Any = None,
    propagate: bool = True,
    body: Any = None,
    **options: Any,
) -> Any:
    """``chord.apply`` (an eager chord) for every chord: Celery's, after what the engine would
    read of it is checked as a chord sent to a worker is, so that both are refused alike."""
    if on_engine(self._get_app(body)):
        _engine_options(dict(self.options, **options))
        tasks = self.tasks.tasks if isinstance(self.tasks, group) else self.tasks
        if isinstance(tasks, (list, tuple)):  # a generator is read by Celery's apply alone
            for task in tasks:
                _check_header_task(task)
    return _celery_apply(self, args, kwargs, propagate=propagate, body=body, **options)


def _run_as_flow(
    chord: _chord,
    header: group,
    body: Signature,
    partial_args: Any,
    app: Any,
    task_id: str | None,
    kwargs: dict[str, Any] | None,
    header_delay: dict[str, Any] | None,
    options: dict[str, Any],
) -> Any:
    """Celery's steps up to the header's send (the same ids, options and callbacks, so the
    same results), then one flow of the body over the header's tasks."""
    from celery_echomq.canvas import flow

    group_id = header.options.get("task_id") or uuid()
    root_id = body.options.get("root_id")
    options = dict(chord.options, **options)
    engine = _engine_options(options)
    delay = dict(header_delay or {})
    for key in ("countdown", "eta"):
        if key not in delay and options.get(key) is not None:
            delay[key] = options[key]
        options.pop(key, None)
    if options:
        options.pop("task_id", None)
        if hasattr(chord, "_add_body_callbacks"):  # Celery 5.7
            body = chord._add_body_callbacks(body, options)
            body.options.update(chord._body_options(options))
        else:  # before 5.7, Celery's run gives the body the chord's options as they are
            body.options.update(options)
            if isinstance(body, _chain):
                body = _chain_after_last_step(body, app)
    if isinstance(body, _chain) and hasattr(body, "_unroll_chords"):  # Celery 5.7
        body._unroll_chords(app)
    bodyres = body.freeze(task_id or uuid(), group_id=group_id, root_id=root_id)
    # What travels to the header tasks (a chord's header never carries the chain after it,
    # nor a chord of its own).
    for name in ("chain", "chord", "task_id"):
        options.pop(name, None)
    header.options["task_id"] = group_id
    # A generator's tasks are frozen as it is read (a GroupResult made now would read it
    # whole), so the GroupResult is made after the send, as Celery makes it.
    _, results = header._freeze_group_tasks(group_id=group_id, root_id=root_id)
    if not header.tasks:
        # Nothing to wait for: the body runs now, as Celery runs it.
        body.delay([])
        bodyres.parent = app.GroupResult(group_id, results)
        return bodyres
    # What the engine records when the header fails: Celery's own error handling of this body
    # (its errbacks, a group body's tasks, the chain after it), from the body as sent; a chain
    # body's steps are flow jobs that run their errbacks themselves.
    chord_body = "1" if isinstance(body, _chain) else deepcopy(dict(body))
    send = {**options, **delay, CHORD_OPTION: chord_body}
    if isinstance(header.tasks, _regen):
        _send_as_read(app, body, header, results, engine, partial_args, kwargs, send)
    else:
        for task, result in zip(header.tasks, results, strict=True):
            _routed(app, task, result, send)
        held = flow(body, header, app=app, **engine)
        # Celery runs a frozen chord again under its ids: the engine forgets the finished
        # flow that holds them first (send_reusing_finished, below).
        forget_finished_holding(get_state(app), body)
        send_reusing_finished(
            get_state(app), lambda: held.apply_async(partial_args, kwargs, **send)
        )
    bodyres.parent = app.GroupResult(group_id, results)
    return bodyres


def _chain_after_last_step(body: _chain, app: Any) -> _chain:
    """Before Celery 5.7, a chain body sent with the rest of the chain it is in (``a | chord(h,
    b | c) | d``: ``b | c`` carries ``chain=[d]``) hands that rest on when it runs, by adding it
    to its own steps' ``chain`` option. The engine sends a chain body as steps of its own, so
    the rest goes on the body's last step, which runs it when it succeeds, as Celery would; a
    last step that is itself a canvas keeps Celery's way (left as it is)."""
    rest = body.options.get("chain")
    tasks = [maybe_signature(task, app=app) for task in body.tasks]
    if not rest or not tasks or type(tasks[-1]) is not Signature:
        return body
    body = body.clone()
    last = tasks[-1].clone()
    # Celery's chain option is read from its end: the last step's own steps run first.
    last.options["chain"] = [*rest, *(last.options.get("chain") or [])]
    body.kwargs["tasks"] = [*tasks[:-1], last]
    del body.options["chain"]
    return body


def _engine_options(options: dict[str, Any]) -> dict[str, Any]:
    """The options of a chord's send that the engine reads, taken out of ``options`` and
    checked as the chord's (a close misspelling of one, or a value not allowed, refused
    before anything is sent)."""
    check_spelling(options, (*ENGINE_OPTIONS, *SEND_OPTIONS), "chord")
    engine = {name: options.pop(name) for name in ENGINE_OPTIONS if name in options}
    # A header task that fails fails the body once the whole header has run, as in Celery
    # (its errbacks then run, and a caller's get() has seen the header's own error first).
    engine.setdefault("policy", CHORD_POLICY)
    check_policy(engine["policy"], "chord(policy=...)", "policy")
    check_max_active(engine.get("max_active"), "chord(max_active=...)")
    deadline_spec(engine.get("deadline"), "chord(deadline=...)")
    check_on_deadline(engine.get("on_deadline", "fail"), "chord(on_deadline=...)")
    return engine


def _check_header_task(task: Any) -> None:
    """A close misspelling of an option the engine reads of a header task, refused."""
    if isinstance(task, Signature):
        check_spelling(task.options, CHILD_OPTIONS, f"chord header task {task.task!r}: .set()")


def _routed(app: Any, task: Signature, result: Any, send: dict[str, Any]) -> Signature:
    """A header task with what the chord is sent with over its own routing (as in Celery's
    header.apply_async(**options); a flow's own children keep theirs), its result listened
    for from now on, as Celery's send of it does (Redis's result backend, by pub/sub)."""
    _check_header_task(task)
    task.options.update({k: v for k, v in send.items() if k in ROUTING})
    if isinstance(app.backend, RedisBackend):
        app.backend.on_task_call(None, result.id)
    return task


def _send_as_read(
    app: Any,
    body: Signature,
    header: group,
    results: Any,
    engine: dict[str, Any],
    partial_args: Any,
    kwargs: dict[str, Any] | None,
    send: dict[str, Any],
) -> None:
    """A header that is a generator, sent as it yields, as Celery sends it: the flow opens
    with the first task and stays open while each further task is added, then is sealed.
    A generator that raises fails the flow at once (nothing after it is sent)."""
    from celery_echomq.canvas import flow
    from celery_echomq.send.dispatch import dispatch_parent
    from celery_echomq.send.grow import grow
    from celery_echomq.store.reads import locate
    from celery_echomq.worker.recovery.unfinished import abandon_open_flow

    state = get_state(app)
    # Each task is frozen (its id given) by the header's results as they are read.
    tasks = (_routed(app, t, r, send) for t, r in zip(header.tasks, results, strict=True))
    held = flow(body, [next(tasks)], app=app, **engine)
    result = held.apply_async(partial_args, kwargs, **{**send, OPEN_OPTION: True})
    # The job that holds the flow's children: the body, or a chain body's first step.
    hint = result.flow_queue if result.fan_in == result.id else None
    parent = ParentRef(result.fan_in, locate(state, result.fan_in, hint))
    open_key = state.keys.queue_key(parent.queue, "open")
    try:
        for task in tasks:
            grow(
                state,
                parent,
                [task.clone(partial_args, kwargs) if partial_args or kwargs else task],
            )
            # A producer still reading is alive: recovery waits a stall timeout from here.
            seconds, micros = state.client.time()
            state.client.zadd(open_key, {parent.id: seconds * 1000 + micros // 1000}, xx=True)
    except BaseException as exc:
        reason = f"its chord's header raised {exc!r} while it was read"
        payload = state.client.hget(state.keys.job_key(parent.queue, parent.id), "payload")
        abandon_open_flow(state, parent.queue, parent.id, reason, payload, now=True)
        raise
    if state.scripts.seal_flow(parent.queue, parent.id) is Status.RELEASED:
        dispatch_parent(state, parent.queue, parent.id)


def add_to_chord(self: Task, sig: Signature, lazy: bool = False) -> Any:
    """``Task.add_to_chord`` for every task: on the engine, a header task (a flow child) adds
    ``sig`` to its flow, sent now (``lazy`` too: the flow holds it from here on)."""
    if not on_engine(self.app) or not getattr(self.request, H_PARENT, None):
        return _celery_add_to_chord(self, sig, lazy)
    from celery_echomq.send.flow_reads import add_children

    added = add_children([sig], app=self.app)
    return sig if lazy else self.app.AsyncResult(added[0])


@functools.cache
def patch_celery() -> None:
    """Route Celery's chord entry points through this module, once per process: inert for
    every app whose chords are not on the engine."""
    _chord.run = run
    _chord.apply = apply
    Task.add_to_chord = add_to_chord


# --- a Celery id sent again -------------------------------------------------------------------
# Celery lets a frozen canvas be applied more than once (each apply is a new run under the same
# ids, its results overwritten), and its tests reuse a frozen task in a second chord. The store
# keeps one job per id for the result TTL, and a flow refuses an id it still keeps
# (``FlowExistsError``): that is what makes every credit exactly-once. A chord on the engine
# sent with ids of a flow that has finished forgets that flow first (as ``echomq forget`` does),
# then sends again; an id of a flow still running is refused as before, since its jobs' rows
# are what settles the work in flight.

# How long a reused id's earlier run may take to settle once its Celery result is stored (its
# worker stores the result, then finishes the row and credits the flow).
SETTLE_WAIT_S = 5.0
# The finished flows one send may forget: a canvas reusing the ids of more is refused.
MAX_FORGOTTEN = 16

T = TypeVar("T")


def send_reusing_finished(state: EchoMQ, send: Callable[[], T]) -> T:
    """``send()``; where it is refused for an id of a finished flow, forget that flow and send
    again. Each refusal wrote and published nothing, so the send is whole or not at all."""
    forgotten: set[str] = set()
    while True:
        try:
            return send()
        except FlowExistsError as exc:
            top = _finished_top(state, exc.job_id)
            if top is None or top.id in forgotten or len(forgotten) >= MAX_FORGOTTEN:
                raise
            _forget(state, top, exc.job_id, forgotten)


def forget_finished_holding(state: EchoMQ, body: Signature) -> None:
    """Before a chord whose body is a canvas is sent: the ids of that body's tasks that a
    finished flow holds, that flow forgotten now. A group body's tasks are written when the
    body is released, not when the chord is sent, so no refusal at the send would name them,
    and the add at the release would be refused."""
    if not getattr(body, "subtask_type", None):
        return  # a task: its id is the flow's parent's, which the send itself checks
    found: list[Signature] = []
    tasks_of(body, found)
    ids = [str(t.options["task_id"]) for t in found if t.options.get("task_id")]
    keys = state.keys
    queues = sorted(text(q) for q in state.client.smembers(keys.queues_key()))
    if not ids or not queues:
        return
    pipe = state.client.pipeline(transaction=False)
    for job_id in ids:
        for queue in queues:
            pipe.exists(keys.job_key(queue, job_id))
    there = pipe.execute()
    n = len(queues)
    held = [job_id for at, job_id in enumerate(ids) if any(there[at * n : (at + 1) * n])]
    forgotten: set[str] = set()
    for job_id in held:
        top = _finished_top(state, job_id)
        if top is not None and top.id not in forgotten:
            _forget(state, top, job_id, forgotten)


def _forget(state: EchoMQ, top: JobNode, reused: str, forgotten: set[str]) -> None:
    """Forget the finished flow ``top``, whose id ``reused`` a chord sent again reuses."""
    forget_flow(state, top)
    forgotten.add(top.id)
    logger.info("echomq: flow %s forgotten: a chord sent again reuses its id %s", top.id, reused)


def _finished_top(state: EchoMQ, job_id: str) -> JobNode | None:
    """The outermost flow holding ``job_id``, once it has finished (None: unknown, or
    running). A job whose Celery result is stored already is settled by its worker a moment
    later (its flow too): that moment is waited for, at most :data:`SETTLE_WAIT_S`."""
    if not job_id:
        return None
    deadline = time.monotonic() + SETTLE_WAIT_S
    while True:
        try:
            top = _top(state, job_id)
        except UnknownFlowError:
            return None
        if top.finished:
            return top if top.flow is not None else None
        if time.monotonic() > deadline or not state.app.AsyncResult(job_id).ready():
            return None
        time.sleep(0.05)


def _top(state: EchoMQ, job_id: str) -> JobNode:
    node = read_flow(state, job_id, count=1, with_result=False)
    while node.parent is not None:
        node = read_flow(state, node.parent, count=1, with_result=False)
    return node
