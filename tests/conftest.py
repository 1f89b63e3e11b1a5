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

import contextlib
import importlib
import os
import pkgutil
import re
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from tests.helpers import CHROMEDRIVER, CHROMIUM, LOGDIR, REBOUND, TESTS, Env, Served, Worker, ways


def _import_the_package() -> None:
    """Import every module of the package now, while this process has one thread. The
    package is a pytest plugin's distribution, so pytest rewrites each of its modules as it
    is first imported, parsing its source; CPython 3.11's parser can then fail with
    "SystemError: AST constructor recursion depth mismatch" when another thread parses at
    the same moment (a module imported lazily mid-test, beside a worker thread)."""
    package = importlib.import_module("celery_echomq")
    for module in pkgutil.walk_packages(package.__path__, "celery_echomq."):
        with contextlib.suppress(ImportError):  # an optional extra that is not installed
            importlib.import_module(module.name)


_import_the_package()


@pytest.fixture(scope="session")
def redis_base(echomq_redis_url: str) -> str:
    # The plugin's own fixture (celery_echomq.testing): ECHOMQ_TEST_REDIS_URL, else a private
    # redis-server for the session.
    return echomq_redis_url


@pytest.fixture(scope="session")
def env(redis_base: str) -> Env:
    e = Env(redis_base)
    os.environ.update(ECHOMQ_T_BROKER=e.broker, ECHOMQ_T_BACKEND=e.backend, ECHOMQ_T_STORE=e.store)
    from tests.proj import BOOKKEEPING_DB

    for url in (e.broker, e.backend, e.store, f"{e.base}/{BOOKKEEPING_DB}"):
        redis.Redis.from_url(url).flushdb()
    return e


@pytest.fixture(scope="session")
def proj(env: Env) -> Any:
    from tests import proj as module

    return module


@pytest.fixture
def store(env: Env) -> redis.Redis:
    return redis.Redis.from_url(env.store)


