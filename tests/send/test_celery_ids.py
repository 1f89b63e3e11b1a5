"""Celery's own task ids in a flow: a uuid from ``freeze()`` or ``celery.utils.uuid()`` is kept
as the job's id (messages, results, callbacks, reads, the operator's commands), while the
store names the job's keys by its row id, ``JOB`` + the uuid (store/keyspace.py's ``row_id``).
Any other id outside the JOB namespace, and every ill-formed id, is refused before anything
is written or published.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import chain, group
from celery.utils import uuid as celery_uuid

from celery_echomq import (
    DuplicateIdError,
    FlowCancelled,
    FlowExistsError,
    FlowFailed,
    FlowResult,
    InvalidIdError,
    KindError,
    flow,
    get_state,
    list_flows,
    release_flow,
    retry_flow,
)
from celery_echomq.ops.listing import held_parents
from celery_echomq.ops.views import read_tree, walk
from celery_echomq.store.keyspace import check_id, id_of_row, row_id
from celery_echomq.store.script_values import packed
from tests.helpers import Env, Served, kept_keys, run, wait_for

# A fixed uuid for the parametrized ids: every pytest-xdist process must collect the same
# tests, so their ids (and names) cannot be random.
SAMPLE = uuid.UUID("3b241101-e2bb-4255-8caf-4136c566a962")

TIMEOUT = 60


@pytest.fixture
def gate(store: redis.Redis) -> Iterator[str]:
    name = f"test:gate:{uuid.uuid4().hex}"
    yield name
    store.set(name, 1)


def rows_of(store: redis.Redis, job_id: str) -> list[bytes]:
    """The store's keys that name ``job_id`` (Celery's own result keys left out)."""
    found = store.scan_iter(match=f"*{job_id}*", count=1000)
    return sorted(k for k in found if not k.startswith(b"celery-task-meta-"))


def assert_row_named_by_job(store: redis.Redis, job_id: str) -> None:
    """The job's keys exist, and every one names it by ``JOB`` + its uuid."""
    keys = rows_of(store, job_id)
    assert keys, f"no key names {job_id}"
    assert all(f"JOB{job_id}".encode() in key for key in keys), keys


# --- the rule ---------------------------------------------------------------------------------


def test_a_celery_uuid_is_a_job_id_whose_row_is_job_plus_the_uuid() -> None:
    u = celery_uuid()
    assert check_id(u) == u
    assert row_id(u) == "JOB" + u and id_of_row("JOB" + u) == u
    own = "JOB" + uuid.uuid4().hex  # what a flow makes itself: its own row id
    assert row_id(own) == own and id_of_row(own) == own


@pytest.mark.parametrize(
    "bad",
    [
        SAMPLE.hex,  # a uuid, not in Celery's form
        str(SAMPLE).upper(),
        "urn:uuid:" + str(SAMPLE),
        str(SAMPLE)[:-1],
        "task-42",
        "job" + SAMPLE.hex,
    ],
)
def test_any_other_id_outside_the_job_namespace_raises_kind_error(bad: str) -> None:
    with pytest.raises(InvalidIdError) as info:
        check_id(bad)
    if ":" not in bad and "{" not in bad:
        assert isinstance(info.value, KindError)
        assert "celery.utils.uuid()" in str(info.value)


def test_a_uuid_and_job_plus_that_uuid_cannot_both_be_in_one_flow(proj: Any) -> None:
    u = celery_uuid()
    sig = flow(proj.tsum.s(), [proj.add.s(1, 1).set(task_id=u), proj.add.s(2, 2)])
    sig.children[1].set(task_id="JOB" + u)
    with pytest.raises(DuplicateIdError, match="name the same row"):
        sig.apply()


# --- frozen ids, both ways ---------------------------------------------------------------------


def test_a_frozen_child_keeps_its_celery_id(proj: Any, how: str, store: redis.Redis) -> None:
    kid = proj.add.s(2, 3)
    kid_id = kid.freeze().id
    other = proj.add.s(1, 1)
    res = run(flow(proj.tsum.s(), [kid, other]), how)
    assert res.get(timeout=TIMEOUT) == 7
    values = res.children_values()
    assert values[kid_id] == 5 and len(values) == 2
    if how == "apply_async":
        assert proj.app.AsyncResult(kid_id).get(timeout=TIMEOUT) == 5
        assert_row_named_by_job(store, kid_id)
        node = read_tree(get_state(proj.app), res.id)
        assert kid_id in [child.id for child in node.children]
        # show by the child's uuid finds the child and says whose it is
        assert read_tree(get_state(proj.app), kid_id).parent == res.id


