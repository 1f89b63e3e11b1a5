"""Linked chains: a chain of tasks among a flow's children, its steps plain job rows run in
order (send/shapes.py ``linked``, includes/chain_step.lua, complete.lua's ``advanced``), on
a real worker and eagerly, of any length."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from celery import chain

from celery_echomq import FlowFailed, flow
from celery_echomq.store.keyspace import new_job_id as job_id

TIMEOUT = 60


def run(sig: Any, how: str) -> Any:
    return sig.apply() if how == "eager" else sig.apply_async()


@pytest.fixture(params=["eager", "worker"])
def how(request: pytest.FixtureRequest) -> str:
    if request.param == "worker":
        request.getfixturevalue("worker")
    return str(request.param)


def counting(proj: Any, steps: int) -> Any:
    """add(0, 1) then ``steps - 1`` times add(1): its value is ``steps``."""
    return chain(proj.add.s(0, 1), *(proj.add.s(1) for _ in range(steps - 1)))


def test_a_chain_child_gives_its_last_value(proj: Any, how: str) -> None:
    sig = flow(proj.tsum.s(), [counting(proj, 3), proj.add.s(10, 0)])
    assert run(sig, how).get(timeout=TIMEOUT) == 13


@pytest.mark.parametrize("steps", [42, 1000])
def test_a_chain_child_of_any_length_runs(proj: Any, how: str, steps: int) -> None:
    started = time.monotonic()
    res = run(flow(proj.tsum.s(), [counting(proj, steps), proj.add.s(1, 1)]), how)
    assert res.get(timeout=300) == steps + 2
    print(f"{steps}-step chain child ({how}): {time.monotonic() - started:.2f}s")


def test_a_failed_step_fails_the_flow_naming_it(proj: Any, how: str) -> None:
    bad = proj.fail.s().set(task_id=job_id())
    sig = flow(proj.tsum.s(), [chain(proj.add.s(1, 1), bad, proj.add.s(1))])
    with pytest.raises(FlowFailed, match="Task expected to fail") as caught:
        run(sig, how).get(timeout=TIMEOUT)
    assert caught.value.child_id == bad.options["task_id"]


@pytest.mark.parametrize("policy", ["ignore", "remove"])
def test_a_failed_step_counts_the_chain_once_under_its_policy(
    proj: Any, how: str, policy: str
) -> None:
    bad = chain(proj.add.s(1, 1), proj.fail.s(), proj.add.s(1)).set(parent_policy=policy)
    res = run(flow(proj.tsum.s(), [bad, proj.add.s(2, 3)]), how)
    assert res.get(timeout=TIMEOUT) == 5
    assert res.dependencies().outstanding == 0
    assert len(res.failed_children()) == 1
