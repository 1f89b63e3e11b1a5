"""A fleet half upgraded runs nothing twice: a producer of this release sends chords on the
engine (``echomq_chords``) and plain flows; a worker without the extension (its app never calls
``install``) runs the jobs as plain tasks, then it stops and a worker with the extension takes
the queue; or a worker of the last release runs beside one of this one. Each job body runs
once and the parent once, with the values it was sent for; on the fast path (the result
backend on the store's own database) as with the backend on a database of its own.

The producer is an app of its own, configured like the workers (the same broker and store,
the backend under test, ``echomq_chords`` on); it sends the tests.proj tasks by name. Runs
are counted in the store's database (tests/proj.py's ``mark``), which outlives the workers.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, chord
from celery.exceptions import ChordError

import celery_echomq
from celery_echomq import FlowFailed, flow
from celery_echomq.embedded.worker import WorkerProcess
from tests.helpers import (
    KEYS,
    LOGDIR,
    ROOT,
    Env,
    fast_recovery,
    logged,
    release_tree,
    wait_for,
)

pytestmark = pytest.mark.e2e

TIMEOUT = 90
HEADER = 3  # the header tasks (a flow's children) of each chord or flow sent
# The last landed release: its workers run beside this release's during a rolling upgrade.
LAST_RELEASE = "a1b939b"
KINDS = ("chord", "flow")


def producer(env: Env, backend: str) -> Celery:
    app = Celery("producer", set_as_current=False)
    app.conf.update(
        broker_url=env.broker,
        result_backend=backend,
        echomq_redis_url=env.store,
        echomq_chords=True,
        broker_connection_retry_on_startup=True,
    )
    celery_echomq.install(app)
    return app


def task(app: Celery, name: str, *args: Any, **kwargs: Any) -> Any:
    return app.signature(f"tests.proj.{name}", args, kwargs)


@pytest.fixture(params=["fast path", "own database"])
def backend(request: pytest.FixtureRequest, env: Env) -> str:
    """The result backend: the store's own database (where the store writes a flow job's
    result itself), or another database of the same server (Celery writes it)."""
    return env.store if request.param == "fast path" else f"{env.base}/12"


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def send(app: Celery, kind: str, queue: str, tag: str) -> tuple[Any, list[str]]:
    """A chord (on the engine) or a flow of HEADER counted tasks under ``collect``: its
    result and the header tasks' ids."""
    header = [
        task(app, "counted", i, f"{tag}-{i}").set(task_id=f"JOB{uuid.uuid4().hex}", queue=queue)
        for i in range(HEADER)
    ]
    ids = [str(sig.options["task_id"]) for sig in header]
    body = task(app, "collect", tag=tag).set(queue=queue)
    if kind == "chord":
        return chord(header, body).apply_async(), ids
    return flow(body, header).apply_async(queue=queue), ids


def ran(store: redis.Redis, name: str) -> int:
    return int(store.get(f"test:ran:{name}") or 0)


def header_runs(store: redis.Redis, tag: str) -> list[int]:
    return [ran(store, f"counted:{tag}-{i}") for i in range(HEADER)]


def settled(store: redis.Redis, queue: str, res: Any, tag: str) -> None:
    """The body ran once with every header task's value, each header task ran once, and the
    store finished the flow."""
    assert res.get(timeout=TIMEOUT) == {"values": list(range(HEADER)), "tag": tag}
    wait_for(lambda: store.hget(KEYS.job_key(queue, res.id), "state") == b"done", timeout=60)
    assert header_runs(store, tag) == [1] * HEADER
    assert ran(store, f"collect:{tag}") == 1