@pytest.fixture(autouse=True)
def _gates_opened(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test on the session's store, every gate a task still waits on is opened: a
    test that failed before opening its own would otherwise hold pool processes of the
    session's worker for the tests after it (tests/proj.py, WAITING_GATES)."""
    yield
    if "env" not in request.fixturenames:
        return
    from tests.proj import BOOKKEEPING_DB, WAITING_GATES

    env = request.getfixturevalue("env")
    client = redis.Redis.from_url(env.store)
    kept = redis.Redis.from_url(f"{env.base}/{BOOKKEEPING_DB}")
    with contextlib.suppress(redis.RedisError):  # a test that stopped its server
        gates = kept.smembers(WAITING_GATES)
        if gates:
            pipe = client.pipeline(transaction=False)
            for gate in gates:
                pipe.set(gate, 1)
            pipe.execute()
            kept.srem(WAITING_GATES, *gates)


INPROCESS = os.environ.get("ECHOMQ_TEST_WORKER") == "inprocess"
# The modules whose ``worker`` tests run on an in-process worker in the fast tier.
INPROCESS_MODULES = frozenset({"canvas/test_compose", "worker/test_policies", "worker/test_counts"})
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
# A module is named by its path under tests/ without ".py" ("worker/test_recovery"). A new
# module gets e2e from its fixtures and faults from its tests' names; the others it gets by
# being added to a table here. The helpers every folder shares are in tests/helpers.py.
FAULT_MODULES = frozenset(
    {
        "worker/test_recovery",
        "worker/test_exactly_once",
        "canvas/test_faults",
        "store/test_failover",
        "worker/test_soak",
        "worker/test_refusals",
    }
)
FAULT_NAME = re.compile(r"kill|crash|died|failover")
SLOW_MODULES = frozenset(
    {"worker/test_soak", "send/test_large", "worker/test_backlog", "test_examples"}
)
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
        "test_the_deadline_of_a_flow_of_2500_children_cuts_them_a_chunk_per_script_call",
        "test_retry_of_2100_failed_children_reads_and_retries_them_a_chunk_at_a_time",
        "test_release_reads_the_counts_alone_and_revoke_stops_2500_children_a_chunk_at_a_time",
        "test_doctor_counts_the_sentinels_and_replicas_of_a_sentinel_store",
        "test_flows_in_flight_on_the_previous_release_finish_after_an_upgrade_worker_killed",
        "test_flows_under_a_store_that_fills_up_mid_flight_run_each_body_once",
    }
)
RESULT_PATH_MODULES = frozenset(
    {
        "store/test_results",
        "worker/test_backends",
        "send/test_fused",
        "worker/test_fan_in_values",
        "worker/test_held",
        "canvas/test_compose",
        "canvas/test_both_ways",
        "peers/test_celery_chords",
        "canvas/test_chains",
        "send/test_celery_ids",
        "canvas/test_group_errbacks",
        "worker/test_policies",
        "canvas/test_replace",
        "ops/test_cli",
        "ops/test_repair",
        "send/test_join",
    }
)
# The smoke, per concern: (module, test function); every parametrization of it runs.
SMOKE = {
    "flows": [
        ("worker/test_fan_in_values", "test_parent_gets_values_in_childrens_order"),
        (
            "worker/test_fan_in_values",
            "test_ten_child_flow_returns_what_the_equivalent_chord_returns",
        ),
        ("worker/test_held", "test_parent_is_held_until_the_last_child_completes"),
        ("canvas/test_lineage", "test_every_job_of_a_flow_has_the_flow_as_its_root"),
    ],
    "canvas": [
        ("canvas/test_compose", "test_flow_in_the_middle_of_a_chain"),
        ("canvas/test_both_ways", "test_a_chain_child_under_ignore_is_left_out"),
        ("canvas/test_chains", "test_a_redelivered_step_is_counted_once"),
        ("send/test_celery_ids", "test_a_frozen_child_keeps_its_celery_id"),
        (
            "canvas/test_group_errbacks",
            "test_each_failing_task_of_a_group_parent_runs_the_errbacks_once",
        ),
        ("canvas/test_chains", "test_a_step_whose_message_was_never_published_is_recovered"),
        ("peers/test_celery_chords", "test_chord__error_propagates_from_chord"),
        (
            "canvas/test_replace",
            "test_a_replaced_parent_of_a_nested_flow_gives_its_outer_flow_the_replacements_value",
        ),
    ],
    "policies": [
        ("worker/test_policies", "test_ignore_policy_resolves_the_child_and_records_its_error"),
        ("worker/test_policies", "test_retries_that_end_in_success_count_the_child_once"),
    ],
    "queues and slots": [
        ("send/test_cross_queue", "test_children_on_other_queues_keep_their_keys_on_their_slots"),
        ("store/test_cluster", "test_same_queue_flow_on_cluster"),
    ],
    "windows": [
        ("send/test_window", "test_at_most_max_active_children_are_out_and_they_start_in_order"),
    ],
    "shared jobs": [
        ("send/test_join", "test_re_adding_the_same_flow_returns_it_and_runs_nothing_twice"),
    ],
    "growing flows": [
        ("send/test_grow", "test_a_child_adds_siblings_and_the_parent_gets_every_value_in_order"),
    ],
    "integrity": [
        ("worker/test_integrity", "test_a_task_no_worker_registered_fails_its_flow_at_once"),
    ],
    "exactly once": [
        ("worker/test_exactly_once", "test_a_duplicate_delivery_racing_the_first_is_skipped"),
        (
            "worker/test_exactly_once",
            "test_pool_process_killed_mid_child_is_redelivered_and_credited_once",
        ),
        (
            "canvas/test_faults",
            "test_a_chain_step_whose_pool_process_died_is_redelivered_and_counted_once",
        ),
    ],
    "recovery": [
        ("worker/test_recovery", "test_every_message_lost_in_the_broker_is_republished"),
        ("worker/test_recovery", "test_worker_killed_mid_child_the_child_is_republished"),
    ],
    "failover": [
        ("store/test_failover", "test_failover_sentinel_with_min_replicas_loses_nothing"),
    ],
    "deadlines": [
        ("worker/test_deadlines", "test_a_nested_flow_keeps_its_own_deadline"),
    ],
    "results": [
        ("store/test_results", "test_a_failing_child_raises_as_a_chord_child_would"),
        ("worker/test_backends", "test_no_result_backend_flows_run_and_get_says_what_to_set"),
    ],
    "operators": [
        ("ops/test_cli", "test_show_json_gives_the_same_tree_as_data"),
        (
            "ops/test_repair",
            "test_retry_reruns_the_failed_children_and_get_returns_the_parents_value",
        ),
        ("ops/test_dashboard", "test_a_held_flow_shows_its_running_child_then_turns_done"),
        ("ops/test_dashboard", "test_api_flows_serves_the_json_of_show"),
        ("ops/test_pages", "test_pages_follow_cursors_and_filter_by_state_the_failed_first"),
        ("ops/test_doctor", "test_doctor_passes_a_good_deployment_and_asks_the_workers"),
    ],
    "tracing": [
        ("test_tracing", "test_a_flow_is_one_trace_from_its_producer_to_its_parent"),
    ],
    "rabbitmq": [
        ("worker/test_rabbit", "test_rabbit_nested_flow"),
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
        module = item.path.relative_to(TESTS).with_suffix("").as_posix()
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


@pytest.fixture(params=ways(worker_for_both=False))
def how(request: pytest.FixtureRequest) -> str:
    """``apply`` (eager, in this process, no worker) or ``apply_async`` (on the worker): each
    case both ways, for ``tests.helpers.run``. A module with other needs defines its own."""
    if request.param == "apply_async":
        request.getfixturevalue("worker")
    return str(request.param)


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


# --- Redis Cluster (tests/store/test_cluster.py) ------------------------------------------------


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


# --- The scripts one by one (store/test_scripts, store/test_fan_in, ...) -------------------------


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


# The operator tests' fixtures: a dashboard served in this process, a headless Chromium.
@pytest.fixture
def serve(proj: Any) -> Iterator[Callable[..., Served]]:
    started: list[Served] = []

    def start(*, allow_actions: bool = False, exposure: Any = None) -> Served:
        started.append(Served(proj.app, allow_actions=allow_actions, exposure=exposure))
        return started[-1]

    yield start
    for served in started:
        served.stop()


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.skip(
            f"browser tests need {CHROMIUM} and {CHROMEDRIVER} "
            "(Debian: apt-get install chromium chromium-driver)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    # Both paths given: Selenium Manager has nothing to look up or download.
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1280,720")
    # A DNS name of an attacker's that resolves to this machine (a rebinding attack).
    options.add_argument(f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1")
    driver = webdriver.Chrome(
        service=Service(executable_path=CHROMEDRIVER, log_output=str(LOGDIR / "chromedriver.log")),
        options=options,
    )
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()
