"""The Celery app the tests' real workers run. Configured from environment variables so that
the test process and each `celery worker` subprocess agree on the URLs."""

from __future__ import annotations

import json
import os
import time
from typing import Any
from urllib.parse import urlsplit

import redis
from celery import Celery

import celery_echomq

app = Celery("proj")
app.conf.update(
    broker_url=os.environ.get("ECHOMQ_T_BROKER", "redis://127.0.0.1:6379/1"),
    # ECHOMQ_T_BACKEND=none: no result backend at all.
    result_backend=None
    if os.environ.get("ECHOMQ_T_BACKEND") == "none"
    else os.environ.get("ECHOMQ_T_BACKEND", "redis://127.0.0.1:6379/2"),
    echomq_redis_url=os.environ.get("ECHOMQ_T_STORE", "redis://127.0.0.1:6379/3"),
    echomq_stall_timeout=float(os.environ.get("ECHOMQ_T_STALL", "300")),
    echomq_recovery_interval=float(os.environ.get("ECHOMQ_T_RECOVERY_INTERVAL", "1")),
    echomq_transport_options={"master_name": os.environ.get("ECHOMQ_T_MASTER_NAME", "")}
    if os.environ.get("ECHOMQ_T_MASTER_NAME")
    else {},
    echomq_min_replicas=int(os.environ.get("ECHOMQ_T_MIN_REPLICAS", "0")),
    echomq_result_ttl=int(os.environ.get("ECHOMQ_T_TTL", "86400")),
    echomq_store_retry_timeout=float(os.environ.get("ECHOMQ_T_STORE_RETRY", "20")),
    task_acks_late=os.environ.get("ECHOMQ_T_ACKS_LATE") == "1",
    task_reject_on_worker_lost=os.environ.get("ECHOMQ_T_ACKS_LATE") == "1",
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=int(os.environ.get("ECHOMQ_T_RESULT_EXPIRES", "3600")),
    # ECHOMQ_T_CHORDS=1: every chord of this app on the flow engine (tests/canvas/test_chords.py).
    echomq_chords=os.environ.get("ECHOMQ_T_CHORDS") == "1",
    # Where a worker's tasks send what names no queue (a chord a chain step sends).
    task_default_queue=os.environ.get("ECHOMQ_T_DEFAULT_QUEUE", "celery"),
    result_extended=os.environ.get("ECHOMQ_T_RESULT_EXTENDED") == "1",
    worker_send_task_events=os.environ.get("ECHOMQ_T_EVENTS") == "1",
)
if os.environ.get("ECHOMQ_TEST_WORKER") == "inprocess":
    # The fast tier's in-process worker shares this process: results still awaited when the
    # session's Redis stops are given up at once, not retried for twenty seconds at exit.
    app.conf.result_backend_transport_options = {"retry_policy": {"max_retries": 0}}
# ECHOMQ_T_PLAIN=1: a worker of a fleet not yet upgraded, whose app never calls install (it
# runs a flow's jobs as plain tasks and knows no echomq remote-control command).
if os.environ.get("ECHOMQ_T_PLAIN") != "1":
    celery_echomq.install(app)


def _store() -> redis.Redis:
    return redis.Redis.from_url(app.conf.echomq_redis_url)


def mark(name: str) -> None:
    """Count one execution of ``name`` (tests assert bodies ran exactly once)."""
    _store().incr(f"test:ran:{name}")


@app.task
def add(x: int, y: int) -> int:
    return x + y


@app.task
def square(x: int) -> int:
    return x * x


@app.task
def tsum(values: list[int]) -> int:
    return sum(values)


@app.task
def collect(values: list[Any], tag: str = "") -> dict[str, Any]:
    mark(f"collect:{tag}")
    return {"values": values, "tag": tag}


@app.task
def counted(x: int, tag: str) -> int:
    """Return x, counting each run under ``counted:<tag>``."""
    mark(f"counted:{tag}")
    return x


@app.task
def noargs() -> str:
    return "ran"


@app.task
def gated(x: int, gate: str) -> int:
    """Block until the key ``gate`` exists (the test opens it), then return x."""
    _wait_gate(gate)
    return x


