"""A flow read a page at a time: cursors, state filters, ``show --all``, a nested flow's one
line, and the dashboard's page of a flow of 100,000 children in a real Chromium.

Real workers run the flows (the session's, or one started on a queue of the test's own);
benchmarks/flow_pages.py measures what each read costs at 100, 100,000 and 1,000,000 children.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from celery_echomq import flow, get_state
from celery_echomq.errors import CursorError, EchoMQError
from celery_echomq.ops.pages import read_flow
from tests.helpers import KEYS, Env, echomq, id_of, script_args, wait_for, with_id

pytestmark = pytest.mark.e2e


@pytest.fixture
def gate(store: redis.Redis) -> Iterator[str]:
    name = f"test:gate:{uuid.uuid4().hex}"
    yield name
    store.set(name, 1)


def pages(
    state: Any, job_id: str, count: int, only: str | None = None
) -> tuple[list[str], list[int]]:
    """The ids on every page of ``job_id``'s children (those in state ``only``), following
    the cursors, and each page's length."""
    ids: list[str] = []
    sizes: list[int] = []
    cursor = None
    while True:
        node = read_flow(state, job_id, cursor=cursor, count=count, only=only)
        assert len(node.children) <= count
        ids += [c.id for c in node.children]
        sizes.append(len(node.children))
        cursor = node.page.next_cursor
        if cursor is None:
            return ids, sizes


def test_pages_follow_cursors_and_filter_by_state_the_failed_first(
    proj: Any, worker: Any, store: redis.Redis, gate: str
) -> None:
    ok = [with_id(proj.add.s(i, 1)) for i in range(117)]
    ignored = with_id(proj.boom.s("gone").set(parent_policy="ignore"))
    removed = with_id(proj.boom.s("moved").set(parent_policy="remove"))
    running = with_id(proj.gated.s(7, gate))
    sigs = [*ok[:40], ignored, *ok[40:90], removed, *ok[90:], running]
    res = flow(proj.tsum.s(), sigs).apply_async()
    state = get_state(proj.app)
    wait_for(lambda: res.dependencies() == (1, 117, 1, 1), timeout=120)
    wait_for(lambda: store.hget(f"emq:{{celery}}:{id_of(running)}", "state") == b"active")

    first = read_flow(state, res.id, count=50)
    assert first.flow is not None and first.flow.total == 120
    assert (first.flow.done, first.flow.failed, first.flow.ignored) == (117, 1, 1)
    assert first.flow.outstanding == 1
    # Every child once, in the flow's order, 50 at a time.
    every, sizes = pages(state, res.id, 50)
    assert sizes == [50, 50, 20]
    assert every == [id_of(s) for s in sigs]
    assert first.children[40].id == id_of(ignored) and first.children[40].outcome == "ignored"
    assert first.children[0].has_value and first.children[0].value == 1

    # Filters: each set paged with the same cursors, a page of one at a time.
    failed = pages(state, res.id, 1, "failed")[0]
    assert sorted(failed) == sorted([id_of(ignored), id_of(removed)])
    node = read_flow(state, res.id, only="failed")
    errors = {c.id: (c.state, c.outcome) for c in node.children}
    assert errors == {id_of(ignored): ("failed", "ignored"), id_of(removed): ("failed", "removed")}
    done = pages(state, res.id, 7, "done")[0]
    assert sorted(done) == sorted(id_of(s) for s in ok)
    assert pages(state, res.id, 5, "active")[0] == [id_of(running)]
    assert pages(state, res.id, 50, "pending")[0] == []

    # The same pages from the command line and over HTTP, with the next page's cursor.
    out = echomq("show", res.id, "--count", "10")
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert len(lines) == 1 + 10 + 2
    assert lines[-2] == f"more: echomq show {res.id} --cursor 10"
    assert lines[-1] == f"2 failed: echomq show {res.id} --state failed"
    out = echomq("show", res.id, "--state", "failed", "--json")
    shown = json.loads(out.stdout)
    assert sorted(c["id"] for c in shown["children"]) == sorted(failed)
    assert shown["page"] == {"only": "failed", "cursor": None, "next_cursor": None, "count": 50}

    for bad in ("x1", "99999999999999999999999", "-1"):
        with pytest.raises(CursorError):
            read_flow(state, res.id, cursor=bad)
    with pytest.raises(CursorError):
        read_flow(state, res.id, cursor="q1", only="failed")
    with pytest.raises(EchoMQError, match="state must be one of failed, done"):
        read_flow(state, res.id, only="everything")
    with pytest.raises(EchoMQError, match="a page holds 1 to 1000 children"):
        read_flow(state, res.id, count=0)
    refused = echomq("show", res.id, "--cursor", "nope")
    assert refused.exit_code != 0 and "not a page cursor" in refused.stderr

    store.set(gate, 1)
    assert res.get(timeout=60) == sum(range(1, 118)) + 7


