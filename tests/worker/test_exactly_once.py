"""Nothing counted twice: duplicate and concurrent deliveries, a pool process killed mid-child,
stale tokens and retries. Each child is credited once, the parent is released and dispatched
once, and its body runs once, with the values ``children_values()`` shows.

Each test runs on a queue of its own with workers of its own, never the session worker's.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from typing import Any

import pytest
import redis

import celery_echomq
from celery_echomq import flow
from celery_echomq.store.codec import load_job, read_stored
from celery_echomq.store.keyspace import new_job_id
from celery_echomq.store.scripts import ParentRef
from celery_echomq.store.state import get_state
from tests.helpers import KEYS, Env, counters, logged, skipped, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture
def queue(own_queue: Any) -> str:
    """A queue of this test's own (removed afterwards)."""
    return str(own_queue("once"))


def row(client: Any, queue: str, job_id: str) -> dict[str, str]:
    """A job's row as a person reads it (without its payload)."""
    raw = client.hgetall(KEYS.job_key(queue, job_id))
    return {k.decode(): v.decode(errors="replace") for k, v in raw.items() if k != b"payload"}


def runs(client: Any, name: str) -> int:
    """How many times ``mark(name)`` ran (``collect:<tag>`` for a parent body)."""
    return int(client.get(f"test:ran:{name}") or 0)


def successes(worker: Any, job_id: str) -> int:
    """Deliveries of ``job_id`` that finished, signals included ("succeeded" is logged after)."""
    return int(worker.output().count(f"[{job_id}] succeeded"))


# --- one child, two deliveries -----------------------------------------------------------------


