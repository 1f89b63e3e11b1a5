"""`celery -A proj echomq ...` against real flows run by a real prefork worker.

Most commands run in-process through Celery's own `celery` click group (so the entry point
and `-A` loading are the real ones); a few run `celery` as a subprocess, exactly as a user
types it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import chain
from celery.bin.celery import celery as celery_main
from click.testing import CliRunner

from celery_echomq import FlowCancelled, flow
from tests.helpers import (
    ROOT,
    Env,
    echomq,
    echomq_process,
    id_of,
    settle,
    state_of,
    wait_for,
    with_id,
)

pytestmark = pytest.mark.e2e


@pytest.fixture
def gate(store: redis.Redis) -> Iterator[str]:
    """A gate key for `proj.gated`; always opened at the end so no worker process stays blocked."""
    name = f"test:gate:{uuid.uuid4().hex}"
    yield name
    store.set(name, 1)


def flow_keys(store: redis.Redis, job_id: str) -> list[bytes]:
    """The store's keys naming ``job_id``; Celery's own result key (there when the result
    backend shares the store's database) is the backend's, not the flow's."""
    keys = store.scan_iter(match=f"*{job_id}*")
    return sorted(k for k in keys if not k.startswith(b"celery-task-meta-"))


# --- show -------------------------------------------------------------------------------------


def test_show_prints_a_finished_flow_as_a_tree(proj: Any, worker: Any) -> None:
    ok1, ok2, bad = (
        with_id(proj.add.s(1, 2)),
        with_id(proj.add.s(3, 4)),
        with_id(proj.boom.s("disk full")),
    )
    res = flow(proj.tsum.s(), [ok1, ok2, bad.set(parent_policy="ignore")]).apply_async()
    assert settle(res) == 10
    ids = [id_of(sig) for sig in (ok1, ok2, bad)]

    out = echomq("show", res.id)
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert len(lines) == 4
    root, first, second, last = lines
    assert root.startswith(f"flow {res.id}  tests.proj.tsum  done")
    assert "outstanding=0  done=2/3  failed=0  ignored=1" in root and "value=10" in root
    assert first.startswith(f"├─ {ids[0]}  tests.proj.add  done  attempts=1  args=(1, 2)")
    assert "runtime=" in first  # from its start to its end (the result's date_done)
    assert "value=3" in first and "policy=" not in first  # the flow's default: on the root
    assert "default-policy=fail" in root
    assert second.startswith(f"├─ {ids[1]}  tests.proj.add  done") and "value=7" in second
    assert last.startswith(f"└─ {ids[2]}  tests.proj.boom  failed  attempts=1  args=('disk full',)")
    assert "  policy=ignore  " in last
    assert "error='ValueError: disk full'" in last and "[ignored]" in last


def test_show_json_gives_the_same_tree_as_data(proj: Any, worker: Any) -> None:
    children = [with_id(proj.add.s(i, i)) for i in range(3)]
    res = flow(proj.tsum.s(), children, policy="ignore").apply_async()
    assert settle(res) == 6

    out = echomq("show", "--json", res.id)
    assert out.exit_code == 0, out.output
    tree = json.loads(out.stdout)
    assert tree["id"] == res.id and tree["state"] == "done" and tree["value"] == 6
    assert tree["flow"] == {
        "policy": "ignore",
        "outstanding": 0,
        "done": 3,
        "failed": 0,
        "ignored": 0,
        "cut": 0,  # none cut: the flow ended with every child
        "total": 3,
        "failed_child": None,
        "max_active": None,  # no window: every child out at once
        "waiting": 0,
        "quorum": None,  # released by its last child, not by a quorum
        "reduce": None,  # its parent gets the list of values, not one folded
        "acc": None,
    }
    first = tree["children"][0]
    assert first["args"] == "(0, 0)" and first["kwargs"] == "{}"
    assert first["started_ms"] <= first["finished_ms"]
    assert first["runtime_ms"] == first["finished_ms"] - first["started_ms"]
    assert [c["id"] for c in tree["children"]] == [id_of(c) for c in children]
    assert [c["value"] for c in tree["children"]] == [0, 2, 4]
    assert {c["policy"] for c in tree["children"]} == {"ignore"}
    assert all(c["parent"] == res.id and c["outcome"] == "credited" for c in tree["children"])


def test_show_a_held_flow_then_its_release(
    proj: Any,
    worker: Any,
    gate: str,
    store: redis.Redis,
) -> None:
    fast, slow = with_id(proj.add.s(2, 2)), with_id(proj.gated.s(5, gate))
    res = flow(proj.tsum.s(), [fast, slow]).apply_async()
    wait_for(lambda: state_of(store, id_of(slow)) == "active", timeout=60)
    wait_for(lambda: state_of(store, id_of(fast)) == "done", timeout=60)

    held = echomq("show", res.id)
    assert held.exit_code == 0, held.output
    root, first, second = held.stdout.splitlines()
    assert "awaiting_children" in root and "outstanding=1  done=1/2" in root
    assert "value=" not in root
    assert f"{id_of(fast)}  tests.proj.add  done" in first and "value=4" in first
    assert f"{id_of(slow)}  tests.proj.gated  active  attempts=1" in second

    store.set(gate, 1)
    assert settle(res) == 9
    done = echomq("show", res.id)
    assert "  done  " in done.stdout.splitlines()[0] and "value=9" in done.stdout


def test_show_a_child_id_shows_the_child_and_its_parent(proj: Any, worker: Any) -> None:
    child = with_id(proj.add.s(20, 22))
    res = flow(proj.tsum.s(), [child]).apply_async()
    assert settle(res) == 42

    out = echomq("show", id_of(child))
    assert out.exit_code == 0, out.output
    (line,) = out.stdout.splitlines()
    assert line.startswith(f"{id_of(child)}  tests.proj.add  done  attempts=1  args=(20, 22)  ")
    assert re.search(r"  runtime=\d+\.\d\ds  ", line)
    assert line.endswith(f"  value=42  parent={res.id}  queue=celery")


@pytest.mark.parametrize("command", ["show", "watch", "forget", "cancel"])
def test_an_unknown_id_exits_non_zero_with_a_clear_message(command: str, env: Env) -> None:
    missing = f"JOB{uuid.uuid4().hex}"
    out = echomq(command, missing, "--json")
    assert out.exit_code == 1
    assert out.stdout == ""
    assert f"no job '{missing}' in Redis (never started, or expired)" in out.stderr


def test_an_ill_formed_id_is_refused_before_any_read(env: Env) -> None:
    out = echomq("show", "task-42")
    assert out.exit_code == 1
    assert "job id 'task-42' must be JOB-namespaced" in out.stderr


def test_show_through_the_celery_command_as_a_user_types_it(
    proj: Any, worker: Any, env: Env
) -> None:
    # A real `celery` process: proves the `celery.commands` entry point and `-A` loading.
    res = flow(proj.tsum.s(), [proj.add.s(1, 1), proj.add.s(2, 2)]).apply_async()
    assert settle(res) == 6

    done = echomq_process(env, "show", res.id)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].startswith(f"flow {res.id}  tests.proj.tsum  done")
    assert len(done.stdout.splitlines()) == 3

    unknown = echomq_process(env, "show", "JOBdoesnotexist")
    assert unknown.returncode == 1
    assert "no job 'JOBdoesnotexist' in Redis" in unknown.stderr