@app.task
def boom(message: str = "boom") -> None:
    raise ValueError(message)


@app.task
def gated_boom(gate: str, message: str = "boom") -> None:
    """Fail once ``gate`` opens: a failure the test can order after other children."""
    _wait_gate(gate)
    raise ValueError(message)


@app.task
def flaky(x: int, flag: str) -> int:
    """Fail unless the key ``flag`` exists (the test sets it, then retries the flow); counts
    each run under ``flaky:<flag>``."""
    mark(f"flaky:{flag}")
    if not _store().exists(flag):
        raise ValueError(f"flag {flag} not set")
    return x


@app.task
def errback(task_id: str) -> None:
    """An old-style error callback: records which task failed."""
    _store().rpush("test:errback", task_id)


@app.task(bind=True, max_retries=3, default_retry_delay=0)
def retry_until(self: Any, x: int, succeed_on: int) -> int:
    """Retry until attempt ``succeed_on`` (1-based); past max_retries it fails for good."""
    mark(f"retry_until:{self.request.id}")
    if self.request.retries + 1 < succeed_on:
        raise self.retry(exc=RuntimeError(f"attempt {self.request.retries + 1}"))
    return x


@app.task(bind=True)
def reads_own(self: Any, values: list[Any]) -> dict[str, Any]:
    """A parent that reads its own flow's state from inside its body."""
    return {
        "values": values,
        "children": celery_echomq.children_values(self.request.id),
        "dependencies": list(celery_echomq.dependencies(self.request.id)),
        "ignored": celery_echomq.ignored_failures(self.request.id),
    }


@app.task(bind=True)
def whereami(self: Any, *args: Any) -> dict[str, Any]:
    """Where this delivery came from: its queue, priority and a custom header."""
    info = self.request.delivery_info or {}
    return {
        "args": list(args),
        "queue": info.get("routing_key"),
        "priority": info.get("priority"),
        "header": (self.request.headers or {}).get("x-trace"),
    }


@app.task(bind=True)
def group_of(self: Any, x: int) -> list[Any]:
    """The group this task was sent in, as Celery's request says: [group id, group index]."""
    return [self.request.group, self.request.group_index]


@app.task(time_limit=1)
def too_slow(seconds: float) -> None:
    time.sleep(seconds)


class Unpicklable(Exception):
    """An exception whose argument no serializer carries (a lock)."""


@app.task
def raises(kind: str) -> None:
    """Raise ``kind``: a plain ValueError, a Reject without requeue, or an exception whose
    argument cannot be serialized."""
    import threading

    from celery.exceptions import Reject

    if kind == "reject":
        raise Reject("no thanks", requeue=False)
    if kind == "unpicklable":
        raise Unpicklable(threading.Lock())
    raise ValueError("bad value", 42)


@app.task
def sleep_then(x: int, seconds: float) -> int:
    time.sleep(seconds)
    return x


@app.task(bind=True)
def slow_child(self: Any, x: int, seconds: float) -> int:
    """Count this run of this job id, then take ``seconds``: a queue of them is a backlog."""
    mark(f"slow:{self.request.id}")
    time.sleep(seconds)
    return x


@app.task(bind=True)
def replaced_by(self: Any, kind: str, x: int) -> Any:
    """A child that replaces itself (Task.replace) with a task, a chain, a group, a chord or a
    flow."""
    from celery import chain, chord, group

    mark(f"replaced_by:{self.request.id}")
    replacements = {
        "task": lambda: add.s(x, 100),
        "chain": lambda: chain(add.s(x, 1), add.s(100)),
        "group": lambda: group(add.s(x, 1), add.s(x, 2)),
        "chord": lambda: chord([add.s(x, 1), add.s(x, 2)], tsum.s()),
        "flow": lambda: celery_echomq.flow(tsum.s(), [add.s(x, 1), add.s(x, 2)]),
    }
    raise self.replace(replacements[kind]())


@app.task(bind=True)
def replaced_by_nested_chord(self: Any, x: int, key: str, width: int = 2) -> Any:
    """A task that replaces itself with a group holding a chain that starts with a chord
    (and, ``width`` 2, a task), the chord's body pushing its own id to the list ``key``."""
    from celery import chain, chord, group

    inner = chord([add.s(x, 1), add.s(x, 2)], pushes_own_id.s(key))
    raise self.replace(group([chain(inner, add.s(100)), add.s(x, 3)][:width]))


