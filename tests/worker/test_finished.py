"""What a finished flow keeps: what its readers need (states, counts, values, show), not its
jobs' large messages (64 KiB or more), which are dropped when they finish instead of staying
``echomq_result_ttl`` in the store."""

from __future__ import annotations

from typing import Any

import redis

from celery_echomq import flow
from tests.helpers import KEYS, echomq, id_of, settle, with_id

BIG = 100_000


def test_a_shared_large_argument_leaves_with_its_flows_template(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    big = "x" * BIG
    kids = [with_id(proj.size.s(big)) for _ in range(3)]
    res = flow(proj.tsum.s(), kids).apply_async()
    assert settle(res) == 3 * BIG
    row = KEYS.job_key("celery", res.id)
    assert store.hstrlen(row, "template") < 200  # its task and a marker for the arguments
    assert int(store.hget(row, "dropped") or 0) >= BIG
    # What readers need stays.
    assert res.children_values() == {id_of(k): BIG for k in kids}
    assert res.dependencies() == (0, 3, 0, 0)
    assert store.hget(row, "state") == b"done" and store.ttl(row) > 0
    shown = echomq("show", res.id)
    assert shown.exit_code == 0, shown.output
    assert shown.stdout.startswith(f"flow {res.id}  tests.proj.tsum  done")
    for line in shown.stdout.splitlines()[1:]:
        assert "tests.proj.size  done" in line and "args=('<dropped: " in line
    assert len(store.dump(row) or b"") < BIG  # the row is small now


def test_a_childs_own_large_argument_leaves_when_it_finishes(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    kids = [with_id(proj.size.s(str(i) * BIG)) for i in range(2)]
    small = with_id(proj.add.s(1, 1))
    res = flow(proj.tsum.s(), [*kids, small]).apply_async()
    assert settle(res) == 2 * BIG + 2
    # The first child's message is its flow's template (dropped with it), the second's its
    # own delta (dropped when it finished): no row of the flow keeps a large field.
    rows = [KEYS.job_key("celery", job) for job in (res.id, *map(id_of, kids))]
    for row in rows:
        assert store.hget(row, "state") == b"done"
        for name in (b"payload", b"delta", b"template"):
            assert store.hstrlen(row, name) < 1000, (row, name)
    assert int(store.hget(rows[2], "dropped") or 0) >= BIG
    # A small message stays, for show to print its arguments.
    row = KEYS.job_key("celery", id_of(small))
    assert store.hstrlen(row, "payload") + store.hstrlen(row, "delta") > 0
    assert not store.hexists(row, "dropped")
    assert res.children_values()[id_of(small)] == 2
    lines = echomq("show", res.id).stdout.splitlines()
    assert any(id_of(small) in line and "args=(1, 1)" in line for line in lines)
    assert all("tests.proj." in line for line in lines)  # every task still named


def test_a_flow_with_a_failed_child_keeps_its_template_for_retry(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    big = "y" * BIG
    kids = [with_id(proj.size.s(big)) for _ in range(2)]
    failing = with_id(proj.boom.s("no").set(parent_policy="ignore"))
    res = flow(proj.tsum.s(), [*kids, failing]).apply_async()
    assert settle(res) == 2 * BIG
    row = KEYS.job_key("celery", res.id)
    assert store.hstrlen(row, "template") >= BIG and not store.hexists(row, "dropped")
    assert res.dependencies() == (0, 2, 0, 1)
