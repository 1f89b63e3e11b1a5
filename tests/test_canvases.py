"""Any canvas wherever a chord takes one: chains, groups, chords and flows as a flow's
children and as its parent, each case run eagerly and on a worker, with the same values."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import chain, chord, group

from celery_echomq import FlowFailed, flow

# name -> (a function of the test app making the flow, the parent's value)
CASES: dict[str, tuple[Callable[[Any], Any], Any]] = {
    "chain child: its last task's value": (
        lambda p: flow(p.tsum.s(), [chain(p.add.s(1, 1), p.square.s()), p.add.s(2, 2)]),
        8,
    ),
    "chain child of three steps, in order": (
        lambda p: flow(
            p.collect.s(), [chain(p.add.s(1, 2), p.add.s(10), p.square.s()), p.add.s(0, 1)]
        ),
        {"values": [169, 1], "tag": ""},
    ),
    "group child: unrolled, values flattened in order": (
        lambda p: flow(
            p.collect.s(), [group(p.add.s(1, 1), group(p.add.s(2, 2), p.add.s(3, 3))), p.noargs.s()]
        ),
        {"values": [2, 4, 6, "ran"], "tag": ""},
    ),
    "chord child: its body's value": (
        lambda p: flow(
            p.tsum.s(), [chord([p.add.s(1, 1), p.add.s(2, 2)], p.tsum.s()), p.add.s(5, 5)]
        ),
        16,
    ),
    "chain parent: first step gets the values, get() the last's": (
        lambda p: flow(chain(p.tsum.s(), p.square.s(), p.add.s(1)), [p.add.s(1, 1), p.add.s(2, 2)]),
        37,
    ),
    "group parent: each task gets the values": (
        lambda p: flow(group(p.tsum.s(), p.collect.s(tag="g")), [p.add.s(1, 1), p.add.s(2, 2)]),
        [6, {"values": [2, 4], "tag": "g"}],
    ),
    "flow parent: the values reach each of its children": (
        lambda p: flow(
            flow(p.collect.s(tag="p"), [p.tsum.s(), p.tsum.s()]), [p.add.s(1, 1), p.add.s(2, 2)]
        ),
        {"values": [6, 6], "tag": "p"},
    ),
    "chord parent: the values reach each header task, get() is the body's": (
        lambda p: flow(chord([p.tsum.s(), p.tsum.s()], p.tsum.s()), [p.add.s(1, 1), p.add.s(2, 2)]),
        12,
    ),
    "any depth and mix": (
        lambda p: flow(
            chain(p.tsum.s(), p.square.s()),
            [
                flow(
                    p.tsum.s(),
                    [
                        chain(group(p.add.s(1, 1), p.add.s(1, 2)), p.tsum.s()),
                        chord([p.add.s(1, 1), chain(p.add.s(0, 1), p.square.s())], p.tsum.s()),
                    ],
                ),
                group(p.add.s(0, 1)),
            ],
        ),
        (5 + 3 + 1) ** 2,
    ),
}


def run(sig: Any, how: str) -> Any:
    return sig.apply() if how == "eager" else sig.apply_async()


@pytest.mark.parametrize("name", list(CASES))
def test_canvas_values_eager_and_on_a_worker(proj: Any, worker: Any, name: str) -> None:
    make, expected = CASES[name]
    eager = make(proj).apply().get(timeout=60)
    on_worker = make(proj).apply_async().get(timeout=60)
    assert eager == on_worker == expected


@pytest.mark.parametrize("how", ["eager", "worker"])
def test_a_failure_inside_a_chain_child_fails_the_flow(proj: Any, worker: Any, how: str) -> None:
    sig = flow(proj.tsum.s(), [chain(proj.add.s(1, 1), proj.boom.si("in chain")), proj.add.s(1, 1)])
    with pytest.raises(FlowFailed, match="ValueError: in chain"):
        run(sig, how).get(timeout=60)


@pytest.mark.parametrize("how", ["eager", "worker"])
def test_a_chain_child_under_ignore_is_left_out(proj: Any, worker: Any, how: str) -> None:
    bad = chain(proj.add.s(1, 1), proj.boom.si("left out")).set(parent_policy="ignore")
    res = run(flow(proj.collect.s(), [bad, proj.add.s(2, 2)]), how)
    assert res.get(timeout=60) == {"values": [4], "tag": ""}
    (error,) = res.ignored_failures().values()
    assert error == "ValueError: left out"


@pytest.mark.parametrize("how", ["eager", "worker"])
def test_children_values_of_a_chain_parent_are_the_flows_children(
    proj: Any, worker: Any, how: str
) -> None:
    kids = [proj.add.s(1, 1), proj.add.s(2, 2)]
    res = run(flow(chain(proj.tsum.s(), proj.square.s()), kids), how)
    assert res.get(timeout=60) == 36
    assert sorted(res.children_values().values()) == [2, 4]
    assert res.dependencies().outstanding == 0


@pytest.mark.parametrize("how", ["eager", "worker"])
def test_a_group_parent_with_no_children_gets_an_empty_list(
    proj: Any, worker: Any, how: str
) -> None:
    res = run(flow(group(proj.collect.s(), proj.collect.s(tag="b")), []), how)
    assert res.get(timeout=60) == [{"values": [], "tag": ""}, {"values": [], "tag": "b"}]


def test_a_frozen_flow_with_a_chain_parent_sends_the_ids_it_froze(proj: Any, worker: Any) -> None:
    last = proj.square.s()
    sig = flow(chain(proj.tsum.s(), last), [proj.add.s(1, 1)])
    frozen = sig.freeze()
    assert frozen.id == last.options["task_id"]
    res = sig.apply_async()
    assert res.id == frozen.id
    assert res.get(timeout=60) == 4
