"""Backlog is not loss: a queue that takes ten stall timeouts to drain re-publishes nothing and
runs no body twice; messages really lost inside a backlog are re-published exactly once each.

The workers here have a stall timeout of one second and a single pool process, so a few dozen
children of a tenth of a second each are a backlog of ten stall timeouts and more.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis

from tests.helpers import (
    BACKLOG_STALL,
    BACKLOG_WORKER,
    KEYS,
    Env,
    check_each_ran_once,
    counters,
    send_flows,
    wait_for,
)

pytestmark = pytest.mark.e2e


@pytest.fixture
def queue(own_queue: Any) -> str:
    """A queue of this test's own (removed afterwards)."""
    return str(own_queue("backlog"))


def drained(store: redis.Redis, queue: str) -> None:
    """Nothing pending, active or held by a worker (the last parent's success signal lands a
    moment after its result: ``get`` returns first)."""
    sets = [KEYS.queue_key(queue, name) for name in ("pending", "active", "reserved")]
    wait_for(lambda: not any(store.zcard(key) for key in sets), timeout=15)


def test_a_backlog_of_ten_stall_timeouts_republishes_nothing(
    proj: Any, store: redis.Redis, queue: str, start_worker: Any
) -> None:
    # 4 flows of 28 children of 0.1 s on one pool process: about 12 s of backlog, 12 stall
    # timeouts; each parent waits behind the later flows' children once released.
    started = time.monotonic()
    sent = send_flows(proj, queue, flows=4, size=28, seconds=0.1)
    w = start_worker(queues=queue, concurrency=1, extra_env=BACKLOG_WORKER)
    check_each_ran_once(store, sent, timeout=120)
    assert time.monotonic() - started > 10 * float(BACKLOG_STALL)  # it really was a backlog
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
    w = start_worker(queues=queue, concurrency=1, extra_env=BACKLOG_WORKER)
    check_each_ran_once(store, first, timeout=120)
    check_each_ran_once(store, second, timeout=120)
    assert counters(store, queue).get("republished", 0) == len(lost)
    for cid in lost:
        assert f"re-published {cid}" in w.output()
    drained(store, queue)
