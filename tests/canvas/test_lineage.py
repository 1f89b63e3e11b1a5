"""One tree in every monitor: every job of a flow carries the same Celery ``root_id``.

Flower and ``celery events`` group tasks by ``root_id``. A flow's children, its nested flows'
jobs, its chains' steps, a group parent's tasks and the parent itself carry the outermost
flow's id as their root, or, when a task starts the flow, that task's root (as ``send_task``
gives a task's messages); eagerly as on a worker. The tasks report the ``request.root_id``
they ran with (``ids``, ``collect_ids``: ``(root_id, parent_id, i)``).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import redis
from celery import chain, group
from celery.events.state import State

from celery_echomq import flow
from tests.helpers import Env, Worker, run, wait_for, ways

TIMEOUT = 30


@pytest.fixture(params=ways(worker_for_both=False))
def how(request: pytest.FixtureRequest) -> str:
    """``apply`` (eager, in this process) or ``apply_async`` (on the worker)."""
    if request.param == "apply_async":
        request.getfixturevalue("worker")
    elif _eager_tasks_have_no_root(request.getfixturevalue("proj")):
        pytest.skip(
            "Celery before 5.6 gives a task run by Task.apply (eager) no root_id at all, so "
            "there is no root for a flow to keep"
        )
    return str(request.param)


def _eager_tasks_have_no_root(proj: Any) -> bool:
    """Whether Celery itself leaves ``request.root_id`` unset in a plain ``Task.apply``."""
    root_id, _parent, _i = proj.ids.apply(kwargs={"i": 0}).get(timeout=TIMEOUT)
    return root_id is None


def _roots(value: Any) -> dict[int, str]:
    """``i -> root_id`` of every ``(root_id, parent_id, i)`` a flow's value holds."""
    found: dict[int, str] = {}

    def walk(node: Any) -> None:
        if isinstance(node, list):
            if len(node) == 3 and isinstance(node[0], str) and type(node[2]) is int:
                found[node[2]] = node[0]
                return
            for item in node:
                walk(item)

    walk(json.loads(json.dumps(value)))  # eager values hold tuples; a worker's, lists
    return found


def _flows(proj: Any) -> dict[str, tuple[Any, set[int]]]:
    """Each kind of flow, and the ``i`` of every job whose lineage reaches its value."""
    ids, collect = proj.ids, proj.collect_ids
    return {
        "tasks": (flow(collect.s(i=0), [ids.si(i=1), ids.si(i=2)]), {0, 1, 2}),
        "nested": (
            flow(collect.s(i=0), [ids.si(i=1), flow(collect.s(i=10), [ids.si(i=11)])]),
            {0, 1, 10, 11},
        ),
        "chains": (
            flow(
                chain(collect.s(i=0), collect.s(i=100)),
                [chain(ids.si(i=1), collect.s(i=2)), ids.si(i=3)],
            ),
            {0, 1, 2, 3, 100},
        ),
        "group parent": (
            flow(group(collect.s(i=0), collect.s(i=1)), [ids.si(i=5), ids.si(i=6)]),
            {0, 1, 5, 6},
        ),
    }


@pytest.mark.parametrize("kind", ["tasks", "nested", "chains", "group parent"])
def test_every_job_of_a_flow_has_the_flow_as_its_root(proj: Any, how: str, kind: str) -> None:
    sig, jobs = _flows(proj)[kind]
    res = run(sig, how)
    roots = _roots(res.get(timeout=TIMEOUT))
    assert set(roots) == jobs
    assert set(roots.values()) == {res.id}, roots


def test_a_flow_started_by_a_task_has_that_tasks_root(proj: Any, how: str) -> None:
    if how == "apply":
        (value, caller_root) = proj.flow_of_ids.apply(("apply",)).get(timeout=TIMEOUT)
    else:
        flow_id, caller_root = proj.flow_of_ids.delay("apply_async").get(timeout=TIMEOUT)
        value = proj.app.AsyncResult(flow_id).get(timeout=TIMEOUT)
    roots = _roots(value)
    assert set(roots) == {0, 1, 2}
    assert caller_root and set(roots.values()) == {caller_root}, (caller_root, roots)