def test_jobs_a_worker_without_the_extension_ran_are_settled_never_run_again(
    env: Env,
    proj: Any,
    store: redis.Redis,
    own_queue: Any,
    start_worker: Any,
    backend: str,
    kind: str,
) -> None:
    queue, tag = own_queue("fleet"), uuid.uuid4().hex
    app = producer(env, backend)
    try:
        # Not upgraded yet: it runs every header task as a plain task, and nothing reaches
        # the flow (its rows stay pending, their messages acknowledged).
        old = start_worker(
            queues=queue, extra_env=fast_recovery(ECHOMQ_T_PLAIN="1", ECHOMQ_T_BACKEND=backend)
        )
        res, ids = send(app, kind, queue, tag)
        wait_for(lambda: header_runs(store, tag) == [1] * HEADER, timeout=TIMEOUT)
        wait_for(lambda: all(f"{cid}] succeeded" in old.output() for cid in ids), timeout=30)
        old.stop()
        assert {store.hget(KEYS.job_key(queue, cid), "state") for cid in ids} == {b"pending"}

        new = start_worker(queues=queue, extra_env=fast_recovery(ECHOMQ_T_BACKEND=backend))
        settled(store, queue, res, tag)
        for cid in ids:
            logged(new, f"completed {cid} from its SUCCESS result")
            assert f"{cid}] received" not in new.output()
        assert not store.hget(KEYS.queue_key(queue, "counters"), "republished")
    finally:
        app.close()


def test_a_failure_a_worker_without_the_extension_ran_fails_the_flow_once(
    env: Env, proj: Any, store: redis.Redis, own_queue: Any, start_worker: Any, kind: str
) -> None:
    """On the fast path: the header task that failed there is failed from its FAILURE, the
    others completed from their SUCCESS, none run again, and the body never runs."""
    queue, tag, flag = own_queue("fleetfail"), uuid.uuid4().hex, f"flag:{uuid.uuid4().hex}"
    app = producer(env, env.store)
    try:
        old = start_worker(
            queues=queue, extra_env=fast_recovery(ECHOMQ_T_PLAIN="1", ECHOMQ_T_BACKEND=env.store)
        )
        good = task(app, "counted", 1, tag).set(task_id=f"JOB{uuid.uuid4().hex}", queue=queue)
        bad = task(app, "flaky", 2, flag).set(task_id=f"JOB{uuid.uuid4().hex}", queue=queue)
        body = task(app, "collect", tag=tag).set(queue=queue)
        ids = [good.options["task_id"], bad.options["task_id"]]
        res = (
            chord([good, bad], body).apply_async()
            if kind == "chord"
            else flow(body, [good, bad]).apply_async(queue=queue)
        )
        wait_for(lambda: all(f"{cid}] " in old.output() for cid in ids), timeout=TIMEOUT)
        wait_for(lambda: f"{ids[1]}] raised unexpected" in old.output(), timeout=30)
        wait_for(lambda: f"{ids[0]}] succeeded" in old.output(), timeout=30)
        old.stop()

        new = start_worker(queues=queue, extra_env=fast_recovery(ECHOMQ_T_BACKEND=env.store))
        if kind == "chord":
            # get() raises the failed header task's own error; the body's result is the
            # ChordError Celery words (tests/canvas/test_chords.py).
            with pytest.raises(ValueError, match=f"flag {flag} not set"):
                res.get(timeout=TIMEOUT)
            wait_for(lambda: res.state == "FAILURE", timeout=30)
            assert isinstance(res.result, ChordError)
            assert str(res.result).startswith(f"Dependency {ids[1]} raised ValueError(")
        else:
            with pytest.raises(FlowFailed) as failed:
                res.get(timeout=TIMEOUT)
            assert failed.value.child_id == ids[1]
        logged(new, f"failed {ids[1]} from its FAILURE result")
        logged(new, f"completed {ids[0]} from its SUCCESS result")
        assert ran(store, f"counted:{tag}") == ran(store, f"flaky:{flag}") == 1
        assert ran(store, f"collect:{tag}") == 0
    finally:
        app.close()