@pytest.mark.parametrize("timeout", [None, "2"])
def test_an_unreachable_store_says_so_retries_then_stops_in_one_line(
    env: Env, timeout: str | None
) -> None:
    from celery_echomq.embedded import free_port

    # A loopback port nobody listens on: the store is down (the app's own retry timeout, 20 s,
    # is a worker's: the command gives up after its --timeout, default 5 s).
    args = (["--timeout", timeout] if timeout else []) + ["list"]
    # What the interpreter's start and the app's import cost here and now (seconds on a loaded
    # machine), measured on a command that reaches no store: slack for the bound below.
    started = time.monotonic()
    assert echomq_process(env, "--help").returncode == 0
    start_cost = time.monotonic() - started
    started = time.monotonic()
    out = echomq_process(env, *args, ECHOMQ_T_STORE=f"redis://127.0.0.1:{free_port()}/13")
    took = time.monotonic() - started
    assert out.returncode == 1
    lines = out.stderr.splitlines()
    assert lines[0] == "retrying (store unreachable)..."
    assert lines[1].startswith("Error: cannot reach the flow store in Redis:")
    assert len(lines) == 2 and "Traceback" not in out.stderr
    wanted = float(timeout or 5)
    # It gives up when its next try would pass the timeout: never before it, and not much later
    # than it plus the interpreter's start (which varies with the machine's load, hence the 4 s).
    assert wanted - 1 <= took < wanted + start_cost + 4


