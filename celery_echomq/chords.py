"""Every chord of an app on the flow engine: ``app.conf.echomq_chords = True``.

Celery runs a chord in ``chord.run``: it freezes the body and the header, asks the result
backend to keep the count (``apply_chord``, then ``on_chord_part_return`` from each header
task) and sends the header. With the setting on, Celery's own ``run`` still does every step a
caller can see (the ids it gives, the body's options and callbacks, the ``AsyncResult`` of the
body whose ``parent`` is the header's ``GroupResult``), each as that Celery release does it;
two of its steps go to the flow engine instead: the backend's ``apply_chord`` keeps no count,
and the header's send (``HeldHeader.apply_async``) is the send of a flow whose parent is the
body, held in the store, and whose children are the header's tasks, each credited once by the
script that completes it and recovered like any flow job. A header failure fails the body once
every header task has settled (the policy ``fail_at_end``), as Celery's does; what the engine
records then is a ``FlowFailed``, which is a ``ChordError``, worded as Celery words it.

Eager chords (``task_always_eager``, ``chord.apply``) are Celery's: nothing is held there.
``self.add_to_chord(sig)`` in a header task on the engine adds ``sig`` to the flow
(``add_children``), as Celery's adds it to the backend's count. A frozen chord applied again
runs again under its ids, as Celery's does: the finished flow that holds them is forgotten
first (a flow still running refuses them, as any flow does).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from copy import deepcopy
from typing import Any, TypeVar

import celery
from celery.app.task import Task
from celery.backends.redis import RedisBackend
from celery.canvas import Signature, _chain, _chord, group, maybe_signature
from celery.utils.functional import regen

from celery_echomq.errors import ConfigError, FlowExistsError, UnknownFlowError
from celery_echomq.ops.forget import forget_flow
from celery_echomq.ops.pages import read_flow
from celery_echomq.ops.views import JobNode
from celery_echomq.send.accepts import CHILD_OPTIONS, SEND_OPTIONS, check_spelling
from celery_echomq.send.batches import OWN_MESSAGE, check_batch
from celery_echomq.send.fan_in import check_max_active
from celery_echomq.send.ids import tasks_of
from celery_echomq.send.jobs import check_policy
from celery_echomq.send.shape import CHORD_POLICY, is_task
from celery_echomq.store.connection import text
from celery_echomq.store.deadline_spec import check_on_deadline, deadline_spec
from celery_echomq.store.headers import CHORD_OPTION, H_PARENT, OPEN_OPTION
from celery_echomq.store.replies import Status
from celery_echomq.store.scripts import ParentRef
from celery_echomq.store.state import EchoMQ, find_state, get_state

logger = logging.getLogger("celery_echomq")

SETTING = "echomq_chords"
# Header tasks a broker message delivers, for every chord on the engine whose header a batch
# can carry (send/batches.py); unset: one message each, as Celery sends them.
BATCH_SETTING = "echomq_chord_batch"
# A chord's own options that the engine reads (``chord(h, b, deadline=60)`` or
# ``apply_async(max_active=10)``), and that never reach a task's message.
ENGINE_OPTIONS = ("policy", "deadline", "on_deadline", "max_active", "batch")

# What Celery keeps a header given as a generator in (``regen``'s type): it is sent as read.
READ_AS_SENT = type(regen(iter(())))

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
    """``chord.run`` for every chord: Celery's own, which on the engine hands its header's send
    to the flow engine (:class:`HeldHeader`)."""
    app = app or self._get_app(body)
    engine_run = on_engine(app)
    # The engine's own options never reach Celery's run, which would give them to the body and
    # the header's tasks as message options; the chord keeps its own for its next apply.
    stashed: dict[str, Any] = {}
    sent: Any = header
    if engine_run:
        engine = _engine_options({**self.options, **options})
        for name in ENGINE_OPTIONS:
            options.pop(name, None)
            if name in self.options:
                stashed[name] = self.options.pop(name)
        sent = HeldHeader(header, app, engine)
        _hold_backend_count(app.backend)
    try:
        with _HOLDING.count_of(app.backend if engine_run else None):
            return _celery_run(
                self,
                sent,
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
    finally:
        self.options.update(stashed)


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


class _Holding(threading.local):
    """The result backend whose chord count this thread (or greenlet) leaves to the engine:
    the app's, while Celery's run of one of its chords on the engine is under way."""

    backend: Any = None

    @contextlib.contextmanager
    def count_of(self, backend: Any) -> Iterator[None]:
        before, self.backend = self.backend, backend
        try:
            yield
        finally:
            self.backend = before


_HOLDING = _Holding()


class _CountLeftToEngine:
    """A result backend's ``apply_chord`` that keeps no count while a chord of that backend
    runs on the engine (``_HOLDING``), and is the backend's own for every other call."""

    def __init__(self, backend: Any, own: Any) -> None:
        self.backend, self.own = backend, own

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _HOLDING.backend is self.backend:
            return None
        return self.own(*args, **kwargs)


def _hold_backend_count(backend: Any) -> None:
    """Celery's run asks the result backend to keep the chord's count (``apply_chord``) before
    it sends the header: on the engine the flow keeps it, and a backend without a counter of
    its own would send ``celery.chord_unlock``, which polls the header and sends the body a
    second time. The backend's own ``apply_chord`` (which some backends set per instance) is
    kept for every other run, decided per call, so that threads sharing the backend never
    see it change."""
    if not isinstance(backend.apply_chord, _CountLeftToEngine):
        backend.apply_chord = _CountLeftToEngine(backend, backend.apply_chord)


