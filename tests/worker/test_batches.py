"""A flow's children delivered many to a broker message, ``flow(parent, children, batch=N)``
(send/batches.py, worker/batches.py): each child is still a job of its own (its id, result,
request, claim and place in the parent's values), on a worker and eagerly; a copied, forged or
half-run batch message runs no body twice."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
import uuid
from typing import Any

import httpx
import pytest
import redis
from celery.result import AsyncResult

import celery_echomq
from celery_echomq import flow
from celery_echomq.send.batches import BATCH_TASK
from celery_echomq.store.headers import H_BATCH, H_TEMPLATE
from celery_echomq.store.keyspace import new_job_id
from tests.helpers import (
    KEYS,
    Env,
    echomq,
    fast_recovery,
    kept_keys,
    keys_written,
    logged,
    run,
    wait_for,
)

TIMEOUT = 60


def runs(store: redis.Redis, name: str) -> int:
    return int(store.get(f"test:ran:{name}") or 0)


def send_batch(proj: Any, queue: str, ids: list[str]) -> str:
    """A batch message of our own naming ``ids`` on ``queue``: a real message on the broker,
    as a copy or a forgery of the producer's would be."""
    sent = proj.app.send_task(BATCH_TASK, args=[ids], queue=queue, headers={H_BATCH: queue})
    return str(sent.id)


def batch_done(worker: Any, batch_id: str) -> bool:
    return f"celery_echomq.batch[{batch_id}] succeeded" in worker.output()


# --- values, results and requests: as a message each ---------------------------------------------


@pytest.mark.parametrize("size", [1, 3, 7, 50])
def test_values_results_and_order_are_a_flows(proj: Any, how: str, size: int) -> None:
    kids = [proj.add.s(i, i) for i in range(7)]
    res = run(flow(proj.collect.s(), kids, batch=size), how)
    assert res.get(timeout=TIMEOUT)["values"] == [2 * i for i in range(7)]
    assert [child.get(timeout=TIMEOUT) for child in res.parent.results] == [2 * i for i in range(7)]
    assert res.dependencies() == (0, 7, 0, 0)


def test_each_child_sees_the_request_a_message_of_its_own_gives_it(
    proj: Any, how: str, worker: Any
) -> None:
    """``self.request`` of a batched child is what it is unbatched: its own id, the flow's
    root, no parent (sent from no task), no retries, its own arguments and its queue."""
    ids = [new_job_id() for _ in range(3)]
    batched = run(
        flow(
            proj.collect.s(),
            [proj.own_request.s(i).set(task_id=t) for i, t in enumerate(ids)],
            batch=2,
        ),
        how,
    ).get(timeout=TIMEOUT)["values"]
    alone = flow(proj.collect.s(), [proj.own_request.s(i) for i in range(3)]).apply_async()
    unbatched = alone.get(timeout=TIMEOUT)["values"]
    for i, (seen, plain) in enumerate(zip(batched, unbatched, strict=True)):
        assert seen["id"] == ids[i]
        assert seen["args"] == [i] and seen["x"] == i
        assert seen["retries"] == 0 and seen["parent_id"] is None
        assert seen["root_id"] == plain["root_id"].replace(alone.id, seen["root_id"])
        assert seen["eager"] is (how == "apply")
        if how == "apply_async":
            assert seen["queue"] == plain["queue"] == "celery"


def test_a_failing_child_fails_the_flow_as_unbatched(proj: Any, how: str) -> None:
    boom = new_job_id()
    kids = [proj.add.s(1, 1), proj.boom.s("no").set(task_id=boom), proj.add.s(2, 2)]
    res = run(flow(proj.tsum.s(), kids, batch=3), how)
    with pytest.raises(celery_echomq.FlowFailed) as failed:
        res.get(timeout=TIMEOUT)
    assert failed.value.child_id == boom
    assert "no" in failed.value.error
    kids = [proj.add.s(1, 1), proj.boom.s("no"), proj.add.s(2, 2)]
    kept = run(flow(proj.tsum.s(), kids, batch=3, policy="ignore"), how)
    assert kept.get(timeout=TIMEOUT) == 6


# --- refused before anything is written ---------------------------------------------------------