def test_a_store_user_without_rights_or_a_wrong_password_is_one_line(
    proj: Any, worker: Any, env: Env, gate: str, store: redis.Redis
) -> None:
    blocked = with_id(proj.gated.s(1, gate))
    res = flow(proj.tsum.s(), [blocked]).apply_async()
    wait_for(lambda: state_of(store, id_of(blocked)) == "active", timeout=60)
    user = f"reader{uuid.uuid4().hex[:8]}"
    # A user who may read but not run scripts: show works, cancel is refused by Redis.
    store.execute_command("ACL", "SETUSER", user, "on", ">pw", "~*", "&*", "+@all", "-@scripting")
    host = env.store.split("//", 1)[1]
    try:
        reader = f"redis://{user}:pw@{host}"
        shown = echomq_process(env, "show", res.id, ECHOMQ_T_STORE=reader)
        assert shown.returncode == 0, shown.stderr
        refused = echomq_process(env, "cancel", res.id, ECHOMQ_T_STORE=reader)
        assert refused.returncode == 1
        assert refused.stderr.startswith("Error: the flow store refused: ")
        assert "no permissions" in refused.stderr and "Traceback" not in refused.stderr
        assert len(refused.stderr.splitlines()) == 1
        assert state_of(store, res.id) == "awaiting_children"  # nothing changed
        wrong = echomq_process(env, "list", ECHOMQ_T_STORE=f"redis://{user}:nope@{host}")
        assert wrong.returncode == 1 and "Traceback" not in wrong.stderr
        assert wrong.stderr.startswith("Error: the flow store refused the login: ")
    finally:
        store.execute_command("ACL", "DELUSER", user)


# --- watch ------------------------------------------------------------------------------------


