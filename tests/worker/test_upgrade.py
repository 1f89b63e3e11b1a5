"""An upgrade with flows in flight: the previous landed release (its tree from this repository's
git history, first on the subprocesses' PYTHONPATH) enqueues flows of every shape and runs part
of them on its own workers, which are then SIGKILLed mid-child; workers of this release finish
every flow, each parent once, with the values the flow was sent for.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_echomq.embedded.worker import WorkerProcess
from tests.helpers import LOGDIR, ROOT, Env, fast_recovery, release_tree, wait_for

pytestmark = pytest.mark.e2e

# The landed releases whose flows in flight this release must finish, each with the format its
# rows carry: the last before the store's format was recorded (no 'format' field: format 1),
# and the last landed release (format 2). Add each release that changes the format.
RELEASES = {"5833a56": None, "c4bdd09": b"2"}

# What the previous release's producer sends, every shape a flow can be in when its workers go
# away: each flow's id (its parent counts its runs under "<tag>-<name>") and the id of the
# chain's slow step, printed as JSON. Its workers take the queue in this order: the first
# flow finishes on them, the chain's step and the slow children are running at the kill, the
# flows after them wait (held, their children pending, a window's waiting).
PRODUCER = """
import json, sys, uuid
from celery import chain
from celery_echomq import flow
from tests import proj as p

queue, tag = sys.argv[1], sys.argv[2]
def c(name):
    return p.collect.s(tag=f"{tag}-{name}")
shared = p.add.s(20, 22)
shared.freeze()
step = p.slow_child.s(4).set(task_id="JOB" + uuid.uuid4().hex)  # in flight at the kill
sent = {
    "held": flow(c("held"), [p.add.s(i, i) for i in range(4)]),
    "chain": flow(c("chain"), [chain(p.add.s(1, 2), step, p.square.s()), p.add.s(0, 1)]),
    "running": flow(c("running"), [p.slow_child.s(i, 4) for i in range(3)]),
    "window": flow(c("window"), [p.add.s(i, 1) for i in range(5)], max_active=2),
    "deadline": flow(c("deadline"), [p.add.s(i, 0) for i in range(3)], deadline=600),
    "shared": flow(c("shared"), [flow(c("shared1"), [shared, p.add.s(1, 1)]),
                                 flow(c("shared2"), [shared, p.add.s(2, 2)])]),
    "nested": flow(c("nested"), [flow(p.tsum.s(), [p.add.s(1, 1), p.add.s(2, 2)]),
                                 p.add.s(3, 3)]),
    "ignore": flow(c("ignore"), [p.add.s(1, 1), p.boom.s()], policy="ignore"),
    "remove": flow(c("remove"), [p.add.s(2, 2), p.boom.s()], policy="remove"),
}
ids = {}
for name, f in sent.items():
    res = f.apply_async(queue=queue, on_exists="join") if name == "shared" else (
        f.apply_async(queue=queue))
    ids[name] = res.id
print(json.dumps({"flows": ids, "step": step.id}))
"""


def shared_values(tag: str) -> list[Any]:
    return [
        {"values": [42, 2], "tag": f"{tag}-shared1"},
        {"values": [42, 4], "tag": f"{tag}-shared2"},
    ]


# Each flow's parent's values, as its user would read them from AsyncResult.get().
EXPECTED: dict[str, Any] = {
    "held": [0, 2, 4, 6],
    "running": [0, 1, 2],
    "window": [1, 2, 3, 4, 5],
    "deadline": [0, 1, 2],
    "chain": [9, 1],
    "shared": shared_values,
    "nested": [6, 6],
    "ignore": [2],
    "remove": [4],
}


@pytest.fixture(params=sorted(RELEASES))
def release(request: pytest.FixtureRequest) -> str:
    """A landed release's commit."""
    return str(request.param)


