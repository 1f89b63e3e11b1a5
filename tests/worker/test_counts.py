"""A flow's counts add up in every ending: ``dependencies()``'s outstanding, done, failed,
ignored and cut are its number of children, and none is outstanding once it has finished;
eagerly and on a worker where the ending applies to both, on a worker for an operator's."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_echomq import Dependencies, FlowDeadlineExceeded, FlowFailed, flow
from tests.helpers import echomq, id_of, run, state_of, wait_for, with_id

TIMEOUT = 60


@pytest.fixture
def gate(store: redis.Redis) -> Iterator[str]:
    name = f"test:gate:{uuid.uuid4().hex}"
    yield name
    store.set(name, 1)  # whatever the test did, nothing stays blocked on it


def finished(res: Any, children: int) -> Dependencies:
    """The counts once no child is outstanding (a child still running when its flow ended
    settles a moment later); they add up to ``children``."""
    wait_for(lambda: res.dependencies().outstanding == 0, TIMEOUT)
    deps = res.dependencies()
    assert deps.total == children, deps
    assert sum(deps) + deps.cut == children
    return deps


def expect(deps: Dependencies, done: int, failed: int = 0, ignored: int = 0, cut: int = 0) -> None:
    assert (deps.outstanding, deps.done, deps.failed, deps.ignored, deps.cut) == (
        0,
        done,
        failed,
        ignored,
        cut,
    ), deps


# --- the four counts stay a tuple of four ----------------------------------------------------


def test_dependencies_unpacks_as_four_and_carries_cut_beside_them() -> None:
    deps = Dependencies(0, 2, 1, 0, cut=3)
    outstanding, done, failed, ignored = deps
    assert (outstanding, done, failed, ignored) == (0, 2, 1, 0)
    assert deps == (0, 2, 1, 0) and deps.cut == 3 and deps.total == 6
    assert deps._asdict() == {"outstanding": 0, "done": 2, "failed": 1, "ignored": 0, "cut": 3}
    assert deps._replace(done=3).cut == 3 and deps._replace(cut=0).cut == 0
    assert repr(deps) == "Dependencies(outstanding=0, done=2, failed=1, ignored=0, cut=3)"
    assert Dependencies(1, 2, 0, 0).cut == 0


# --- endings a flow reaches by itself: eagerly and on a worker -------------------------------


def test_normal(proj: Any, how: str) -> None:
    res = run(flow(proj.tsum.s(), [proj.add.s(i, i) for i in range(3)]), how)
    assert res.get(timeout=TIMEOUT) == 6
    expect(finished(res, 3), done=3)


@pytest.mark.parametrize(
    ("policy", "failed", "ignored"),
    [("fail", 1, 0), ("fail_at_end", 1, 0), ("remove", 1, 0), ("ignore", 0, 1)],
)
def test_a_failed_child_under_each_policy(
    proj: Any, how: str, policy: str, failed: int, ignored: int
) -> None:
    kids = [proj.add.s(1, 1), proj.boom.s("no"), proj.add.s(2, 2)]
    res = run(flow(proj.collect.s(), kids, policy=policy), how)
    if policy in ("fail", "fail_at_end"):
        with pytest.raises(FlowFailed):
            res.get(timeout=TIMEOUT)
    else:
        assert res.get(timeout=TIMEOUT)["values"] == [2, 4]
    # Under fail the siblings go on and are counted; the failed child is not outstanding.
    expect(finished(res, 3), done=2, failed=failed, ignored=ignored)


def test_continue(proj: Any, how: str) -> None:
    kids = [proj.boom.s("no"), proj.add.s(1, 1), proj.add.s(2, 2)]
    res = run(flow(proj.collect.s(), kids, policy="continue"), how)
    res.get(timeout=TIMEOUT)
    # Released by the failure; the children after it still run and are counted.
    expect(finished(res, 3), done=2, failed=1)


def test_a_quorum_of_two_of_six_cuts_the_other_four(proj: Any, how: str) -> None:
    """The third success onwards comes after the quorum was met (not a value of the parent's):
    cut, with the children that never started."""
    tag = uuid.uuid4().hex
    kids = [proj.hedge.s(i, tag) for i in range(6)]
    res = run(flow(proj.collect.s(tag=tag), kids, quorum=2), how)
    assert len(res.get(timeout=TIMEOUT)["values"]) == 2
    expect(finished(res, 6), done=2, cut=4)


@pytest.mark.parametrize("on_deadline", ["fail", "continue"])
def test_a_deadline_cuts_the_children_not_started(proj: Any, how: str, on_deadline: str) -> None:
    """One child runs past the deadline and is counted once it finishes; two never started
    (eagerly: behind it; on a worker: waiting out a countdown) are cut."""
    kids = [
        proj.add.s(1, 1),
        proj.sleep_then.s(3, 2.5),
        proj.add.s(5, 5).set(countdown=30),
        proj.add.s(6, 6).set(countdown=30),
    ]
    res = run(flow(proj.collect.s(), kids, deadline=1.5, on_deadline=on_deadline), how)
    if on_deadline == "fail":
        with pytest.raises(FlowDeadlineExceeded):
            res.get(timeout=TIMEOUT)
    else:
        assert res.get(timeout=TIMEOUT)["values"][0] == 2
    expect(finished(res, 4), done=2, cut=2)


def test_a_window(proj: Any, how: str) -> None:
    res = run(flow(proj.tsum.s(), [proj.add.s(i, 0) for i in range(5)], max_active=2), how)
    assert res.get(timeout=TIMEOUT) == 10
    expect(finished(res, 5), done=5)


def test_a_reducer(proj: Any, how: str) -> None:
    res = run(flow(proj.identity.s(), [proj.add.s(i, 0) for i in range(4)], reduce="sum"), how)
    assert res.get(timeout=TIMEOUT) == 6
    expect(finished(res, 4), done=4)


# --- endings an operator gives a flow: on a worker --------------------------------------------


def _held(proj: Any, store: redis.Redis, gate: str, **options: Any) -> tuple[Any, list[Any]]:
    """A flow of three: one done, one running (until ``gate`` opens), one not started (its
    message waits out a countdown)."""
    kids = [
        with_id(proj.add.s(1, 1)),
        with_id(proj.gated.s(2, gate)),
        with_id(proj.add.s(3, 3).set(countdown=30)),
    ]
    res = flow(proj.collect.s(), kids, **options).apply_async()
    wait_for(lambda: state_of(store, id_of(kids[0])) == "done", TIMEOUT)
    wait_for(lambda: state_of(store, id_of(kids[1])) == "active", TIMEOUT)
    return res, kids


def test_a_cancel_cuts_every_child_not_finished(
    proj: Any, worker: Any, store: redis.Redis, gate: str
) -> None:
    res, _ = _held(proj, store, gate)
    res.revoke()
    store.set(gate, 1)  # the running child finishes on a flow that no longer counts it
    wait_for(lambda: state_of(store, res.id) == "cancelled", TIMEOUT)
    expect(finished(res, 3), done=1, cut=2)


@pytest.mark.parametrize("revoke", [False, True])
def test_a_release(proj: Any, worker: Any, store: redis.Redis, gate: str, revoke: bool) -> None:
    res, kids = _held(proj, store, gate)
    args = ["release", res.id, *(["--revoke"] if revoke else [])]
    out = echomq(*args)
    assert out.exit_code == 0, out.output
    assert res.get(timeout=TIMEOUT)["values"] == [2]
    store.set(gate, 1)
    if revoke:
        # The child not started never runs; the running one finishes and is counted.
        expect(finished(res, 3), done=2, cut=1)
    else:
        # Nothing is cut: the child waiting out its countdown runs later and is counted.
        wait_for(lambda: state_of(store, id_of(kids[2])) == "done", TIMEOUT)
        expect(finished(res, 3), done=3)


def test_a_release_with_revoke_of_a_window_cuts_its_waiting_children(
    proj: Any, worker: Any, store: redis.Redis, gate: str
) -> None:
    kids = [with_id(proj.gated.s(i, gate)) for i in range(5)]
    res = flow(proj.collect.s(), kids, max_active=2).apply_async()
    wait_for(lambda: [state_of(store, id_of(k)) for k in kids[:2]] == ["active"] * 2, TIMEOUT)
    assert res.release(revoke=True).values == 0
    store.set(gate, 1)
    expect(finished(res, 5), done=2, cut=3)


def test_a_cancel_of_a_window_cuts_its_running_and_waiting_children(
    proj: Any, worker: Any, store: redis.Redis, gate: str
) -> None:
    kids = [with_id(proj.gated.s(i, gate)) for i in range(5)]
    res = flow(proj.collect.s(), kids, max_active=2).apply_async()
    wait_for(lambda: [state_of(store, id_of(k)) for k in kids[:2]] == ["active"] * 2, TIMEOUT)
    res.revoke()
    store.set(gate, 1)  # the two running finish on a flow that no longer counts them
    expect(finished(res, 5), done=0, cut=5)
    assert [state_of(store, id_of(k)) for k in kids] == ["cancelled"] * 5


def test_show_and_its_json_say_how_many_were_cut(
    proj: Any, worker: Any, store: redis.Redis, gate: str
) -> None:
    res, _ = _held(proj, store, gate)
    res.revoke()
    wait_for(lambda: state_of(store, res.id) == "cancelled", TIMEOUT)
    shown = echomq("show", res.id)
    assert shown.exit_code == 0, shown.output
    assert "outstanding=0  done=1/3" in shown.output
    assert "failed=0  ignored=0  cut=2" in shown.output
    data = json.loads(echomq("show", res.id, "--json").output)
    counts = {k: data["flow"][k] for k in ("outstanding", "done", "failed", "ignored", "cut")}
    assert counts == {"outstanding": 0, "done": 1, "failed": 0, "ignored": 0, "cut": 2}
    assert data["flow"]["total"] == 3


def test_a_cancel_counts_the_children_cut_on_another_queues_slot(
    proj: Any, store: redis.Redis, own_queue: Any
) -> None:
    """No worker consumes either queue: the children wait, the cancel cuts them where they
    live and each is counted once on the parent's slot."""
    home, far = own_queue("cuthome"), own_queue("cutfar")
    kids = [with_id(proj.add.s(i, i).set(queue=far)) for i in range(2)]
    kids.append(with_id(proj.add.s(9, 9)))
    res = flow(proj.tsum.s(), kids).apply_async(queue=home)
    res.revoke()
    assert [state_of(store, id_of(k), far) for k in kids[:2]] == ["cancelled"] * 2
    assert state_of(store, id_of(kids[2]), home) == "cancelled"
    expect(finished(res, 3), done=0, cut=3)