def test_watch_follows_a_flow_until_its_parent_is_done(
    proj: Any,
    worker: Any,
    env: Env,
    gate: str,
    store: redis.Redis,
) -> None:
    fast, slow = with_id(proj.add.s(1, 1)), with_id(proj.gated.s(3, gate))
    res = flow(proj.tsum.s(), [fast, slow]).apply_async()
    wait_for(lambda: state_of(store, id_of(fast)) == "done", timeout=60)
    watcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.proj",
            "echomq",
            "watch",
            res.id,
            "--interval",
            "0.1",
            "--timeout",
            "120",
        ],
        cwd=ROOT,
        env=env.environ(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert watcher.stdout is not None
        first = watcher.stdout.readline()  # blocks until the watcher has read the flow once
        store.set(gate, 1)
        rest, err = watcher.communicate(timeout=120)
    finally:
        if watcher.poll() is None:
            watcher.kill()
    assert watcher.returncode == 0, err
    assert first.startswith(f"{res.id} [###############...............] 1/2 done, 0 failed")
    assert "· parent awaiting_children" in first
    lines = rest.splitlines()
    assert lines[-2].startswith(f"{res.id} [{'#' * 30}] 2/2 done, 0 failed · parent")
    assert lines[-1] == f"flow {res.id} done"
    assert settle(res) == 5


def test_watch_exits_1_when_a_child_fails_the_flow(proj: Any, worker: Any) -> None:
    bad = with_id(proj.boom.s("no such page"))
    res = flow(proj.tsum.s(), [proj.add.s(1, 1), bad]).apply_async()
    out = echomq("watch", res.id, "--interval", "0.1", "--timeout", "120")
    assert out.exit_code == 1
    assert (
        f"flow {res.id} failed: child {id_of(bad)} failed: ValueError: no such page" in out.stderr
    )


def test_watch_times_out_with_124_while_the_parent_is_held(
    proj: Any, worker: Any, gate: str
) -> None:
    res = flow(proj.tsum.s(), [proj.gated.s(1, gate)]).apply_async()
    started = time.monotonic()
    out = echomq("watch", res.id, "--interval", "0.1", "--timeout", "1.5")
    assert out.exit_code == 124
    assert time.monotonic() - started >= 1.5
    assert f"timed out after 1.5s; flow {res.id} is still running" in out.stderr
    assert "0/1 done" in out.stdout


def test_watch_json_prints_one_object_per_change(
    proj: Any,
    worker: Any,
    gate: str,
    store: redis.Redis,
) -> None:
    res = flow(proj.tsum.s(), [proj.gated.s(4, gate), proj.gated.s(6, gate)]).apply_async()
    # Open the gate from another thread while the in-process watcher loops.
    opener = threading.Timer(1.0, store.set, args=(gate, 1))
    opener.start()
    try:
        out = echomq("watch", res.id, "--json", "--interval", "0.05", "--timeout", "120")
    finally:
        opener.cancel()
    assert out.exit_code == 0, out.output
    updates = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(updates) >= 2
    assert updates[0]["total"] == 2 and updates[0]["finished"] is False
    assert updates[-1] == {
        "flow_id": res.id,
        "parent_state": "done",
        "total": 2,
        "done": 2,
        "failed": 0,
        "cancelled": 0,
        "active": 0,
        "pending": 0,
        "outstanding": 0,
        "finished": True,
        "error": None,
    }
    assert settle(res) == 10


# --- stats ------------------------------------------------------------------------------------


def test_stats_counts_pending_active_held_and_failed_per_queue(
    proj: Any,
    env: Env,
    start_worker: Any,
    gate: str,
    store: redis.Redis,
) -> None:
    # A queue of its own, so that the counts are this test's alone.
    queue = f"stats{uuid.uuid4().hex[:8]}"
    start_worker(queues=queue, concurrency=1)
    blocked = with_id(proj.gated.s(1, gate))
    held = flow(proj.tsum.s(), [blocked, proj.add.s(1, 1)]).apply_async(queue=queue)
    wait_for(lambda: state_of(store, id_of(blocked), queue) == "active", timeout=60)

    out = echomq("stats", "--json")
    assert out.exit_code == 0, out.output
    mine = [q for q in json.loads(out.stdout)["queues"] if q["queue"] == queue]
    # One worker process: the gated child runs, its sibling waits, the parent is held.
    assert mine == [
        {
            "queue": queue,
            "pending_jobs": 1,
            "active_jobs": 1,
            "held_flows": 1,
            "failed_jobs": 0,
            "republished_messages": 0,
            "skipped_messages": 0,
            "forged_messages": 0,
        }
    ]

    text = echomq("stats")
    # What each column counts, then in what: jobs (children and parents), flows, messages.
    names, units = text.stdout.splitlines()[:2]
    assert names.split() == [
        "queue",
        "pending",
        "active",
        "held",
        "failed",
        "republished",
        "skipped",
        "forged",
    ]
    assert units.split() == ["jobs", "jobs", "flows", "jobs", "messages", "messages", "messages"]
    assert [queue, "1", "1", "1", "0", "0", "0", "0"] in [
        line.split() for line in text.stdout.splitlines()
    ]

    store.set(gate, 1)
    assert settle(held, queue) == 3
    failing = flow(proj.tsum.s(), [proj.boom.s()]).apply_async(queue=queue)
    with pytest.raises(Exception, match="ValueError: boom"):
        failing.get(timeout=60, propagate=True)
    after = [
        q for q in json.loads(echomq("stats", "--json").stdout)["queues"] if q["queue"] == queue
    ]
    # The failed child and its failed parent are both in the queue's failed set.
    assert after == [
        {
            "queue": queue,
            "pending_jobs": 0,
            "active_jobs": 0,
            "held_flows": 0,
            "failed_jobs": 2,
            "republished_messages": 0,
            "skipped_messages": 0,
            "forged_messages": 0,
        }
    ]


# --- forget -----------------------------------------------------------------------------------


def test_forget_deletes_every_key_of_a_finished_flow(
    proj: Any,
    worker: Any,
    store: redis.Redis,
) -> None:
    children = [with_id(proj.add.s(i, 1)) for i in range(3)]
    res = flow(proj.tsum.s(), children).apply_async()
    assert settle(res) == 6
    ids = [res.id, *(id_of(c) for c in children)]
    assert all(flow_keys(store, job_id) for job_id in ids)

    out = echomq("forget", res.id)
    assert out.exit_code == 0, out.output
    # 4 rows, the counter, the values, the index of children by position, the locator.
    assert out.stdout.strip() == f"forgot flow {res.id}: 4 job(s), 8 key(s) deleted"
    assert [flow_keys(store, job_id) for job_id in ids] == [[], [], [], []]
    again = echomq("show", res.id)
    assert again.exit_code == 1 and f"no job '{res.id}' in Redis" in again.stderr


def test_forget_deletes_every_step_of_a_chain_child(
    proj: Any,
    worker: Any,
    store: redis.Redis,
) -> None:
    # Only a chain's last step is in its flow's index of children; the steps before it are
    # the flow's too, and go with it.
    steps = [with_id(proj.add.si(1, 1)), with_id(proj.add.s(1)), with_id(proj.add.s(1))]
    res = flow(proj.tsum.s(), [chain(*steps), with_id(proj.add.s(2, 2))]).apply_async()
    assert settle(res) == 4 + 4
    ids = [id_of(s) for s in steps]
    assert all(flow_keys(store, job_id) for job_id in ids)
    out = echomq("forget", res.id)
    assert out.exit_code == 0, out.output
    assert [flow_keys(store, job_id) for job_id in ids] == [[], [], []]


def test_show_and_forget_a_flow_whose_children_live_on_two_queues(
    proj: Any,
    start_worker: Any,
    store: redis.Redis,
) -> None:
    home, other = f"home{uuid.uuid4().hex[:6]}", f"other{uuid.uuid4().hex[:6]}"
    start_worker(queues=f"{home},{other}")
    near, far = with_id(proj.add.s(1, 1)), with_id(proj.add.s(2, 2).set(queue=other))
    res = flow(proj.tsum.s(), [near, far]).apply_async(queue=home)
    assert settle(res, home) == 6

    lines = echomq("show", res.id).stdout.splitlines()
    assert (
        lines[0].startswith(f"flow {res.id}  tests.proj.tsum  done") and f"queue={home}" in lines[0]
    )
    assert lines[1].startswith(f"├─ {id_of(near)}  tests.proj.add  done") and "value=2" in lines[1]
    assert lines[2].startswith(f"└─ {id_of(far)}  tests.proj.add  done") and "value=4" in lines[2]
    tree = json.loads(echomq("show", "--json", res.id).stdout)
    assert [c["queue"] for c in tree["children"]] == [home, other]

    assert echomq("forget", res.id).exit_code == 0
    for job_id in (res.id, id_of(near), id_of(far)):
        assert flow_keys(store, job_id) == [], job_id


def test_forget_refuses_an_unfinished_flow_unless_forced(
    proj: Any,
    worker: Any,
    gate: str,
    store: redis.Redis,
) -> None:
    blocked = with_id(proj.gated.s(1, gate))
    res = flow(proj.tsum.s(), [blocked]).apply_async()
    wait_for(lambda: state_of(store, id_of(blocked)) == "active", timeout=60)

    refused = echomq("forget", res.id)
    assert refused.exit_code == 1
    assert f"flow {res.id} has not finished (parent awaiting_children" in refused.stderr
    assert "pass --force" in refused.stderr
    assert state_of(store, res.id) == "awaiting_children"

    forced = echomq("forget", res.id, "--force", "--json")
    assert forced.exit_code == 0, forced.output
    report = json.loads(forced.stdout)
    assert report["jobs"] == [res.id, id_of(blocked)]
    assert report["unfinished"] == [res.id, id_of(blocked)]
    assert flow_keys(store, res.id) == [] and flow_keys(store, id_of(blocked)) == []
    # Nor does the forgotten child linger in the queue's active set.
    assert store.zscore("emq:{celery}:active", id_of(blocked)) is None


def test_forget_refuses_a_child_id(proj: Any, worker: Any) -> None:
    child = with_id(proj.add.s(1, 1))
    res = flow(proj.tsum.s(), [child]).apply_async()
    assert settle(res) == 2
    out = echomq("forget", id_of(child))
    assert out.exit_code == 1
    assert f"forget its flow instead: echomq forget {res.id}" in out.stderr


# --- cancel -----------------------------------------------------------------------------------


def test_cancel_stops_a_held_flow(
    proj: Any,
    worker: Any,
    gate: str,
    store: redis.Redis,
) -> None:
    blocked, waiting = with_id(proj.gated.s(1, gate)), with_id(proj.add.s(2, 2))
    res = flow(proj.tsum.s(), [blocked, waiting]).apply_async()
    wait_for(lambda: state_of(store, id_of(blocked)) == "active", timeout=60)

    out = echomq("cancel", res.id)
    assert out.exit_code == 0, out.output
    assert out.stdout.splitlines()[0] == f"flow {res.id}: cancelled"
    shown = echomq("show", "--json", res.id)
    tree = json.loads(shown.stdout)
    assert tree["state"] == "cancelled"
    assert tree["children"][0]["state"] == "cancelled"  # the running child, cancelled mid-run
    watched = echomq("watch", res.id, "--timeout", "10")
    assert watched.exit_code == 1 and f"flow {res.id} cancelled" in watched.stderr

    again = echomq("cancel", res.id)
    assert again.exit_code == 1
    assert f"flow {res.id} already finished (cancelled); nothing to cancel" in again.stderr
    # Celery's state for it, through the result backend.
    assert proj.app.AsyncResult(res.id).state == "REVOKED"


def test_revoke_terminate_revokes_a_held_flow_and_stops_its_running_child(
    proj: Any, worker: Any, gate: str, store: redis.Redis
) -> None:
    blocked = with_id(proj.gated.s(1, gate))
    res = flow(proj.tsum.s(), [blocked, with_id(proj.add.s(2, 2))]).apply_async()
    wait_for(lambda: state_of(store, id_of(blocked)) == "active", timeout=60)

    out = echomq("revoke", "--terminate", "--json", res.id)
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout) == {"cancelled": res.id, "state": "cancelled", "unfinished": []}
    with pytest.raises(FlowCancelled) as info:
        res.get(timeout=30)
    assert info.value.flow_id == res.id and res.state == "REVOKED"
    # --terminate: the running child's process was signalled, so its body never returned.
    wait_for(lambda: proj.app.AsyncResult(id_of(blocked)).state == "REVOKED", timeout=30)
    assert state_of(store, id_of(blocked)) == "cancelled"


