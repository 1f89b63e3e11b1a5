"""Results the store writes: where the result backend is Celery's Redis backend on the flow
store's own server and database, a flow job's result is written by its completion script, and
``AsyncResult(job_id)`` reads what Celery itself would have stored.

The workers here run tests/proj.py with ``ECHOMQ_T_BACKEND`` set to the store's database (the
fused path) or to another database (Celery's path), on a queue of each test's own. The caller
is an app of its own configured the same way; it sends the tests.proj tasks by name.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from billiard.exceptions import TimeLimitExceeded
from celery import Celery
from celery.exceptions import TaskRevokedError
from celery.result import AsyncResult

import celery_echomq
from celery_echomq import flow
from celery_echomq.store.codec import load_job, read_stored
from celery_echomq.store.headers import H_RESULT
from celery_echomq.store.scripts import ParentRef, ResultWrite, Scripts
from celery_echomq.store.state import get_state
from celery_echomq.wire.results import RESULT_KEYS, fusable, result_write
from tests.helpers import KEYS, Env, needs_own_backend_db, wait_for

TIMEOUT = 60
EXPIRES = 3600  # tests/proj.py's result_expires


def caller(env: Env, backend: str, **conf: Any) -> Celery:
    app = Celery("caller", set_as_current=False)
    app.conf.update(
        broker_url=env.broker,
        result_backend=backend,
        echomq_redis_url=env.store,
        broker_connection_retry_on_startup=True,
        result_expires=EXPIRES,
        **conf,
    )
    celery_echomq.install(app)
    return app


def task(app: Celery, name: str, *args: Any, **options: Any) -> Any:
    return app.signature(f"tests.proj.{name}", args, {}, **options)


@pytest.fixture
def fused(env: Env, own_queue: Any, start_worker: Any) -> Iterator[tuple[Celery, str]]:
    """A caller and a worker (result_extended) whose result backend is the store's database."""
    queue = own_queue("fused")
    start_worker(
        queues=queue,
        extra_env={"ECHOMQ_T_BACKEND": env.store, "ECHOMQ_T_RESULT_EXTENDED": "1"},
    )
    app = caller(env, env.store, result_extended=True)
    # The worker reads the same URLs: its backend is the store's too.
    assert fusable(get_state(app), app.backend)
    yield app, queue
    app.close()


def stored(env: Env, url: str, task_id: str) -> dict[str, Any] | None:
    raw = redis.Redis.from_url(url).get(f"celery-task-meta-{task_id}")
    return None if raw is None else dict(json.loads(raw))


def headers_of(app: Celery, queue: str, job_id: str) -> tuple[dict[str, Any], Any]:
    """The stored message of a flow job: its headers and its ignore_result option."""
    state = get_state(app)
    kept = read_stored(state, queue, job_id)
    assert kept is not None
    options = load_job(state, queue, job_id, kept)["options"]
    return options.get("headers") or {}, options.get("ignore_result")


def comparable(meta: dict[str, Any]) -> dict[str, Any]:
    """A stored meta without what differs between two runs of one task (its id, when)."""
    return {k: v for k, v in meta.items() if k not in ("task_id", "date_done", "args")}


def test_a_childs_stored_result_is_what_celery_stores_for_a_plain_task(
    env: Env, fused: tuple[Celery, str]
) -> None:
    app, queue = fused
    ids = [f"JOB{uuid.uuid4().hex}" for _ in range(3)]
    children = [task(app, "add", i, i, task_id=cid) for i, cid in enumerate(ids)]
    res = flow(task(app, "tsum", queue=queue), children).apply_async(queue=queue)
    assert res.get(timeout=TIMEOUT) == 6
    plain = app.send_task("tests.proj.add", (2, 2), queue=queue)
    assert plain.get(timeout=TIMEOUT) == 4

    # Marked, and silent on ignore_result: a worker without the extension would store the
    # result itself (tests/worker/test_mixed_fleet.py shows that only the script writes it).
    for job_id in (*ids, res.id):
        headers, ignore = headers_of(app, queue, job_id)
        assert headers[H_RESULT] == "1" and ignore is None
    assert [AsyncResult(cid, app=app).get(timeout=TIMEOUT) for cid in ids] == [0, 2, 4]
    reference = stored(env, env.store, plain.id)
    assert reference is not None
    for i, cid in enumerate(ids):
        meta = stored(env, env.store, cid)
        assert meta is not None
        assert meta["task_id"] == cid and meta["date_done"] and meta["args"] == [i, i]
        assert set(meta) == set(reference)
        assert comparable(meta) == {**comparable(reference), "result": 2 * i}
        assert meta["name"] == "tests.proj.add" and meta["queue"] == queue
        ttl = redis.Redis.from_url(env.store).ttl(f"celery-task-meta-{cid}")
        assert EXPIRES - 60 < ttl <= EXPIRES
    parent = stored(env, env.store, res.id)
    assert parent is not None
    assert parent["status"] == "SUCCESS" and parent["result"] == 6
    assert parent["name"] == "tests.proj.tsum"