def test_a_duplicate_delivery_after_the_first_completed_is_skipped(
    proj: Any, store: Any, queue: str, start_worker: Any
) -> None:
    tag, dup = uuid.uuid4().hex, new_job_id()
    w = start_worker(queues=queue)
    # The first delivery re-sends its own message to arrive a second later, after it completed.
    kids = [proj.redeliver.s(4, countdown=1.0).set(task_id=dup), proj.add.s(1, 1)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    value = res.get(timeout=90)
    wait_for(lambda: skipped(w, dup, "done"), timeout=60)

    assert value == {"values": [41, 2], "tag": tag}
    assert res.children_values()[dup] == 41
    assert res.dependencies() == (0, 2, 0, 0)
    assert runs(store, f"collect:{tag}") == 1
    assert int(store.get(f"test:delivery:{dup}")) == 1  # the duplicate's body did not run
    assert row(store, queue, dup)["attempts"] == "1"
    assert counters(store, queue).get("duplicates_skipped") == 1
    assert counters(store, queue).get("republished", 0) == 0


def test_a_duplicate_delivery_racing_the_first_is_skipped(
    proj: Any, store: Any, queue: str, start_worker: Any
) -> None:
    tag, dup = uuid.uuid4().hex, new_job_id()
    w = start_worker(queues=queue, concurrency=3)
    kids = [proj.redeliver.s(4).set(task_id=dup), proj.add.s(1, 1)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    value = res.get(timeout=90)
    # The copy arrives while the first runs (busy) or after it finished (done): either way
    # its body is skipped.
    wait_for(lambda: skipped(w, dup, "busy") or skipped(w, dup, "done"), timeout=60)

    assert value == {"values": [41, 2], "tag": tag}
    assert res.children_values()[dup] == 41
    assert res.dependencies() == (0, 2, 0, 0)
    assert runs(store, f"collect:{tag}") == 1
    assert int(store.get(f"test:delivery:{dup}")) == 1


def test_a_second_copy_of_a_running_childs_message_is_not_run(
    proj: Any, store: Any, queue: str, start_worker: Any
) -> None:
    tag, dup, gate = uuid.uuid4().hex, new_job_id(), f"test:gate:{uuid.uuid4().hex}"
    w = start_worker(queues=queue, concurrency=3)
    kids = [proj.redeliver.s(4, gate=gate).set(task_id=dup), proj.add.s(1, 1)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    # The first delivery runs (blocked on the gate) and sends a copy of its own message; the
    # copy finds the holder's lease live: acknowledged and skipped, its body never starts.
    wait_for(lambda: skipped(w, dup, "busy"), timeout=60)
    assert int(store.get(f"test:started:{dup}") or 0) == 1
    assert row(store, queue, dup)["state"] == "active"
    assert row(store, queue, dup)["attempts"] == "1"
    assert row(store, queue, dup)["skipped"] == "1"
    store.set(gate, 1)

    value = res.get(timeout=90)
    assert value == {"values": [41, 2], "tag": tag}
    assert res.children_values()[dup] == 41
    assert res.dependencies() == (0, 2, 0, 0)
    assert runs(store, f"collect:{tag}") == 1
    assert int(store.get(f"test:delivery:{dup}")) == 1
    assert int(store.get(f"test:started:{dup}")) == 1


def test_a_copy_takes_over_only_once_the_holders_lease_lapsed(
    proj: Any, env: Env, store: Any, queue: str, start_worker: Any
) -> None:
    from celery_echomq.send.start import publish

    tag, slow, gate = uuid.uuid4().hex, new_job_id(), f"test:gate:{uuid.uuid4().hex}"
    stall = {"ECHOMQ_T_STALL": "3", "ECHOMQ_T_RECOVERY_INTERVAL": "0.5"}
    holder = start_worker(queues=queue, concurrency=1, name="holder", extra_env=stall)
    kids = [proj.gated.s(7, gate).set(task_id=slow)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    wait_for(lambda: row(store, queue, slow).get("state") == "active", timeout=60)
    # Copies of the child's message go to a queue only the other worker consumes (the job's
    # row stays where its headers say), so the holder's worker cannot be the one that gets them.
    side = f"{queue}-side"
    other = start_worker(queues=side, concurrency=1, name="other", extra_env=stall)
    state = get_state(proj.app)
    copy = load_job(state, queue, slow, read_stored(state, queue, slow))
    copy["options"]["queue"] = side
    try:
        # The holder's worker is alive and renews its lease: a copy is skipped.
        time.sleep(4)  # longer than a stall timeout: only renewals keep the lease live
        publish(proj.app, [copy])
        wait_for(lambda: skipped(other, slow, "busy"), timeout=30)
        assert row(store, queue, slow)["attempts"] == "1"

        # The holder's main process stops (SIGSTOP: alive but silent): its lease lapses, and
        # the next copy takes the job over.
        os.kill(holder.pid, signal.SIGSTOP)
        try:
            wait_for(
                lambda: (
                    (store.zscore(KEYS.queue_key(queue, "active"), slow) or 0) < time.time() * 1000
                ),
                timeout=30,
            )
            publish(proj.app, [copy])
            wait_for(lambda: row(store, queue, slow).get("attempts") == "2", timeout=30)
            logged(other, f"claim {slow} -> taken over")
        finally:
            os.kill(holder.pid, signal.SIGCONT)
        # Both bodies finish; only the current token's completion counts.
        store.set(gate, 1)
        assert res.get(timeout=60) == {"values": [7], "tag": tag}
        assert runs(store, f"collect:{tag}") == 1
        assert res.dependencies() == (0, 1, 0, 0)
    finally:
        redis.Redis.from_url(env.broker).delete(side)


def test_a_pool_process_killed_with_acks_early_fails_its_flow_at_once(
    proj: Any, store: Any, queue: str, start_worker: Any
) -> None:
    tag, hung = uuid.uuid4().hex, new_job_id()
    # Celery's default (acks early): the worker reports WorkerLostError for a killed pool
    # process, and the child fails under its policy then, as a chord's header task does. The
    # stall timeout is far longer than the wait below: no recovery pass is involved.
    w = start_worker(queues=queue, extra_env={"ECHOMQ_T_STALL": "300"})
    kids = [proj.hang_first.s(6).set(task_id=hung), proj.add.s(1, 1)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    wait_for(lambda: store.exists(f"test:pid:{hung}"), timeout=60)
    pid = int(store.get(f"test:pid:{hung}"))
    assert pid in w.pool_pids()
    os.kill(pid, signal.SIGKILL)

    with pytest.raises(celery_echomq.FlowFailed) as failed:
        res.get(timeout=60)
    assert failed.value.child_id == hung
    assert "WorkerLostError" in failed.value.error
    assert row(store, queue, hung)["state"] == "failed"
    assert runs(store, f"collect:{tag}") == 0


def test_pool_process_killed_mid_child_is_redelivered_and_credited_once(
    proj: Any, store: Any, queue: str, start_worker: Any
) -> None:
    tag, hung = uuid.uuid4().hex, new_job_id()
    # acks_late + reject_on_worker_lost: the broker redelivers what a dead pool process held.
    w = start_worker(queues=queue, extra_env={"ECHOMQ_T_ACKS_LATE": "1", "ECHOMQ_T_STALL": "60"})
    kids = [proj.hang_first.s(6).set(task_id=hung), proj.add.s(1, 1)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    wait_for(lambda: store.exists(f"test:pid:{hung}"), timeout=60)
    pid = int(store.get(f"test:pid:{hung}"))
    assert pid in w.pool_pids()  # a pool process of this test's own worker
    first_token = row(store, queue, hung)["token"]
    os.kill(pid, signal.SIGKILL)

    assert res.get(timeout=90) == {"values": [6, 2], "tag": tag}
    after = row(store, queue, hung)
    assert after["attempts"] == "2"
    assert after["token"] != first_token  # the redelivery was claimed with a new token
    assert res.children_values()[hung] == 6
    assert res.dependencies() == (0, 2, 0, 0)
    assert runs(store, f"collect:{tag}") == 1


# --- tokens (script level) -----------------------------------------------------------------------


def test_a_completion_with_a_stale_token_changes_nothing(proj: Any, store: Any, queue: str) -> None:
    state = get_state(proj.app)
    scripts = state.scripts
    parent, c1, c2 = new_job_id(), new_job_id(), new_job_id()
    scripts.enqueue_flow(queue, parent, b"{}", [(c1, b"{}"), (c2, b"{}")])
    ref = ParentRef(parent, queue)

    def complete(token: str, value: int) -> str:
        return scripts.complete(
            queue, c1, token, ttl=600, is_parent=False, parent=ref, value=state.dumps(value)
        )

    def reads() -> tuple[Any, dict[str, Any]]:
        return (
            celery_echomq.dependencies(parent, app=proj.app, queue=queue),
            celery_echomq.children_values(parent, app=proj.app, queue=queue),
        )

    assert scripts.claim(queue, c1, "A", 60_000) == ("claimed", 1, "")
    # A redelivery once A's holder is known dead.
    assert scripts.claim(queue, c1, "B", 60_000, force=True) == ("taken_over", 2, "A")

    # Delivery A is stale now: none of its transitions changes anything.
    assert complete("A", 1) == "stale"
    assert scripts.retry(queue, c1, "A") == "stale"
    assert scripts.fail(queue, c1, "A", "E: x", ttl=600, is_parent=False, parent=ref) == (
        "stale",
        "",
    )
    assert scripts.requeue(queue, c1, 0, "active", "A")[0] == "stale"
    assert reads() == ((2, 0, 0, 0), {})
    assert row(store, queue, c1)["state"] == "active"
    assert row(store, queue, c1)["token"] == "B"

    # The current token completes once; the scripts survive a flushed script cache (NOSCRIPT).
    store.script_flush()
    assert complete("B", 2) == "credited"
    assert complete("B", 3) == "done"  # already done: nothing changed
    assert complete("A", 4) == "done"
    assert reads() == ((1, 1, 0, 0), {c1: 2})


# --- retries -------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["retry_later", "autoretry_later"])
def test_retries_go_back_to_pending_and_count_once(
    proj: Any, store: Any, queue: str, start_worker: Any, task: str
) -> None:
    tag, flaky, quick = uuid.uuid4().hex, new_job_id(), new_job_id()
    start_worker(queues=queue, extra_env={"ECHOMQ_T_STALL": "30"})
    kids = [getattr(proj, task).s(7, 3).set(task_id=flaky), proj.add.s(1, 1).set(task_id=quick)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)

    # Between two tries (a 1 s countdown) the child is pending again, its attempt recorded.
    def retried() -> bool:
        now = row(store, queue, flaky)
        return now.get("state") == "pending" and now.get("attempts") in ("1", "2")

    wait_for(retried, timeout=60, interval=0.02)
    assert flaky not in res.children_values()  # a retry is not a completion
    assert res.dependencies().outstanding >= 1

    assert res.get(timeout=90) == {"values": [7, 2], "tag": tag}
    assert runs(store, f"{task}:{flaky}") == 3  # three tries of the body
    assert row(store, queue, flaky)["attempts"] == "3"
    assert row(store, queue, flaky)["state"] == "done"
    assert res.children_values() == {flaky: 7, quick: 2}
    assert res.dependencies() == (0, 2, 0, 0)
    assert runs(store, f"collect:{tag}") == 1