@app.task(bind=True)
def pushes_own_id(self: Any, values: list[int], key: str) -> int:
    """The sum of ``values``; this job's id pushed to the list ``key``."""
    _store().rpush(key, self.request.id)
    return sum(values)


@app.task(bind=True)
def replaced_parent(self: Any, values: list[int]) -> Any:
    """A flow parent that replaces itself: its value is the replacement's."""
    mark(f"replaced_parent:{self.request.id}")
    raise self.replace(tsum.si([v * 10 for v in values]))


# --- Tasks of tests/worker/test_exactly_once.py and tests/worker/test_recovery.py ---------------


class Flaky(Exception):
    """What ``autoretry_later`` raises until its last try."""


def _delivery(task_id: str) -> int:
    """Count this delivery of ``task_id`` (1 for the first) and return the count."""
    return int(_store().incr(f"test:delivery:{task_id}"))


# Every gate a task has waited on, so that each test's teardown opens what the test left
# closed (tests/conftest.py: a test that failed before opening its gate must not leave the
# session's worker blocked for the tests after it). Kept in a database of its own on the
# store's server, so that no test counting the store's keys ever counts it.
WAITING_GATES = "test:gates:waiting"
BOOKKEEPING_DB = 15


def _wait_gate(gate: str) -> None:
    """Block until the key ``gate`` exists (the test opens it)."""
    client = _store()
    kept = urlsplit(app.conf.echomq_redis_url)._replace(path=f"/{BOOKKEEPING_DB}").geturl()
    redis.Redis.from_url(kept).sadd(WAITING_GATES, gate)
    deadline = time.monotonic() + 120
    while not client.exists(gate):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {gate} never opened")
        time.sleep(0.05)


@app.task(bind=True)
def redeliver(self: Any, x: int, countdown: float = 0.0, gate: str = "") -> int:
    """Send this very message again once (same id, same headers): a duplicate delivery.

    Each delivery returns a different value (``x * 10 + delivery number``). With ``gate`` every
    delivery blocks until the gate opens, so both deliveries run at the same time.
    """
    n = _delivery(self.request.id)
    if gate:
        # Counted before the copy exists: a copy whose claim finds this delivery busy finds
        # it counted too, and a copy whose body ran would count a second start.
        _store().incr(f"test:started:{self.request.id}")
    if n == 1:
        self.signature_from_request().apply_async(countdown=countdown or None)
    if gate:
        _wait_gate(gate)
    return x * 10 + n


@app.task(bind=True)
def hang_first(self: Any, x: int) -> int:
    """The first delivery records its pool process id and hangs (the test kills it)."""
    n = _delivery(self.request.id)
    if n == 1:
        _store().set(f"test:pid:{self.request.id}", os.getpid())
        time.sleep(120)
    return x


@app.task(bind=True, max_retries=5)
def retry_later(self: Any, x: int, tries: int) -> int:
    """``self.retry(countdown=1)`` until the ``tries``-th delivery, then return x."""
    mark(f"retry_later:{self.request.id}")
    if self.request.retries + 1 < tries:
        raise self.retry(countdown=1)
    return x


@app.task(bind=True, max_retries=1)
def retry_once(self: Any, x: int, tag: str, countdown: float) -> int:
    """Retry once, ``countdown`` seconds on; counts each run under ``retry_once:<tag>``."""
    mark(f"retry_once:{tag}")
    if not self.request.retries:
        raise self.retry(countdown=countdown)
    return x


@app.task(
    bind=True, autoretry_for=(Flaky,), max_retries=5, default_retry_delay=1, retry_jitter=False
)
def autoretry_later(self: Any, x: int, tries: int) -> int:
    """Raise ``Flaky`` (autoretry_for) until the ``tries``-th delivery, then return x."""
    mark(f"autoretry_later:{self.request.id}")
    if self.request.retries + 1 < tries:
        raise Flaky(f"try {self.request.retries + 1}")
    return x


