"""Test fixtures: a real redis-server (or ECHOMQ_TEST_REDIS_URL) and real `celery worker`
subprocesses running tests/proj.py.

Every test that runs a worker subprocess is marked ``e2e`` (here, by the fixtures it uses, or
by its module). With ``ECHOMQ_TEST_WORKER=inprocess`` (``python3 dev.py test --fast``, which
also deselects ``e2e``), the ``worker`` fixture is an in-process worker instead (the
``echomq_worker`` of the pytest plugin users load, ``celery_echomq.testing``: Celery's
``start_worker``, threads pool), for the canvas and policy tests: what needs no crash runs in
seconds. ``redis_base`` is that plugin's ``echomq_redis_url``.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_echomq.embedded import WorkerProcess

ROOT = Path(__file__).resolve().parent.parent
# Worker logs of this test session (kept after the run for reading a failure).
LOGDIR = Path(os.environ.get("ECHOMQ_TEST_LOGDIR") or tempfile.mkdtemp(prefix="echomq-logs-"))
# One directory per pytest-xdist process: each has its own "session" worker and logs.
LOGDIR = LOGDIR / os.environ.get("PYTEST_XDIST_WORKER", "")
LOGDIR.mkdir(parents=True, exist_ok=True)  # ECHOMQ_TEST_LOGDIR may name a new directory


@pytest.fixture(scope="session")
def redis_base(echomq_redis_url: str) -> str:
    # The plugin's own fixture (celery_echomq.testing): ECHOMQ_TEST_REDIS_URL, else a private
    # redis-server for the session.
    return echomq_redis_url


class Env:
    """The URLs one test run uses: broker, result backend and flow store on separate DBs."""

    def __init__(self, base: str, broker: str | None = None) -> None:
        self.base = base
        self.broker = broker or f"{base}/11"
        # ECHOMQ_TEST_SHARED_DB=1: the result backend on the store's database, where the store
        # writes a flow job's result itself (celery_echomq/store/results.py). For the behaviour
        # tests: those that list the store's keys or watch its commands (test_cli's forget and
        # show) leave Celery's result keys out; those that need the two apart (test_e2e_held's
        # MONITOR of the store's database, some of test_store_results) skip with
        # ``needs_own_backend_db``.
        self.shared = os.environ.get("ECHOMQ_TEST_SHARED_DB") == "1"
        self.backend = f"{base}/13" if self.shared else f"{base}/12"
        self.store = f"{base}/13"

    def environ(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            ECHOMQ_T_BROKER=self.broker,
            ECHOMQ_T_BACKEND=self.backend,
            ECHOMQ_T_STORE=self.store,
            PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        )
        env.update(extra)
        return env


@pytest.fixture(scope="session")
def env(redis_base: str) -> Env:
    e = Env(redis_base)
    os.environ.update(ECHOMQ_T_BROKER=e.broker, ECHOMQ_T_BACKEND=e.backend, ECHOMQ_T_STORE=e.store)
    for url in (e.broker, e.backend, e.store):
        redis.Redis.from_url(url).flushdb()
    return e


@pytest.fixture(scope="session")
def proj(env: Env) -> Any:
    from tests import proj as module

    return module


@pytest.fixture
def store(env: Env) -> redis.Redis:
    return redis.Redis.from_url(env.store)


class Worker(WorkerProcess):
    """A real `celery worker` subprocess (prefork) running tests/proj.py, started at once."""

    def __init__(
        self,
        env: Env,
        *,
        queues: str = "celery",
        concurrency: int = 2,
        name: str = "",
        pool: str = "prefork",
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.name = name or f"w{uuid.uuid4().hex[:8]}"
        super().__init__(
            "tests.proj",
            log=LOGDIR / f"{self.name}.log",
            cwd=ROOT,
            env=env.environ(**(extra_env or {})),
            queues=queues,
            concurrency=concurrency,
            name=self.name,
            pool=pool,
        )
        self.start()


def worker_pair(
    env: Env, first: str, second: str, name: str, extra_env: dict[str, str]
) -> tuple[Worker, Worker]:
    """A worker on ``first`` (concurrency 2) and one on ``second`` (1); none left if one fails."""
    one = Worker(env, queues=first, concurrency=2, name=f"{name}-1", extra_env=extra_env)
    try:
        two = Worker(env, queues=second, concurrency=1, name=f"{name}-2", extra_env=extra_env)
    except BaseException:
        one.stop()
        raise
    return one, two


INPROCESS = os.environ.get("ECHOMQ_TEST_WORKER") == "inprocess"
# The modules whose ``worker`` tests run on an in-process worker in the fast tier.
INPROCESS_MODULES = frozenset({"test_canvas", "test_policies"})
# Fixtures that start worker subprocesses whatever the tier.
SUBPROCESS_FIXTURES = frozenset({"start_worker", "cluster_workers", "rabbit_workers"})

# --- Markers: what a test costs, assigned here only (pyproject.toml lists them) -----------------
#
# e2e: runs real `celery worker` subprocesses (the fixtures above, or its module's pytestmark).
# faults: kills a real process or server (a crash, a failover): these modules, and any test
#   whose name says it kills, crashes or fails over.
# browser: drives Chromium (the ``browser`` fixture).
# slow: a soak, a large flow, a backlog or an example run, or one of the tests below that take
#   15 s and more on 2 cores.
# result_path: behaves differently where the result backend is the store's own database
#   (ECHOMQ_TEST_SHARED_DB=1: the store writes flow jobs' results): CI's second pass.
# smoke: the few tests per concern that ``python3 dev.py test`` runs on real workers.
# A new module gets e2e from its fixtures and faults from its tests' names; the others it gets
# by being added to a table here.
FAULT_MODULES = frozenset(
    {"test_recovery", "test_exactly_once", "test_canvas_faults", "test_failover", "test_soak"}
)
FAULT_NAME = re.compile(r"kill|crash|died|failover")
SLOW_MODULES = frozenset({"test_soak", "test_large", "test_backlog", "test_examples"})
SLOW_TESTS = frozenset(
    {
        "test_failover_sentinel_without_min_replicas_reports_what_was_lost",
        "test_failover_sentinel_with_min_replicas_loses_nothing",
        "test_failover_cluster_master_killed_mid_flow",
        "test_a_worker_that_could_not_reach_the_store_is_repaired_once_it_is_back",
        "test_tls_store_rediss_url",
        "test_steps_released_by_a_pool_process_that_died_before_dispatching_them_are_dispatched",
        "test_rabbit_messages_purged_from_the_queue_are_republished_once",
        "test_rabbit_a_backlog_of_ten_stall_timeouts_republishes_nothing",
        "test_children_replaced_by_a_task_a_chain_a_group_a_chord_and_a_flow",
        "test_the_dashboard_pages_a_flow_of_100000_children_in_chromium",
        "test_cancel_and_forget_a_large_flow_a_chunk_per_script_call",
        "test_doctor_counts_the_sentinels_and_replicas_of_a_sentinel_store",
    }
)
RESULT_PATH_MODULES = frozenset(
    {
        "test_store_results",
        "test_backends",
        "test_fused",
        "test_e2e_basic",
        "test_e2e_held",
        "test_canvas",
        "test_canvases",
        "test_celery_chords",
        "test_chains",
        "test_celery_ids",
        "test_group_errbacks",
        "test_policies",
        "test_replace",
        "test_cli",
        "test_repair",
    }
)
# The smoke, per concern: (module, test function); every parametrization of it runs.
SMOKE = {
    "flows": [
        ("test_e2e_basic", "test_parent_gets_values_in_childrens_order"),
        ("test_e2e_basic", "test_ten_child_flow_returns_what_the_equivalent_chord_returns"),
        ("test_e2e_held", "test_parent_is_held_until_the_last_child_completes"),
        ("test_lineage", "test_every_job_of_a_flow_has_the_flow_as_its_root"),
    ],
    "canvas": [
        ("test_canvas", "test_flow_in_the_middle_of_a_chain"),
        ("test_canvases", "test_a_chain_child_under_ignore_is_left_out"),
        ("test_chains", "test_a_redelivered_step_is_counted_once"),
        ("test_celery_ids", "test_a_frozen_child_keeps_its_celery_id"),
        ("test_group_errbacks", "test_each_failing_task_of_a_group_parent_runs_the_errbacks_once"),
        ("test_chains", "test_a_step_whose_message_was_never_published_is_recovered"),
        ("test_celery_chords", "test_chord__error_propagates_from_chord"),
        (
            "test_replace",
            "test_a_replaced_parent_of_a_nested_flow_gives_its_outer_flow_the_replacements_value",
        ),
    ],
    "policies": [
        ("test_policies", "test_ignore_policy_resolves_the_child_and_records_its_error"),
        ("test_policies", "test_retries_that_end_in_success_count_the_child_once"),
    ],
    "queues and slots": [
        ("test_cross_queue", "test_children_on_other_queues_keep_their_keys_on_their_slots"),
        ("test_cluster", "test_same_queue_flow_on_cluster"),
    ],
    "growing flows": [
        ("test_grow", "test_a_child_adds_siblings_and_the_parent_gets_every_value_in_order"),
    ],
    "integrity": [
        ("test_integrity", "test_a_task_no_worker_registered_fails_its_flow_at_once"),
    ],
    "exactly once": [
        ("test_exactly_once", "test_a_duplicate_delivery_racing_the_first_is_skipped"),
        (
            "test_exactly_once",
            "test_pool_process_killed_mid_child_is_redelivered_and_credited_once",
        ),
        (
            "test_canvas_faults",
            "test_a_chain_step_whose_pool_process_died_is_redelivered_and_counted_once",
        ),
    ],
    "recovery": [
        ("test_recovery", "test_every_message_lost_in_the_broker_is_republished"),
        ("test_recovery", "test_worker_killed_mid_child_the_child_is_republished"),
    ],
    "failover": [
        ("test_failover", "test_failover_sentinel_with_min_replicas_loses_nothing"),
    ],
    "deadlines": [
        ("test_deadlines", "test_a_nested_flow_keeps_its_own_deadline"),
    ],
    "results": [
        ("test_store_results", "test_a_failing_child_raises_as_a_chord_child_would"),
        ("test_backends", "test_no_result_backend_flows_run_and_get_says_what_to_set"),
    ],
    "operators": [
        ("test_cli", "test_show_json_gives_the_same_tree_as_data"),
        ("test_repair", "test_retry_reruns_the_failed_children_and_get_returns_the_parents_value"),
        ("test_dashboard", "test_a_held_flow_shows_its_running_child_then_turns_done"),
        ("test_dashboard", "test_api_flows_serves_the_json_of_show"),
        ("test_pages", "test_pages_follow_cursors_and_filter_by_state_the_failed_first"),
        ("test_doctor", "test_doctor_passes_a_good_deployment_and_asks_the_workers"),
    ],
    "tracing": [
        ("test_tracing", "test_a_flow_is_one_trace_from_its_producer_to_its_parent"),
    ],
    "rabbitmq": [
        ("test_rabbit", "test_rabbit_nested_flow"),
    ],
    "examples": [
        ("test_examples", "test_quickstart_prints_the_parents_result"),
    ],
}
SMOKE_TESTS = frozenset(test for tests in SMOKE.values() for test in tests)


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("ECHOMQ_TEST_REDIS_URL") and getattr(config.option, "numprocesses", None):
        raise pytest.UsageError(
            "ECHOMQ_TEST_REDIS_URL gives every test one Redis: pytest-xdist's processes would "
            "empty each other's databases; run with -n 0, or unset it (each process then "
            "starts a redis-server of its own)"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    modules: dict[str, Any] = {}
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        module = item.module.__name__.rpartition(".")[2] if item.module else ""
        function = getattr(item, "originalname", item.name)
        modules[module] = item.module
        in_process = INPROCESS and module in INPROCESS_MODULES
        if names & SUBPROCESS_FIXTURES or ("worker" in names and not in_process):
            item.add_marker(pytest.mark.e2e)
        if module in FAULT_MODULES or FAULT_NAME.search(function):
            item.add_marker(pytest.mark.faults)
        if "browser" in names:
            item.add_marker(pytest.mark.browser)
        if module in SLOW_MODULES or function in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
        if module in RESULT_PATH_MODULES:
            item.add_marker(pytest.mark.result_path)
        if (module, function) in SMOKE_TESTS:
            item.add_marker(pytest.mark.smoke)
    # A smoke test renamed or removed would shrink the smoke unseen.
    missing = sorted(
        f"{m}::{f}" for m, f in SMOKE_TESTS if m in modules and not hasattr(modules[m], f)
    )
    if missing:
        raise pytest.UsageError(
            "tests/conftest.py SMOKE names tests that are not there: " + ", ".join(missing)
        )


@pytest.fixture(scope="session")
def echomq_app(proj: Any) -> Any:
    """The app the plugin's ``echomq_worker`` runs: tests/proj.py."""
    return proj.app


