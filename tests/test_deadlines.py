"""Deadlines (issue 25): a flow's fan-in failed or released exactly once when its deadline
passes while it still waits, by whichever worker polls first; on real workers and eagerly."""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis

from celery_echomq import (
    DeadlineError,
    FlowDeadlineExceeded,
    FlowFailed,
    NotRepairableError,
    flow,
    get_state,
    retry_flow,
)
from celery_echomq.views import read_tree

from .conftest import wait_for


def tag() -> str:
    return uuid.uuid4().hex


def ran(store: redis.Redis, name: str) -> int:
    return int(store.get(f"test:ran:{name}") or 0)


def row(store: redis.Redis, job_id: str, queue: str = "celery") -> dict[str, str]:
    raw = store.hgetall(f"emq:{{{queue}}}:{job_id}")
    return {k.decode(): v.decode(errors="replace") for k, v in raw.items()}


# --- bad input: refused when the flow is made, before anything reaches Redis ---------------


@pytest.mark.parametrize(
    ("deadline", "words"),
    [
        (0, "more than 0 seconds"),
        (-5, "more than 0 seconds"),
        (float("nan"), "more than 0 seconds"),
        ("60", "is a str"),
        (True, "is a bool"),
        (10**9, "more than a year"),
        (datetime(2030, 1, 1), "naive datetime"),
        (datetime(2001, 1, 1, tzinfo=timezone.utc), "already passed"),
    ],
)
def test_a_bad_deadline_is_refused_when_the_flow_is_made(
    proj: Any, deadline: Any, words: str
) -> None:
    with pytest.raises(DeadlineError, match=words) as info:
        flow(proj.tsum.s(), [proj.add.s(1, 1)], deadline=deadline)
    assert isinstance(info.value, ValueError)


def test_an_unknown_on_deadline_is_refused(proj: Any) -> None:
    with pytest.raises(DeadlineError, match="allowed: fail, continue"):
        flow(proj.tsum.s(), [proj.add.s(1, 1)], deadline=5, on_deadline="later")


def test_the_deadline_survives_json_clone_and_a_timedelta(proj: Any) -> None:
    from celery.canvas import Signature

    f = flow(proj.tsum.s(), [proj.add.s(1, 1)], deadline=timedelta(seconds=90))
    back = Signature.from_dict(dict(f), app=proj.app)
    assert back.deadline == {"in": 90.0} and back.on_deadline == "fail"
    when = datetime.now(timezone.utc) + timedelta(minutes=5)
    g = flow(proj.tsum.s(), [proj.add.s(1, 1)], deadline=when, on_deadline="continue").clone()
    assert g.deadline == {"at": when.timestamp()} and g.on_deadline == "continue"


# --- on a worker ----------------------------------------------------------------------------


def _blocked(proj: Any, gate: str, *, n_running: int = 2, n_waiting: int = 2) -> list[Any]:
    """Children that hold both pool slots (gated) and children queued behind them."""
    running = [proj.gated.s(i, gate) for i in range(1, n_running + 1)]
    waiting = [proj.add.s(10 * i, 1) for i in range(1, n_waiting + 1)]
    return running + waiting


def test_fail_fails_the_parent_naming_the_outstanding_children_and_cuts_the_waiting_ones(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    t, gate = tag(), f"gate:{tag()}"
    kids = _blocked(proj, gate)
    f = flow(proj.collect.s(tag=t), kids, deadline=1.5)
    f.on_error(proj.errback.s())
    res = f.freeze()
    ids = [k.options["task_id"] for k in kids]
    started = time.monotonic()
    f.apply_async()
    with pytest.raises(FlowDeadlineExceeded) as info:
        res.get(timeout=30)
    took = time.monotonic() - started
    exc = info.value
    assert isinstance(exc, FlowFailed)
    assert exc.flow_id == res.id
    assert set(exc.outstanding) == set(ids) and exc.count == 4
    assert "passed its deadline with 4 children outstanding" in str(exc)
    assert 1.4 < took < 4, took
    parent = row(store, res.id)
    assert parent["state"] == "failed" and parent["failed_by"] == "deadline"
    lateness = int(parent["deadline_fired"]) - int(parent["deadline_at"])
    assert 0 <= lateness < 1000, lateness
    # The children queued behind were cut, not run.
    for cid in ids[2:]:
        assert row(store, cid)["state"] == "cancelled" and row(store, cid)["cut"] == "deadline"
    # The running children finish and are recorded; the parent is never run; its link_error
    # callback (queued behind the running children) runs once.
    store.set(gate, 1)
    wait_for(lambda: sorted(res.children_values().values()) == [1, 2])
    wait_for(lambda: res.id.encode() in store.lrange("test:errback", 0, -1))
    tree = read_tree(get_state(proj.app), res.id)
    assert [c.outcome for c in tree.children] == ["credited", "credited", "deadline", "deadline"]
    time.sleep(0.5)
    assert ran(store, f"collect:{t}") == 0
    assert store.lrange("test:errback", 0, -1).count(res.id.encode()) == 1
    for cid in ids[2:]:
        assert row(store, cid)["state"] == "cancelled"


def test_continue_releases_the_parent_with_the_values_so_far(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    t, gate = tag(), f"gate:{tag()}"
    quick = proj.add.s(1, 1)
    kids = [quick, proj.gated.s(2, gate), proj.gated.s(3, gate), proj.add.s(4, 4)]
    f = flow(proj.collect.s(tag=t), kids, deadline=1.5, on_deadline="continue")
    f.freeze()
    res = f.apply_async()
    wait_for(lambda: row(store, res.id).get("released_by") == "deadline", timeout=10)
    # Released with the values so far; both pool slots are still busy with the gated
    # children, so the parent runs once they finish (their values come too late for it).
    store.set(gate, 1)
    assert res.get(timeout=30) == {"values": [2], "tag": t}
    assert "failed_by" not in row(store, res.id)
    assert row(store, kids[3].options["task_id"])["cut"] == "deadline"
    wait_for(lambda: sorted(res.children_values().values()) == [2, 2, 3])
    time.sleep(0.5)
    assert ran(store, f"collect:{t}") == 1  # never released again


def test_a_flow_done_before_its_deadline_is_left_alone_and_its_entry_goes(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    res = flow(proj.tsum.s(), [proj.add.s(1, 1), proj.add.s(2, 2)], deadline=1).apply_async()
    assert res.get(timeout=30) == 6
    assert store.zscore("emq:{celery}:deadlines", res.id) is not None
    wait_for(lambda: store.zscore("emq:{celery}:deadlines", res.id) is None, timeout=10)
    assert "deadline_fired" not in row(store, res.id)