@app.task(ignore_result=True)
def add_quietly(x: int, y: int) -> int:
    """A task class that ignores its results: nothing is stored for it, in a flow or not."""
    return x + y


@app.task(track_started=True)
def gated_tracked(x: int, gate: str) -> int:
    """``gated`` with track_started: STARTED is stored while it waits for ``gate``."""
    _wait_gate(gate)
    return x


@app.task
def sleep_then_boom(seconds: float, message: str = "boom") -> None:
    time.sleep(seconds)
    raise ValueError(message)


# Crash points for tests/worker/test_recovery.py: with ECHOMQ_T_DIE_AT=dispatch (parent_failed,
# credit,
# publish_step) a pool process SIGKILLs itself where a worker publishes the parent its child
# just released (records the parent its child just failed, credits a child staged in its
# queue's outbox on its parent's slot, publishes the chain's step its step just made
# pending; publish_freed: publishes the child of a flow's window its child just made pending):
# a worker dying between two steps of the protocol. With run_released (tests/worker/
# test_batches.py), where a batch's runner runs the parent its last child just released.
# The worker's main process, where recovery runs, goes through unharmed.
_DIE_AT = os.environ.get("ECHOMQ_T_DIE_AT", "")
_DIE_POINTS = ("dispatch", "parent_failed", "credit", "publish_step", "publish_freed")
if _DIE_AT in (*_DIE_POINTS, "run_released"):
    import logging
    import signal as _signal

    from billiard.process import current_process

    from celery_echomq.worker import batches as _batches
    from celery_echomq.worker import settle as _settle

    # Publishing a released parent: handed to the completion that released it
    # (publish_handed), or claimed by the dispatch script (dispatch_parent).
    _steps = {"dispatch": ("dispatch_parent", "publish_handed"), "credit": ("credit_remote",)}

    def _dying(original: Any) -> Any:
        def _die(*args: Any, **kwargs: Any) -> Any:
            if current_process().name == "MainProcess":
                return original(*args, **kwargs)
            logging.getLogger("tests.proj").warning(
                "pool process %d killed itself at %s", os.getpid(), _DIE_AT
            )
            os.kill(os.getpid(), _signal.SIGKILL)
            return None

        return _die

    _module = _batches if _DIE_AT == "run_released" else _settle
    for _step in _steps.get(_DIE_AT, (_DIE_AT,)):
        setattr(_module, _step, _dying(getattr(_module, _step)))


# --- Tasks of tests/send/test_grow.py: children added while a flow runs; flows in chord bodies ---


@app.task(bind=True)
def spawner(self: Any, x: int, more: list[int], queue: str = "", gate: str = "") -> int:
    """A flow child that adds ``add(m, 0)`` for each m in ``more`` as its siblings, then
    returns x (after ``gate`` opens, when given: the test looks at the flow in between)."""
    options = {"queue": queue} if queue else {}
    celery_echomq.add_children([add.s(m, 0).set(**options) for m in more])
    if gate:
        _wait_gate(gate)
    return x


@app.task(bind=True)
def spawn_flow(self: Any, x: int, inner: list[int]) -> int:
    """A flow child that adds a nested flow ``tsum(add(i, 0) for i in inner)`` as a sibling."""
    celery_echomq.add_children([celery_echomq.flow(tsum.s(), [add.s(i, 0) for i in inner])])
    return x


@app.task(bind=True)
def replace_by_flow(self: Any, x: int) -> Any:
    """Replace this task (in a chain or a chord's header) by a flow: tsum([x + 1, x + 2])."""
    mark(f"replace_by_flow:{self.request.id}")
    raise self.replace(celery_echomq.flow(tsum.s(), [add.s(x, 1), add.s(x, 2)]))


# --- Tasks of tests/peers/test_celery_chords.py: Celery's t/integration/tasks.py, for flows -----
# A task that replaces itself returns ``self.replace(...)``: in eager mode ``replace`` gives the
# replacement's value back instead of raising.