@pytest.fixture(scope="session")
def echomq_app_config(env: Env) -> dict[str, Any]:
    # tests/proj.py reads its URLs from the environment ``env`` set: nothing to change.
    return {}


@pytest.fixture(scope="session")
def worker(env: Env, proj: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    if INPROCESS:
        # The plugin's in-process worker (celery_echomq.testing), as a user's suite has it.
        yield request.getfixturevalue("echomq_worker")
        return
    w = Worker(env, name="session")
    yield w
    w.stop()


@pytest.fixture
def start_worker(env: Env, proj: Any) -> Iterator[Any]:
    started: list[Worker] = []

    def start(**kwargs: Any) -> Worker:
        w = Worker(env, **kwargs)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


def wait_for(predicate: Any, timeout: float = 30, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


def quiet(read: Any) -> Any:
    """What ``read()`` returns once it stays the same over a quarter of a second: a worker
    may still be tidying after a flow settles (its lease loop ends the holds it made on its
    next tick), and a snapshot to compare against must not catch it midway."""
    last = [read()]

    def same() -> bool:
        time.sleep(0.25)
        now = read()
        unchanged = now == last[0]
        last[0] = now
        return unchanged

    wait_for(same, timeout=30)
    return last[0]


# --- Redis Cluster (tests/test_cluster.py) ------------------------------------------------------


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[str]:
    """A private three-master Redis Cluster on loopback: its ``redis+cluster://`` URL."""
    from celery_echomq.embedded import RedisClusterServer

    with RedisClusterServer(masters=3) as cluster:
        yield cluster.url()


@pytest.fixture
def own_queue(env: Env, store: redis.Redis) -> Iterator[Any]:
    """``own_queue(prefix)``: a queue name of this test's own; its flow keys and broker
    messages are removed afterwards, so no other test or worker ever sees it."""
    made: list[str] = []

    def make(prefix: str) -> str:
        made.append(f"{prefix}-{uuid.uuid4().hex[:10]}")
        return made[-1]

    yield make
    broker = redis.Redis.from_url(env.broker)
    for name in made:
        keys = list(store.scan_iter(match=f"emq:{{{name}}}:*", count=1000))
        if keys:
            store.delete(*keys)
        store.srem("emq:queues", name)
        broker.delete(name)


# --- The scripts one by one (test_scripts, test_fan_in, test_repair_scripts, ...) -------------


@pytest.fixture
def db(env: Env) -> Iterator[redis.Redis]:
    """A database of its own (14), emptied before and after: DBSIZE and snapshots of it speak
    of this test alone."""
    client = redis.Redis.from_url(f"{env.base}/14")
    client.flushdb()
    yield client
    client.flushdb()


@pytest.fixture
def scripts(db: redis.Redis) -> Any:
    """The transition scripts on ``db``, under the default key prefix."""
    from celery_echomq.store.keyspace import Keyspace
    from celery_echomq.store.scripts import Scripts

    return Scripts(db, Keyspace("emq"))


needs_own_backend_db = pytest.mark.skipif(
    os.environ.get("ECHOMQ_TEST_SHARED_DB") == "1",
    reason="needs the result backend on a database of its own (ECHOMQ_TEST_SHARED_DB=1)",
)