def test_show_all_streams_every_child_of_a_chunked_flow(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    n = 1500  # more than echomq_chunk_size: the chunked path writes the index
    sigs = [with_id(proj.add.s(i, 0)) for i in range(n)]
    res = flow(proj.tsum.s(), sigs).apply_async()
    assert res.get(timeout=240) == sum(range(n))
    wait_for(lambda: store.hget(f"emq:{{celery}}:{res.id}", "state") == b"done")

    page = echomq("show", res.id).stdout.splitlines()
    assert len(page) == 1 + 50 + 1 and page[-1] == f"more: echomq show {res.id} --cursor 50"
    assert "done=1500/1500" in page[0] and "value=" in page[0]

    every = echomq("show", res.id, "--all", "--count", "200").stdout.splitlines()
    assert len(every) == 1 + n
    shown = [re.match(r"├─ (JOB\w+)  tests.proj.add  done", line) for line in every[1:]]
    assert [m.group(1) for m in shown if m] == [id_of(s) for s in sigs]

    lines = echomq("show", res.id, "--all", "--json").stdout.splitlines()
    objects = [json.loads(line) for line in lines]
    assert objects[0]["id"] == res.id and objects[0]["flow"]["total"] == n
    assert [o["value"] for o in objects[1:]] == list(range(n))
    assert {o["parent"] for o in objects[1:]} == {res.id}


def test_a_nested_flow_is_one_line_with_its_own_counts_until_opened(
    proj: Any,
    worker: Any,
    store: redis.Redis,
    serve: Any,
) -> None:
    leaves = [with_id(proj.add.s(1, 1)), with_id(proj.add.s(2, 2)), with_id(proj.boom.s("no"))]
    leaves[2] = leaves[2].set(parent_policy="ignore")
    inner = with_id(flow(proj.tsum.s(), leaves))
    res = flow(proj.tsum.s(), [inner, proj.add.s(10, 10)]).apply_async()
    assert res.get(timeout=60) == 26
    site = serve()

    tree = httpx.get(f"{site.url}/api/flows/{res.id}", timeout=30).json()
    nested = tree["children"][0]
    assert nested["id"] == id_of(inner) and nested["children"] == []
    assert nested["flow"]["total"] == 3 and nested["flow"]["done"] == 2
    assert nested["flow"]["ignored"] == 1 and nested["value"] == 6
    page = httpx.get(f"{site.url}/flows/{res.id}", timeout=30).text
    assert f'id="job-{id_of(inner)}"' in page and f'href="/flows/{id_of(inner)}"' in page
    assert all(f'id="job-{id_of(leaf)}"' not in page for leaf in leaves)
    assert "done=2/3" in page

    opened = httpx.get(f"{site.url}/flows/{id_of(inner)}", timeout=30).text
    assert all(f'id="job-{id_of(leaf)}"' in opened for leaf in leaves)
    assert 'id="failed"' in opened  # its failed child, first


@pytest.mark.timeout(900)
def test_the_dashboard_pages_a_flow_of_100000_children_in_chromium(
    proj: Any,
    env: Env,
    own_queue: Any,
    start_worker: Any,
    serve: Any,
    browser: Any,
) -> None:
    from selenium.webdriver.common.by import By

    n = 100_000
    queue = own_queue("pages")
    sigs = [with_id(proj.add.s(i, 0)) for i in range(n)]
    res = flow(proj.tsum.s(), sigs).apply_async(queue=queue)
    site = serve()

    def shown() -> list[str]:
        # Read in one script call: the page the browser holds when it runs, never elements of
        # a page a click is replacing.
        return list(
            browser.execute_script(
                "return Array.from(document.querySelectorAll('#tree li.job li.job'))"
                ".map(e => e.id);"
            )
        )

    browser.get(f"{site.url}/flows/{res.id}")
    summary = browser.find_element(By.ID, "summary").text
    assert summary == f"parent awaiting_children · 0/{n} children finished, {n} outstanding"
    assert shown() == [f"job-{id_of(s)}" for s in sigs[:50]]
    assert browser.find_element(By.ID, "pager").text.startswith(f"50 shown of {n}")
    browser.find_element(By.ID, "next").click()
    second = [f"job-{id_of(s)}" for s in sigs[50:100]]
    wait_for(lambda: "cursor=50" in browser.current_url and shown() == second)

    # A real worker runs them: the page in view follows, its counts climbing without a reload.
    start_worker(queues=queue, concurrency=2, extra_env={"ECHOMQ_T_STALL": "3600"})

    def finished() -> int:
        text = browser.execute_script(
            "const e = document.getElementById('summary'); return e ? e.textContent : '';"
        )
        found = re.search(r"· (\d+)/100000 children finished", str(text))
        return int(found.group(1)) if found else 0

    wait_for(lambda: finished() >= 100, timeout=300)
    wait_for(
        lambda: (
            browser.execute_script(
                "return document.getElementById(arguments[0]).dataset.state;",
                f"job-{id_of(sigs[50])}",
            )
            == "done"
        ),
        timeout=300,
    )
    browser.get(f"{site.url}/flows/{res.id}?state=done&count=20")
    done = browser.execute_script(
        "return Array.from(document.querySelectorAll('#tree li.job li.job'))"
        ".map(e => e.dataset.state);"
    )
    assert 1 <= len(done) <= 20
    assert set(done) == {"done"}
    assert len(browser.page_source) < 200_000  # a page of children, never the tree


@pytest.mark.timeout(600)
def test_cancel_and_forget_a_large_flow_a_chunk_per_script_call(
    proj: Any, env: Env, own_queue: Any, start_worker: Any, store: redis.Redis, gate: str
) -> None:
    from celery_echomq.errors import FlowCancelled

    n = 5000  # five chunks: one script call with every child would take 5,000 keys and more
    queue = own_queue("bigcancel")
    sigs = [with_id(proj.gated.s(i, gate)) for i in range(n)]
    res = flow(proj.tsum.s(), sigs).apply_async(queue=queue)
    start_worker(queues=queue, concurrency=2, extra_env={"ECHOMQ_T_STALL": "3600"})

    def row(job_id: str) -> str:
        return KEYS.job_key(queue, job_id)

    wait_for(lambda: store.hget(row(id_of(sigs[0])), "state") == b"active", timeout=60)

    before = store.config_get("slowlog-*")
    store.config_set("slowlog-log-slower-than", 0)
    store.config_set("slowlog-max-len", 100_000)
    store.slowlog_reset()
    try:
        out = echomq("cancel", res.id, "--json")
        sizes = script_args(store)
    finally:
        for name, value in before.items():
            store.config_set(name, value)
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["state"] == "cancelled"
    # The cancel's script calls: a chunk (1,000 children: a key and an id each) per call at
    # most, five or more of them; one call for the whole flow would take 5,000 keys.
    assert len(sizes) >= 5 and max(sizes) <= 2 * 1000 + 20
    pipe = store.pipeline(transaction=False)
    for sig in sigs:
        pipe.hget(row(id_of(sig)), "state")
    assert set(pipe.execute()) == {b"cancelled"}  # the running ones too
    deps = res.dependencies()  # every chunk's children counted as cut, none outstanding
    assert deps == (0, 0, 0, 0) and deps.cut == n
    with pytest.raises(FlowCancelled):
        res.get(timeout=30)

    store.set(gate, 1)  # the running children return; their rows say cancelled
    forgot = echomq("forget", res.id, "--json")
    assert forgot.exit_code == 0, forgot.output
    report = json.loads(forgot.stdout)
    assert report["jobs"] == [res.id, *(id_of(s) for s in sigs)]
    # A plain task behind the flow's messages: once it has run, the worker has dropped every
    # revoked one still in the broker, and the running children have returned. None of them
    # brings a forgotten row back (see the test below).
    assert proj.add.s(1, 2).apply_async(queue=queue).get(timeout=300) == 3
    assert_only_tombstones(store, queue, res.id)
    for name in ("pending", "active", "recent"):
        assert store.zcard(KEYS.queue_key(queue, name)) == 0


@pytest.mark.timeout(300)
def assert_only_tombstones(store: redis.Redis, queue: str, flow_id: str) -> None:
    """What forget leaves of a cancelled flow: for each cancelled child, its state and parent
    alone (what a worker that receives its message later reads to drop it), expiring; no
    other key of the flow's."""
    left = list(store.scan_iter(match=f"emq:{{{queue}}}:JOB*", count=10_000))
    for key in left:
        assert store.hgetall(key) == {b"state": b"cancelled", b"parent": flow_id.encode()}, key
        assert store.pttl(key) > 0, key


def test_revoked_messages_a_worker_drops_after_forget_bring_no_row_back(
    proj: Any, env: Env, own_queue: Any, start_worker: Any, store: redis.Redis, gate: str
) -> None:
    """The window the large cancel-and-forget meets on a loaded machine: a cancelled flow is
    forgotten while its children's messages still wait in the broker. The worker drops each
    one it then receives (the cancel revoked it) and reports the revocation, which finds no
    row: it must leave none behind (nor a failed-set entry), as forget left the queue."""
    from celery_echomq.errors import FlowCancelled

    n = 30
    queue = own_queue("forgotrevoked")
    sigs = [with_id(proj.gated.s(i, gate)) for i in range(n)]
    res = flow(proj.tsum.s(), sigs).apply_async(queue=queue)
    # One pool process: the first child holds it, the other 29 messages wait in the broker.
    start_worker(queues=queue, concurrency=1, extra_env={"ECHOMQ_T_STALL": "3600"})
    wait_for(lambda: store.hget(KEYS.job_key(queue, id_of(sigs[0])), "state") == b"active", 60)

    assert echomq("cancel", res.id).exit_code == 0
    with pytest.raises(FlowCancelled):
        res.get(timeout=30)
    forgot = echomq("forget", res.id, "--json")
    assert forgot.exit_code == 0, forgot.output
    assert_only_tombstones(store, queue, res.id)
    # A plain task behind the flow's messages: once it has run, the worker has received (and
    # dropped, reporting each revocation) every one of them.
    after = proj.add.s(1, 2).apply_async(queue=queue)
    store.set(gate, 1)
    assert after.get(timeout=120) == 3
    revoked = [proj.app.AsyncResult(id_of(s)).state for s in sigs[1:]]
    assert set(revoked) == {"REVOKED"}
    assert_only_tombstones(store, queue, res.id)
    for name in ("pending", "active", "failed", "recent"):
        assert store.zcard(KEYS.queue_key(queue, name)) == 0, name


@pytest.mark.timeout(600)
def test_retry_of_a_flow_of_1200_children_reads_its_index_not_its_payload(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    """A flow of more than echomq_chunk_size children (its parent keeps a ``head`` and its
    index): one child fails it under ``fail``; ``retry`` finds that child, runs it again, and
    the parent gets every value, in order."""
    flag = f"test:flag:{uuid.uuid4().hex}"
    n = 1200
    sigs = [with_id(proj.add.s(i, 0)) for i in range(n - 1)]
    bad = with_id(proj.flaky.s(7, flag))
    sigs.insert(600, bad)
    res = flow(proj.tsum.s(), sigs).apply_async()
    row = f"emq:{{celery}}:{res.id}"
    wait_for(lambda: store.hget(row, "state") == b"failed", timeout=240)
    assert store.hexists(row, "head")  # the chunked path's parent: read without its payload
    failed = read_flow(get_state(proj.app), res.id, only="failed")
    assert [c.id for c in failed.children] == [id_of(bad)]

    store.set(flag, 1)
    out = echomq("retry", res.id)
    assert out.exit_code == 0, out.output
    assert (
        out.stdout.splitlines()[0] == f"flow {res.id}: awaiting_children; re-published 1 child(ren)"
    )
    assert res.get(timeout=240) == sum(range(n - 1)) + 7
    assert read_flow(get_state(proj.app), res.id, only="failed").children == ()
