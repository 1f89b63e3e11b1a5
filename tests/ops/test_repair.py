"""Repairing flows with real workers: `echomq retry` / `echomq release` and their Python calls."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_echomq import FlowFailed, FlowResult, NotRepairableError, flow, get_state
from celery_echomq.ops.repair import release_flow, retry_flow
from tests.helpers import (
    KEYS,
    Env,
    echomq,
    echomq_process,
    id_of,
    quiet,
    settle,
    snapshot,
    state_of,
    wait_for,
    with_id,
)


def ran(store: redis.Redis, name: str) -> int:
    return int(store.get(f"test:ran:{name}") or 0)


@pytest.fixture
def flag(store: redis.Redis) -> Iterator[str]:
    """A flag key for `proj.flaky`: its children fail until the test sets it."""
    name = f"test:flag:{uuid.uuid4().hex}"
    yield name
    store.delete(name)


@pytest.fixture
def gate(store: redis.Redis) -> Iterator[str]:
    name = f"test:gate:{uuid.uuid4().hex}"
    yield name
    store.set(name, 1)


def failed_flow(proj: Any, store: redis.Redis, flag: str, tag: str) -> tuple[Any, list[str]]:
    """A flow of three children, two of them failing until ``flag`` is set: failed, settled."""
    ok, bad1, bad2 = (
        with_id(proj.add.s(1, 1)),
        with_id(proj.flaky.s(10, flag)),
        with_id(proj.flaky.s(20, flag)),
    )
    res = flow(proj.collect.s(tag=tag), [ok, bad1, bad2]).apply_async()
    with pytest.raises(FlowFailed):
        res.get(timeout=60)
    ids = [id_of(ok), id_of(bad1), id_of(bad2)]
    # Every child has settled (the second failure is recorded on a flow that already failed).
    wait_for(lambda: [state_of(store, i) for i in ids] == ["done", "failed", "failed"], 60)
    wait_for(lambda: state_of(store, res.id) == "failed")
    return res, ids


def test_retry_reruns_the_failed_children_and_get_returns_the_parents_value(
    proj: Any, worker: Any, store: redis.Redis, flag: str
) -> None:
    tag = uuid.uuid4().hex
    res, (ok, bad1, bad2) = failed_flow(proj, store, flag, tag)
    # Every child finished: one done, two failed (they were never counted down).
    assert res.dependencies() == (0, 1, 2, 0)
    error = f"ValueError: flag {flag} not set"
    assert res.failed_children() == {bad1: error, bad2: error}

    store.set(flag, 1)
    out = echomq("retry", res.id)
    assert out.exit_code == 0, out.output
    assert (
        out.stdout.splitlines()[0] == f"flow {res.id}: awaiting_children; re-published 2 child(ren)"
    )
    assert any(
        line.startswith(f"flow {res.id}  tests.proj.collect") for line in out.stdout.splitlines()
    )

    # The very result that saw the failure looks at the store again: it waits for the new
    # outcome (or, the retried children quick, has it already) rather than answer FAILURE
    # from its cache.
    assert res.state in ("PENDING", "SUCCESS")
    assert settle(res) == {"values": [2, 10, 20], "tag": tag}
    fresh = FlowResult(res.id, app=proj.app)
    assert fresh.dependencies() == (0, 3, 0, 0)  # each child counted once
    assert fresh.failed_children() == {}  # retried children are failures no more
    assert set(fresh.children_values()) == {ok, bad1, bad2}
    assert ran(store, f"collect:{tag}") == 1
    assert ran(store, f"flaky:{flag}") == 4  # each flaky child: one failed run, one good
    assert store.hget(f"emq:{{celery}}:{bad1}", "attempts") == b"2"
    assert store.hget(f"emq:{{celery}}:{ok}", "attempts") == b"1"  # not run again


def test_retry_child_retries_one_child_and_the_flow_waits_for_the_other(
    proj: Any, worker: Any, store: redis.Redis, flag: str
) -> None:
    tag = uuid.uuid4().hex
    res, (_, bad1, bad2) = failed_flow(proj, store, flag, tag)
    store.set(flag, 1)

    outcome = res.retry(child=bad1)  # the Python call
    assert outcome.republished == (bad1,) and outcome.held == (res.id,)
    assert outcome.state == "awaiting_children"
    wait_for(lambda: state_of(store, bad1) == "done", 60)
    assert state_of(store, res.id) == "awaiting_children"
    assert res.dependencies() == (0, 2, 1, 0)  # held: the other child is still failed
    assert state_of(store, bad2) == "failed"

    # A held flow with a child failed under "fail": `retry` takes up that child.
    out = echomq("retry", "--json", res.id, "--child", bad2)
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["republished"] == [bad2] and data["tree"]["id"] == res.id
    assert settle(res) == {"values": [2, 10, 20], "tag": tag}
    assert ran(store, f"collect:{tag}") == 1


def test_retry_of_a_child_that_did_not_fail_under_fail_is_refused(
    proj: Any, worker: Any, store: redis.Redis, flag: str
) -> None:
    res, (ok, bad1, bad2) = failed_flow(proj, store, flag, uuid.uuid4().hex)
    before = quiet(lambda: snapshot(store, res.id, ok, bad1, bad2))
    out = echomq("retry", res.id, "--child", ok)
    assert out.exit_code == 1
    assert f"child {ok} of flow {res.id} is done" in out.stderr
    assert snapshot(store, res.id, ok, bad1, bad2) == before


def test_retry_is_refused_for_a_held_or_done_flow_and_changes_nothing(
    proj: Any, worker: Any, store: redis.Redis, gate: str, env: Env
) -> None:
    fast, slow, other = (
        with_id(proj.add.s(1, 1)),
        with_id(proj.gated.s(5, gate)),
        with_id(proj.add.s(2, 2)),
    )
    held = flow(proj.tsum.s(), [fast, slow]).apply_async()
    wait_for(lambda: state_of(store, id_of(fast)) == "done", 60)
    done = flow(proj.tsum.s(), [other]).apply_async()
    assert settle(done) == 4

    ids = (held.id, id_of(fast), id_of(slow), done.id, id_of(other))
    before = quiet(lambda: snapshot(store, *ids))
    out = echomq("retry", held.id)
    assert out.exit_code == 1 and out.stdout == ""
    assert f"flow {held.id} is awaiting_children (held, with no child failed under 'fail')" in (
        out.stderr
    )
    assert "retry applies to a flow that failed under policy 'fail'" in out.stderr
    process = echomq_process(env, "retry", done.id)  # as a user types it
    assert process.returncode == 1
    assert f"flow {done.id} is done" in process.stderr
    unknown = echomq("retry", f"JOB{uuid.uuid4().hex}")
    assert unknown.exit_code == 1 and "in Redis (never started, or expired)" in unknown.stderr
    with pytest.raises(NotRepairableError) as info:
        retry_flow(get_state(proj.app), done.id)
    assert info.value.state == "done"
    assert snapshot(store, *ids) == before
    store.set(gate, 1)
    assert settle(held) == 7


def test_a_retry_run_twice_runs_nothing_twice(
    proj: Any, worker: Any, store: redis.Redis, flag: str, gate: str
) -> None:
    tag = uuid.uuid4().hex
    ok, bad = with_id(proj.add.s(1, 1)), with_id(proj.flaky.s(3, flag))
    res = flow(proj.collect.s(tag=tag), [ok, bad, with_id(proj.gated.s(4, gate))]).apply_async()
    with pytest.raises(FlowFailed):
        res.get(timeout=60)
    wait_for(lambda: state_of(store, id_of(bad)) == "failed")
    store.set(flag, 1)
    first = retry_flow(get_state(proj.app), res.id)
    assert first.republished == (id_of(bad),)
    # The gated child (still running when the flow failed) keeps its place: still counted.
    with pytest.raises(NotRepairableError):
        retry_flow(get_state(proj.app), res.id)
    wait_for(lambda: state_of(store, id_of(bad)) == "done", 60)
    with pytest.raises(NotRepairableError):
        retry_flow(get_state(proj.app), res.id)
    store.set(gate, 1)
    # A result object that already read the failure keeps it (res.retry() would refresh it).
    assert settle(FlowResult(res.id, app=proj.app)) == {"values": [2, 3, 4], "tag": tag}
    assert ran(store, f"flaky:{flag}") == 2 and ran(store, f"collect:{tag}") == 1


def test_retrying_a_nested_flow_that_failed_its_outer_flow_holds_both_again(
    proj: Any, worker: Any, store: redis.Redis, flag: str
) -> None:
    tag = uuid.uuid4().hex
    inner = flow(proj.tsum.s(), [with_id(proj.flaky.s(5, flag)), proj.add.s(1, 1)])
    outer = flow(proj.collect.s(tag=tag), [proj.add.s(3, 4), inner])
    res = outer.freeze()
    inner_id = inner.freeze().id
    outer.apply_async()
    with pytest.raises(FlowFailed) as info:
        res.get(timeout=60)
    assert info.value.child_id == inner_id
    wait_for(lambda: store.hget(f"emq:{{celery}}:{inner_id}", "propagated") == b"1", 60)
    assert state_of(store, res.id) == "failed"

    store.set(flag, 1)
    out = echomq("retry", inner_id)
    assert out.exit_code == 0, out.output
    assert f"held again: {res.id}, {inner_id}" in out.stdout
    assert settle(FlowResult(res.id, app=proj.app)) == {"values": [7, 7], "tag": tag}
    assert ran(store, f"collect:{tag}") == 1
    assert store.hget(f"emq:{{celery}}:{inner_id}", "state") == b"done"
    assert FlowResult(res.id, app=proj.app).dependencies() == (0, 2, 0, 0)


def test_release_runs_a_held_parent_with_the_values_so_far_once(
    proj: Any, worker: Any, store: redis.Redis, gate: str
) -> None:
    tag = uuid.uuid4().hex
    fast, slow = with_id(proj.add.s(1, 1)), with_id(proj.gated.s(5, gate))
    res = flow(proj.collect.s(tag=tag), [fast, slow]).apply_async()
    wait_for(lambda: state_of(store, id_of(fast)) == "done", 60)

    out = echomq("release", res.id)
    assert out.exit_code == 0, out.output
    assert out.stdout.splitlines()[0] == (
        f"flow {res.id}: released with 1 value(s); 1 child(ren) outstanding"
    )
    assert settle(res) == {"values": [2], "tag": tag}
    # The late child is recorded, and releases nothing again.
    store.set(gate, 1)
    wait_for(lambda: len(res.children_values()) == 2, 60)
    assert res.children_values()[id_of(slow)] == 5
    assert state_of(store, res.id) == "done" and ran(store, f"collect:{tag}") == 1
    again = echomq("release", res.id)
    assert again.exit_code == 1 and f"flow {res.id} is done" in again.stderr


def test_release_with_revoke_revokes_the_children_not_started(
    proj: Any, worker: Any, store: redis.Redis, gate: str
) -> None:
    tag = uuid.uuid4().hex
    fast, slow = with_id(proj.add.s(1, 1)), with_id(proj.gated.s(5, gate))
    # Not started: its message waits out a countdown in the worker's timer.
    later = with_id(proj.add.s(7, 7).set(countdown=30))
    res = flow(proj.collect.s(tag=tag), [fast, slow, later]).apply_async()
    wait_for(lambda: state_of(store, id_of(slow)) == "active", 60)
    wait_for(lambda: state_of(store, id_of(fast)) == "done", 60)

    outcome = res.release(revoke=True)
    assert outcome.revoked == (id_of(later),) and outcome.values == 1
    assert settle(res) == {"values": [2], "tag": tag}
    assert state_of(store, id_of(later)) == "cancelled"
    store.set(gate, 1)  # the running child finishes and is recorded, without a second release
    wait_for(lambda: state_of(store, id_of(slow)) == "done", 60)
    assert res.children_values() == {id_of(fast): 2, id_of(slow): 5}
    assert ran(store, f"collect:{tag}") == 1


def test_release_of_an_unknown_or_finished_flow_exits_non_zero(
    proj: Any, worker: Any, store: redis.Redis, env: Env
) -> None:
    child = with_id(proj.add.s(2, 2))
    done = flow(proj.tsum.s(), [child]).apply_async()
    assert settle(done) == 4
    before = quiet(lambda: snapshot(store, done.id, id_of(child)))
    missing = f"JOB{uuid.uuid4().hex}"
    unknown = echomq_process(env, "release", missing)
    assert unknown.returncode == 1
    assert f"no job '{missing}' in Redis (never started, or expired)" in unknown.stderr
    finished = echomq("release", "--revoke", done.id)
    assert finished.exit_code == 1
    assert f"flow {done.id} is done; nothing changed: release applies to a held parent" in (
        finished.stderr
    )
    with pytest.raises(NotRepairableError):
        release_flow(get_state(proj.app), done.id)
    assert snapshot(store, done.id, id_of(child)) == before


# --- across slots: children and nested flows on another queue ------------------------------


@pytest.fixture
def other_queue(start_worker: Any, own_queue: Any) -> str:
    name: str = own_queue("xr")
    start_worker(queues=name, concurrency=2)
    return name


def test_retry_of_a_failed_child_on_another_queue_is_credited_once(
    proj: Any, worker: Any, other_queue: str, store: redis.Redis, flag: str
) -> None:
    tag = uuid.uuid4().hex
    remote = with_id(proj.flaky.s(10, flag).set(queue=other_queue))
    res = flow(proj.collect.s(tag=tag), [proj.add.s(1, 1), remote]).apply_async()
    with pytest.raises(FlowFailed):
        res.get(timeout=60)
    settled = f"emq:{{celery}}:{res.id}:settled"
    wait_for(lambda: store.hget(settled, id_of(remote)) == b"failed", 60)
    assert state_of(store, id_of(remote), other_queue) == "failed"

    store.set(flag, 1)
    outcome = retry_flow(get_state(proj.app), res.id)
    assert outcome.republished == (id_of(remote),)
    assert settle(FlowResult(res.id, app=proj.app)) == {"values": [2, 10], "tag": tag}
    assert store.hget(settled, id_of(remote)) == b"done"
    assert FlowResult(res.id, app=proj.app).dependencies() == (0, 2, 0, 0)
    assert ran(store, f"collect:{tag}") == 1


def test_retry_of_a_nested_flow_on_another_queue_that_failed_its_outer_flow(
    proj: Any, worker: Any, other_queue: str, store: redis.Redis, flag: str
) -> None:
    tag = uuid.uuid4().hex
    q = other_queue
    inner = flow(
        proj.tsum.s().set(queue=q),
        [proj.flaky.s(5, flag).set(queue=q), proj.add.s(1, 1).set(queue=q)],
    )
    outer = flow(proj.collect.s(tag=tag), [proj.add.s(3, 4), inner])
    res = outer.freeze()
    inner_id = inner.freeze().id
    outer.apply_async()
    with pytest.raises(FlowFailed):
        res.get(timeout=60)
    settled = f"emq:{{celery}}:{res.id}:settled"
    wait_for(lambda: store.hget(settled, inner_id) == b"failed", 60)
    assert state_of(store, inner_id, q) == "failed"

    store.set(flag, 1)
    outcome = FlowResult(inner_id, app=proj.app).retry()
    assert outcome.held == (res.id, inner_id) and len(outcome.republished) == 1
    assert settle(FlowResult(res.id, app=proj.app)) == {"values": [7, 7], "tag": tag}
    assert store.hget(settled, inner_id) == b"done"
    assert state_of(store, inner_id, q) == "done"
    assert ran(store, f"collect:{tag}") == 1


def test_retry_of_a_flow_whose_keys_expired_in_part_is_refused(
    proj: Any, worker: Any, store: redis.Redis, flag: str
) -> None:
    res, (ok, bad1, bad2) = failed_flow(proj, store, flag, uuid.uuid4().hex)
    store.delete(f"emq:{{celery}}:{bad2}")  # as when its result TTL ran out
    before = quiet(lambda: snapshot(store, res.id, ok, bad1, bad2))
    with pytest.raises(NotRepairableError, match=f"children {bad2}"):
        res.retry()
    assert snapshot(store, res.id, ok, bad1, bad2) == before


def test_release_revoke_names_the_running_children_it_cannot_stop_and_terminate_stops_them(
    proj: Any, worker: Any, store: redis.Redis, gate: str
) -> None:
    tag = uuid.uuid4().hex
    fast, slow = with_id(proj.add.s(1, 1)), with_id(proj.gated.s(5, gate))
    res = flow(proj.collect.s(tag=tag), [fast, slow]).apply_async()
    wait_for(lambda: state_of(store, id_of(slow)) == "active", 60)
    wait_for(lambda: state_of(store, id_of(fast)) == "done", 60)
    alone = echomq("release", "--terminate", res.id)
    assert alone.exit_code == 2 and "--terminate goes with --revoke" in alone.stderr
    assert state_of(store, res.id) == "awaiting_children"  # nothing changed

    out = echomq("release", "--revoke", res.id)
    assert out.exit_code == 0, out.output
    assert out.stdout.splitlines()[0] == (
        f"flow {res.id}: released with 1 value(s); 1 child(ren) outstanding, 0 revoked; "
        "1 already running, not revoked (a revoke stops only children not started; a running "
        "one finishes and is recorded): add --terminate to stop them"
    )
    assert settle(res) == {"values": [2], "tag": tag}

    tag = uuid.uuid4().hex
    fast, slow = with_id(proj.add.s(1, 1)), with_id(proj.gated.s(6, gate + "-t"))
    res = flow(proj.collect.s(tag=tag), [fast, slow]).apply_async()
    wait_for(lambda: state_of(store, id_of(slow)) == "active", 60)
    wait_for(lambda: state_of(store, id_of(fast)) == "done", 60)
    outcome = json.loads(echomq("release", "--revoke", "--terminate", "--json", res.id).stdout)
    assert outcome["running"] == outcome["terminated"] == [id_of(slow)]
    assert settle(res) == {"values": [2], "tag": tag}
    # Its process is signalled: the child never returns its value.
    wait_for(lambda: state_of(store, id_of(slow)) not in ("active", "pending"), 60)
    assert state_of(store, id_of(slow)) != "done"
    assert id_of(slow) not in res.children_values()


def test_forget_of_a_cancelled_flow_never_lets_its_queued_children_run(
    proj: Any, start_worker: Any, store: redis.Redis, env: Env
) -> None:
    """Children cancelled while their messages wait in a queue no worker consumes: after the
    flow is forgotten, a worker that takes the queue turns them away, as before the forget."""
    queue = f"forgotten{uuid.uuid4().hex[:6]}"
    tag = uuid.uuid4().hex
    kids = [with_id(proj.counted.s(i, tag)) for i in range(3)]
    res = flow(proj.collect.s(tag=tag), kids).apply_async(queue=queue)
    broker = redis.Redis.from_url(env.broker)
    assert broker.llen(queue) == 3
    assert echomq("cancel", res.id).exit_code == 0
    out = echomq("forget", res.id)
    assert out.exit_code == 0, out.output
    assert "kept 3 cancelled child row(s)" in out.stdout
    assert [k for k in store.scan_iter(match=f"*{res.id}*") if b"celery-task-meta" not in k] == []
    for kid in kids:  # all that is left of each child: what turns its message away
        row = store.hgetall(KEYS.job_key(queue, id_of(kid)))
        assert row == {b"state": b"cancelled", b"parent": res.id.encode()}
        assert 0 < store.ttl(KEYS.job_key(queue, id_of(kid))) <= 86400

    start_worker(queues=queue)
    wait_for(lambda: broker.llen(queue) == 0, 60)
    time.sleep(2)  # the deliveries claimed and dropped
    assert ran(store, f"counted:{tag}") == 0 and ran(store, f"collect:{tag}") == 0
