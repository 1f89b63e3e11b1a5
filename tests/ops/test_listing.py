"""What an operator reads of many flows and of huge ones, on a real Redis (no worker): the
list of flows (``list_flows``, the dashboard's lists), paged children values, failed
children under every policy and the four counts of ``Dependencies``.

The flows are written by the real scripts, so the indexes read are the ones a worker keeps.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

import celery_echomq
from celery_echomq import CursorError, ListingError, list_flows
from celery_echomq.store.keyspace import new_job_id
from celery_echomq.store.scripts import ParentRef, Scripts
from celery_echomq.store.state import EchoMQ, get_state

TTL = 600
LEASE = 60_000


@pytest.fixture
def state(proj: Any) -> EchoMQ:
    return get_state(proj.app)


@pytest.fixture
def queue(state: EchoMQ, own_queue: Any) -> str:
    name = own_queue("list")
    state.client.sadd(state.keys.queues_key(), name)
    return name


def payload(state: EchoMQ, task: str, children: list[str], **extra: Any) -> bytes:
    job = {"task": task, "args": [], "kwargs": {}, "options": {"headers": {}}, "children": children}
    return state.dumps({**job, **extra})


def enqueue(state: EchoMQ, queue: str, n: int, task: str = "tests.proj.tsum") -> Any:
    parent, children = new_job_id(), [new_job_id() for _ in range(n)]
    child = state.dumps({"task": "tests.proj.add", "args": [1, 1], "kwargs": {}, "options": {}})
    state.scripts.enqueue_flow(
        queue, parent, payload(state, task, children), [(c, child) for c in children]
    )
    return parent, children


def finish(scripts: Scripts, queue: str, parent: str, child: str, *, error: str = "") -> Any:
    token = uuid.uuid4().hex
    assert scripts.claim(queue, child, token, LEASE)[0] == "claimed"
    ref = ParentRef(parent, queue)
    if error:
        return scripts.fail(queue, child, token, error, ttl=TTL, is_parent=False, parent=ref)[0]
    return scripts.complete(queue, child, token, ttl=TTL, is_parent=False, parent=ref, value=b"1")


def every_page(**kwargs: Any) -> tuple[list[str], int]:
    seen, cursor, pages = [], None, 0
    while True:
        rows, cursor = list_flows(cursor=cursor, **kwargs)
        seen += [row.id for row in rows]
        pages += 1
        if cursor is None:
            return seen, pages


def test_list_pages_every_flow_once_newest_first_by_state(
    proj: Any, state: EchoMQ, queue: str
) -> None:
    flows = [enqueue(state, queue, 1) for _ in range(230)]
    parents = [p for p, _ in flows]
    oldest, (its_child,) = flows[0]
    finish(state.scripts, queue, oldest, its_child, error="ValueError: gone")
    done, (done_child,) = flows[1]
    finish(state.scripts, queue, done, done_child)  # released: the parent then runs
    token = uuid.uuid4().hex
    assert state.scripts.claim(queue, done, token, LEASE)[0] == "claimed"
    state.scripts.complete(queue, done, token, ttl=TTL, is_parent=True, parent=None, value=b"1")
    cancelled = parents[-2]
    state.scripts.cancel(queue, cancelled, flows[-2][1], ttl=TTL)

    seen, pages = every_page(state="recent", queue=queue, limit=100, app=proj.app)
    assert seen == parents[::-1] and pages == 3  # every flow once, newest first
    held, _ = every_page(state="held", queue=queue, limit=100, app=proj.app)
    assert held == [p for p in parents[::-1] if p not in (oldest, done, cancelled)]

    (failed,), after = list_flows("failed", queue=queue, app=proj.app)
    assert after is None
    assert failed.id == oldest and failed.state == "failed" and failed.task == "tests.proj.tsum"
    assert "ValueError: gone" in (failed.error or "")
    assert (failed.done, failed.failed, failed.ignored, failed.outstanding) == (0, 1, 0, 0)
    assert failed.failed_ms is not None and failed.enqueued_ms is not None
    (finished,), _ = list_flows("done", queue=queue, app=proj.app)
    assert finished.id == done and (finished.done, finished.total) == (1, 1)
    assert [r.id for r in list_flows("cancelled", queue=queue, app=proj.app)[0]] == [cancelled]
    # Every queue at once (the default): this queue's flows are among them.
    everywhere, _ = list_flows("failed", limit=1000, app=proj.app)
    assert oldest in [r.id for r in everywhere]


def test_list_filters_by_task_and_leaves_nested_flows_out(
    proj: Any, state: EchoMQ, queue: str
) -> None:
    merge, _ = enqueue(state, queue, 2, task="proj.merge")
    report, _ = enqueue(state, queue, 2, task="proj.report")
    other, _ = enqueue(state, queue, 1, task="other.thing")
    # A nested flow is a child of its flow: in the tree (show), not in the list.
    nested = new_job_id()
    state.client.hset(state.keys.job_key(queue, nested), "parent", merge)
    state.client.zadd(state.keys.queue_key(queue, "recent"), {nested: 1})

    named = lambda pattern: [  # noqa: E731
        r.id for r in list_flows("recent", queue=queue, task=pattern, app=proj.app)[0]
    ]
    assert named("proj.merge") == [merge]
    assert named("proj.*") == [report, merge]
    assert named("nothing.*") == []
    rows, _ = list_flows("recent", queue=queue, app=proj.app)
    assert [r.id for r in rows] == [other, report, merge]
    assert rows[1].total == 2 and rows[1].outstanding == 2 and rows[1].age_s is not None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"state": "running"}, "state must be one of held, failed, done, cancelled, recent"),
        ({"limit": 0}, "limit must be a whole number from 1 to 1000"),
        ({"limit": 5000}, "limit must be a whole number from 1 to 1000"),
        ({"cursor": "²"}, "not a list cursor"),
        ({"cursor": "f" + "9" * 5000 + ":JOBx"}, "not a list cursor"),
        ({"cursor": "r12:JOBabc"}, "from a list of another state"),
        ({"queue": "bad{queue}"}, "queue"),
    ],
)
def test_bad_list_input_is_refused_before_anything_is_read(
    proj: Any, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ListingError if "queue" not in kwargs else ValueError, match=message):
        list_flows(app=proj.app, **kwargs)


def test_the_front_page_lists_the_same_pages(proj: Any, state: EchoMQ, queue: str) -> None:
    from celery_echomq.ops.dashboard.overview import PAGE, read_overview

    flows = [enqueue(state, queue, 1) for _ in range(PAGE + 5)]
    oldest, (child,) = flows[0]
    finish(state.scripts, queue, oldest, child, error="ValueError: gone")
    (view,) = read_overview(state, queue=queue)
    assert view.held == len(flows) - 1 and view.failed_jobs == 2  # the child and the parent
    failed = view.lists["failed"]
    assert [r.id for r in failed.rows] == [oldest] and failed.more is None
    recent = view.lists["recent"]
    assert len(recent.rows) == PAGE and recent.more is not None
    (older,) = read_overview(state, queue=queue, only="recent", cursor=recent.more)
    assert [r.id for r in older.lists["recent"].rows] == [p for p, _ in flows[4::-1]]
    with pytest.raises(CursorError):
        read_overview(state, queue=queue, only="recent", cursor="9" * 5000)


@pytest.mark.parametrize("n", [25, 300])  # a listpack, then a hashtable
def test_children_values_come_in_pages_of_count_each_once(
    proj: Any, state: EchoMQ, queue: str, n: int
) -> None:
    parent, children = enqueue(state, queue, n + 1)
    for child in children[:n]:
        finish(state.scripts, queue, parent, child)
    whole = celery_echomq.children_values(parent, app=proj.app, queue=queue)
    assert set(whole) == set(children[:n])
    seen: list[str] = []
    cursor = None
    while True:
        page, cursor = celery_echomq.children_values(
            parent, app=proj.app, queue=queue, cursor=cursor, count=7
        )
        assert 1 <= len(page) <= 7 and set(page.values()) == {1}
        seen += list(page)
        if cursor is None:
            break
    assert sorted(seen) == sorted(whole)  # each value exactly once
    for bad in ("x", "12:notajob", "9" * 5000):
        with pytest.raises(CursorError):
            celery_echomq.children_values(parent, app=proj.app, queue=queue, cursor=bad, count=7)
    with pytest.raises(ListingError):
        celery_echomq.children_values(parent, app=proj.app, queue=queue, count=0)


def test_failed_children_and_dependencies_under_every_policy(
    proj: Any, state: EchoMQ, queue: str
) -> None:
    parent, kids = enqueue(state, queue, 6)
    policies = ["", "ignore", "remove", "continue", "fail", ""]
    for child, policy in zip(kids, policies, strict=True):
        if policy:
            state.client.hset(state.keys.job_key(queue, child), "parent_policy", policy)
    deps = celery_echomq.dependencies(parent, app=proj.app, queue=queue)
    assert deps == (6, 0, 0, 0)
    finish(state.scripts, queue, parent, kids[0])
    for child, policy in zip(kids[1:5], policies[1:5], strict=True):
        finish(state.scripts, queue, parent, child, error=f"ValueError: {policy}")
    # continue released the parent; fail came after, on a parent that no longer waits; the
    # last child is still running: the counts add up to six.
    deps = celery_echomq.dependencies(parent, app=proj.app, queue=queue)
    assert deps == (1, 1, 3, 1)
    assert deps.outstanding + deps.done + deps.failed + deps.ignored == len(kids)
    assert celery_echomq.failed_children(parent, app=proj.app, queue=queue) == {
        kids[1]: "ValueError: ignore",
        kids[2]: "ValueError: remove",
        kids[3]: "ValueError: continue",
        kids[4]: "ValueError: fail",
    }


def test_a_retried_child_is_no_longer_a_failed_one(proj: Any, state: EchoMQ, queue: str) -> None:
    parent, (ok, bad) = enqueue(state, queue, 2)
    finish(state.scripts, queue, parent, ok)
    finish(state.scripts, queue, parent, bad, error="ValueError: once")
    read = lambda: celery_echomq.dependencies(parent, app=proj.app, queue=queue)  # noqa: E731
    assert read() == (0, 1, 1, 0)
    status, _ = state.scripts.retry_flow(queue, parent, [bad])
    assert status == "retried"
    assert read() == (1, 1, 0, 0)
    assert celery_echomq.failed_children(parent, app=proj.app, queue=queue) == {}
    finish(state.scripts, queue, parent, bad)
    assert read() == (0, 2, 0, 0)


def test_list_without_state_says_it_lists_failed_flows_and_how_to_list_every_one(
    queue: str,
) -> None:
    from tests.helpers import echomq

    usage = echomq("list", "--help").stdout
    assert "Without --state, only the failed flows" in " ".join(usage.split())
    assert "recent (every flow, in any state)" in " ".join(usage.split())
    empty = echomq("list", "--queue", queue)
    assert empty.exit_code == 0, empty.output
    assert empty.stdout.splitlines() == [
        "no failed flows",
        "(--state recent lists every flow, in any state)",
    ]


def test_show_says_why_a_flow_waits_on_too_few_replicas_and_what_heals_it(
    proj: Any, own_queue: Any, env: Any
) -> None:
    from celery_echomq import flow
    from tests.helpers import echomq_process

    queue = own_queue("replicas")
    res = flow(proj.tsum.s(), [proj.add.s(1, 1)]).apply_async(queue=queue)  # no worker: held
    waiting = echomq_process(env, "show", res.id, ECHOMQ_T_MIN_REPLICAS="1")
    assert waiting.returncode == 0, waiting.stderr
    last = " ".join(waiting.stdout.splitlines()[-1].split())
    assert last.startswith("waiting: the primary of this flow's slot (")
    assert "has 0 replica(s) connected, fewer than echomq_min_replicas=1" in last
    assert "Heals once that primary has 1 replica(s) connected" in last
    # Without the setting, or once the flow is finished, nothing of the kind.
    plain = echomq_process(env, "show", res.id)
    assert plain.returncode == 0 and "waiting:" not in plain.stdout