class HeldHeader:
    """A chord's header as Celery's run sees it on the engine: Celery freezes it (the ids, the
    group id, the body it gives each task), and its send is the flow's send: the body held in
    the store as the parent of the header's tasks, which go out as the flow's children."""

    def __init__(self, header: group, app: Any, engine: dict[str, Any]) -> None:
        self.header, self.app, self.engine = header, app, engine
        self.frozen: tuple[str, Any] | None = None

    def __getattr__(self, name: str) -> Any:
        # What Celery's run reads of its header (options, tasks) is the header's own.
        return getattr(self.header, name)

    def _freeze_group_tasks(self, *args: Any, **kwargs: Any) -> Any:
        # Celery's run freezes the header here and keeps what it returns (the group id and
        # the tasks' results) to itself: the flow needs the results too.
        self.frozen = self.header._freeze_group_tasks(*args, **kwargs)
        return self.frozen

    def apply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        """The header's send, as Celery's run asks for it (the chord's options, less what a
        header never carries), made the flow's."""
        from celery_echomq.canvas import flow

        header, app = self.header, self.app
        body = header.options.pop("chord", None)
        if self.frozen is None or body is None:
            # A Celery whose run no longer freezes the header with its body before the send:
            # nothing is sent, and the error says which step the extension relies on.
            raise RuntimeError(
                f"Celery {celery.__version__}'s chord.run sent the header without freezing it "
                "with its body (group._freeze_group_tasks(chord=body)), which echomq_chords "
                "relies on; set echomq_chords = False to run chords as Celery does"
            )
        group_id, results = self.frozen
        # What the engine records when the header fails: Celery's own error handling of this
        # body (its errbacks, a group body's tasks, the chain after it), from the body as sent;
        # a chain body's steps are flow jobs that run their errbacks themselves.
        chord_body = "1" if isinstance(body, _chain) else deepcopy(dict(body))
        if isinstance(body, _chain) and "chain" in body.options:
            body = _chain_after_last_step(body, app)
        send = {**options, CHORD_OPTION: chord_body}
        if isinstance(header.tasks, READ_AS_SENT):
            _send_as_read(app, body, header, results, self.engine, args, kwargs, send)
        else:
            for task, result in zip(header.tasks, results, strict=True):
                _routed(app, task, result, send, body)
            held = flow(body, header, app=app, **_batched(app, header.tasks, self.engine))
            # Celery runs a frozen chord again under its ids: the engine forgets the finished
            # flow that holds them first (send_reusing_finished, below).
            forget_finished_holding(get_state(app), body)
            send_reusing_finished(get_state(app), lambda: held.apply_async(args, kwargs, **send))
        return app.GroupResult(group_id, results)


def chord_batch(app: Any) -> int | None:
    """The app's ``echomq_chord_batch``: header tasks a message delivers (None: one each)."""
    try:
        return check_batch(app.conf.get(BATCH_SETTING) or None, BATCH_SETTING)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _batched(app: Any, tasks: Any, engine: dict[str, Any]) -> dict[str, Any]:
    """The chord's engine options with ``echomq_chord_batch`` applied: to a header of single
    tasks that no option of their own keeps to a message each (a chain, a nested chord, a
    countdown: such a header goes out a message a task, as Celery sends it), where the chord
    names neither its own batch nor a window."""
    size = chord_batch(app)
    if size is None or "batch" in engine or engine.get("max_active"):
        return engine
    for task in tasks:
        if not is_task(task) or any(task.options.get(name) is not None for name in OWN_MESSAGE):
            return engine
    return {**engine, "batch": size}


def _without_body(sig: Any, body: Signature) -> None:
    """Celery's run gives every header task the body as its ``chord`` option, by which a worker
    reports to the backend's count; on the engine the flow counts, so no task carries it."""
    if not isinstance(sig, Signature):
        return
    if sig.options.get("chord") is body:
        del sig.options["chord"]
    tasks: Any = getattr(sig, "tasks", None)
    # A generator's tasks are left to be read as they are sent (they carry the body only if
    # the generator was a nested group's, which the engine sends as a group of its own).
    if isinstance(sig, (group, _chain)) and type(tasks) in (list, tuple):
        for task in tasks:
            _without_body(task, body)
    elif isinstance(sig, _chord):
        _without_body(sig.tasks, body)
        _without_body(sig.body, body)


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
    check_batch(engine.get("batch"), "chord(batch=...)")
    deadline_spec(engine.get("deadline"), "chord(deadline=...)")
    check_on_deadline(engine.get("on_deadline", "fail"), "chord(on_deadline=...)")
    return engine


def _check_header_task(task: Any) -> None:
    """A close misspelling of an option the engine reads of a header task, refused."""
    if isinstance(task, Signature):
        check_spelling(task.options, CHILD_OPTIONS, f"chord header task {task.task!r}: .set()")


def _routed(
    app: Any, task: Signature, result: Any, send: dict[str, Any], body: Signature
) -> Signature:
    """A header task with what the chord is sent with over its own routing (as in Celery's
    header.apply_async(**options); a flow's own children keep theirs), without the body Celery
    gave it, its result listened for from now on, as Celery's send of it does (Redis's result
    backend, by pub/sub)."""
    _check_header_task(task)
    _without_body(task, body)
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
    tasks = (_routed(app, t, r, send, body) for t, r in zip(header.tasks, results, strict=True))
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