class ExpectedException(Exception):
    """What ``fail`` raises (Celery's sentinel exception of its integration tests)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExpectedException) and self.args == other.args

    def __hash__(self) -> int:
        return hash(self.args)


@app.task
def size(value: str) -> int:
    """The length of ``value``: a small value from a large argument."""
    return len(value)


@app.task
def identity(x: Any) -> Any:
    return x


@app.task
def add_z(x: Any, y: Any, z: Any = None) -> Any:
    """Celery's ``add``: two numbers, or three."""
    return x + y + z if z else x + y


@app.task
def fail(*args: Any) -> None:
    raise ExpectedException("Task expected to fail", *args)


@app.task
def xsum(nums: list[Any]) -> int:
    """The sum of numbers and of lists of numbers."""
    return sum(sum(n) if isinstance(n, list) else n for n in nums)


@app.task(bind=True)
def add_replaced(self: Any, x: int, y: int) -> Any:
    return self.replace(add.s(x, y))


@app.task(bind=True)
def add_to_all(self: Any, nums: list[Any], val: Any) -> Any:
    """Replace this task by a group adding ``val`` to each of ``nums``."""
    from celery import group

    return self.replace(group(*[add.s(num, val) for num in nums]))


@app.task(bind=True)
def add_to_all_to_flow(self: Any, nums: list[int], val: int) -> int:
    """Celery's ``add_to_all_to_chord``: add ``add(num, val)`` siblings, then return 0."""
    celery_echomq.add_children([add.s(num, val) for num in nums])
    return 0


@app.task(bind=True)
def add_flow_to_flow(self: Any, nums: list[int], val: int) -> int:
    """Celery's ``add_chord_to_chord``: add a nested flow summing ``add(num, val)``."""
    celery_echomq.add_children([celery_echomq.flow(tsum.s(), [add.s(num, val) for num in nums])])
    return 0


@app.task(bind=True)
def replace_with_chain(
    self: Any, *args: Any, link_msg: Any = None, link_key: str = "redis-echo"
) -> Any:
    from celery import chain

    c = chain(identity.s(*args), identity.s())
    link_sig = redis_echo.s(redis_key=link_key)
    if link_msg is not None:
        link_sig.args = (link_msg,)
        link_sig.set(immutable=True)
    c.link(link_sig)
    return self.replace(c)


@app.task
def redis_echo(message: Any, redis_key: str = "redis-echo") -> None:
    """Append ``message`` to the list ``redis_key`` of the flow store's database: as it is
    if Redis takes it (a string, a number), else as JSON (a link's list of values)."""
    scalar = isinstance(message, str | bytes | int | float)
    _store().rpush(redis_key, message if scalar else json.dumps(message))


@app.task
def redis_count(redis_key: str = "redis-count") -> None:
    _store().incr(redis_key)


@app.task
def errback_old_style(request_id: str) -> str:
    redis_count(request_id)
    return request_id


@app.task
def errback_new_style(request: Any, exc: Any, tb: Any) -> str:
    redis_count(request.id)
    return str(request.id)


@app.task
def print_unicode(log_message: str = "håå®ƒ valmuefrø", print_message: str = "hiöäüß") -> None:
    import logging

    logging.getLogger("tests.proj").warning(log_message)
    print(print_message)


@app.task(bind=True)
def return_priority(self: Any, *_args: Any) -> str:
    return f"Priority: {self.request.delivery_info['priority']}"


@app.task(bind=True)
def return_request_eta(self: Any, *_args: Any) -> Any:
    return self.request.eta


@app.task
def delayed_sum(numbers: list[int], pause_time: float = 1) -> int:
    time.sleep(pause_time)
    return sum(numbers)


@app.task
def delayed_sum_with_soft_guard(numbers: list[int], pause_time: float = 1) -> int:
    from celery.exceptions import SoftTimeLimitExceeded

    try:
        time.sleep(pause_time)
        return sum(numbers)
    except SoftTimeLimitExceeded:
        return 0


@app.task
def write_to_file_and_return_int(file_name: str, i: int) -> int:
    with open(file_name, mode="a", buffering=1) as handle:
        handle.write(f"{i}\n")
    return i


@app.task(bind=True)
def ids(self: Any, i: int) -> tuple[Any, Any, int]:
    """``(root_id, parent_id, i)`` of this run."""
    return self.request.root_id, self.request.parent_id, i


