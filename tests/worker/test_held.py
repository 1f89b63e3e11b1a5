"""While children run, the parent is held in Redis (in no state set) and has not run."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import redis

from celery_echomq import children_values, dependencies, flow, get_state
from tests.helpers import needs_own_backend_db, wait_for

HOT_PATH = ("claim", "complete", "fail", "retry", "dispatch")


def test_parent_is_held_until_the_last_child_completes(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    tag = uuid.uuid4().hex
    gates = [f"gate:{tag}:{i}" for i in range(3)]
    res = flow(proj.collect.s(tag=tag), [proj.gated.s(i, g) for i, g in enumerate(gates)])()
    key = f"emq:{{celery}}:{res.id}"

    def in_any_set() -> bool:
        return any(
            store.zscore(f"emq:{{celery}}:{name}", res.id) is not None
            for name in ("pending", "active", "failed")
        )

    for opened in range(3):
        wait_for(lambda n=opened: res.dependencies().outstanding == 3 - n)
        assert store.hget(key, "state") == b"awaiting_children"
        assert not in_any_set()
        assert res.state == "PENDING"
        assert store.get(f"test:ran:collect:{tag}") is None
        assert res.dependencies().done == opened
        store.set(gates[opened], 1)

    assert res.get(timeout=60) == {"values": [0, 1, 2], "tag": tag}
    assert store.get(f"test:ran:collect:{tag}") == b"1"
    # The module functions read the same state by id alone.
    assert dependencies(res.id) == (0, 3, 0, 0)
    assert sorted(children_values(res.id).values()) == [0, 1, 2]


def test_empty_children_dispatches_the_parent_at_once_with_an_empty_list(
    proj: Any, worker: Any
) -> None:
    tag = uuid.uuid4().hex
    res = flow(proj.collect.s(tag=tag), []).apply_async()
    assert res.get(timeout=60) == {"values": [], "tag": tag}
    assert res.dependencies() == (0, 0, 0, 0)


def test_immutable_parent_gets_no_values(proj: Any, worker: Any) -> None:
    res = flow(proj.noargs.si(), [proj.add.s(1, 2), proj.add.s(3, 4)]).apply_async()
    assert res.get(timeout=60) == "ran"
    assert sorted(res.children_values().values()) == [3, 7]


def test_delay_and_call_start_the_flow_too(proj: Any, worker: Any) -> None:
    assert flow(proj.tsum.s(), [proj.add.s(1, 1)]).delay().get(timeout=60) == 2
    assert flow(proj.tsum.s(), [proj.add.s(2, 2)])().get(timeout=60) == 4


@needs_own_backend_db
def test_non_flow_tasks_cause_no_redis_command(
    proj: Any, worker: Any, store: redis.Redis, env: Any
) -> None:
    store_db = int(env.store.rsplit("/", 1)[1])
    hot = {get_state(proj.app).scripts.runner.registered[name].sha for name in HOT_PATH}
    seen: list[str] = []
    ready, done = threading.Event(), threading.Event()

    def watch() -> None:
        # MONITOR sees every command the server runs, with the database it ran on. The
        # worker's recovery pass runs on its own schedule; what a task would cause is a
        # transition script or a command naming the task.
        with redis.Redis.from_url(env.store).monitor() as monitor:
            ready.set()
            for command in monitor.listen():
                text = str(command["command"])
                if command.get("db") == store_db:
                    seen.append(text)
                if done.is_set() or "echomq-probe-end" in text:
                    return

    wait_for(lambda: store.zcard("emq:{celery}:active") == 0)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    ready.wait(10)
    plain = [proj.add.delay(2, 3), proj.add.apply_async((4, 5), countdown=0)]
    assert [r.get(timeout=60) for r in plain] == [5, 9]
    store.get("echomq-probe-end")
    thread.join(10)
    done.set()
    assert seen and seen[-1] == "GET echomq-probe-end"
    assert not [c for c in seen if any(r.id in c for r in plain)]
    assert not [
        c for c in seen if c.split(" ")[0] in ("EVALSHA", "EVAL") and c.split(" ")[1] in hot
    ]