@pytest.fixture
def previous_tree(release: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A landed release's tree, from this repository's own history."""
    return release_tree(release, tmp_path_factory)


def on_previous(env: Env, tree: Path, **extra: str) -> dict[str, str]:
    """An environment whose Python imports the previous release first (its celery_echomq and
    its tests.proj), the same venv's dependencies after it."""
    return env.environ(PYTHONPATH=str(tree), **extra)


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for w in started:
        w.stop()


def start(started: list[WorkerProcess], where: Path, environ: dict[str, str], queue: str) -> Any:
    name = f"up{uuid.uuid4().hex[:8]}"
    w = WorkerProcess(
        "tests.proj", log=LOGDIR / f"{name}.log", cwd=where, env=environ, queues=queue,
        concurrency=2, name=name,
    )  # fmt: skip
    started.append(w)
    return w.start()


def runs(store: Any, tag: str) -> int:
    return int(store.get(f"test:ran:collect:{tag}") or 0)


def test_flows_in_flight_on_the_previous_release_finish_after_an_upgrade_worker_killed(
    env: Env,
    proj: Any,
    store: Any,
    own_queue: Any,
    release: str,
    previous_tree: Path,
    workers: list[WorkerProcess],
) -> None:
    queue, tag = own_queue("up"), uuid.uuid4().hex[:10]
    old_env = on_previous(env, previous_tree, **fast_recovery())
    produced = subprocess.run(
        [sys.executable, "-c", PRODUCER, queue, tag],
        cwd=previous_tree, env=old_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert produced.returncode == 0, produced.stderr[-3000:]
    sent = json.loads(produced.stdout.strip().splitlines()[-1])
    ids: dict[str, str] = sent["flows"]
    # The rows the previous release wrote carry its format (none: format 1).
    assert store.hget(f"emq:{{{queue}}}:{ids['held']}", "format") == RELEASES[release]

    old = start(workers, previous_tree, old_env, queue)
    # Mid-child: the slow children run (and, a chain step in flight, its slow step) when the
    # old worker is SIGKILLed, its messages acked on receipt, so gone with it.
    wait_for(lambda: store.exists(f"test:ran:slow:{sent['step']}"), timeout=90)
    wait_for(lambda: len(store.keys("test:ran:slow:*")) >= 2, timeout=90)
    old.kill()
    assert store.hget(f"emq:{{{queue}}}:{sent['step']}", "state") == b"active"

    start(workers, ROOT, env.environ(**fast_recovery()), queue)
    start(workers, ROOT, env.environ(**fast_recovery()), queue)
    for name, flow_id in ids.items():
        want = EXPECTED[name]
        want = want(tag) if callable(want) else want
        assert proj.app.AsyncResult(flow_id).get(timeout=120) == {
            "values": want,
            "tag": f"{tag}-{name}",
        }
        assert runs(store, f"{tag}-{name}") == 1, name
    assert runs(store, f"{tag}-shared1") == runs(store, f"{tag}-shared2") == 1


def test_a_flow_of_a_newer_format_is_left_untouched_and_logged_then_finished_by_a_newer_worker(
    env: Env, proj: Any, store: Any, own_queue: Any, workers: list[WorkerProcess]
) -> None:
    from celery_echomq import flow
    from celery_echomq.store.store_format import STORE_FORMAT
    from tests.helpers import KEYS, logged, snapshot

    queue, tag = own_queue("newer"), uuid.uuid4().hex[:10]
    children = [proj.add.s(i, i).set(task_id=f"JOB{uuid.uuid4().hex}") for i in range(3)]
    res = flow(proj.collect.s(tag=tag), children).apply_async(queue=queue)
    ids = [res.id, *(c.id for c in children)]
    rows = [KEYS.job_key(queue, job) for job in ids]
    for key in rows:  # what a newer release would have written
        store.hset(key, "format", str(STORE_FORMAT + 1))
    before = snapshot(store, *ids)

    worker = start(workers, ROOT, env.environ(**fast_recovery()), queue)
    # Its deliveries are skipped, and recovery (a lost message, a stall timeout later) leaves
    # the rows alone too: one line per row, naming the format found and the one it knows.
    logged(worker, f"store format {STORE_FORMAT + 1}, newer than format {STORE_FORMAT}")
    logged(worker, f"recovery of pending job {children[0].id} on {queue} left alone", timeout=60)
    assert snapshot(store, *ids) == before
    assert runs(store, tag) == 0 and not store.get(f"test:ran:collect:{tag}")
    found = worker.output()
    assert found.count(f"row {rows[1]} is in store format") == 2  # its delivery, its recovery
    assert "Upgrade celery-echomq" in found

    # A worker that knows the format (here: the rows read as this release's again) finds the
    # children still pending, their messages acknowledged, and finishes the flow.
    for key in rows:
        store.hset(key, "format", str(STORE_FORMAT))
    assert res.get(timeout=60) == {"values": [0, 2, 4], "tag": tag}
    assert runs(store, tag) == 1


def test_a_shared_job_credits_its_flows_and_leaves_a_newer_flows_credit_to_its_release(
    env: Env, proj: Any, store: Any, own_queue: Any, workers: list[WorkerProcess]
) -> None:
    from celery_echomq import flow
    from celery_echomq.store.store_format import STORE_FORMAT
    from tests.helpers import KEYS, logged

    queue, tag = own_queue("newer-join"), uuid.uuid4().hex[:10]
    shared = proj.add.s(20, 22).set(task_id=f"JOB{uuid.uuid4().hex}")
    first = flow(proj.collect.s(tag=f"{tag}-1"), [shared]).apply_async(queue=queue)
    second = flow(proj.collect.s(tag=f"{tag}-2"), [shared]).apply_async(
        queue=queue, on_exists="join"
    )
    newer = KEYS.job_key(queue, second.id)
    store.hset(newer, "format", str(STORE_FORMAT + 1))  # the second flow is a newer release's

    worker = start(workers, ROOT, env.environ(**fast_recovery()), queue)
    assert first.get(timeout=30) == {"values": [42], "tag": f"{tag}-1"}
    logged(worker, f"credit of joined {shared.id} to {second.id} left alone")
    assert store.hget(newer, "state") == b"awaiting_children"
    assert store.zscore(KEYS.queue_key(queue, "joined"), shared.id) is not None  # still staged
    # Once a worker knows the flow's format, its recovery credits the staged edge.
    store.hset(newer, "format", str(STORE_FORMAT))
    assert second.get(timeout=60) == {"values": [42], "tag": f"{tag}-2"}
    assert runs(store, f"{tag}-1") == runs(store, f"{tag}-2") == 1
    assert worker.output().count(f"credit of joined {shared.id} to {second.id} left") == 1
