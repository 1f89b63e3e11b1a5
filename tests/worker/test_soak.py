"""Soak: flows keep arriving for 30 s while pool processes and whole workers are SIGKILLed at
random. Every flow must end with the right value, each child counted once, nothing left
pending, active or held. Bodies may run twice where a kill forces it (a killed body runs
again); the test prints how many did, and how many messages recovery re-published.
"""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import pytest
import redis

from celery_echomq import get_state
from celery_echomq.ops.views import held_parents
from tests.helpers import KEYS, Sent, counters, send_flows, wait_for

pytestmark = pytest.mark.e2e

SECONDS = 30
# acks late with reject-on-worker-lost: the broker redelivers what a killed pool process held,
# so killed children run again rather than fail their flow.
SOAK_ENV = {
    "ECHOMQ_T_STALL": "2",
    "ECHOMQ_T_RECOVERY_INTERVAL": "0.5",
    "ECHOMQ_T_ACKS_LATE": "1",
}


@pytest.fixture
def queue(own_queue: Any) -> str:
    """A queue of this test's own (removed afterwards)."""
    return str(own_queue("soak"))


def test_soak_flows_keep_arriving_while_pool_processes_and_workers_are_killed(
    proj: Any, store: redis.Redis, queue: str, start_worker: Any
) -> None:
    seed = int(os.environ.get("ECHOMQ_SOAK_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    n = 0

    def new_worker() -> Any:
        nonlocal n
        n += 1
        return start_worker(queues=queue, concurrency=2, name=f"{queue}-{n}", extra_env=SOAK_ENV)

    workers = [new_worker(), new_worker()]
    sent: Sent = []
    pool_kills = worker_kills = 0
    deadline = time.monotonic() + SECONDS
    next_kill = time.monotonic() + rng.uniform(1.5, 3.5)
    while time.monotonic() < deadline:
        size, seconds = rng.randint(2, 8), rng.choice([0.0, 0.05, 0.2])
        sent += send_flows(proj, queue, flows=1, size=size, seconds=seconds)
        if time.monotonic() >= next_kill:
            victim = rng.choice(workers)
            pids = victim.pool_pids()
            if pids and rng.random() < 0.7:
                os.kill(rng.choice(pids), signal.SIGKILL)
                pool_kills += 1
            else:
                victim.kill()  # the whole worker: main process and pool, no goodbye
                workers.remove(victim)
                workers.append(new_worker())
                worker_kills += 1
            next_kill = time.monotonic() + rng.uniform(1.5, 3.5)
        time.sleep(0.25)

    twice = parents_twice = 0
    for res, tag, ids in sent:
        assert res.get(timeout=180) == {"values": list(range(len(ids))), "tag": tag}, seed
        assert res.dependencies() == (0, len(ids), 0, 0), seed
        assert res.children_values() == {cid: i for i, cid in enumerate(ids)}, seed
        twice += sum(int(store.get(f"test:ran:slow:{cid}") or 0) > 1 for cid in ids)
        parents_twice += int(store.get(f"test:ran:collect:{tag}") or 0) > 1

    def settled() -> bool:
        return all(store.zcard(KEYS.queue_key(queue, s)) == 0 for s in ("pending", "active"))

    wait_for(settled, timeout=60)
    assert held_parents(get_state(proj.app), queue) == []
    found = counters(store, queue)
    print(
        f"\nsoak (seed {seed}): {len(sent)} flows, {sum(len(ids) for _, _, ids in sent)} "
        f"children; {pool_kills} pool processes and {worker_kills} workers killed; "
        f"{twice} child bodies and {parents_twice} parent bodies ran twice; "
        f"{found.get('republished', 0)} re-published, "
        f"{found.get('duplicates_skipped', 0)} duplicate deliveries skipped"
    )
    assert pool_kills + worker_kills > 0
