"""A child or a parent that replaces itself (Celery's ``Task.replace``): the flow waits for the
replacement and takes its value, as a chord does, with no stall timeout in between.

The session worker's stall timeout is 300 s and every ``get`` below waits far less: a flow that
waited for recovery to notice a stalled job would time out here.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
from celery.result import AsyncResult

from celery_echomq import flow
from celery_echomq.store.keyspace import new_job_id

pytestmark = pytest.mark.e2e


def values_of(ids: list[str], values: dict[str, Any]) -> list[Any]:
    return [values[cid] for cid in ids]


def ran(store: redis.Redis, name: str) -> int:
    return int(store.get(f"test:ran:{name}") or 0)


def test_children_replaced_by_a_task_a_chain_a_group_a_chord_and_a_flow(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    ids = [new_job_id() for _ in range(5)]
    kinds = ["task", "chain", "group", "chord", "flow"]
    kids = [
        proj.replaced_by.s(kind, 1).set(task_id=cid) for kind, cid in zip(kinds, ids, strict=True)
    ]
    tag = uuid.uuid4().hex
    res = flow(proj.collect.s(tag=tag), [*kids, proj.add.s(1, 1)]).apply_async()
    # task: 1 + 100; chain: (1 + 1) + 100; group: [1 + 1, 1 + 2]; chord and flow:
    # (1 + 1) + (1 + 2)
    assert res.get(timeout=60) == {"values": [101, 102, [2, 3], 5, 5, 2], "tag": tag}
    values = res.children_values()
    assert [values[cid] for cid in ids] == [101, 102, [2, 3], 5, 5]
    assert res.dependencies() == (0, 6, 0, 0)
    # As Task.replace promises, each replaced id resolves to its replacement's value.
    assert [AsyncResult(cid, app=proj.app).get(timeout=10) for cid in ids] == values_of(ids, values)
    assert ran(store, f"collect:{tag}") == 1
    for cid in ids:
        assert ran(store, f"replaced_by:{cid}") == 1  # the replaced body ran once
        assert store.hget(f"emq:{{celery}}:{cid}", "state") == b"done"


def test_a_replaced_parent_of_a_nested_flow_gives_its_outer_flow_the_replacements_value(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    inner_id = new_job_id()
    inner = flow(
        proj.replaced_parent.s().set(task_id=inner_id), [proj.add.s(1, 1), proj.add.s(2, 2)]
    )
    tag = uuid.uuid4().hex
    res = flow(proj.collect.s(tag=tag), [inner, proj.add.s(5, 5)]).apply_async()
    assert res.get(timeout=60) == {"values": [60, 10], "tag": tag}  # 60 = 10 * (2 + 4)
    assert res.children_values()[inner_id] == 60
    assert ran(store, f"replaced_parent:{inner_id}") == 1
    assert store.hget(f"emq:{{celery}}:{inner_id}", "state") == b"done"
