"""A group parent's errbacks run as a chord's whose body is a group: once per failing task of
the group, with that task's id; a child that fails the flow before the group runs still runs
them once, with the flow's id. Eagerly and on a worker alike (the errbacks an eager run sends
run on the worker)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import group

from celery_echomq import FlowFailed, flow

pytestmark = pytest.mark.e2e

TIMEOUT = 60


@pytest.fixture(params=["apply", "apply_async"], ids=["eager", "worker"])
def how(request: pytest.FixtureRequest, worker: Any) -> str:
    return str(request.param)


@pytest.fixture
def counted(store: redis.Redis) -> Iterator[list[str]]:
    """Keys the errbacks count under, deleted after the test."""
    made: list[str] = []
    yield made
    if made:
        store.delete(*made)


def counts(store: redis.Redis, keys: list[str], expected: int) -> list[int]:
    """Each key's count once the first reaches ``expected`` and a moment has passed (a
    second run would show by then)."""
    deadline = time.monotonic() + TIMEOUT
    while int(store.get(keys[0]) or 0) < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    return [int(store.get(key) or 0) for key in keys]


def failing_group(proj: Any, n: int) -> tuple[Any, list[str]]:
    tasks = [proj.fail.s() for _ in range(n)]
    ids = [task.freeze().id for task in tasks]
    return group(proj.identity.si(1), *tasks), ids


@pytest.mark.parametrize("linked", ["method", "option", "group"])
def test_each_failing_task_of_a_group_parent_runs_the_errbacks_once(
    proj: Any, how: str, store: redis.Redis, counted: list[str], linked: str
) -> None:
    parent, fail_ids = failing_group(proj, 3)
    counted.extend(fail_ids)
    errback = proj.errback_new_style.s()  # counts under the failed task's own id
    if linked == "group":
        parent.set(link_error=[errback])
    sig = flow(parent, [proj.identity.si(1)])
    flow_id = sig.freeze().id
    counted.append(flow_id)
    if linked == "method":
        sig.link_error(errback)
    options = {"link_error": errback} if linked == "option" else {}
    res = getattr(sig, how)(**options)
    with pytest.raises(proj.ExpectedException):  # a failed task's own, as a chord's group body
        res.get(timeout=TIMEOUT)
    assert counts(store, [*fail_ids, flow_id], 1) == [1, 1, 1, 0]


def test_a_child_failing_the_flow_runs_a_group_parents_errbacks_once_with_the_flows_id(
    proj: Any, how: str, store: redis.Redis, counted: list[str]
) -> None:
    parent, fail_ids = failing_group(proj, 2)
    sig = flow(parent, [proj.fail.s()])
    sig.link_error(proj.errback_old_style.s())  # counts under the id it is given
    flow_id = sig.freeze().id
    counted.extend([flow_id, *fail_ids])
    with pytest.raises(FlowFailed):
        getattr(sig, how)().get(timeout=TIMEOUT)
    assert counts(store, [flow_id, *fail_ids], 1) == [1, 0, 0]


def test_a_task_parent_and_a_failed_childs_own_errbacks_are_as_before(
    proj: Any, how: str, store: redis.Redis, counted: list[str]
) -> None:
    bad = proj.fail.s()
    bad.link_error(proj.errback_new_style.s())
    bad_id = bad.freeze().id
    sig = flow(proj.tsum.s(), [bad, proj.identity.si(1)])
    sig.link_error(proj.errback_old_style.s())
    flow_id = sig.freeze().id
    counted.extend([bad_id, flow_id])
    with pytest.raises(FlowFailed):
        getattr(sig, how)().get(timeout=TIMEOUT)
    assert counts(store, [bad_id, flow_id], 1) == [1, 1]
