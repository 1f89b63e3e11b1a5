"""Backlog is not loss: a queue that takes ten stall timeouts to drain re-publishes nothing and
runs no body twice; messages really lost inside a backlog are re-published exactly once each.

The workers here have a stall timeout of one second and a single pool process, so a few dozen
children of a tenth of a second each are a backlog of ten stall timeouts and more.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest
import redis

from celery_echomq import FlowResult, flow
from celery_echomq.store.keyspace import new_job_id

from .conftest import Env, wait_for

pytestmark = pytest.mark.e2e

STALL = "1"
FAST = {"ECHOMQ_T_STALL": STALL, "ECHOMQ_T_RECOVERY_INTERVAL": "0.5"}


@pytest.fixture
def queue(own_queue: Any) -> str:
    """A queue of this test's own (removed afterwards)."""
    return str(own_queue("backlog"))


def counters(store: redis.Redis, queue: str) -> dict[str, int]:
    raw = store.hgetall(f"emq:{{{queue}}}:counters")
    return {k.decode(): int(v) for k, v in raw.items()}


Sent = list[tuple[FlowResult, str, list[str]]]


def send_flows(
    proj: Any, queue: str, flows: int, size: int, seconds: float, app: Any = None
) -> Sent:
    """``flows`` flows of ``size`` children; child i of flow f returns ``f * 100 + i``."""
    sent = []
    for f in range(flows):
        tag, ids = uuid.uuid4().hex, [new_job_id() for _ in range(size)]
        kids = [
            proj.slow_child.s(f * 100 + i, seconds).set(task_id=cid) for i, cid in enumerate(ids)
        ]
        res = flow(proj.collect.s(tag=tag), kids, app=app).apply_async(queue=queue)
        sent.append((res, tag, ids))
    return sent


def check_each_ran_once(store: redis.Redis, sent: Sent, timeout: float, first: int = 0) -> None:
    for f, (res, tag, ids) in enumerate(sent, start=first):
        assert res.get(timeout=timeout) == {
            "values": [f * 100 + i for i in range(len(ids))],
            "tag": tag,
        }
        assert res.dependencies() == (0, len(ids), 0, 0)
        assert int(store.get(f"test:ran:collect:{tag}") or 0) == 1, "the parent ran twice"
        runs = [int(store.get(f"test:ran:slow:{cid}") or 0) for cid in ids]
        assert runs == [1] * len(ids), f"bodies ran {runs}"


def drained(store: redis.Redis, queue: str) -> None:
    """Nothing pending, active or held by a worker (the last parent's success signal lands a
    moment after its result: ``get`` returns first)."""
    sets = [f"emq:{{{queue}}}:{name}" for name in ("pending", "active", "reserved")]
    wait_for(lambda: not any(store.zcard(key) for key in sets), timeout=15)


def test_a_backlog_of_ten_stall_timeouts_republishes_nothing(
    proj: Any, store: redis.Redis, queue: str, start_worker: Any
) -> None:
    # 4 flows of 28 children of 0.1 s on one pool process: about 12 s of backlog, 12 stall
    # timeouts; each parent waits behind the later flows' children once released.
    started = time.monotonic()
    sent = send_flows(proj, queue, flows=4, size=28, seconds=0.1)
    w = start_worker(queues=queue, concurrency=1, extra_env=FAST)
    check_each_ran_once(store, sent, timeout=120)
    assert time.monotonic() - started > 10 * float(STALL)  # it really was a backlog
    assert counters(store, queue).get("republished", 0) == 0
    assert counters(store, queue).get("duplicates_skipped", 0) == 0
    assert "re-published" not in w.output()
    drained(store, queue)


def test_messages_lost_inside_a_backlog_are_republished_exactly_once_each(
    proj: Any, env: Env, store: redis.Redis, queue: str, start_worker: Any
) -> None:
    first = send_flows(proj, queue, flows=1, size=30, seconds=0.1)
    time.sleep(1.5)  # the second flow becomes pending more than a stall timeout later
    second = send_flows(proj, queue, flows=1, size=30, seconds=0.1)
    broker = redis.Redis.from_url(env.broker)
    lost = {*first[0][2][3:6], *second[0][2][10:12]}
    for raw in broker.lrange(queue, 0, -1):
        if json.loads(raw)["headers"]["id"] in lost:
            assert broker.lrem(queue, 1, raw) == 1
    assert broker.llen(queue) == 60 - len(lost)

    # The first flow's lost children are overtaken by the second flow's; the second's are
    # found once the queue is empty.
    w = start_worker(queues=queue, concurrency=1, extra_env=FAST)
    check_each_ran_once(store, first, timeout=120)
    check_each_ran_once(store, second, timeout=120)
    assert counters(store, queue).get("republished", 0) == len(lost)
    for cid in lost:
        assert f"re-published {cid}" in w.output()
    drained(store, queue)
