"""End to end with a real prefork `celery worker`: flows fan in like chords."""

from __future__ import annotations

import uuid
from typing import Any

from celery import chord

from celery_echomq import flow


def test_ten_child_flow_returns_what_the_equivalent_chord_returns(proj: Any, worker: Any) -> None:
    header = [proj.add.s(i, i) for i in range(10)]
    chord_value = chord(header)(proj.tsum.s()).get(timeout=60)
    res = flow(proj.tsum.s(), [proj.add.s(i, i) for i in range(10)]).apply_async()
    assert res.get(timeout=60) == chord_value == 90
    assert res.dependencies().outstanding == 0
    assert res.dependencies().done == 10
    assert sorted(res.children_values().values()) == [2 * i for i in range(10)]


def test_parent_gets_values_in_childrens_order(proj: Any, worker: Any) -> None:
    tag = uuid.uuid4().hex
    # Later children finish first: the list still follows the declared order.
    children = [proj.sleep_then.s(i, (5 - i) * 0.1) for i in range(5)]
    res = flow(proj.collect.s(tag=tag), children).apply_async()
    assert res.get(timeout=60) == {"values": [0, 1, 2, 3, 4], "tag": tag}
