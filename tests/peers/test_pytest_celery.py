"""A user's suite with pytest-celery installed and enabled runs flows: Celery's legacy
fixtures (``celery_config``, ``celery_session_app``, ``celery_session_worker``,
``celery_app``) beside this project's plugin (``echomq_redis_url``).

Settings are read when the app is finalized or first used, as Celery reads ``app.conf``, so
``install(app)`` may come before the app has its URLs (the test app's configuration, here).
"""

from __future__ import annotations

import textwrap

import pytest

pytest_plugins = ["pytester"]

# pytest-celery's plugin is on (no "-p no:celery"), as in a suite that uses its fixtures.
ARGS = ("-p", "no:pytest_docker_tools", "-q")

USER_TASKS = """
    from celery import shared_task


    @shared_task
    def double(x):
        return 2 * x


    @shared_task
    def total(values):
        return sum(values)
"""

USER_CONFTEST = """
    import pytest
    import celery_echomq


    @pytest.fixture(scope="session")
    def celery_config(echomq_redis_url):
        # The URLs come from the plugin's Redis: Celery's legacy fixtures apply them to the
        # test app, after celery_echomq is imported and whatever order the fixtures run in.
        return {
            "broker_url": echomq_redis_url + "/4",
            "result_backend": echomq_redis_url + "/5",
            "echomq_redis_url": echomq_redis_url + "/6",
        }


    @pytest.fixture(scope="session")
    def celery_includes():
        return ["usertasks"]


    @pytest.fixture(scope="session")
    def celery_worker_pool():
        return "threads"


    @pytest.fixture(scope="session")
    def celery_session_app(celery_session_app):
        celery_echomq.install(celery_session_app)
        return celery_session_app
"""

USER_TEST = """
    import pytest
    import celery_echomq
    from celery import Celery
    from celery_echomq import ConfigError, flow
    from usertasks import double, total


    def test_a_flow_runs_on_the_legacy_session_worker(celery_session_app, celery_session_worker):
        res = flow(total.s(), [double.s(i) for i in range(4)]).apply_async()
        assert res.get(timeout=30) == 12
        assert res.dependencies() == (0, 4, 0, 0)
        rows, _ = celery_echomq.list_flows("recent", app=celery_session_app)
        assert res.id in [row.id for row in rows]


    def test_install_before_the_configuration(echomq_redis_url):
        app = Celery("late", set_as_current=False)
        celery_echomq.install(app)  # nothing is read yet
        app.conf.update(
            broker_url=echomq_redis_url + "/4", echomq_redis_url=echomq_redis_url + "/6"
        )
        assert celery_echomq.get_state(app).settings.redis_url == echomq_redis_url + "/6"


    def test_a_missing_url_is_named_at_first_use():
        app = Celery("unset", broker="memory://", set_as_current=False)
        celery_echomq.install(app)

        @app.task(shared=False)
        def one():
            return 1

        with pytest.raises(ConfigError, match="echomq_redis_url"):
            flow(one.si(), [one.si()]).apply_async()
"""


def test_a_users_suite_with_pytest_celery_runs_flows(
    pytester: pytest.Pytester, redis_base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ECHOMQ_TEST_REDIS_URL", redis_base + "/0")
    pytester.makepyfile(usertasks=textwrap.dedent(USER_TASKS))
    pytester.makeconftest(textwrap.dedent(USER_CONFTEST))
    pytester.makepyfile(test_user=textwrap.dedent(USER_TEST))
    result = pytester.runpytest_subprocess(*ARGS, timeout=150)
    result.assert_outcomes(passed=3)