def test_a_frozen_parent_is_the_flows_id(proj: Any, how: str, store: redis.Redis) -> None:
    parent = proj.tsum.s()
    parent_id = parent.freeze().id
    res = run(flow(parent, [proj.add.s(1, 1), proj.add.s(2, 2)]), how)
    assert res.id == parent_id
    assert res.get(timeout=TIMEOUT) == 6
    assert res.dependencies() == (0, 2, 0, 0)
    if how == "apply_async":
        assert proj.app.AsyncResult(parent_id).get(timeout=TIMEOUT) == 6
        assert FlowResult(parent_id, app=proj.app).dependencies() == (0, 2, 0, 0)
        assert_row_named_by_job(store, parent_id)


def test_apply_async_with_a_celery_task_id(proj: Any, how: str) -> None:
    given = celery_uuid()
    sig = flow(proj.tsum.s(), [proj.add.s(1, 2)])
    res = run(sig, how, task_id=given)
    assert res.id == given
    assert res.get(timeout=TIMEOUT) == 3


def test_a_frozen_flow_and_a_nested_flow_with_celery_ids(proj: Any, how: str) -> None:
    inner_parent = proj.tsum.s().set(task_id=celery_uuid())
    inner = flow(inner_parent, [proj.add.s(1, 1).set(task_id=celery_uuid())])
    outer = flow(proj.tsum.s(), [inner, proj.add.s(3, 3)])
    frozen = outer.freeze(celery_uuid())
    res = run(outer, how)
    assert res.id == frozen.id
    assert res.get(timeout=TIMEOUT) == 8
    assert res.children_values()[inner_parent.options["task_id"]] == 2


def test_a_chain_child_whose_steps_carry_celery_ids(proj: Any, how: str) -> None:
    first, last = proj.add.s(1, 1), proj.add.s(10)
    first_id, last_id = first.freeze().id, last.freeze().id
    res = run(flow(proj.tsum.s(), [chain(first, last), proj.add.s(0, 1)]), how)
    assert res.get(timeout=TIMEOUT) == 13
    assert res.children_values()[last_id] == 12
    if how == "apply_async":
        assert proj.app.AsyncResult(first_id).get(timeout=TIMEOUT) == 2
        assert proj.app.AsyncResult(last_id).get(timeout=TIMEOUT) == 12


def test_a_failed_frozen_child_is_named_by_its_celery_id(proj: Any, how: str) -> None:
    bad = proj.fail.s()
    bad_id = bad.freeze().id
    parent = proj.tsum.s()
    parent_id = parent.freeze().id
    res = run(flow(parent, [proj.add.s(1, 1), bad]), how)
    with pytest.raises(FlowFailed) as info:
        res.get(timeout=TIMEOUT)
    assert info.value.child_id == bad_id and info.value.flow_id == parent_id
    assert bad_id in res.failed_children()


def test_link_error_callbacks_get_the_celery_ids(
    proj: Any, worker: Any, store: redis.Redis
) -> None:
    bad = proj.fail.s()
    bad.link_error(proj.errback_new_style.s())  # counts under the failed task's request.id
    bad_id = bad.freeze().id
    parent = proj.tsum.s()
    parent_id = parent.freeze().id
    sig = flow(parent, [bad])
    sig.link_error(proj.errback_old_style.s())  # counts under the task id it is given
    try:
        with pytest.raises(FlowFailed):
            sig.apply_async().get(timeout=TIMEOUT)
        wait_for(lambda: store.get(bad_id) == b"1" and store.get(parent_id) == b"1")
    finally:
        store.delete(bad_id, parent_id)


# --- the operator's side, by the uuid ----------------------------------------------------------


