"""Children added while a flow runs (``add_children``), a flow as a chord's body, and a task in
a chain or a chord's header replaced by a flow: against real worker processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from typing import Any

import pytest
import redis
from celery import chain, chord, group
from celery.result import AsyncResult

from celery_echomq import (
    DuplicateIdError,
    FlowClosedError,
    FlowExistsError,
    FlowResult,
    KindError,
    add_children,
    flow,
)
from celery_echomq.ops.views import read_tree
from celery_echomq.store.keyspace import new_job_id
from celery_echomq.store.state import get_state
from tests.helpers import KEYS, ROOT, Env, quiet, wait_for

pytestmark = pytest.mark.e2e


def row_state(store: redis.Redis, queue: str, job_id: str) -> bytes | None:
    value: bytes | None = store.hget(KEYS.job_key(queue, job_id), "state")
    return value


def content(client: redis.Redis, key: bytes) -> Any:
    """A key's type and value (not DUMP: a hash table's DUMP order moves as Redis rehashes it)."""
    kind = client.type(key)
    read = {
        b"hash": client.hgetall,
        b"zset": lambda k: client.zrange(k, 0, -1, withscores=True),
        b"set": client.smembers,
        b"list": lambda k: client.lrange(k, 0, -1),
        b"string": client.get,
    }.get(kind)
    return kind, read(key) if read else None


def snapshot(broker: redis.Redis) -> dict[bytes, Any]:
    """The broker's queues (lists): what a publish changes (kombu's bindings, their deadlines
    and its record of unacknowledged deliveries move on their own)."""
    return {
        key: content(broker, key) for key in sorted(broker.keys("*")) if broker.type(key) == b"list"
    }


def keys_of(client: redis.Redis, names: list[bytes]) -> dict[bytes, Any]:
    return {name: content(client, name) for name in names}


def gate_key() -> str:
    return f"test:gate:{uuid.uuid4().hex}"


def test_a_child_adds_siblings_and_the_parent_gets_every_value_in_order(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    children = [proj.add.s(1, 0), proj.spawner.s(2, [3, 4]), proj.add.s(5, 0)]
    res = flow(proj.collect.s(), children).apply_async()
    assert res.get(timeout=60)["values"] == [1, 2, 5, 3, 4]
    assert res.dependencies() == (0, 5, 0, 0)
    values = res.children_values()
    assert sorted(values.values()) == [1, 2, 3, 4, 5]
    wait_for(lambda: row_state(store, "celery", res.id) == b"done")
    tree = read_tree(get_state(proj.app), res.id)
    assert [c.value for c in tree.children] == [1, 2, 5, 3, 4]
    assert all(c.state == "done" for c in tree.children)


def test_children_adding_siblings_at_the_same_time_lose_none(
    proj: Any, start_worker: Any, own_queue: Any
) -> None:
    queue = own_queue("grow-many")
    start_worker(queues=queue, concurrency=4, name="grow-many")
    n = 8
    res = flow(
        proj.collect.s(), [proj.spawner.s(i, [100 + i, 200 + i]) for i in range(n)]
    ).apply_async(queue=queue)
    values = res.get(timeout=90)["values"]
    assert values[:n] == list(range(n))
    added = values[n:]
    assert sorted(added) == sorted([100 + i for i in range(n)] + [200 + i for i in range(n)])
    # Each child's siblings arrive together, in the order that child added them.
    pairs = [added[i : i + 2] for i in range(0, len(added), 2)]
    assert all(b == a + 100 for a, b in pairs)
    assert res.dependencies() == (0, 3 * n, 0, 0)


def test_show_json_lists_added_children(proj: Any, worker: Any, store: redis.Redis) -> None:
    from celery.bin.celery import celery as celery_main
    from click.testing import CliRunner

    res = flow(proj.tsum.s(), [proj.spawner.s(1, [10, 20])]).apply_async()
    assert res.get(timeout=60) == 31
    wait_for(lambda: row_state(store, "celery", res.id) == b"done")
    out = CliRunner().invoke(celery_main, ["-A", "tests.proj", "echomq", "show", "--json", res.id])
    assert out.exit_code == 0, out.output
    tree = json.loads(out.stdout)
    assert [c["value"] for c in tree["children"]] == [1, 10, 20]
    assert tree["flow"]["total"] == 3 and tree["flow"]["done"] == 3


def test_adding_from_outside_while_the_parent_is_held(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    gate = gate_key()
    res = flow(proj.collect.s(), [proj.gated.s(1, gate)]).apply_async()
    added = res.add_children([proj.add.s(2, 0)])
    assert len(added) == 1 and added[0].startswith("JOB")
    more = add_children([proj.add.s(3, 0), proj.add.s(4, 0)], parent_id=res.id)
    assert len(more) == 2
    # The gated child holds the parent: the added children complete, the counter waits.
    wait_for(lambda: res.dependencies() == (1, 3, 0, 0))
    assert row_state(store, "celery", res.id) == b"awaiting_children"
    store.set(gate, 1)
    assert res.get(timeout=60)["values"] == [1, 2, 3, 4]
    assert set(res.children_values()) >= {*added, *more}
    # The children added from anywhere are in the flow's parent, read from the store.
    assert [r.get(timeout=60) for r in FlowResult(res.id, app=proj.app).parent.results] == [
        1,
        2,
        3,
        4,
    ]


def test_a_nested_flow_can_be_added_from_inside_and_from_outside(proj: Any, worker: Any) -> None:
    gate = gate_key()
    res = flow(
        proj.collect.s(), [proj.spawn_flow.s(1, [2, 3]), proj.gated.s(100, gate)]
    ).apply_async()
    # spawn_flow's add first, so that the order is known.
    wait_for(lambda: len(read_tree(get_state(proj.app), res.id).children) == 3)
    inner = flow(proj.tsum.s(), [proj.add.s(10, 0), flow(proj.tsum.s(), [proj.add.s(20, 0)])])
    inner_res = inner.freeze()
    assert res.add_children([inner]) == [inner_res.id]
    proj._store().set(gate, 1)
    # spawn_flow's value, the gated child's, then the flows added, in the order added (the
    # one from inside was added first: the gated child waits for the test).
    assert res.get(timeout=60)["values"] == [1, 100, 5, 30]
    assert inner_res.get(timeout=60) == 30


def test_a_closed_flow_refuses_children_and_nothing_is_written(
    proj: Any, worker: Any, env: Env, store: redis.Redis, own_queue: Any
) -> None:
    broker = redis.Redis.from_url(env.broker)
    done = flow(proj.tsum.s(), [proj.add.s(1, 1)]).apply_async()
    assert done.get(timeout=60) == 2
    wait_for(lambda: row_state(store, "celery", done.id) == b"done")

    # On a queue no worker consumes: its child never starts, nothing moves after the cancel.
    idle = own_queue("grow-idle")
    cancelled = flow(proj.tsum.s(), [proj.add.s(1, 1)]).apply_async(queue=idle)
    cancelled.revoke()
    wait_for(lambda: row_state(store, idle, cancelled.id) == b"cancelled")

    failed = flow(proj.tsum.s(), [proj.boom.s("no")]).apply_async()
    wait_for(lambda: row_state(store, "celery", failed.id) == b"failed")
    wait_for(failed.ready)

    for res, state, queue in (
        (done, "done", "celery"),
        (cancelled, "cancelled", idle),
        (failed, "failed", "celery"),
    ):
        cid = new_job_id()
        # What an add could touch: the flow's keys, the new child's row, the queue's sets and
        # the queues recovery scans; and the whole broker.
        touched = [
            *(k for k in store.keys(f"emq:{{{queue}}}:{res.id}*")),
            KEYS.job_key(queue, cid).encode(),
            KEYS.queue_key(queue, "pending").encode(),
            KEYS.queue_key(queue, "adding").encode(),
            b"emq:queues",
        ]
        # Once the worker has finished writing the flow's last fields.
        before = quiet(lambda names=touched: (keys_of(store, names), snapshot(broker)))
        with pytest.raises(FlowClosedError) as info:
            res.add_children([proj.add.s(5, 5).set(task_id=cid)])
        assert info.value.parent_id == res.id and info.value.state == state
        assert res.id in str(info.value)
        with pytest.raises(FlowClosedError):
            add_children([proj.add.s(5, 5)], parent_id=res.id)
        assert (keys_of(store, touched), snapshot(broker)) == before


def test_bad_ids_are_refused_before_anything_is_written(
    proj: Any, worker: Any, env: Env, store: redis.Redis, own_queue: Any
) -> None:
    broker = redis.Redis.from_url(env.broker)
    gate = gate_key()
    other = flow(proj.tsum.s(), [proj.add.s(1, 1)]).apply_async()
    assert other.get(timeout=60) == 2
    taken = next(iter(other.children_values()))
    # A child row of another flow on another queue's slot (no worker consumes it).
    idle = own_queue("grow-idle")
    elsewhere = new_job_id()
    flow(proj.tsum.s(), [proj.add.s(1, 1).set(task_id=elsewhere)]).apply_async(queue=idle)
    res = flow(proj.tsum.s(), [proj.gated.s(1, gate)]).apply_async()
    wait_for(lambda: row_state(store, "celery", res.id) == b"awaiting_children")
    same = new_job_id()
    bad = [
        ([proj.add.s(1, 1).set(task_id="nope")], KindError),
        (
            [proj.add.s(1, 1).set(task_id=same), proj.add.s(2, 2).set(task_id=same)],
            DuplicateIdError,
        ),
        ([proj.add.s(1, 1).set(task_id=taken)], FlowExistsError),
        ([proj.add.s(2, 0), proj.add.s(1, 1).set(task_id=elsewhere, queue=idle)], FlowExistsError),
    ]

    # The gated child is running (its row and leases move): compare everything else.
    def look() -> Any:
        return (
            snapshot(broker),
            res.dependencies(),
            store.hget(f"emq:{{celery}}:{res.id}", "payload"),
            store.zrange("emq:{celery}:pending", 0, -1),
        )

    for children, error in bad:
        before = quiet(look)
        with pytest.raises(error):
            res.add_children(children)
        assert look() == before
        assert not store.exists(f"emq:{{celery}}:{same}")
    store.set(gate, 1)
    assert res.get(timeout=60) == 1


def test_a_repeated_add_writes_one_row(proj: Any, worker: Any, store: redis.Redis) -> None:
    gate = gate_key()
    res = flow(proj.collect.s(), [proj.gated.s(1, gate)]).apply_async()
    cid = new_job_id()
    assert res.add_children([proj.add.s(2, 0).set(task_id=cid)]) == [cid]
    assert res.add_children([proj.add.s(2, 0).set(task_id=cid)]) == []
    assert add_children([proj.add.s(2, 0).set(task_id=cid)], parent_id=res.id) == []
    assert res.dependencies().outstanding in (1, 2)  # the added child may have completed
    store.set(gate, 1)
    assert res.get(timeout=60)["values"] == [1, 2]
    assert res.dependencies() == (0, 2, 0, 0)


def test_a_child_policy_is_honoured_for_added_children(proj: Any, worker: Any) -> None:
    gate = gate_key()
    res = flow(proj.tsum.s(), [proj.gated.s(1, gate)]).apply_async()
    failing = proj.boom.s("lost").set(parent_policy="ignore", task_id=new_job_id())
    res.add_children([proj.add.s(2, 0), failing])
    proj._store().set(gate, 1)
    assert res.get(timeout=60) == 3
    assert res.ignored_failures() == {failing.options["task_id"]: "ValueError: lost"}


def test_children_added_on_another_queue_are_credited_across_slots(
    proj: Any, start_worker: Any, own_queue: Any, store: redis.Redis
) -> None:
    home, other = own_queue("grow-a"), own_queue("grow-b")
    start_worker(queues=f"{home},{other}", concurrency=2, name="grow-x")
    gate = gate_key()
    res = flow(
        proj.collect.s(), [proj.spawner.s(1, [2, 3], queue=other), proj.gated.s(9, gate)]
    ).apply_async(queue=home)
    wait_for(lambda: len(res.children_values()) == 3, timeout=60)
    outside = res.add_children([proj.add.s(4, 0).set(queue=other)])
    store.set(gate, 1)
    assert res.get(timeout=60)["values"] == [1, 9, 2, 3, 4]
    assert res.dependencies() == (0, 5, 0, 0)
    assert store.hget(KEYS.job_key(other, outside[0]), "pq") == home.encode()
    wait_for(lambda: row_state(store, home, res.id) == b"done")
    tree = read_tree(get_state(proj.app), res.id)
    assert [(c.queue, c.value) for c in tree.children] == [
        (home, 1),
        (home, 9),
        (other, 2),
        (other, 3),
        (other, 4),
    ]
    # Nothing left staged on the parent's slot.
    assert not store.exists(KEYS.adding_key(home, res.id))
    assert not store.zcard(KEYS.queue_key(home, "adding"))


CRASH = """
import os, signal, sys
from tests import proj
from celery_echomq import add_children
from celery_echomq.send import grow

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

