"""Bad input raises before any Redis command or broker publish, and changes nothing."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis

from celery_echomq import (
    DuplicateIdError,
    FlowExistsError,
    InvalidIdError,
    KindError,
    PolicyError,
    flow,
)
from celery_echomq.store.keyspace import Keyspace, check_id, new_job_id
from tests.helpers import Env, wait_for


@pytest.mark.parametrize(
    "bad",
    ["", "JOB" + "x" * 200, "JOB{a}", "JOB}", "JOBa:b", "JOB a", "JOB\ta", "JOB\x00", "JOB\x7f"],
)
def test_ill_formed_ids_are_invalid(bad: str) -> None:
    with pytest.raises(InvalidIdError) as info:
        check_id(bad)
    assert not isinstance(info.value, KindError)
    assert "allowed" in str(info.value)


@pytest.mark.parametrize("bad", ["abc", "job123", "7d3f1c2e-uuid", "JO"])
def test_non_job_ids_raise_kind_error(bad: str) -> None:
    with pytest.raises(KindError, match="JOB"):
        check_id(bad)
    assert issubclass(KindError, ValueError)


def test_key_builder_tags_every_key_with_its_queue() -> None:
    keys = Keyspace("emq")
    assert keys.job_key("default", "JOB1") == "emq:{default}:JOB1"
    assert keys.queue_key("default", "pending") == "emq:{default}:pending"
    assert keys.flow_keys("q", "JOB1")[0] == "emq:{q}:JOB1:dependencies"
    with pytest.raises(InvalidIdError):
        keys.job_key("a}b", "JOB1")  # a queue name cannot escape its hash tag either


class Probe:
    """What a bad flow must leave untouched: store keys, broker queue, script calls."""

    def __init__(self, env: Env) -> None:
        self.store = redis.Redis.from_url(env.store)
        self.broker = redis.Redis.from_url(env.broker)

    def snapshot(self) -> tuple[int, int, int]:
        stats = self.store.info("commandstats")
        scripts = sum(
            int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("eval", "evalsha")
        )
        # Less what the worker's recovery loop records on its own (emq:workers, a queue's
        # per-minute samples): it may write the first of them at any time.
        own = sum(1 for _ in self.store.scan_iter(match="emq:{*}:minutes", count=1000))
        own += int(self.store.exists("emq:workers"))
        return self.store.dbsize() - own, self.broker.llen("celery"), scripts


@pytest.fixture
def probe(env: Env, worker: Any) -> Probe:
    return Probe(env)


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda p: flow(p.tsum.s().set(task_id="abc"), [p.add.s(1, 1)]), KindError),
        (lambda p: flow(p.tsum.s(), [p.add.s(1, 1).set(task_id="nope-1")]), KindError),
        (lambda p: flow(p.tsum.s(), [p.add.s(1, 1).set(task_id="JOB{x}")]), InvalidIdError),
        (lambda p: flow(p.tsum.s(), [p.add.s(1, 1).set(task_id="JOB:x")]), InvalidIdError),
        (lambda p: flow(p.tsum.s(), [p.add.s(1, 1).set(task_id="")]), InvalidIdError),
        (
            lambda p: flow(p.tsum.s(), [p.add.s(1, 1).set(task_id="JOB" + "9" * 300)]),
            InvalidIdError,
        ),
        (
            lambda p: flow(
                p.tsum.s(),
                [p.add.s(1, 1).set(task_id="JOBdup"), p.add.s(2, 2).set(task_id="JOBdup")],
            ),
            DuplicateIdError,
        ),
        (
            lambda p: flow(
                p.tsum.s().set(task_id="JOBsame"), [p.add.s(1, 1).set(task_id="JOBsame")]
            ),
            DuplicateIdError,
        ),
    ],
)
def test_bad_ids_raise_before_any_redis_command_or_publish(
    proj: Any, probe: Probe, make: Any, error: type[Exception]
) -> None:
    before = probe.snapshot()
    with pytest.raises(error):
        make(proj).apply_async()
    assert probe.snapshot() == before


def test_unknown_policy_raises_at_flow_time_listing_the_allowed(proj: Any) -> None:
    with pytest.raises(PolicyError, match="fail, ignore, remove, continue"):
        flow(proj.tsum.s(), [proj.add.s(1, 1)], policy="skip")
    with pytest.raises(ValueError, match="allowed"):
        flow(proj.tsum.s(), [proj.add.s(1, 1).set(parent_policy="retry")])


def test_existing_parent_id_is_refused_and_nothing_is_published(
    proj: Any, probe: Probe, store: redis.Redis
) -> None:
    gate = f"gate:{uuid.uuid4().hex}"
    parent_id = new_job_id()
    first = flow(proj.tsum.s().set(task_id=parent_id), [proj.gated.s(5, gate)]).apply_async()
    wait_for(lambda: first.dependencies().outstanding == 1)
    wait_for(lambda: probe.broker.llen("celery") == 0)
    row = f"emq:{{celery}}:{parent_id}"
    held = store.hgetall(row), store.get(f"{row}:dependencies")
    second = flow(proj.tsum.s().set(task_id=parent_id), [proj.add.s(1, 1)])
    second.freeze()
    try:
        with pytest.raises(FlowExistsError, match=parent_id):
            second.apply_async()
        assert probe.broker.llen("celery") == 0
        # The first flow is untouched and the second left no key.
        assert (store.hgetall(row), store.get(f"{row}:dependencies")) == held
        assert store.keys(f"*{second.children[0].options['task_id']}*") == []
    finally:
        store.set(gate, 1)
    assert first.get(timeout=60) == 5