def test_revoke_by_the_celery_id(proj: Any, worker: Any, gate: str, store: redis.Redis) -> None:
    given = celery_uuid()
    flow(proj.tsum.s(), [proj.gated.s(1, gate)]).apply_async(task_id=given)
    res = FlowResult(given, app=proj.app)
    wait_for(lambda: res.dependencies().outstanding == 1)
    rows, _ = list_flows("held", limit=1000, app=proj.app)
    assert [row.id for row in rows].count(given) == 1
    assert given in held_parents(get_state(proj.app), "celery")
    res.revoke()
    with pytest.raises(FlowCancelled):
        proj.app.AsyncResult(given).get(timeout=TIMEOUT)
    assert store.hget(f"emq:{{celery}}:JOB{given}", "state") == b"cancelled"


def test_release_by_the_celery_id(proj: Any, worker: Any, gate: str) -> None:
    given = celery_uuid()
    fast = proj.add.s(2, 2)
    fast_id = fast.freeze().id
    res = flow(proj.tsum.s(), [fast, proj.gated.s(5, gate)]).apply_async(task_id=given)
    wait_for(lambda: res.dependencies().done == 1)
    outcome = release_flow(get_state(proj.app), given)
    assert outcome.flow_id == given and outcome.values == 1
    assert res.get(timeout=TIMEOUT) == 4
    tree = read_tree(get_state(proj.app), given)
    assert tree.id == given and fast_id in [n.id for n in walk(tree)]


def test_retry_by_the_celery_id(proj: Any, worker: Any, store: redis.Redis) -> None:
    flag = f"test:flag:{uuid.uuid4().hex}"
    shaky = proj.flaky.s(5, flag)
    shaky_id = shaky.freeze().id
    given = celery_uuid()
    res = flow(proj.tsum.s(), [proj.add.s(1, 1), shaky]).apply_async(task_id=given)
    try:
        with pytest.raises(FlowFailed):
            res.get(timeout=TIMEOUT)
        store.set(flag, 1)
        outcome = retry_flow(get_state(proj.app), given)
        assert outcome.flow_id == given and shaky_id in outcome.republished
        assert FlowResult(given, app=proj.app).get(timeout=TIMEOUT) == 7
    finally:
        store.delete(flag)


def test_the_group_parent_and_the_group_child_keep_their_ids(proj: Any, how: str) -> None:
    task = proj.add.s(1, 1)
    task_id = task.freeze().id
    res = run(flow(group(proj.tsum.s(), proj.tsum.s()), [task]), how)
    assert res.get(timeout=TIMEOUT) == [2, 2]
    assert task_id in res.children_values()


@pytest.mark.e2e
def test_show_list_and_the_dashboard_take_the_celery_id(proj: Any, worker: Any) -> None:
    import json

    import httpx
    from celery.bin.celery import celery as celery_main
    from click.testing import CliRunner

    kid = proj.add.s(4, 4)
    kid_id = kid.freeze().id
    given = celery_uuid()
    res = flow(proj.tsum.s(), [kid]).apply_async(task_id=given)
    assert res.get(timeout=TIMEOUT) == 8
    wait_for(lambda: read_tree(get_state(proj.app), given).state == "done")

    def echomq(*args: str) -> Any:
        return CliRunner().invoke(celery_main, ["-A", "tests.proj", "echomq", *args])

    shown = echomq("show", given)
    assert shown.exit_code == 0, shown.output
    root, child = shown.stdout.splitlines()
    assert root.startswith(f"flow {given}  tests.proj.tsum  done") and kid_id in child
    tree = json.loads(echomq("show", "--json", kid_id).stdout)
    assert tree["id"] == kid_id and tree["parent"] == given
    listed = json.loads(echomq("list", "--state", "done", "--limit", "1000", "--json").stdout)
    assert given in json.dumps(listed)
    site = Served(proj.app, allow_actions=False)
    try:
        page = httpx.get(f"{site.url}/api/flows/{given}")
        assert page.status_code == 200 and page.json()["id"] == given
        assert page.json()["children"][0]["id"] == kid_id
        assert kid_id in httpx.get(f"{site.url}/flows/{given}").text
        refused = httpx.get(f"{site.url}/api/flows/{uuid.UUID(given).hex}")
        assert refused.status_code == 400 and "celery.utils.uuid()" in refused.json()["error"]
    finally:
        site.stop()


# --- refusals: nothing written, nothing published ----------------------------------------------


