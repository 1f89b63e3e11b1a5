"""Flows run eagerly: ``flow(...).apply()`` and ``task_always_eager``, with no Redis at all.

Each test makes its own app on kombu's in-memory broker with no result backend and no Redis
URL (``eager_app``), or one whose flow store names a port where nothing listens
(``unreachable_app``): any Redis command would fail, so a passing test shows that none was
sent. The values are compared with what ``chord`` gives on the same app, and the policies
with what a worker does (tests/worker/test_policies.py).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
from celery import Celery, chain, chord, group
from celery.result import EagerResult

import celery_echomq
from celery_echomq import ConfigError, FlowFailed, FlowResult, flow


class Tasks(NamedTuple):
    app: Any
    add: Any
    tsum: Any
    boom: Any
    collect: Any
    reads_own: Any
    errback: Any
    calls: list[Any]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _queued(app: Celery, queue: str) -> int:
    """Messages waiting in ``queue`` on the app's broker (0 if it was never declared)."""
    from amqp.exceptions import ChannelError

    with app.connection_for_write() as conn:
        try:
            return int(conn.default_channel.queue_declare(queue, passive=True).message_count)
        except ChannelError:
            return 0


def _make(app: Celery) -> Tasks:
    calls: list[Any] = []

    @app.task(shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(shared=False)
    def tsum(values: list[int]) -> int:
        return sum(values)

    @app.task(shared=False)
    def boom(message: str = "boom") -> None:
        raise ValueError(message)

    @app.task(shared=False)
    def collect(values: list[Any], tag: str = "") -> dict[str, Any]:
        calls.append(("collect", tag, values))
        return {"values": values, "tag": tag}

    @app.task(bind=True, shared=False)
    def reads_own(self: Any, values: list[Any]) -> dict[str, Any]:
        return {
            "values": values,
            "children": celery_echomq.children_values(self.request.id),
            "dependencies": list(celery_echomq.dependencies(self.request.id)),
            "ignored": celery_echomq.ignored_failures(self.request.id),
        }

    @app.task(shared=False)
    def errback(task_id: str) -> None:
        calls.append(("errback", task_id))

    return Tasks(app, add, tsum, boom, collect, reads_own, errback, calls)


@pytest.fixture
def eager_app() -> Iterator[Tasks]:
    """task_always_eager, the in-memory broker, no result backend, no Redis URL at all."""
    app = Celery("eager", broker="memory://", set_as_current=False)
    app.conf.task_always_eager = True
    celery_echomq.install(app)
    yield _make(app)
    app.close()


@pytest.fixture
def unreachable_app() -> Iterator[Tasks]:
    """Not eager; the flow store names a port where nothing listens (only apply() works)."""
    app = Celery("apply", broker="memory://", set_as_current=False)
    app.conf.echomq_redis_url = f"redis://127.0.0.1:{_closed_port()}/0"
    app.conf.echomq_store_retry_timeout = 0
    celery_echomq.install(app)
    yield _make(app)
    app.close()


def test_apply_runs_the_children_then_the_parent_as_chord_apply_does(
    unreachable_app: Tasks,
) -> None:
    t = unreachable_app
    children = [t.add.s(i, i) for i in range(5)]
    res = flow(t.tsum.s(), children).apply()
    expected = chord([t.add.s(i, i) for i in range(5)], t.tsum.s()).apply().get()
    assert isinstance(res, FlowResult) and isinstance(res, EagerResult)
    assert res.get() == expected == 20
    assert res.state == "SUCCESS" and res.successful()
    assert res.id.startswith("JOB")
    assert sorted(res.children_values().values()) == [0, 2, 4, 6, 8]
    assert res.dependencies() == (0, 5, 0, 0)
    assert res.ignored_failures() == {}
    # The same store would refuse any command: a non-eager apply_async still needs it.
    with pytest.raises(celery_echomq.StoreUnavailableError):
        flow(t.tsum.s(), [t.add.s(1, 1)]).apply_async()


def test_frozen_ids_are_the_ones_the_eager_run_uses(unreachable_app: Tasks) -> None:
    t = unreachable_app
    first, second = t.add.s(1, 1), t.add.s(2, 2)
    f = flow(t.tsum.s(), [first, second])
    frozen = f.freeze()
    res = f.apply()
    assert res.id == frozen.id
    assert res.children_values() == {
        first.options["task_id"]: 2,
        second.options["task_id"]: 4,
    }


def test_always_eager_runs_apply_async_delay_and_call_in_process_without_redis(
    eager_app: Tasks,
) -> None:
    t = eager_app
    f = flow(t.tsum.s(), [t.add.s(1, 2), t.add.s(3, 4)])
    assert f.apply_async().get() == 10
    assert f.delay().get() == 10
    assert f().get() == 10
    # Partial args reach every child, as a chord header's do.
    assert flow(t.tsum.s(), [t.add.s(1), t.add.s(2)]).apply_async((10,)).get() == 23
    # There is no store at all: its first use says what to set.
    with pytest.raises(ConfigError, match="echomq_redis_url"):
        _ = celery_echomq.get_state(t.app).client


def test_a_missing_redis_url_is_named_at_first_use_unless_the_app_is_eager() -> None:
    app = Celery("plain", broker="memory://", set_as_current=False)

    @app.task(shared=False)
    def tsum(values: Any = ()) -> int:
        return sum(values)

    # install() reads nothing yet, as Celery reads app.conf lazily: the configuration may
    # come later (config_from_object, a test plugin).
    celery_echomq.install(app)
    with pytest.raises(ConfigError, match=r"needs a Redis URL: set app.conf.echomq_redis_url"):
        flow(tsum.s(), [tsum.s()]).apply_async()
    assert _queued(app, "celery") == 0
    # A value that is not a Redis URL is refused even when eager.
    app.conf.task_always_eager = True
    app.conf.echomq_redis_url = "amqp://localhost"
    with pytest.raises(ConfigError, match="is not a Redis URL"):
        _ = celery_echomq.install(app).settings
    app.close()


def test_install_may_come_before_the_configuration() -> None:
    app = Celery("late", set_as_current=False)
    celery_echomq.install(app)

    class Config:
        broker_url = "memory://"
        echomq_redis_url = "redis://127.0.0.1:1/5"
        echomq_stall_timeout = 12

    app.config_from_object(Config)
    app.finalize()  # what a worker does first: the settings are read here
    state = celery_echomq.get_state(app)
    assert state.settings.redis_url == "redis://127.0.0.1:1/5"
    assert state.settings.stall_timeout == 12
    app.close()


def test_an_app_installed_eager_then_not_fails_clearly_before_sending_anything(
    eager_app: Tasks,
) -> None:
    t = eager_app
    t.app.conf.task_always_eager = False
    with pytest.raises(ConfigError, match="needs a Redis URL"):
        flow(t.tsum.s(), [t.add.s(1, 1)]).apply_async()
    assert _queued(t.app, "celery") == 0
    # apply() still runs in process.
    assert flow(t.tsum.s(), [t.add.s(1, 1)]).apply().get() == 2


def test_fail_policy_raises_flow_failed_naming_the_child_and_runs_error_callbacks(
    eager_app: Tasks,
) -> None:
    t = eager_app
    bad = t.boom.s("disk full")
    f = flow(t.collect.s(tag="fail"), [t.add.s(1, 1), bad, t.add.s(2, 2)])
    f.on_error(t.errback.s())
    f.freeze()  # assigns every job id, so the test knows the bad child's
    res = f.apply_async()
    with pytest.raises(FlowFailed) as info:
        res.get()
    assert info.value.child_id == bad.options["task_id"]
    assert info.value.error == "ValueError: disk full"
    assert str(info.value) == (
        f"flow {res.id}: child {bad.options['task_id']} failed: ValueError: disk full"
    )
    assert res.state == "FAILURE" and res.failed()
    # The children after the failed one still ran and were recorded; the parent never ran.
    assert sorted(res.children_values().values()) == [2, 4]
    assert res.dependencies() == (0, 2, 1, 0)  # every child finished, as on a worker
    assert res.failed_children() == {bad.options["task_id"]: "ValueError: disk full"}
    assert info.value.flow_id == res.id
    assert ("errback", res.id) in t.calls
    assert not [c for c in t.calls if c[0] == "collect"]


def test_fail_policy_raises_from_apply_with_task_eager_propagates(eager_app: Tasks) -> None:
    t = eager_app
    t.app.conf.task_eager_propagates = True
    with pytest.raises(FlowFailed, match="ValueError: boom"):
        flow(t.tsum.s(), [t.add.s(1, 1), t.boom.s()]).apply_async()
    # A failure the policy resolves is not an error of the flow.
    res = flow(t.tsum.s(), [t.add.s(1, 1), t.boom.s().set(parent_policy="ignore")]).apply()
    assert res.get() == 2


def test_ignore_policy_resolves_the_child_and_records_its_error(eager_app: Tasks) -> None:
    t = eager_app
    bad = t.boom.s("bad page").set(parent_policy="ignore")
    f = flow(t.reads_own.s(), [t.add.s(1, 1), bad, t.add.s(2, 2)])
    f.freeze()
    res = f.apply_async()
    value = res.get()
    bad_id = bad.options["task_id"]
    assert value["values"] == [2, 4]
    assert value["ignored"] == {bad_id: "ValueError: bad page"}
    assert sorted(value["children"].values()) == [2, 4]
    assert value["dependencies"] == [0, 2, 0, 1]
    assert res.ignored_failures() == {bad_id: "ValueError: bad page"}
    assert res.failed_children() == {bad_id: "ValueError: bad page"}
    assert res.dependencies() == (0, 2, 0, 1)


def test_flow_default_policy_applies_to_children_that_set_none(eager_app: Tasks) -> None:
    t = eager_app
    res = flow(t.tsum.s(), [t.boom.s(), t.add.s(2, 2), t.boom.s()], policy="ignore")()
    assert res.get() == 4
    assert len(res.ignored_failures()) == 2


def test_remove_policy_resolves_the_child_and_keeps_its_error_out_of_the_values(
    eager_app: Tasks,
) -> None:
    t = eager_app
    bad = t.boom.s().set(parent_policy="remove")
    f = flow(t.reads_own.s(), [t.add.s(1, 1), bad, t.add.s(2, 2)])
    f.freeze()
    res = f.apply_async()
    value = res.get()
    assert value["values"] == [2, 4]
    assert value["ignored"] == {} and res.ignored_failures() == {}
    assert res.failed_children() == {bad.options["task_id"]: "ValueError: boom"}
    assert res.dependencies() == (0, 2, 1, 0)
    values, after = res.children_values(count=1)
    rest, end = res.children_values(cursor=after, count=1)
    assert len(values) == len(rest) == 1 and end is None
    assert {**values, **rest} == res.children_values()


def test_continue_policy_releases_the_parent_at_once_and_never_again(eager_app: Tasks) -> None:
    t = eager_app
    watchdog = t.boom.s("timeout").set(parent_policy="continue")
    later = t.add.s(5, 5)
    f = flow(t.collect.s(tag="continue"), [t.add.s(1, 1), watchdog, later])
    f.freeze()
    res = f.apply_async()
    # Released when the watchdog failed, with the values completed before it.
    assert res.get() == {"values": [2], "tag": "continue"}
    assert [c for c in t.calls if c[0] == "collect"] == [("collect", "continue", [2])]
    # The child after it still ran and is recorded.
    assert res.children_values()[later.options["task_id"]] == 10
    assert res.dependencies() == (0, 2, 1, 0)


def test_parents_own_failure_is_its_error(eager_app: Tasks) -> None:
    t = eager_app
    res = flow(t.boom.si("parent broke"), [t.add.s(1, 1)]).apply()
    with pytest.raises(ValueError, match="parent broke"):
        res.get()
    assert res.state == "FAILURE"
    assert list(res.children_values().values()) == [2]


def test_immutable_parent_gets_no_values(eager_app: Tasks) -> None:
    t = eager_app
    assert flow(t.tsum.si([7, 8]), [t.add.s(1, 1)]).apply_async().get() == 15


def test_empty_flow_runs_its_parent_at_once(eager_app: Tasks) -> None:
    t = eager_app
    res = flow(t.tsum.s(), []).apply_async()
    assert res.get() == 0
    assert res.dependencies() == (0, 0, 0, 0)


def test_nested_flow_is_equivalent_to_the_nested_chord(eager_app: Tasks) -> None:
    t = eager_app
    inner_chord = chord([t.add.s(i, i) for i in range(3)], t.tsum.s())
    expected = chord([inner_chord, t.add.s(10, 10)])(t.tsum.s()).get()
    inner = flow(t.tsum.s(), [t.add.s(i, i) for i in range(3)])
    outer = flow(t.tsum.s(), [inner, t.add.s(10, 10)])
    outer.freeze()
    res = outer.apply_async()
    assert res.get() == expected == 26
    # A nested flow contributes its parent's value, under its parent's id.
    assert res.children_values()[inner.parent.options["task_id"]] == 6


def test_three_level_tree_fans_in_level_by_level(eager_app: Tasks) -> None:
    t = eager_app
    innermost = flow(t.tsum.s(), [t.add.s(3, 3), t.add.s(4, 4)])
    middle = flow(t.tsum.s(), [t.add.s(2, 2), innermost])
    outer = flow(t.collect.s(tag="tree"), [t.add.s(1, 1), middle])
    res = outer.apply_async()
    assert res.get()["values"] == [2, 18]
    assert res.dependencies() == (0, 2, 0, 0)


def test_failure_inside_a_nested_flow_fails_the_outer_flow_under_fail(eager_app: Tasks) -> None:
    t = eager_app
    inner = flow(t.tsum.s(), [t.add.s(1, 1), t.boom.s("deep")])
    outer = flow(t.tsum.s(), [t.add.s(5, 5), inner])
    outer.freeze()
    res = outer.apply_async()
    with pytest.raises(FlowFailed) as info:
        res.get()
    assert info.value.child_id == inner.parent.options["task_id"]
    assert info.value.error.startswith("FlowFailed: flow ")
    assert "ValueError: deep" in str(info.value)


def test_a_nested_flow_can_be_ignored_by_its_outer_flow(eager_app: Tasks) -> None:
    t = eager_app
    inner = flow(t.tsum.s(), [t.boom.s("deep")]).set(parent_policy="ignore")
    outer = flow(t.tsum.s(), [t.add.s(5, 5), inner])
    outer.freeze()
    res = outer.apply_async()
    assert res.get() == 10
    ((failed_id, error),) = res.ignored_failures().items()
    assert failed_id == inner.parent.options["task_id"]
    assert error.startswith("FlowFailed") and "ValueError: deep" in error


def test_flows_inside_chains_groups_and_chord_headers(eager_app: Tasks) -> None:
    t = eager_app
    # chain(flow, task): the parent's value goes on.
    assert chain(flow(t.tsum.s(), [t.add.s(1, 1), t.add.s(2, 2)]), t.add.s(100))().get() == 106
    # chain(task, flow): the previous value reaches every child.
    assert (chain(t.add.s(1, 2), flow(t.tsum.s(), [t.add.s(1), t.add.s(2)]))).delay().get() == 9
    # A flow in the middle of a chain.
    middle = chain(t.add.s(1, 1), flow(t.tsum.s(), [t.add.s(10)]), t.add.s(1000))
    assert middle.apply_async().get() == 1012
    # group([flow, flow]).
    both = group([flow(t.tsum.s(), [t.add.s(1, 1)]), flow(t.tsum.s(), [t.add.s(2, 2)])])
    assert both.apply_async().get() == [2, 4]
    # A flow in a chord's header.
    header = [flow(t.tsum.s(), [t.add.s(1, 1), t.add.s(2, 2)]), t.add.s(10, 10)]
    assert chord(header)(t.tsum.s()).get() == 26
    # flow | task
    assert (flow(t.tsum.s(), [t.add.s(3, 3)]) | t.add.s(1)).apply_async().get() == 7


def test_link_on_the_flow_goes_to_the_parent(eager_app: Tasks) -> None:
    t = eager_app
    f = flow(t.tsum.s(), [t.add.s(1, 1), t.add.s(2, 2)])
    f.link(t.collect.s(tag="linked"))
    assert f.apply_async().get() == 6
    assert ("collect", "linked", 6) in t.calls


def test_add_children_grows_an_eager_flow_as_on_a_worker(eager_app: Tasks) -> None:
    t = eager_app

    @t.app.task(shared=False)
    def spawn(n: int) -> int:
        # Siblings of this child, added before it completes: its parent cannot run before them.
        celery_echomq.add_children([t.add.s(n, k) for k in (1, 2)])
        return n

    seen: list[str] = []

    @t.app.task(bind=True, shared=False)
    def spawn_by_id(self: Any, parent_id: str) -> int:
        # The other form: naming the parent, while it is held; a repeated add adds nothing.
        sig = t.add.s(100, 0).set(task_id=f"JOB{'a' * 32}")
        seen.extend(celery_echomq.add_children([sig], parent_id=parent_id))
        seen.extend(celery_echomq.add_children([sig], parent_id=parent_id))
        return 0

    parent = t.collect.s()
    f = flow(parent, [spawn.s(10), t.add.s(0, 1)])
    res = f.apply()
    # The added children's values follow the existing children's, in the order added.
    assert res.get()["values"] == [10, 1, 11, 12]
    assert res.dependencies() == (0, 4, 0, 0)
    # A nested flow may be added too, and the reads include what was added.
    nested = flow(t.tsum.s(), [t.add.s(2, 2), t.add.s(3, 3)])

    @t.app.task(shared=False)
    def spawn_flow() -> int:
        celery_echomq.add_children([nested])
        return 1

    assert flow(t.tsum.s(), [spawn_flow.s()]).apply().get() == 1 + 10
    parent_id = f"JOB{'b' * 32}"
    res = flow(t.collect.s().set(task_id=parent_id), [spawn_by_id.si(parent_id)]).apply()
    assert res.id == parent_id
    assert res.get()["values"] == [0, 100] and seen == [f"JOB{'a' * 32}"]


def test_add_children_to_a_finished_eager_flow_is_refused(eager_app: Tasks) -> None:
    t = eager_app
    res = flow(t.tsum.s(), [t.add.s(1, 1)]).apply()
    with pytest.raises(celery_echomq.FlowClosedError, match=res.id):
        res.add_children([t.add.s(2, 2)])

    refused: list[BaseException] = []

    @t.app.task(shared=False)
    def late() -> int:
        # Under continue the parent ran when the failed child settled: the flow is closed.
        try:
            celery_echomq.add_children([t.add.s(5, 5)])
        except celery_echomq.FlowClosedError as exc:
            refused.append(exc)
        return 0

    f = flow(t.collect.s(), [t.boom.s().set(parent_policy="continue"), late.s()])
    res = f.apply()
    assert res.get()["values"] == []
    assert len(refused) == 1 and "is released" in str(refused[0])
    assert res.dependencies() == (0, 1, 1, 0)