def test_without_result_extended_the_meta_is_celerys_too(
    env: Env, own_queue: Any, start_worker: Any
) -> None:
    queue = own_queue("plainmeta")
    start_worker(queues=queue, extra_env={"ECHOMQ_T_BACKEND": env.store})
    app = caller(env, env.store)
    try:
        cid = f"JOB{uuid.uuid4().hex}"
        res = flow(
            task(app, "tsum", queue=queue), [task(app, "add", 3, 4, task_id=cid)]
        ).apply_async(queue=queue)
        assert res.get(timeout=TIMEOUT) == 7
        plain = app.send_task("tests.proj.add", (3, 4), queue=queue)
        assert plain.get(timeout=TIMEOUT) == 7
        meta, reference = stored(env, env.store, cid), stored(env, env.store, plain.id)
        assert meta is not None and reference is not None
        assert (
            set(meta)
            == set(reference)
            == {
                "status",
                "result",
                "traceback",
                "children",
                "date_done",
                "task_id",
            }
        )
        assert comparable(meta) == comparable(reference)
        assert meta["task_id"] == cid and meta["date_done"]
    finally:
        app.close()


def test_a_failing_child_raises_as_a_chord_child_would(env: Env, fused: tuple[Celery, str]) -> None:
    app, queue = fused
    bad = f"JOB{uuid.uuid4().hex}"
    res = flow(
        task(app, "collect", queue=queue),
        [task(app, "boom", "no", task_id=bad, parent_policy="ignore"), task(app, "add", 1, 1)],
    ).apply_async(queue=queue)
    assert res.get(timeout=TIMEOUT)["values"] == [2]
    with pytest.raises(ValueError, match="no"):
        AsyncResult(bad, app=app).get(timeout=TIMEOUT)
    plain = app.send_task("tests.proj.boom", ("no",), queue=queue)
    with pytest.raises(ValueError):
        plain.get(timeout=TIMEOUT)
    meta, reference = stored(env, env.store, bad), stored(env, env.store, plain.id)
    assert meta is not None and reference is not None
    assert set(meta) == set(reference)
    assert meta["status"] == "FAILURE" and meta["result"] == reference["result"]
    assert "ValueError: no" in meta["traceback"]


def test_a_child_past_its_hard_time_limit_fails_as_a_chord_child_would(
    env: Env, fused: tuple[Celery, str]
) -> None:
    # Reported by the worker's main process (the pool process is killed), which stores the
    # FAILURE (the message does not say ignore_result); the store's receiver stores none more.
    app, queue = fused
    slow = f"JOB{uuid.uuid4().hex}"
    res = flow(
        task(app, "tsum", queue=queue),
        [task(app, "too_slow", 5, task_id=slow, parent_policy="ignore"), task(app, "add", 2, 2)],
    ).apply_async(queue=queue)
    assert res.get(timeout=TIMEOUT) == 4
    with pytest.raises(TimeLimitExceeded):
        AsyncResult(slow, app=app).get(timeout=TIMEOUT)