# --- list -------------------------------------------------------------------------------------


def test_list_shows_held_and_failed_flows_with_their_tasks_and_pages(
    proj: Any, env: Env, start_worker: Any, gate: str, store: redis.Redis
) -> None:
    queue = f"list{uuid.uuid4().hex[:8]}"
    start_worker(queues=queue, concurrency=2)
    blocked = with_id(proj.gated.s(1, gate))
    held = flow(proj.tsum.s(), [blocked, with_id(proj.add.s(1, 1))]).apply_async(queue=queue)
    failing = flow(proj.collect.s(), [proj.boom.s("disk full")]).apply_async(queue=queue)
    done = [flow(proj.tsum.s(), [proj.add.s(i, i)]).apply_async(queue=queue) for i in range(3)]
    for res in done:
        assert settle(res, queue) in (0, 2, 4)
    wait_for(lambda: state_of(store, failing.id, queue) == "failed", timeout=60)
    wait_for(lambda: state_of(store, id_of(blocked), queue) == "active", timeout=60)

    out = echomq("list", "--state", "held", "--queue", queue)
    assert out.exit_code == 0, out.output
    title, header, row = out.stdout.splitlines()
    # The rows are flows; the counts on a row are that flow's children.
    assert title == (
        "1 held flow, newest first; done/total, failed, ignored and cut count each flow's children"
    )
    assert header.split() == ["flow", "task", "state", "done/total", "failed", "ignored", "cut",
                              "age", "queue"]  # fmt: skip
    assert row.split()[:6] == [held.id, "tests.proj.tsum", "awaiting_children", "1/2", "0", "0"]
    # The default is what needs a look: the failed flows, with their error in --json.
    failed = json.loads(echomq("list", "--queue", queue, "--json").stdout)
    assert [f["id"] for f in failed["flows"]] == [failing.id] and failed["next_cursor"] is None
    (row_data,) = failed["flows"]
    assert row_data["task"] == "tests.proj.collect" and "ValueError: disk full" in row_data["error"]
    assert (row_data["done"], row_data["failed"], row_data["total"]) == (0, 1, 1)
    # Pages of two, newest first, each flow once: the cursor a page prints gives the next.
    seen: list[str] = []
    cursor: list[str] = []
    while True:
        page = json.loads(
            echomq("list", "--state", "recent", "--queue", queue, "--limit", "2", "--json",
                   *cursor).stdout
        )  # fmt: skip
        seen += [f["id"] for f in page["flows"]]
        if page["next_cursor"] is None:
            break
        cursor = ["--cursor", page["next_cursor"]]
    assert seen == [r.id for r in reversed(done)] + [failing.id, held.id]
    named = json.loads(echomq("list", "--state", "recent", "--task", "*.collect", "--json").stdout)
    assert failing.id in [f["id"] for f in named["flows"]] and held.id not in str(named)
    bad = echomq("list", "--cursor", "²")
    assert bad.exit_code == 1 and "not a list cursor" in bad.stderr
    text = echomq("list", "--state", "recent", "--queue", queue, "--limit", "1")
    more = text.stdout.splitlines()[-1]
    assert re.fullmatch(r"more: echomq list --state recent --cursor r\d+:JOB\w+", more), more
    store.set(gate, 1)


