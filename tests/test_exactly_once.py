"""Nothing counted twice: duplicate and concurrent deliveries, a pool process killed mid-child,
stale tokens and retries. Each child is credited once, the parent is released and dispatched
once, and its body runs once, with the values ``children_values()`` shows.

Each test runs on a queue of its own with workers of its own, never the session worker's.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

import celery_echomq
from celery_echomq import flow
from celery_echomq.flows import new_job_id
from celery_echomq.scripts import ParentRef
from celery_echomq.state import get_state

from .conftest import Env, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture
def queue(env: Env, store: redis.Redis) -> Iterator[str]:
    """A queue of this test's own; its flow keys and broker messages are removed afterwards."""
    name = f"once-{uuid.uuid4().hex[:10]}"
    yield name
    keys = list(store.scan_iter(match=f"emq:{{{name}}}:*", count=1000))
    if keys:
        store.delete(*keys)
    store.srem("emq:queues", name)
    redis.Redis.from_url(env.broker).delete(name)


def row(client: Any, queue: str, job_id: str) -> dict[str, str]:
    """A job's row as a person reads it (without its payload)."""
    raw = client.hgetall(f"emq:{{{queue}}}:{job_id}")
    return {k.decode(): v.decode(errors="replace") for k, v in raw.items() if k != b"payload"}


def runs(client: Any, name: str) -> int:
    """How many times ``mark(name)`` ran (``collect:<tag>`` for a parent body)."""
    return int(client.get(f"test:ran:{name}") or 0)


def successes(worker: Any, job_id: str) -> int:
    """Deliveries of ``job_id`` that finished, signals included ("succeeded" is logged after)."""
    return int(worker.output().count(f"[{job_id}] succeeded"))


# --- one child, two deliveries -----------------------------------------------------------------


def test_duplicate_delivery_after_the_first_completed_the_first_completion_wins(
    proj: Any, store: Any, queue: str, start_worker: Any
) -> None:
    tag, dup = uuid.uuid4().hex, new_job_id()
    w = start_worker(queues=queue)
    # The first delivery re-sends its own message to arrive a second later, after it completed;
    # the second delivery returns another value (42, not 41).
    kids = [proj.redeliver.s(4, countdown=1.0).set(task_id=dup), proj.add.s(1, 1)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    value = res.get(timeout=90)
    wait_for(lambda: successes(w, dup) == 2, timeout=60)

    assert value == {"values": [41, 2], "tag": tag}
    assert res.children_values()[dup] == 41 == value["values"][0]
    assert res.dependencies() == (0, 2)
    assert runs(store, f"collect:{tag}") == 1
    assert int(store.get(f"test:delivery:{dup}")) == 2  # the body ran twice: at-least-once
    assert row(store, queue, dup)["attempts"] == "1"  # the duplicate's claim found it done


def test_duplicate_delivery_racing_the_first_is_credited_once(
    proj: Any, store: Any, queue: str, start_worker: Any
) -> None:
    tag, dup = uuid.uuid4().hex, new_job_id()
    w = start_worker(queues=queue, concurrency=3)
    kids = [proj.redeliver.s(4).set(task_id=dup), proj.add.s(1, 1)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    value = res.get(timeout=90)
    wait_for(lambda: successes(w, dup) == 2, timeout=60)

    # Whichever delivery held the claim when it completed was credited; the other one changed
    # nothing. The parent's argument and children_values() agree on which.
    credited = res.children_values()[dup]
    assert credited in (41, 42)
    assert value == {"values": [credited, 2], "tag": tag}
    assert res.dependencies() == (0, 2)
    assert runs(store, f"collect:{tag}") == 1


def test_two_deliveries_running_at_the_same_time(
    proj: Any, store: Any, queue: str, start_worker: Any
) -> None:
    tag, dup, gate = uuid.uuid4().hex, new_job_id(), f"test:gate:{uuid.uuid4().hex}"
    w = start_worker(queues=queue, concurrency=3)
    kids = [proj.redeliver.s(4, gate=gate).set(task_id=dup), proj.add.s(1, 1)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    wait_for(lambda: int(store.get(f"test:started:{dup}") or 0) == 2, timeout=60)
    # Both run now; the second delivery's claim took the job over with a new token.
    assert row(store, queue, dup)["state"] == "active"
    assert row(store, queue, dup)["attempts"] == "2"
    store.set(gate, 1)

    value = res.get(timeout=90)
    wait_for(lambda: successes(w, dup) == 2, timeout=60)
    assert value == {"values": [42, 2], "tag": tag}  # the current token's delivery counts
    assert res.children_values()[dup] == 42
    assert res.dependencies() == (0, 2)
    assert runs(store, f"collect:{tag}") == 1


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
    assert res.dependencies() == (0, 2)
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

    assert scripts.claim(queue, c1, "A", 60_000) == ("claimed", 1)
    assert scripts.claim(queue, c1, "B", 60_000) == ("taken_over", 2)  # a redelivery

    # Delivery A is stale now: none of its transitions changes anything.
    assert complete("A", 1) == "stale"
    assert scripts.retry(queue, c1, "A") == "stale"
    assert scripts.fail(queue, c1, "A", "E: x", ttl=600, is_parent=False, parent=ref) == (
        "stale",
        "",
    )
    assert scripts.requeue(queue, c1, 0, "active", "A")[0] == "stale"
    assert reads() == ((2, 0), {})
    assert row(store, queue, c1)["state"] == "active"
    assert row(store, queue, c1)["token"] == "B"

    # The current token completes once; the scripts survive a flushed script cache (NOSCRIPT).
    store.script_flush()
    assert complete("B", 2) == "credited"
    assert complete("B", 3) == "done"  # already done: nothing changed
    assert complete("A", 4) == "done"
    assert reads() == ((1, 1), {c1: 2})


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
    assert res.dependencies() == (0, 2)
    assert runs(store, f"collect:{tag}") == 1