def test_a_revoked_child_is_revoked_as_a_chord_child_would_be(
    env: Env, fused: tuple[Celery, str]
) -> None:
    app, queue = fused
    cid, gate = f"JOB{uuid.uuid4().hex}", f"test:gate:{uuid.uuid4().hex}"
    # Both pool processes wait on the gate: the child cannot run before its revoke arrives.
    blockers = [task(app, "gated", 1, gate) for _ in range(2)]
    res = flow(
        task(app, "tsum", queue=queue),
        [*blockers, task(app, "add", 2, 2, task_id=cid, parent_policy="ignore")],
    ).apply_async(queue=queue)
    child = AsyncResult(cid, app=app)
    # Revoked before the gate opens, as the worker confirms: the child either waits in the
    # worker's reserve (revoked when its turn comes) or arrives revoked.
    wait_for(lambda: app.control.revoke(cid, reply=True, timeout=0.5), timeout=TIMEOUT)
    redis.Redis.from_url(env.store).set(gate, 1)
    assert res.get(timeout=TIMEOUT) == 2
    with pytest.raises(TaskRevokedError):
        child.get(timeout=TIMEOUT)


def test_a_retrying_child_shows_retry_then_success(env: Env, fused: tuple[Celery, str]) -> None:
    app, queue = fused
    cid = f"JOB{uuid.uuid4().hex}"
    res = flow(
        task(app, "tsum", queue=queue), [task(app, "retry_later", 5, 2, task_id=cid)]
    ).apply_async(queue=queue)
    child = AsyncResult(cid, app=app)
    wait_for(lambda: child.state == "RETRY", timeout=TIMEOUT, interval=0.02)
    assert child.get(timeout=TIMEOUT) == 5
    assert child.state == "SUCCESS"
    assert res.get(timeout=TIMEOUT) == 5


def test_track_started_shows_started(env: Env, fused: tuple[Celery, str]) -> None:
    app, queue = fused
    cid, gate = f"JOB{uuid.uuid4().hex}", f"test:gate:{uuid.uuid4().hex}"
    res = flow(
        task(app, "tsum", queue=queue), [task(app, "gated_tracked", 7, gate, task_id=cid)]
    ).apply_async(queue=queue)
    child = AsyncResult(cid, app=app)
    wait_for(lambda: child.state == "STARTED", timeout=TIMEOUT, interval=0.02)
    assert set(child.info) == {"pid", "hostname"}
    redis.Redis.from_url(env.store).set(gate, 1)
    assert child.get(timeout=TIMEOUT) == 7
    assert res.get(timeout=TIMEOUT) == 7


def test_a_task_class_that_ignores_results_stores_none(env: Env, fused: tuple[Celery, str]) -> None:
    app, queue = fused
    cid = f"JOB{uuid.uuid4().hex}"
    res = flow(
        task(app, "tsum", queue=queue), [task(app, "add_quietly", 2, 3, task_id=cid)]
    ).apply_async(queue=queue)
    assert res.get(timeout=TIMEOUT) == 5
    assert stored(env, env.store, cid) is None


@needs_own_backend_db
def test_a_worker_whose_backend_is_elsewhere_stores_through_celery(
    env: Env, own_queue: Any, start_worker: Any
) -> None:
    # The caller's backend is the store's database (it marks the jobs); the worker's is
    # another database: it stores each result through Celery's backend before completing.
    queue = own_queue("elsewhere")
    start_worker(queues=queue)  # ECHOMQ_T_BACKEND: env.backend
    app = caller(env, env.store)
    try:
        cid = f"JOB{uuid.uuid4().hex}"
        res = flow(
            task(app, "tsum", queue=queue), [task(app, "add", 4, 4, task_id=cid)]
        ).apply_async(queue=queue)
        assert headers_of(app, queue, cid)[0][H_RESULT] == "1"
        assert wait_for(lambda: stored(env, env.backend, res.id), timeout=TIMEOUT)["result"] == 8
        meta = stored(env, env.backend, cid)
        assert meta is not None and meta["status"] == "SUCCESS" and meta["result"] == 8
        assert stored(env, env.store, cid) is None
    finally:
        app.close()