def test_on_the_fast_path_a_worker_with_the_extension_stores_each_result_once_in_the_script(
    env: Env, proj: Any, store: redis.Redis, own_queue: Any, start_worker: Any, kind: str
) -> None:
    """Flow messages no longer say ``ignore_result``: a worker with the extension still
    leaves the SUCCESS to the completing script, written once (MONITOR: no SET of a job's
    result from a client, one from Lua)."""
    queue, tag = own_queue("fleetfast"), uuid.uuid4().hex
    start_worker(queues=queue, extra_env={"ECHOMQ_T_BACKEND": env.store})
    app = producer(env, env.store)
    seen: list[dict[str, Any]] = []
    try:
        with redis.Redis.from_url(env.store).monitor() as monitor:
            res, ids = send(app, kind, queue, tag)
            assert res.get(timeout=TIMEOUT) == {"values": list(range(HEADER)), "tag": tag}
            marker = f"end-{uuid.uuid4().hex}"
            redis.Redis.from_url(env.store).echo(marker)
            for command in monitor.listen():
                if marker in command["command"]:
                    break
                seen.append(command)
        for cid in ids:
            key = f"celery-task-meta-{cid}"
            writes = [
                c for c in seen if c["command"].split(" ")[:2] in (["SET", key], ["SETEX", key])
            ]
            assert [c["client_type"] for c in writes] == ["lua"], [
                c for c in seen if key in c["command"]
            ]
        header = redis.Redis.from_url(env.broker)  # nothing left on the queue
        assert header.llen(queue) == 0
        assert header_runs(store, tag) == [1] * HEADER
    finally:
        app.close()


def test_a_retry_a_worker_without_the_extension_ran_is_settled_never_run_again(
    env: Env, proj: Any, store: redis.Redis, own_queue: Any, start_worker: Any
) -> None:
    """A worker with the extension holds the job's result back while it runs it; the retry
    it sends is silent on ignore_result all the same, so the worker without the extension
    that takes the retry stores its result."""
    queue, tag = own_queue("fleetretry"), uuid.uuid4().hex
    app = producer(env, env.store)
    recovering = fast_recovery(ECHOMQ_T_BACKEND=env.store)
    try:
        first = start_worker(queues=queue, extra_env=recovering)
        cid = f"JOB{uuid.uuid4().hex}"
        child = task(app, "retry_once", 5, tag, 4).set(task_id=cid, queue=queue)
        res = flow(task(app, "collect", tag=tag).set(queue=queue), [child]).apply_async()
        wait_for(lambda: ran(store, f"retry_once:{tag}") == 1, timeout=TIMEOUT)
        logged(first, f"echomq: retry {cid} -> retried")
        first.stop()  # its retry's message, not due yet, goes back to the queue
        assert ran(store, f"retry_once:{tag}") == 1

        old = start_worker(
            queues=queue, extra_env=fast_recovery(ECHOMQ_T_PLAIN="1", ECHOMQ_T_BACKEND=env.store)
        )
        wait_for(lambda: f"{cid}] succeeded" in old.output(), timeout=TIMEOUT)
        old.stop()

        new = start_worker(queues=queue, extra_env=recovering)
        assert res.get(timeout=TIMEOUT) == {"values": [5], "tag": tag}
        logged(new, f"completed {cid} from its SUCCESS result")
        assert ran(store, f"retry_once:{tag}") == 2  # the first run and its retry
        assert ran(store, f"collect:{tag}") == 1
    finally:
        app.close()


@pytest.fixture
def last_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return release_tree(LAST_RELEASE, tmp_path_factory)


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for w in started:
        w.stop()