@app.task(bind=True)
def collect_ids(self: Any, res: Any, i: int) -> tuple[Any, tuple[Any, Any, int]]:
    """``(previous result, (root_id, parent_id, i))`` of this run."""
    return res, (self.request.root_id, self.request.parent_id, i)


@app.task
def return_nested_flow(kind: str) -> Any:
    """A nested canvas holding a flow (never run): Celery's ``return_nested_signature_*``."""
    from celery import chain, group

    def inner() -> Any:
        return celery_echomq.flow(add.s(), [add.s()])

    canvases = {
        "chain_flow": lambda: chain(inner()),
        "group_flow": lambda: group(inner()),
        "flow_chain": lambda: celery_echomq.flow(add.s(), [chain([add.s()])]),
        "flow_group": lambda: celery_echomq.flow(add.s(), group([add.s()])),
        "flow_flow": lambda: celery_echomq.flow(add.s(), [inner()]),
    }
    return canvases[kind]()


@app.task
def rebuild_signature(sig_dict: dict[str, Any]) -> list[str]:
    """Rebuild a canvas from its JSON and walk it: the kinds met, depth first (a signature
    that did not come back as one raises ``TypeError``)."""
    from celery import Signature, chord, group
    from celery.canvas import _chain

    seen: list[str] = []

    def walk(sig: Any) -> None:
        if not isinstance(sig, Signature):
            raise TypeError(f"{sig!r} is not a signature object")
        seen.append(sig.subtask_type or "task")
        if isinstance(sig, celery_echomq.flow):
            walk(sig.parent)
            for child in sig.children:
                walk(child)
        elif isinstance(sig, (_chain, group, chord)):
            for task in sig.tasks:
                walk(task)
            if isinstance(sig, chord):
                walk(sig.body)

    walk(Signature.from_dict(sig_dict, app=app))
    return seen


@app.task(bind=True)
def lineage(self: Any, *args: Any) -> dict[str, Any]:
    """A parent that reports its own lineage: the task it is the child of, and the root."""
    return {"parent_id": self.request.parent_id, "root_id": self.request.root_id}


# --- Tasks of tests/canvas/test_faults.py -------------------------------------------------------


@app.task(bind=True)
def redeliver_boom(self: Any, message: str = "boom", countdown: float = 0.0) -> None:
    """``redeliver`` that fails: send this very message again once, then raise."""
    if _delivery(self.request.id) == 1:
        self.signature_from_request().apply_async(countdown=countdown or None)
    raise ValueError(message)


@app.task
def flow_add_eager(x: int, y: int) -> Any:
    """Celery's ``chord_add``: apply a flow from inside a task; its value, read without
    ``get()`` (which a task may not call, on an eager result as on any)."""
    return celery_echomq.flow(tsum.s(), [add.s(x, x), add.s(y, y)]).apply_async().result


# --- Tasks of tests/canvas/test_lineage.py ------------------------------------------------------


@app.task(bind=True)
def flow_of_ids(self: Any, how: str) -> Any:
    """Start ``flow(collect_ids(i=0), [ids(i=1), ids(i=2)])`` from inside this task (``how``:
    ``apply``, eagerly, or ``apply_async``): its value (eager) or its id, and this task's own
    root."""
    res = getattr(celery_echomq.flow(collect_ids.s(i=0), [ids.si(i=1), ids.si(i=2)]), how)()
    return (res.result if how == "apply" else res.id), self.request.root_id


# --- Tasks of tests/test_window.py --------------------------------------------------------------

# The most of a key's value seen: SET when higher (one atomic step).
_PEAK = (
    "if tonumber(redis.call('GET', KEYS[1]) or '0') < tonumber(ARGV[1]) then "
    "redis.call('SET', KEYS[1], ARGV[1]) end"
)