# --- nested flows -----------------------------------------------------------------------------


def test_show_indents_a_nested_flow(
    proj: Any,
    worker: Any,
    store: redis.Redis,
) -> None:
    leaves = [with_id(proj.add.s(1, 1)), with_id(proj.add.s(2, 2))]
    inner = with_id(flow(proj.tsum.s(), leaves))
    res = flow(proj.tsum.s(), [inner, proj.add.s(10, 10)]).apply_async()
    assert settle(res) == 26

    # A nested flow is one line with its own counts until it is opened.
    lines = echomq("show", res.id).stdout.splitlines()
    assert len(lines) == 3
    assert lines[1].startswith(f"├─ flow {id_of(inner)}  tests.proj.tsum  done")
    assert "value=6" in lines[1] and "done=2/2" in lines[1] and "outstanding=0" in lines[1]
    assert lines[2].startswith("└─ JOB") and "value=20" in lines[2]
    # --all opens it, its children under it, every level read a page at a time.
    every = echomq("show", res.id, "--all").stdout.splitlines()
    assert len(every) == 5
    assert every[1].startswith(f"├─ flow {id_of(inner)}  tests.proj.tsum  done")
    assert every[2].startswith("│  ├─ JOB") and "value=2" in every[2]
    assert every[3].startswith("│  ├─ JOB") and "value=4" in every[3]
    assert every[4].startswith("├─ JOB") and "value=20" in every[4]

    # The nested flow on its own: its root line names the flow it belongs to.
    inner_lines = echomq("show", id_of(inner)).stdout.splitlines()
    assert inner_lines[0].startswith(f"flow {id_of(inner)}  tests.proj.tsum  done")
    assert f"parent={res.id}" in inner_lines[0] and len(inner_lines) == 3

    refused = echomq("forget", id_of(inner))
    assert refused.exit_code == 1
    assert f"flow {id_of(inner)} is nested in flow {res.id}; forget {res.id} instead" in (
        refused.stderr
    )
    assert echomq("forget", res.id).exit_code == 0
    for job_id in (res.id, id_of(inner), *map(id_of, leaves)):
        assert flow_keys(store, job_id) == [], job_id