def test_a_worker_of_the_last_release_beside_one_of_this_release_runs_nothing_twice(
    env: Env,
    proj: Any,
    store: redis.Redis,
    own_queue: Any,
    backend: str,
    last_release: Path,
    workers: list[WorkerProcess],
) -> None:
    queue, tag = own_queue("fleetlast"), uuid.uuid4().hex
    for where, path in ((last_release, str(last_release)), (ROOT, str(ROOT))):
        name = f"fl{uuid.uuid4().hex[:8]}"
        environ = env.environ(**fast_recovery(ECHOMQ_T_BACKEND=backend))
        environ["PYTHONPATH"] = path  # the release's celery_echomq and tests.proj first
        w = WorkerProcess(
            "tests.proj", log=LOGDIR / f"{name}.log", cwd=where, env=environ, queues=queue,
            concurrency=1, name=name,
        )  # fmt: skip
        workers.append(w)
        w.start()
    app = producer(env, backend)
    try:
        tags = [f"{tag}-{n}" for n in range(6)]
        sent = [send(app, KINDS[n % 2], queue, t) for n, t in enumerate(tags)]
        for t, (res, ids) in zip(tags, sent, strict=True):
            settled(store, queue, res, t)
            assert {store.hget(KEYS.job_key(queue, cid), "state") for cid in ids} == {b"done"}
        # Both releases took part.
        # A worker logs a task's end after its result: the last may still be writing its line.
        wait_for(lambda: all("] succeeded" in w.output() for w in workers), timeout=30)
        assert not store.hget(KEYS.queue_key(queue, "counters"), "republished")
    finally:
        app.close()


def test_a_worker_of_the_last_release_recovers_a_chord_from_rows_this_release_wrote(
    env: Env,
    proj: Any,
    store: redis.Redis,
    own_queue: Any,
    last_release: Path,
    workers: list[WorkerProcess],
) -> None:
    # This release keeps a header task's place in its group beside its row's delta: the last
    # release's recovery reads such rows. Every message of a chord is lost and a worker of
    # the last release alone re-publishes and runs them: each once, the body with every value.
    queue, tag = own_queue("fleetrows"), uuid.uuid4().hex
    app = producer(env, env.store)
    try:
        res, _ = send(app, "chord", queue, tag)
        redis.Redis.from_url(env.broker).delete(queue)  # every header message lost
        environ = env.environ(**fast_recovery(ECHOMQ_T_BACKEND=env.store))
        environ["PYTHONPATH"] = str(last_release)
        name = f"fr{uuid.uuid4().hex[:8]}"
        w = WorkerProcess(
            "tests.proj", log=LOGDIR / f"{name}.log", cwd=last_release, env=environ,
            queues=queue, concurrency=1, name=name,
        )  # fmt: skip
        workers.append(w)
        w.start()
        settled(store, queue, res, tag)
        # Its recovery re-published each header task from its row.
        assert store.hget(KEYS.queue_key(queue, "counters"), "republished") == str(HEADER).encode()
    finally:
        app.close()


def test_a_batch_message_a_worker_without_the_extension_drops_loses_no_child(
    env: Env, proj: Any, store: redis.Redis, own_queue: Any, start_worker: Any
) -> None:
    """A producer of this release sends a flow with ``batch``; a worker without the extension
    takes the batch message, an unregistered task to it, and drops it. Its children are
    pending rows with no message: a worker with the extension re-publishes each on its own,
    and each runs once, the parent once."""
    queue, tag = own_queue("fleet"), uuid.uuid4().hex
    app = producer(env, env.store)
    try:
        old = start_worker(queues=queue, extra_env=fast_recovery(ECHOMQ_T_PLAIN="1"))
        header = [task(app, "counted", i, f"{tag}-{i}").set(queue=queue) for i in range(HEADER)]
        body = task(app, "collect", tag=tag).set(queue=queue)
        res = flow(body, header, batch=HEADER).apply_async(queue=queue)
        wait_for(lambda: "celery_echomq.batch" in old.output(), timeout=TIMEOUT)
        old.stop()
        assert header_runs(store, tag) == [0] * HEADER

        start_worker(queues=queue, extra_env=fast_recovery())
        settled(store, queue, res, tag)
    finally:
        app.close()
