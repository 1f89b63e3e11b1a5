"""Children on other queues: each queue's keys on its own slot, credited across slots once."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_echomq import FlowFailed, flow, get_state
from tests.helpers import KEYS, wait_for


@pytest.fixture(scope="module")
def queues() -> tuple[str, str]:
    return "xa" + uuid.uuid4().hex[:6], "xb" + uuid.uuid4().hex[:6]


@pytest.fixture
def other_worker(start_worker: Any, queues: tuple[str, str]) -> Any:
    return start_worker(queues=",".join(queues), concurrency=2)


@pytest.fixture
def small_chunks(proj: Any) -> Iterator[int]:
    state = get_state(proj.app)
    saved = state.settings
    state.settings = dataclasses.replace(saved, chunk_size=7)
    yield 7
    state.settings = saved


def test_children_on_other_queues_keep_their_keys_on_their_slots(
    proj: Any,
    worker: Any,
    other_worker: Any,
    queues: tuple[str, str],
    store: redis.Redis,
) -> None:
    qa, qb = queues
    a, b, c = proj.add.s(1, 1).set(queue=qa), proj.add.s(2, 2).set(queue=qb), proj.add.s(3, 3)
    f = flow(proj.collect.s(), [a, b, c])
    res = f.freeze()
    f.apply_async()
    assert res.get(timeout=60)["values"] == [2, 4, 6]
    ida, idb, idc = (s.options["task_id"] for s in (a, b, c))
    assert store.exists(KEYS.job_key(qa, ida)) and store.exists(KEYS.job_key(qb, idb))
    assert store.exists(f"emq:{{celery}}:{idc}")
    assert store.hget(KEYS.job_key(qa, ida), "pq") == b"celery"
    # The two remote children were credited once each on the parent's slot.
    assert store.hgetall(f"emq:{{celery}}:{res.id}:settled") == {
        ida.encode(): b"done",
        idb.encode(): b"done",
    }
    assert res.dependencies() == (0, 3, 0, 0)
    assert store.zcard(KEYS.queue_key(qa, "outbox")) == 0
    assert store.zcard("emq:{celery}:open") == 0


def test_parent_on_another_queue_than_all_its_children(
    proj: Any, worker: Any, other_worker: Any, queues: tuple[str, str]
) -> None:
    qa, _ = queues
    f = flow(proj.tsum.s(), [proj.add.s(i, i).set(queue=qa) for i in range(5)])
    assert f.apply_async().get(timeout=60) == 20


def test_cross_queue_failure_policies(
    proj: Any, worker: Any, other_worker: Any, queues: tuple[str, str]
) -> None:
    qa, qb = queues
    ignored = proj.boom.s("far").set(queue=qa, parent_policy="ignore")
    f = flow(proj.tsum.s(), [ignored, proj.add.s(2, 2).set(queue=qb)])
    res = f.freeze()
    f.apply_async()
    assert res.get(timeout=60) == 4
    assert res.ignored_failures() == {ignored.options["task_id"]: "ValueError: far"}

    failing = proj.boom.s("far").set(queue=qb)
    f2 = flow(proj.tsum.s(), [failing, proj.add.s(2, 2)], policy="fail")
    res2 = f2.freeze()
    f2.apply_async()
    with pytest.raises(FlowFailed) as info:
        res2.get(timeout=60)
    assert info.value.child_id == failing.options["task_id"]


def test_nested_flow_on_another_queue(
    proj: Any, worker: Any, other_worker: Any, queues: tuple[str, str]
) -> None:
    qa, qb = queues
    inner = flow(proj.tsum.s().set(queue=qa), [proj.add.s(1, 1).set(queue=qb), proj.add.s(2, 2)])
    res = flow(proj.collect.s(), [inner, proj.add.s(5, 5)]).apply_async()
    # proj.add.s(2, 2) routes to the default queue; the inner parent lives on qa's slot.
    assert res.get(timeout=60)["values"] == [6, 10]


def test_chunked_same_queue_flow(
    proj: Any, worker: Any, small_chunks: int, store: redis.Redis
) -> None:
    n = 3 * small_chunks + 2
    res = flow(proj.tsum.s(), [proj.add.s(i, 0) for i in range(n)]).apply_async()
    assert res.get(timeout=60) == sum(range(n))
    assert res.dependencies() == (0, n, 0, 0)
    assert store.zscore("emq:{celery}:open", res.id) is None


def test_chunked_and_cross_queue_refuse_an_existing_child_and_write_nothing(
    proj: Any,
    worker: Any,
    queues: tuple[str, str],
    small_chunks: int,
    store: redis.Redis,
    env: Any,
) -> None:
    qa, _ = queues
    taken = "JOB" + uuid.uuid4().hex
    gate = f"gate:{uuid.uuid4().hex}"
    first = flow(proj.tsum.s(), [proj.gated.s(1, gate).set(task_id=taken)]).apply_async()
    wait_for(lambda: first.dependencies().outstanding == 1)
    from celery_echomq import FlowExistsError

    children = [proj.add.s(i, i).set(queue=qa) for i in range(3)] + [
        proj.add.s(0, 0).set(task_id=taken)
    ]
    before = sorted(store.keys(f"emq:{{{qa}}}:*"))
    broker_before = redis.Redis.from_url(env.broker).llen(qa)
    with pytest.raises(FlowExistsError, match=taken):
        flow(proj.tsum.s(), children).apply_async()
    assert redis.Redis.from_url(env.broker).llen(qa) == broker_before
    store.set(gate, 1)
    assert first.get(timeout=60) == 1
    # Children of the refused flow had landed on the other queue's slot before the refusal
    # on this one: they were taken back, and its parent too.
    assert sorted(store.keys(f"emq:{{{qa}}}:*")) == before
    assert store.zcard("emq:{celery}:open") == 0