@needs_own_backend_db
def test_another_backend_or_lean_children_are_not_marked(env: Env, own_queue: Any) -> None:
    # Planning only (nothing runs on this queue): a job's stored message says who stores.
    queue = own_queue("unmarked")
    other = caller(env, env.backend)  # another database of the same server
    lean = caller(env, env.store, echomq_child_results=False)
    mine = caller(env, env.store)
    try:
        assert not fusable(get_state(other), other.backend)
        cases = (
            (other, {}, None),  # Celery's path, as for any task
            (lean, {}, True),  # no result at all
            (mine, {"ignore_result": False}, False),  # the caller's own choice, kept
        )
        for app, options, ignore in cases:
            cid = f"JOB{uuid.uuid4().hex}"
            res = flow(
                task(app, "tsum", queue=queue), [task(app, "add", 1, 1, task_id=cid, **options)]
            ).apply_async(queue=queue)
            headers, ignored = headers_of(app, queue, cid)
            assert H_RESULT not in headers and ignored is ignore
            if app is not mine:
                assert H_RESULT not in headers_of(app, queue, res.id)[0]
    finally:
        for app in (other, lean, mine):
            app.close()


LEASE = 60_000


def test_only_the_real_completion_writes_the_result(db: redis.Redis, scripts: Scripts) -> None:
    queue = "q" + uuid.uuid4().hex[:8]
    parent, child = f"JOB{uuid.uuid4().hex}", f"JOB{uuid.uuid4().hex}"
    scripts.enqueue_flow(queue, parent, b"parent", [(child, b"payload")])
    ref = ParentRef(parent, queue)
    key = f"celery-task-meta-{child}"

    def complete(token: str, meta: bytes) -> tuple[str, bool]:
        write = ResultWrite(key, meta, 100, channel=key)
        return scripts.complete_writing(
            queue, child, token, ttl=600, is_parent=False, parent=ref, value=b"1", result=write
        )

    scripts.claim(queue, child, "old", LEASE)
    scripts.claim(queue, child, "new", LEASE, force=True)
    assert complete("old", b"stale") == ("stale", False)
    assert db.get(key) is None
    pubsub = db.pubsub()
    pubsub.subscribe(key)
    assert pubsub.get_message(timeout=1)["type"] == "subscribe"
    assert complete("new", b"first") == ("released", True)
    assert db.get(key) == b"first" and 95 < db.ttl(key) <= 100
    message = pubsub.get_message(timeout=1)
    assert message is not None and message["data"] == b"first"
    # A duplicate completion (a redelivery's, the same token resent) writes nothing.
    assert complete("new", b"second") == ("done", False)
    assert db.get(key) == b"first"
    assert pubsub.get_message(timeout=0.2) is None
    pubsub.close()


@needs_own_backend_db
def test_a_child_cancelled_while_running_still_stores_its_success(
    env: Env, fused: tuple[Celery, str]
) -> None:
    # Its completion is no transition any more (the flow was cancelled while it ran): the
    # result is stored as Celery would store a chord child's.
    app, queue = fused
    cid, gate = f"JOB{uuid.uuid4().hex}", f"test:gate:{uuid.uuid4().hex}"
    res = flow(
        task(app, "collect", queue=queue), [task(app, "gated", 5, gate, task_id=cid)]
    ).apply_async(queue=queue)
    row = KEYS.job_key(queue, cid)
    store = redis.Redis.from_url(env.store)
    wait_for(lambda: store.hget(row, "state") == b"active", timeout=TIMEOUT)
    res.revoke()
    assert store.hget(row, "state") == b"cancelled"
    store.set(gate, 1)
    assert AsyncResult(cid, app=app).get(timeout=TIMEOUT) == 5
    assert store.hget(row, "state") == b"cancelled"


def test_the_result_record_is_named_as_celerys_backend_names_it() -> None:
    # complete.lua writes the key, expiry and channel as given: each is the backend's own.
    app = Celery("record", set_as_current=False)
    app.conf.update(result_backend="redis://localhost:1/0", result_expires=EXPIRES)
    backend = app.backend
    write = result_write(backend, "some-id", b"meta")
    assert write.key == backend.get_key_for_task("some-id").decode() == "celery-task-meta-some-id"
    assert write.channel == write.key  # RedisBackend._set publishes on the key's own name
    assert (write.meta, write.expires) == (b"meta", EXPIRES)
    assert RESULT_KEYS == "celery-task-meta-*"
    app.close()
    kept = Celery("kept", set_as_current=False)
    kept.conf.update(result_backend="redis://localhost:1/0", result_expires=None)
    assert result_write(kept.backend, "some-id", b"meta").expires is None
    kept.close()