# --- recover ----------------------------------------------------------------------------------


def test_recover_republishes_a_child_whose_message_was_lost(
    proj: Any,
    env: Env,
    start_worker: Any,
    store: redis.Redis,
) -> None:
    queue = f"lost{uuid.uuid4().hex[:8]}"
    child = with_id(proj.add.s(20, 1))
    res = flow(proj.tsum.s(), [child]).apply_async(queue=queue)
    # No worker consumes this queue yet: drop the child's message from the broker, as a
    # broker restart without persistence would. The flow now waits forever without recovery.
    assert redis.Redis.from_url(env.broker).delete(queue) == 1
    time.sleep(1.5)  # past the 1 s stall timeout given to the recovering process below

    out = echomq_process(env, "recover", "--queue", queue, ECHOMQ_T_STALL="1")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "1 repair(s)"
    assert lines[0].startswith(f"{queue}: re-published {id_of(child)} of parent {res.id}")

    start_worker(queues=queue)
    assert settle(res, queue) == 21
    again = echomq_process(env, "recover", "--queue", queue, "--json", ECHOMQ_T_STALL="1")
    assert json.loads(again.stdout) == {"repairs": []}


def test_recover_with_nothing_to_repair(proj: Any, worker: Any) -> None:
    res = flow(proj.tsum.s(), [proj.add.s(1, 1)]).apply_async()
    assert settle(res) == 2
    out = echomq("recover", "--queue", "celery")
    assert out.exit_code == 0, out.output
    assert out.stdout == "nothing to repair\n"
    assert json.loads(echomq("recover", "--queue", "celery", "--json").stdout) == {"repairs": []}


def test_the_echomq_group_is_listed_by_celery(env: Env) -> None:
    top = CliRunner().invoke(celery_main, ["--help"])
    assert "echomq" in top.stdout and "Find, inspect, follow and repair" in top.stdout
    out = CliRunner().invoke(celery_main, ["-A", "tests.proj", "echomq", "--help"])
    assert out.exit_code == 0
    assert "--timeout" in out.stdout
    commands = ("list", "show", "watch", "recover", "stats", "forget", "cancel", "revoke")
    for command in (*commands, "retry", "release", "dashboard"):
        assert f"  {command} " in out.stdout
