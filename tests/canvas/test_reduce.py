"""A flow whose children's values are folded as they arrive, ``flow(parent, children,
reduce=R)``: the parent gets the accumulator as its first argument; a value the reducer cannot
fold fails that child under its policy; ``children_values()`` still reads the children's own
values (send/fan_in.py, store/lua/includes/reduce.lua), on a worker and eagerly."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest
import redis
from celery.result import AsyncResult

from celery_echomq import FlowFailed, ReduceError, flow
from tests.helpers import echomq, run, state_of, wait_for

TIMEOUT = 60

DICTS = [{"id": 1, "s": 5}, {"id": 2, "s": 9}, {"id": 3, "s": 1}, {"id": 4, "s": 9}]

# reducer -> (the children's values, the accumulator the parent gets)
CASES: dict[str, tuple[Any, list[Any], Any]] = {
    "count": ("count", [1, 2, 3, 4], 4),
    "sum": ("sum", [1, 2, 3, 4.5], 10.5),
    "min": ("min", [3, -2, 7], -2),
    "max": ("max", [3, -2, 7], 7),
    "merge": ("merge", [{"a": 1, "b": 1}, {"b": 2}, {"c": 3}], {"a": 1, "b": 2, "c": 3}),
    "top": (("top", 2, "s"), DICTS, [{"id": 2, "s": 9}, {"id": 4, "s": 9}]),
    "list": (("list", 2), [[1], {"x": None}, "three"], [[1], {"x": None}]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_reducer(proj: Any, how: str, case: str) -> None:
    reducer, values, expected = CASES[case]
    tag = uuid.uuid4().hex
    kids = [proj.echo.s(v) for v in values]
    if case in ("merge", "list", "top"):
        # In order: a later child's keys, the first n, the earlier of equals, both ways.
        res = run(flow(proj.collect.s(tag=tag), kids, reduce=reducer, max_active=1), how)
    else:
        res = run(flow(proj.collect.s(tag=tag), kids, reduce=reducer), how)
    got = res.get(timeout=TIMEOUT)
    assert got == {"values": expected, "tag": tag}
    # The children's own values, still kept.
    assert sorted(map(repr, res.children_values().values())) == sorted(map(repr, values))


def test_a_value_it_cannot_fold_fails_the_child(proj: Any, how: str) -> None:
    kids = [proj.echo.s(1), proj.echo.s("x"), proj.echo.s(2)]
    res = run(flow(proj.tsum.s(), kids, reduce="sum"), how)
    with pytest.raises(FlowFailed) as err:
        res.get(timeout=TIMEOUT)
    assert 'ReduceError: sum folds numbers, not str "x"' in str(err.value)


def test_a_value_it_cannot_fold_under_ignore(proj: Any, how: str) -> None:
    tag = uuid.uuid4().hex
    kids = [proj.echo.s(1), proj.echo.s("x"), proj.echo.s(2)]
    res = run(flow(proj.collect.s(tag=tag), kids, reduce="sum", policy="ignore"), how)
    assert res.get(timeout=TIMEOUT) == {"values": 3, "tag": tag}
    (reason,) = res.ignored_failures().values()
    assert reason == 'ReduceError: sum folds numbers, not str "x"'


def test_refusals(proj: Any) -> None:
    for bad in ("avg", ("top", 0, "s"), ("list",), ("top", 2), 3):
        with pytest.raises(ValueError, match="reduce"):
            flow(proj.tsum.s(), [proj.add.s(1, 1)], reduce=bad)
    sig = flow(proj.tsum.s(), [proj.add.s(1, 1)], reduce=("top", 2, "s"))
    assert flow.from_dict(dict(sig)).kwargs["reduce"] == ["top", 2, "s"]
    assert sig.clone().kwargs["reduce"] == ["top", 2, "s"]
    with pytest.raises(ValueError, match="on its parent's queue"):
        flow(proj.tsum.s(), [proj.add.s(1, 1).set(queue="other")], reduce="sum").apply()


@pytest.fixture
def stored_eagerly(proj: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager runs of ``echo`` store their results, as a worker's do (what
    ``task_store_eager_result`` gives a task when its app is set up)."""
    monkeypatch.setattr(proj.echo, "store_eager_result", True)


def test_a_refused_childs_own_result_is_its_failure(
    proj: Any, how: str, stored_eagerly: None
) -> None:
    """The child whose value the reducer refused reads FAILURE in Celery's result backend,
    a ReduceError naming the reducer and the value's type, never SUCCESS; the others read
    SUCCESS; under ignore the parent runs with the rest folded."""
    tag = uuid.uuid4().hex
    kids = [proj.echo.s(1), proj.echo.s({"x": 1}), proj.echo.s(2)]
    ids = [kid.freeze().id for kid in kids]
    res = run(flow(proj.collect.s(tag=tag), kids, reduce="max", policy="ignore"), how)
    assert res.get(timeout=TIMEOUT) == {"values": 2, "tag": tag}
    results = [AsyncResult(cid, app=proj.app) for cid in ids]
    assert [r.state for r in results] == ["SUCCESS", "FAILURE", "SUCCESS"]
    assert [results[0].result, results[2].result] == [1, 2]
    error = results[1].result
    assert isinstance(error, ReduceError)
    assert str(error) == 'max folds numbers, not dict {"x": 1}'
    assert res.ignored_failures() == {ids[1]: f"ReduceError: {error}"}


def test_show_and_the_dashboard_give_the_reducer_and_its_accumulator(
    proj: Any, worker: Any, store: redis.Redis, serve: Any
) -> None:
    """A held flow with reduce="sum": show (text and --json) and the dashboard's flow page
    name the reducer and the accumulator so far, as they give the quorum."""
    gate, tag = f"test:gate:{uuid.uuid4().hex}", uuid.uuid4().hex
    try:
        kids = [proj.echo.s(4), proj.echo.s(3), proj.gated.s(5, gate)]
        ids = [kid.freeze().id for kid in kids]
        res = flow(proj.collect.s(tag=tag), kids, reduce="sum").apply_async()
        wait_for(lambda: state_of(store, ids[2]) == "active", timeout=60)
        wait_for(lambda: res.dependencies().done == 2, timeout=60)
        shown = echomq("show", res.id)
        assert shown.exit_code == 0, shown.output
        assert "done=2/3" in shown.stdout and "reduce=sum  acc=7" in shown.stdout
        tree = json.loads(echomq("show", "--json", res.id).stdout)
        assert (tree["flow"]["reduce"], tree["flow"]["acc"]) == (["sum"], 7)
        page = httpx.get(f"{serve().url}/flows/{res.id}/live")
        assert page.status_code == 200 and "reduce=sum acc=7" in page.text
        top = flow(proj.collect.s(), [proj.echo.s({"s": 1})], reduce=("top", 2, "s"))
        held = json.loads(echomq("show", "--json", top.apply_async().id).stdout)
        assert held["flow"]["reduce"] == ["top", 2, "s"]
    finally:
        store.set(gate, 1)
    assert res.get(timeout=TIMEOUT) == {"values": 12, "tag": tag}