@app.task
def windowed(x: int, key: str, queue: str = "celery", seconds: float = 0.0) -> int:
    """Record itself under ``key``: ``key:order`` its start order, ``key:peak`` the most
    children running at once, ``key:out`` the most of ``queue``'s flow jobs pending or active
    in the store (what was published or running) when it started; then sleep, return x."""
    store = _store()
    running = store.incr(f"{key}:now")
    pipe = store.pipeline(transaction=False)
    pipe.zcard(f"emq:{{{queue}}}:pending")
    pipe.zcard(f"emq:{{{queue}}}:active")
    pending, active = pipe.execute()
    store.eval(_PEAK, 1, f"{key}:peak", running)
    store.eval(_PEAK, 1, f"{key}:out", pending + active)
    store.rpush(f"{key}:order", x)
    time.sleep(seconds)
    store.decr(f"{key}:now")
    return x


@app.task
def windowed_boom(x: int, key: str) -> None:
    """Record its start as :func:`windowed` does, then fail."""
    _store().rpush(f"{key}:order", x)
    raise ValueError(f"child {x} failed")


if os.environ.get("ECHOMQ_T_OTEL_FILE") or os.environ.get("ECHOMQ_T_OTEL_NULL"):
    # Tracing tests (tests/test_tracing.py): this worker records its spans into that file;
    # benchmarks/tracing_cost.py: spans made and dropped.
    from tests.otel_setup import configure

    configure(os.environ.get("ECHOMQ_T_OTEL_FILE", ""))


# --- Tasks of tests/canvas/test_chords.py: chords on the flow engine ------------------------------


@app.task(bind=True)
def add_to_chord_all(self: Any, nums: list[int], val: int) -> int:
    """Celery's ``add_to_all_to_chord``: ``self.add_to_chord(add(num, val))`` each, then 0."""
    for num in nums:
        self.add_to_chord(add.s(num, val))
    return 0


@app.task
def errback_kind(request: Any, exc: Any, tb: Any) -> None:
    """A new-style errback: records the class of the error it got, and whether it is a
    ``ChordError``, under ``errback-kind:<id>`` (the id it was called with)."""
    from celery.exceptions import ChordError

    kind = f"{type(exc).__name__} chord_error={isinstance(exc, ChordError)}"
    _store().rpush(f"errback-kind:{request.id}", kind)


@app.task(bind=True)
def lineages(self: Any, values: list[Any]) -> dict[str, Any]:
    """A chord body's lineage and its header's (``lineage``'s values)."""
    return {"header": values, "parent_id": self.request.parent_id, "root_id": self.request.root_id}


@app.task(bind=True)
def lineage_chord_in_worker(self: Any) -> list[str]:
    """Sends a chord of ``lineage`` tasks from a worker: this task's id and the body's."""
    from celery import chord

    return [self.request.id, chord([lineage.s(), lineage.s()])(lineages.s()).id]


@app.task
def chord_in_worker(xs: list[int]) -> Any:
    """Sends a chord from a worker (what the worker's own setting decides): its body's id."""
    from celery import chord

    return chord([add.s(x, x) for x in xs])(tsum.s()).id


@app.task
def hedge(x: int, tag: str, delay: float = 0.0) -> int:
    """A replica's answer (flow(..., quorum=K)): sleep ``delay``, then return x; counts each
    run under ``hedge:<tag>:<x>`` and appends x to ``test:hedge:<tag>`` as it finishes."""
    mark(f"hedge:{tag}:{x}")
    time.sleep(delay)
    _store().rpush(f"test:hedge:{tag}", x)
    return x


@app.task
def echo(value: Any) -> Any:
    """Return ``value`` as is (a child whose value a flow's reducer folds)."""
    return value


# --- Tasks of tests/worker/test_batches.py: children delivered many to a message ---------------


@app.task(bind=True)
def own_request(self: Any, x: int) -> dict[str, Any]:
    """What this delivery's ``self.request`` says of it."""
    request = self.request
    return {
        "x": x,
        "id": request.id,
        "root_id": request.root_id,
        "parent_id": request.parent_id,
        "retries": request.retries,
        "args": list(request.args or ()),
        "queue": (request.delivery_info or {}).get("routing_key"),
        "eager": bool(request.is_eager),
    }


@app.task
def forgets_scripts(x: int, tag: str) -> int:
    """Return x, counted under ``counted:<tag>``, once the store has lost every script it had
    loaded (SCRIPT FLUSH: what a restart leaves): the next script its worker sends meets
    NOSCRIPT."""
    mark(f"counted:{tag}")
    _store().script_flush()
    return x