@pytest.mark.parametrize("size", [0, -1, 1001, 2.5, "5", True])
def test_a_batch_that_is_not_a_size_is_refused(proj: Any, size: Any) -> None:
    with pytest.raises(ValueError, match=r"flow\(batch=\.\.\.\).*allowed: an int from 1 to 1000"):
        flow(proj.tsum.s(), [proj.add.s(1, 1)], batch=size)


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        ("window", "max_active=2 both decide when a child is published; allowed: one of them"),
        ("chain", "not a chain of tasks"),
        ("nested", "not a nested flow"),
        ("countdown", "sets countdown, which only a message of its own can keep"),
    ],
)
def test_children_a_batch_cannot_carry_are_refused_and_nothing_is_written(
    proj: Any, how: str, env: Env, store: redis.Redis, kind: str, said: str
) -> None:
    kids: list[Any] = [proj.add.s(1, 1), proj.add.s(2, 2)]
    extra: dict[str, Any] = {}
    if kind == "window":
        extra["max_active"] = 2
    elif kind == "chain":
        kids.append(proj.add.s(1, 1) | proj.square.s())
    elif kind == "nested":
        kids.append(flow(proj.tsum.s(), [proj.add.s(3, 3)]))
    else:
        kids.append(proj.add.s(3, 3).set(countdown=1))
    broker = redis.Redis.from_url(env.broker)
    before, queued = kept_keys(store), broker.llen("celery")
    with pytest.raises(ValueError, match=said):
        run(flow(proj.tsum.s(), kids, batch=2, **extra), how)
    assert not keys_written(store, before)
    assert broker.llen("celery") == queued


# --- copies and forgeries of a batch message -----------------------------------------------------