class Probe:
    """What a refused flow must leave as it was: the store's keys and the broker's queue.

    A snapshot is what a refusal could have changed, and nothing else: the session's worker
    renews its leases and sweeps meanwhile (scripts run, and its lease keys come and go),
    so neither the count of scripts run nor the size of the database can tell."""

    def __init__(self, env: Env) -> None:
        self.store = redis.Redis.from_url(env.store)
        self.broker = redis.Redis.from_url(env.broker)

    def snapshot(self) -> tuple[frozenset[bytes], int]:
        return kept_keys(self.store), self.broker.llen("celery")


@pytest.mark.parametrize(
    "bad, error",
    [
        (SAMPLE.hex, KindError),
        (str(SAMPLE).upper(), KindError),
        ("task-42", KindError),
        ("", InvalidIdError),
        (42, InvalidIdError),
        (str(SAMPLE) + "x" * 200, InvalidIdError),
        (str(SAMPLE) + "\n", InvalidIdError),
        ("\u200b" + str(SAMPLE), InvalidIdError),
        (str(SAMPLE) + "\u202e", InvalidIdError),
    ],
)
@pytest.mark.parametrize("where", ["child", "parent", "task_id", "nested"])
def test_refused_ids_leave_no_key_and_publish_nothing(
    proj: Any, env: Env, worker: Any, how: str, bad: Any, error: type[Exception], where: str
) -> None:
    probe = Probe(env)
    good = proj.add.s(1, 1).set(task_id=celery_uuid())
    parent = proj.tsum.s().set(task_id=celery_uuid())
    options: dict[str, Any] = {}
    if where == "child":
        sig = flow(parent, [good, proj.add.s(2, 2).set(task_id=bad)])
    elif where == "parent":
        sig = flow(proj.tsum.s().set(task_id=bad), [good])
    elif where == "task_id":
        sig, options = flow(proj.tsum.s(), [good]), {"task_id": bad}
    else:
        inner = flow(proj.tsum.s().set(task_id=bad), [proj.add.s(3, 3)])
        sig = flow(parent, [good, inner])
    keys, messages = probe.snapshot()
    with pytest.raises(error):
        run(sig, how, **options)
    keys_after, messages_after = probe.snapshot()
    assert keys_after <= keys, sorted(keys_after - keys)  # no key written (some may expire)
    assert messages_after <= messages  # nothing published (the worker may take what was there)
    for job_id in (good.options["task_id"], parent.options["task_id"]):
        assert rows_of(probe.store, job_id) == []


def test_a_second_flow_with_job_plus_a_taken_uuid_is_refused(
    proj: Any, worker: Any, env: Env, gate: str
) -> None:
    probe = Probe(env)
    u = celery_uuid()
    first = flow(proj.tsum.s(), [proj.gated.s(1, gate).set(task_id=u)]).apply_async()
    wait_for(lambda: first.dependencies().outstanding == 1)
    wait_for(lambda: probe.broker.llen("celery") == 0)
    dbsize = probe.store.dbsize()
    with pytest.raises(FlowExistsError):
        flow(proj.tsum.s(), [proj.add.s(1, 1).set(task_id="JOB" + u)]).apply_async()
    assert probe.broker.llen("celery") == 0 and probe.store.dbsize() == dbsize
    probe.store.set(gate, 1)
    assert first.get(timeout=TIMEOUT) == 1


def test_the_scripts_gate_takes_a_celery_uuid_and_refuses_another_form(
    scripts: Any, db: redis.Redis
) -> None:
    queue = "q"
    u = celery_uuid()
    parent, child = celery_uuid(), u
    keys = [
        f"emq:{{{queue}}}:JOB{parent}",
        f"emq:{{{queue}}}:JOB{parent}:dependencies",
        f"emq:{{{queue}}}:pending",
        f"emq:{{{queue}}}:recent",
        f"emq:{{{queue}}}:counters",
        f"emq:{{{queue}}}:JOB{child}",
    ]
    argv = [parent, "p", "1", packed([child, "c"]), "1000", "10"]
    for bad in (child.upper(), uuid.UUID(child).hex):
        with pytest.raises(KindError, match="EMQKIND"):
            scripts._run("enqueue_flow", keys, [parent, "p", "1", packed([bad, "c"]), "1000", "10"])
        assert db.dbsize() == 0
    scripts._run("enqueue_flow", keys, argv)
    assert db.hget(keys[0], "state") == b"awaiting_children"
    assert db.zrange(keys[2], 0, -1) == [child.encode()]  # members are the jobs' own ids