grow.write_staged = die
add_children([proj.add.s(2, 0).set(queue=sys.argv[2], task_id=sys.argv[3])],
             parent_id=sys.argv[1], app=proj.app)
"""


def test_an_adder_killed_between_the_two_slots_is_repaired_by_recovery(
    proj: Any, start_worker: Any, own_queue: Any, env: Env, store: redis.Redis
) -> None:
    home, other = own_queue("grow-c"), own_queue("grow-d")
    gate = gate_key()
    res = flow(proj.collect.s(), [proj.gated.s(1, gate)]).apply_async(queue=home)
    cid = new_job_id()
    killed = subprocess.run(
        [sys.executable, "-c", CRASH, res.id, other, cid],
        cwd=ROOT,
        env=env.environ(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    # The parent's step landed: the counter holds the staged child, whose row is not written.
    assert res.dependencies() == (2, 0, 0, 0)
    assert store.hexists(KEYS.adding_key(home, res.id), cid)
    assert not store.exists(KEYS.job_key(other, cid))
    assert cid in json.loads(store.hget(KEYS.job_key(home, res.id), "payload"))["children"]
    store.set(gate, 1)
    # A worker whose recovery looks after a one-second stall timeout writes the staged row;
    # the child, never published, is then published on the evidence that its queue is empty.
    start_worker(queues=f"{home},{other}", name="grow-r", extra_env={"ECHOMQ_T_STALL": "1"})
    assert res.get(timeout=90)["values"] == [1, 2]
    assert res.dependencies() == (0, 2, 0, 0)
    assert not store.exists(KEYS.adding_key(home, res.id))


def test_add_children_outside_a_flow_child_says_what_to_do(proj: Any) -> None:
    with pytest.raises(Exception, match="parent_id"):
        add_children([proj.add.s(1, 1)])


# --- A flow as a chord's body; a task replaced by a flow in a chain or a chord ---------------


def test_a_flow_as_a_chords_body_gets_the_headers_values_in_every_child(
    proj: Any, worker: Any
) -> None:
    body = flow(proj.collect.s(), [proj.add.s([100]), proj.whereami.s()])
    res = chord([proj.add.s(1, 2), proj.add.s(3, 4)], body).apply_async()
    got = res.get(timeout=60)
    assert got["values"][0] == [3, 7, 100]  # add([3, 7], [100])
    assert got["values"][1]["args"] == [[3, 7]]
    # The same as a chord in that position.
    as_chord = chord(
        [proj.add.s(1, 2), proj.add.s(3, 4)], chord([proj.add.s([100])], proj.collect.s())
    )
    assert as_chord.apply_async().get(timeout=60)["values"] == [[3, 7, 100]]
    # A group followed by a flow in a chain is such a chord too.
    grouped = chain(group(proj.add.s(1, 2), proj.add.s(3, 4)), flow(proj.tsum.s(), [proj.tsum.s()]))
    assert grouped.apply_async().get(timeout=60) == 10
    # And chord(header)(flow).
    again = chord([proj.add.s(1, 1)])(flow(proj.tsum.s(), [proj.tsum.s(), proj.tsum.s()]))
    assert again.get(timeout=60) == 4


def test_a_task_in_a_chain_replaced_by_a_flow(proj: Any, worker: Any, store: redis.Redis) -> None:
    for task_id in (new_job_id(), str(uuid.uuid4())):
        replaced = proj.replace_by_flow.s().set(task_id=task_id)
        res = chain(proj.add.s(1, 1), replaced, proj.square.s()).apply_async()
        assert res.get(timeout=60) == 49  # 2 -> tsum([3, 4]) = 7 -> 49
        assert int(store.get(f"test:ran:replace_by_flow:{task_id}")) == 1
        # The flow's parent takes the replaced id as it is, a Celery uuid too.
        assert AsyncResult(task_id, app=proj.app).get(timeout=60) == 7


def test_a_chord_header_task_replaced_by_a_flow(proj: Any, worker: Any) -> None:
    res = chord([proj.replace_by_flow.s(1), proj.add.s(10, 10)])(proj.collect.s())
    assert res.get(timeout=60)["values"] == [5, 20]  # tsum([2, 3]), 20


def test_recovery_writes_staged_children_or_drops_them_once_the_flow_is_closed(
    proj: Any, own_queue: Any, store: redis.Redis
) -> None:
    import hashlib

    from celery_echomq.store.scripts import ParentRef
    from celery_echomq.worker.recovery.unfinished import unwritten_children

    state = get_state(proj.app)
    home, other = own_queue("grow-e"), own_queue("grow-f")
    results = []
    for _ in range(2):
        res = flow(proj.tsum.s(), [proj.add.s(1, 1)]).apply_async(queue=home)
        row = KEYS.job_key(home, res.id)
        payload = store.hget(row, "payload")
        assert payload is not None
        cid = new_job_id()
        child = {
            "task": "tests.proj.add",
            "args": [1, 1],
            "kwargs": {},
            "options": {
                "task_id": cid,
                "headers": {"echomq_q": other, "echomq_p": res.id, "echomq_pq": home},
            },
        }
        status, counter = state.scripts.grow_flow(
            ParentRef(res.id, home),
            hashlib.sha1(payload).hexdigest(),
            payload,
            [],
            [(cid, state.dumps(child), "ignore")],
        )
        assert (status, counter) == ("added", 2)
        results.append((res, cid))
    (kept, kept_child), (closed, closed_child) = results
    closed.revoke()
    # A stall timeout has passed since they were staged.
    store.zadd(KEYS.queue_key(home, "adding"), {kept.id: 0, closed.id: 0})
    lines = unwritten_children(state, home, 10)
    assert len(lines) == 2 and any("dropped 1" in line for line in lines)
    written = store.hgetall(KEYS.job_key(other, kept_child))
    assert written[b"state"] == b"pending" and written[b"parent"] == kept.id.encode()
    assert written[b"pq"] == home.encode() and written[b"parent_policy"] == b"ignore"
    assert not store.exists(KEYS.job_key(other, closed_child))
    assert not store.exists(KEYS.adding_key(home, kept.id), KEYS.adding_key(home, closed.id))
    assert store.zcard(KEYS.queue_key(home, "adding")) == 0
    assert unwritten_children(state, home, 10) == []