def test_copies_of_a_batch_message_run_each_body_once(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    tag = uuid.uuid4().hex
    ids = [new_job_id() for _ in range(6)]
    kids = [proj.counted.s(i, tag).set(task_id=t) for i, t in enumerate(ids)]
    res = flow(proj.collect.s(tag=tag), kids, batch=3).apply_async()
    copies = [send_batch(proj, "celery", ids) for _ in range(2)]
    assert res.get(timeout=TIMEOUT)["values"] == list(range(6))
    wait_for(lambda: all(batch_done(worker, c) for c in copies), timeout=TIMEOUT)
    assert runs(store, f"counted:{tag}") == 6
    assert runs(store, f"collect:{tag}") == 1
    late = send_batch(proj, "celery", ids)  # every child finished: nothing runs
    wait_for(lambda: batch_done(worker, late), timeout=TIMEOUT)
    assert runs(store, f"counted:{tag}") == 6


def test_a_forged_batch_message_runs_no_held_parent_and_no_unknown_id(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    tag, gate = uuid.uuid4().hex, f"test:gate:{uuid.uuid4().hex}"
    res = flow(proj.collect.s(tag=tag), [proj.gated.s(1, gate)], batch=2).apply_async()
    wait_for(lambda: store.hget(KEYS.job_key("celery", res.id), "state") == b"awaiting_children")
    forged = send_batch(proj, "celery", [res.id, new_job_id(), "not an id", "x" * 300])
    wait_for(lambda: batch_done(worker, forged), timeout=TIMEOUT)
    # One naming a queue no key can be built from, and one whose argument is no list.
    bad_queue = proj.app.send_task(BATCH_TASK, args=[[res.id]], headers={H_BATCH: "a{b}"})
    no_list = proj.app.send_task(BATCH_TASK, args=[res.id], headers={H_BATCH: "celery"})
    wait_for(lambda: batch_done(worker, bad_queue.id) and batch_done(worker, no_list.id))
    assert runs(store, f"collect:{tag}") == 0
    assert store.hget(KEYS.job_key("celery", res.id), "state") == b"awaiting_children"
    store.set(gate, 1)
    assert res.get(timeout=TIMEOUT)["values"] == [1]
    assert runs(store, f"collect:{tag}") == 1


def test_a_batch_message_naming_another_flows_template_runs_each_child_as_stored(
    proj: Any, store: redis.Redis, queue: str, start_worker: Any
) -> None:
    """A batch message names the parent whose template its rows are stored against, to read
    it in the rows' round trip. Only the rows decide: a copy naming another flow's template
    runs the children it names as they were stored, and none of them twice."""
    tag, gate = uuid.uuid4().hex, f"test:gate:{uuid.uuid4().hex}"
    w = start_worker(queues=queue, concurrency=2)
    other = flow(proj.collect.s(), [proj.square.s(5), proj.square.s(6)], batch=2).apply_async(
        queue=queue
    )
    assert other.get(timeout=TIMEOUT)["values"] == [25, 36]
    assert store.hexists(KEYS.job_key(queue, other.id), "template")
    first, *waiting = (new_job_id() for _ in range(3))
    kids = [
        proj.gated.s(1, gate).set(task_id=first),
        *(proj.counted.s(x, tag).set(task_id=t) for x, t in zip((2, 3), waiting, strict=True)),
    ]
    res = flow(proj.collect.s(tag=tag), kids, batch=3).apply_async(queue=queue)
    wait_for(lambda: store.hget(KEYS.job_key(queue, first), "state") == b"active", timeout=TIMEOUT)
    copy = proj.app.send_task(
        BATCH_TASK, args=[waiting], queue=queue, headers={H_BATCH: queue, H_TEMPLATE: other.id}
    )
    # The copy runs them while the producer's batch waits on its first child.
    assert [AsyncResult(t, app=proj.app).get(timeout=TIMEOUT) for t in waiting] == [2, 3]
    wait_for(lambda: batch_done(w, copy.id), timeout=TIMEOUT)
    store.set(gate, 1)
    assert res.get(timeout=TIMEOUT)["values"] == [1, 2, 3]
    assert runs(store, f"counted:{tag}") == 2
    assert runs(store, f"collect:{tag}") == 1


# --- the parent: run where its last child released it ------------------------------------------


def test_the_parent_runs_in_the_batch_whose_last_child_released_it(
    proj: Any, store: redis.Redis, queue: str, own_queue: Any, start_worker: Any
) -> None:
    """A flow's parent that its batch's last child released runs next in that pool process,
    with no message of its own: once, with its values. One that a message of its own must
    carry (a time limit, which Celery enforces per message; another queue) is published."""
    other = own_queue("parents")
    w = start_worker(queues=f"{queue},{other}")
    tag = uuid.uuid4().hex
    res = flow(proj.collect.s(tag=tag), [proj.add.s(i, i) for i in range(4)], batch=2)
    res = res.apply_async(queue=queue)
    assert res.get(timeout=TIMEOUT)["values"] == [0, 2, 4, 6]
    assert runs(store, f"collect:{tag}") == 1
    logged(w, f"parent {res.id} runs where it was released")
    assert f"collect[{res.id}] received" not in w.output()
    carried = store.hget(KEYS.job_key(queue, res.id), "batch")
    # The batch logs its end after the parent stored its result: wait for the line.
    assert carried
    logged(w, f"celery_echomq.batch[{carried.decode()}] succeeded")
    limited = flow(proj.collect.s(tag=tag).set(time_limit=30), [proj.add.s(1, 1)], batch=2)
    limited = limited.apply_async(queue=queue)
    assert limited.get(timeout=TIMEOUT)["values"] == [2]
    logged(w, f"collect[{limited.id}] received")
    assert not store.hexists(KEYS.job_key(queue, limited.id), "batch")
    elsewhere = flow(proj.collect.s(tag=tag).set(queue=other), [proj.add.s(2, 2)], batch=2)
    elsewhere = elsewhere.apply_async(queue=queue)
    assert elsewhere.get(timeout=TIMEOUT)["values"] == [4]
    logged(w, f"collect[{elsewhere.id}] received")
    assert runs(store, f"collect:{tag}") == 3


def test_a_pool_process_killed_before_running_the_parent_it_released_runs_it_once(
    proj: Any, store: redis.Redis, queue: str, start_worker: Any
) -> None:
    """Until its claim lands, a parent that a batch's runner keeps to run is a released parent
    with no message: its pool process killed there, recovery publishes it once the stall
    timeout has passed, and it runs once."""
    w = start_worker(queues=queue, extra_env=fast_recovery(ECHOMQ_T_DIE_AT="run_released"))
    tag = uuid.uuid4().hex
    res = flow(proj.collect.s(tag=tag), [proj.add.s(i, 1) for i in range(3)], batch=3)
    res = res.apply_async(queue=queue)
    assert res.get(timeout=90)["values"] == [1, 2, 3]
    logged(w, "killed itself at run_released")
    logged(w, f"dispatched parent {res.id}")
    assert runs(store, f"collect:{tag}") == 1
    assert res.dependencies() == (0, 3, 0, 0)


# --- retries and a pool process killed mid-batch ------------------------------------------------


def test_a_child_that_retries_leaves_its_batch_and_is_counted_once(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    tag = uuid.uuid4().hex
    kids = [proj.add.s(1, 1), proj.retry_once.s(7, tag, 0.5), proj.add.s(2, 2)]
    res = flow(proj.collect.s(tag=tag), kids, batch=3).apply_async()
    assert res.get(timeout=TIMEOUT)["values"] == [2, 7, 4]
    assert runs(store, f"retry_once:{tag}") == 2
    assert res.dependencies() == (0, 3, 0, 0)
    assert runs(store, f"collect:{tag}") == 1


@pytest.fixture
def queue(own_queue: Any) -> str:
    return str(own_queue("batch"))


def test_a_pool_process_killed_mid_batch_loses_no_child_and_runs_none_twice(
    proj: Any, store: redis.Redis, queue: str, start_worker: Any
) -> None:
    """The batch's first child finished, its second hangs and its process is killed, two wait
    their turn: the first is credited once, the second runs again, the two waiting are found
    by recovery (pending, their message gone) and run once; the parent runs once."""
    tag, hung = uuid.uuid4().hex, new_job_id()
    w = start_worker(queues=queue, concurrency=1, extra_env={"ECHOMQ_T_STALL": "2"})
    kids = [
        proj.counted.s(1, tag),
        proj.hang_first.s(6).set(task_id=hung),
        proj.counted.s(3, tag),
        proj.counted.s(4, tag),
    ]
    res = flow(proj.collect.s(tag=tag), kids, batch=4).apply_async(queue=queue)
    wait_for(lambda: store.exists(f"test:pid:{hung}"), timeout=TIMEOUT)
    pid = int(store.get(f"test:pid:{hung}") or 0)
    assert pid in w.pool_pids()
    os.kill(pid, signal.SIGKILL)
    assert res.get(timeout=120)["values"] == [1, 6, 3, 4]
    time.sleep(1)
    assert runs(store, f"counted:{tag}") == 3
    assert int(store.get(f"test:delivery:{hung}") or 0) == 2
    assert runs(store, f"collect:{tag}") == 1
    assert res.dependencies() == (0, 4, 0, 0)


def test_a_child_revoked_before_its_batch_arrives_is_revoked_and_never_runs(
    proj: Any, store: redis.Redis, queue: str, start_worker: Any
) -> None:
    """Celery checks a message's own id against its revoked ids at receipt; a batched child
    has no message of its own, and is checked as its batch arrives: it never runs, its result
    is REVOKED and the flow fails under its policy, as for an unbatched child."""
    tag, doomed = uuid.uuid4().hex, new_job_id()
    w = start_worker(queues=queue, concurrency=1)
    node = f"{w.name}@{socket.gethostname()}"
    assert proj.app.control.cancel_consumer(queue, destination=[node], reply=True, timeout=10)
    # A BRPOP the worker sent before the cancel names the queue for up to a second more; a
    # message it takes then is handed back by kombu ("No consumers"), which has left it
    # undelivered past this test's time-out.
    time.sleep(1.5)
    kids = [proj.counted.s(1, tag), proj.counted.s(2, tag).set(task_id=doomed)]
    res = flow(proj.collect.s(tag=tag), kids, batch=2, policy="ignore").apply_async(queue=queue)
    proj.app.control.revoke(doomed, destination=[node], reply=True, timeout=10)
    assert proj.app.control.add_consumer(queue, destination=[node], reply=True, timeout=10)
    assert res.get(timeout=TIMEOUT)["values"] == [1]
    assert runs(store, f"counted:{tag}") == 1
    assert AsyncResult(doomed, app=proj.app).state == "REVOKED"


@pytest.mark.parametrize("revoked", ["waiting", "running"])
def test_a_child_revoked_while_its_batch_runs_is_revoked_unless_it_has_started(
    proj: Any, store: redis.Redis, queue: str, start_worker: Any, revoked: str
) -> None:
    """Celery's worker drops a message it holds once its id is revoked, and lets a running
    task run on (a revoke without terminate). A batch's children are the same: one revoked
    while it waits its turn never runs (REVOKED, the flow goes on under its policy); the one
    running when its revoke comes finishes, and its value counts."""
    tag, gate = uuid.uuid4().hex, f"test:gate:{uuid.uuid4().hex}"
    first, doomed = new_job_id(), new_job_id()
    w = start_worker(queues=queue, concurrency=1)
    node = f"{w.name}@{socket.gethostname()}"
    kids = [
        proj.gated.s(1, gate).set(task_id=first),
        proj.counted.s(2, tag).set(task_id=doomed),
        proj.counted.s(3, tag),
    ]
    res = flow(proj.collect.s(tag=tag), kids, batch=3, policy="ignore").apply_async(queue=queue)
    wait_for(lambda: store.hget(KEYS.job_key(queue, first), "state") == b"active", timeout=TIMEOUT)
    target = doomed if revoked == "waiting" else first
    assert proj.app.control.revoke(target, destination=[node], reply=True, timeout=10)
    if revoked == "waiting":
        row = KEYS.job_key(queue, doomed)
        wait_for(lambda: store.hget(row, "state") == b"failed", timeout=TIMEOUT)
    else:
        time.sleep(1.5)  # several ticks of the worker's lease loop, which would revoke it
    store.set(gate, 1)
    values = res.get(timeout=TIMEOUT)["values"]
    time.sleep(0.5)
    if revoked == "waiting":
        assert values == [1, 3]
        assert runs(store, f"counted:{tag}") == 1
        assert AsyncResult(doomed, app=proj.app).state == "REVOKED"
    else:
        assert values == [1, 2, 3]
        assert runs(store, f"counted:{tag}") == 2
        assert AsyncResult(first, app=proj.app).state == "SUCCESS"
    assert runs(store, f"collect:{tag}") == 1


def test_a_quorum_cuts_the_children_its_batch_has_not_run(
    proj: Any, how: str, store: redis.Redis
) -> None:
    tag = uuid.uuid4().hex
    kids = [proj.add.s(1, 1), proj.counted.s(2, tag), proj.counted.s(3, tag)]
    res = run(flow(proj.collect.s(tag=tag), kids, quorum=1, batch=3), how)
    assert res.get(timeout=TIMEOUT)["values"] == [2]
    time.sleep(0.5)
    assert runs(store, f"counted:{tag}") == 0
    assert runs(store, f"collect:{tag}") == 1


def test_a_store_that_lost_its_scripts_mid_batch_runs_each_child_once(
    proj: Any, how: str, store: redis.Redis
) -> None:
    """The first child's completion carries the second child's claim in its round trip; the
    store has lost its scripts meanwhile (as after a restart), so neither runs there: the
    completion is sent again on its own, and the claim is made at the second child's start."""
    tag = uuid.uuid4().hex
    kids = [proj.forgets_scripts.s(1, tag), proj.counted.s(2, tag), proj.counted.s(3, tag)]
    res = run(flow(proj.collect.s(tag=tag), kids, batch=3), how)
    assert res.get(timeout=TIMEOUT)["values"] == [1, 2, 3]
    time.sleep(0.5)
    assert runs(store, f"counted:{tag}") == 3
    assert runs(store, f"collect:{tag}") == 1
    assert res.dependencies() == (0, 3, 0, 0)


@pytest.mark.parametrize("cut", ["deadline", "cancel"])
def test_a_deadline_or_a_cancel_cuts_the_children_its_batch_has_not_run(
    proj: Any, worker: Any, store: redis.Redis, cut: str
) -> None:
    """The batch's first child holds it; meanwhile the flow's deadline passes, or the flow is
    cancelled: the children behind it in the batch never run, and the parent never runs."""
    tag, gate = uuid.uuid4().hex, f"test:gate:{uuid.uuid4().hex}"
    kids = [proj.gated.s(1, gate), proj.counted.s(2, tag), proj.counted.s(3, tag)]
    extra = {"deadline": 1} if cut == "deadline" else {}
    res = flow(proj.collect.s(tag=tag), kids, batch=3, **extra).apply_async()
    if cut == "deadline":
        with pytest.raises(celery_echomq.FlowDeadlineExceeded):
            res.get(timeout=TIMEOUT)
    else:
        first = KEYS.job_key("celery", res.parent.results[0].id)
        wait_for(lambda: store.hget(first, "state") == b"active", timeout=TIMEOUT)
        res.revoke()
        wait_for(lambda: res.state == "REVOKED", timeout=TIMEOUT)
    children = [KEYS.job_key("celery", child.id) for child in res.parent.results]
    wait_for(lambda: all(store.hget(row, "state") == b"cancelled" for row in children[1:]))
    store.set(gate, 1)
    wait_for(lambda: store.hget(children[0], "state") in (b"done", b"cancelled"), timeout=TIMEOUT)
    time.sleep(0.5)
    assert runs(store, f"counted:{tag}") == 0
    assert runs(store, f"collect:{tag}") == 0


def test_a_nested_flows_own_batch_and_a_reducer_work_as_unbatched(proj: Any, how: str) -> None:
    inner = flow(proj.tsum.s(), [proj.add.s(i, i) for i in range(5)], batch=2)
    res = run(flow(proj.collect.s(), [inner, proj.add.s(1, 1)]), how)
    assert res.get(timeout=TIMEOUT)["values"] == [20, 2]
    summed = run(
        flow(proj.collect.s(), [proj.add.s(i, 0) for i in range(9)], reduce="sum", batch=4), how
    )
    assert summed.get(timeout=TIMEOUT)["values"] == 36


def test_show_its_json_and_the_dashboard_say_which_batch_message_carried_each_child(
    proj: Any, worker: Any, serve: Any
) -> None:
    res = flow(proj.tsum.s(), [proj.add.s(i, i) for i in range(5)], batch=2).apply_async()
    assert res.get(timeout=TIMEOUT) == 20
    shown = echomq("show", res.id).output
    carried = re.findall(r"batch=([0-9a-f-]{36})", shown)
    tree = json.loads(echomq("show", res.id, "--json").output)
    children = [child["batch"] for child in tree["children"]]
    assert len(children) == 5 and len(set(children)) == 3
    # The parent ran in the batch whose last child released it, and says so too.
    assert tree["batch"] in children
    assert sorted(carried) == sorted([*children, tree["batch"]])
    page = httpx.get(f"{serve().url}/flows/{res.id}", timeout=10).text
    assert all(f"batch={batch}" in page for batch in carried)
    unbatched = flow(proj.tsum.s(), [proj.add.s(1, 1)]).apply_async()
    assert unbatched.get(timeout=TIMEOUT) == 2
    assert "batch=" not in echomq("show", unbatched.id).output


@pytest.mark.parametrize("batch", [3, None])
def test_a_child_past_its_time_limit_fails_its_flow_batched_or_not(
    proj: Any, queue: str, start_worker: Any, batch: int | None
) -> None:
    """Celery limits a message: a batch's limit is its children's added up (3 x 1 s here). The
    child that sleeps past its own limit uses up the batch's and is recovered on its own, where
    its own limit ends it: the flow fails naming it, with the error it has unbatched."""
    start_worker(queues=queue, extra_env={"ECHOMQ_T_STALL": "2"})
    slow = new_job_id()
    kids = [proj.too_slow.s(0.2), proj.too_slow.s(30).set(task_id=slow), proj.too_slow.s(0.2)]
    res = flow(proj.collect.s(), kids, batch=batch).apply_async(queue=queue)
    with pytest.raises(celery_echomq.FlowFailed) as failed:
        res.get(timeout=120)
    assert failed.value.child_id == slow
    assert "TimeLimitExceeded" in failed.value.error


def test_a_shared_child_and_an_autoretried_one_run_as_unbatched(
    proj: Any, how: str, store: redis.Redis
) -> None:
    """A job two batched flows list (``on_exists="join"``) runs once and gives both its value;
    a child that raises what its task retries for (``autoretry_for``) leaves its batch for a
    message of its own and is counted once."""
    tag, shared = uuid.uuid4().hex, new_job_id()
    one = flow(
        proj.collect.s(),
        [proj.counted.s(1, tag).set(task_id=shared), proj.counted.s(2, tag)],
        batch=2,
    )
    two = flow(
        proj.collect.s(),
        [proj.counted.s(1, tag).set(task_id=shared), proj.autoretry_later.s(3, 2)],
        batch=2,
    )
    first = run(one, how, on_exists="join")
    second = run(two, how, on_exists="join")
    assert first.get(timeout=TIMEOUT)["values"] == [1, 2]
    assert second.get(timeout=TIMEOUT)["values"] == [1, 3]
    assert runs(store, f"counted:{tag}") == 2