def test_a_flow_in_a_chain_has_the_chains_root(proj: Any, worker: Any) -> None:
    first = proj.ids.si(i=1)
    first_id = first.freeze().id
    res = chain(first, flow(proj.collect_ids.s(i=0), [proj.ids.si(i=2), proj.ids.si(i=3)]))()
    roots = _roots(res.get(timeout=TIMEOUT))
    assert set(roots) == {0, 2, 3}
    assert set(roots.values()) == {first_id}


def test_added_children_have_the_flows_root(proj: Any, worker: Any) -> None:
    res = flow(proj.collect_ids.s(i=0), [proj.sleep_then.s(7, 1.0)]).apply_async()
    res.add_children([proj.ids.si(i=1), flow(proj.collect_ids.s(i=10), [proj.ids.si(i=11)])])
    roots = _roots(res.get(timeout=TIMEOUT))
    assert set(roots) == {0, 1, 10, 11}
    assert set(roots.values()) == {res.id}


def test_the_messages_of_flows_of_one_shape_each_carry_their_own_root(
    proj: Any, env: Env, own_queue: Any
) -> None:
    """The broker's messages (no worker consumes this queue): the first flow's are built by
    Celery, the next ones' from its template (or pushed by their enqueue script); each
    carries its own flow's root, and the caller's root when a task's id is given."""
    queue = own_queue("lineage")
    broker = redis.Redis.from_url(env.broker)
    sent = [
        flow(proj.tsum.s(), [proj.add.s(i, i) for i in range(3)]).apply_async(queue=queue)
        for _ in range(3)
    ]
    given = flow(proj.tsum.s(), [proj.add.s(i, i) for i in range(3)]).apply_async(
        queue=queue, root_id="JOB" + "0" * 32
    )
    messages = [json.loads(m) for m in reversed(broker.lrange(queue, 0, -1))]
    by_flow: dict[str, set[str]] = {}
    for message in messages:
        headers = message["headers"]
        by_flow.setdefault(headers["echomq_p"], set()).add(headers["root_id"])
    assert len(messages) == 12
    assert by_flow == {
        **{res.id: {res.id} for res in sent},
        given.id: {"JOB" + "0" * 32},
    }


def test_celerys_events_draw_a_flow_as_one_tree(proj: Any, env: Env, own_queue: Any) -> None:
    """What Flower reads: the worker's task events, kept in Celery's own ``events.State``."""
    queue = own_queue("events")
    worker = Worker(env, queues=queue, concurrency=1, extra_env={"ECHOMQ_T_EVENTS": "1"})
    seen = State()
    received: list[dict[str, Any]] = []
    try:
        with proj.app.connection_for_read() as connection:

            def keep(event: dict[str, Any]) -> None:
                seen.event(event)
                if event["type"] == "task-received":
                    received.append(event)

            receiver = proj.app.events.Receiver(connection, handlers={"*": keep})
            listening = threading.Thread(
                target=lambda: receiver.capture(limit=None, timeout=None, wakeup=True),
                daemon=True,
            )
            listening.start()
            time.sleep(0.5)  # the receiver's queue is bound before anything is sent
            inner = flow(proj.collect_ids.s(i=10), [proj.ids.si(i=11)])
            res = flow(proj.collect_ids.s(i=0), [proj.ids.si(i=1), inner]).apply_async(queue=queue)
            res.get(timeout=TIMEOUT)
            wait_for(lambda: len(received) >= 4, timeout=TIMEOUT)
            receiver.should_stop = True
            listening.join(10)
    finally:
        worker.stop()
    assert len(received) == 4
    assert {event["root_id"] for event in received} == {res.id}
    tasks = {
        uuid: task for uuid, task in seen.tasks.items() if uuid in {e["uuid"] for e in received}
    }
    assert {task.root_id for task in tasks.values()} == {res.id}
    assert seen.tasks[res.id].root_id == res.id  # the root is a task of the tree
