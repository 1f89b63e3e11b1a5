"""The pytest plugin users load (celery_echomq.testing), run on a small user suite of its own."""

from __future__ import annotations

import textwrap

import pytest

pytest_plugins = ["pytester"]

# The options this project's own suite runs with: Celery's own pytest plugin stays off.
ARGS = ("-p", "no:celery", "-p", "no:pytest_docker_tools", "-q")

USER_APP = """
    from celery import Celery
    import celery_echomq

    # The app as production configures it; the plugin points it at the test Redis.
    app = Celery("userproj", broker="redis://localhost:6379/0", backend="redis://localhost:6379/1")
    celery_echomq.install(app)

    @app.task
    def double(x):
        return 2 * x

    @app.task
    def total(values):
        return sum(values)
"""

USER_CONFTEST = """
    import pytest

    @pytest.fixture(scope="session")
    def echomq_app():
        from userproj import app
        return app
"""

USER_TEST = """
    from celery_echomq import flow, get_state
    from userproj import app, double, total

    def test_a_flow_runs_on_the_plugins_worker(echomq_worker, echomq_redis_url):
        res = flow(total.s(), [double.s(i) for i in range(4)]).apply_async()
        assert res.get(timeout=30) == 12
        assert res.children_values() != {}
        # Broker, result backend and flow store: three databases of the plugin's Redis.
        assert app.conf.broker_url == echomq_redis_url + "/1"
        assert app.backend.url == echomq_redis_url + "/2"
        assert get_state(app).settings.redis_url == echomq_redis_url + "/3"
"""


def test_a_users_suite_gets_a_redis_and_a_worker_from_the_plugin(
    pytester: pytest.Pytester, redis_base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An existing Redis named by the environment is used as is (no server of its own).
    monkeypatch.setenv("ECHOMQ_TEST_REDIS_URL", redis_base + "/0")
    pytester.makepyfile(userproj=textwrap.dedent(USER_APP))
    pytester.makeconftest(textwrap.dedent(USER_CONFTEST))
    pytester.makepyfile(test_user=textwrap.dedent(USER_TEST))
    result = pytester.runpytest_subprocess(*ARGS, timeout=120)
    result.assert_outcomes(passed=1)


def test_a_suite_that_uses_no_fixture_starts_no_redis(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_plain="""
        import sys

        def test_plain(pytestconfig):
            assert pytestconfig.pluginmanager.has_plugin("celery_echomq.testing")
            # Loaded, yet nothing started: the embedded server's module is not even imported.
            assert "celery_echomq.embedded" not in sys.modules
        """
    )
    result = pytester.runpytest_subprocess(*ARGS, timeout=120)
    result.assert_outcomes(passed=1)


def test_a_missing_app_fixture_says_what_to_define(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_noapp="""
        def test_needs_worker(echomq_worker):
            pass
        """
    )
    result = pytester.runpytest_subprocess(*ARGS, timeout=120)
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*define a fixture named 'echomq_app' in your conftest.py*"])


def test_naming_the_plugin_in_a_conftest_too_registers_it_once(pytester: pytest.Pytester) -> None:
    # What a suite written for autoload turned off declares; with autoload on it must not
    # clash with the entry point.
    pytester.makeconftest('pytest_plugins = ["celery_echomq.testing"]\n')
    pytester.makepyfile(
        test_once="""
        def test_once(pytestconfig, echomq_app_config):
            manager = pytestconfig.pluginmanager
            names = [n for n, p in manager.list_name_plugin() if p is manager.get_plugin(
                "celery_echomq.testing")]
            assert names == ["celery_echomq.testing"]
        """
    )
    result = pytester.runpytest_subprocess(*ARGS, timeout=120)
    result.assert_outcomes(passed=1)
    off = pytester.runpytest_subprocess(
        *ARGS, "-p", "no:celery_echomq.testing", "-p", "no:cacheprovider", timeout=120
    )
    assert off.ret != 0  # turned off: its fixtures are unknown
    off.stdout.fnmatch_lines(["*fixture 'echomq_app_config' not found*"])


# An app whose production broker and backend cannot be reached here: whatever still goes
# there after the plugin pointed the app at its own Redis never arrives.
UNREACHABLE_APP = USER_APP.replace("localhost:6379", "127.0.0.1:1")

EAGER_TEST = """
    def test_eager(echomq_app):
        echomq_app.conf.task_always_eager = True
        try:
            assert double.delay(21).get() == 42
            assert flow(total.s(), [double.s(i) for i in range(3)]).delay().get() == 6
        finally:
            echomq_app.conf.task_always_eager = False
"""

WORKER_TEST = """
    def test_worker(echomq_worker):
        assert double.delay(2).get(timeout=20) == 4
        assert flow(total.s(), [double.s(i) for i in range(4)]).delay().get(timeout=20) == 12
"""


@pytest.mark.parametrize("first", ["eager", "worker"])
def test_an_app_used_eagerly_in_the_session_still_reaches_the_plugins_worker(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, first: str
) -> None:
    # The app's result backend and broker pool are built at first use, from the settings of
    # that moment: an eager test before the worker's must not leave the app on its old ones.
    monkeypatch.delenv("ECHOMQ_TEST_REDIS_URL", raising=False)  # the plugin's own server
    pytester.makepyfile(userproj=textwrap.dedent(UNREACHABLE_APP))
    pytester.makeconftest(textwrap.dedent(USER_CONFTEST))
    tests = [EAGER_TEST, WORKER_TEST] if first == "eager" else [WORKER_TEST, EAGER_TEST]
    header = "from celery_echomq import flow\nfrom userproj import double, total\n"
    pytester.makepyfile(test_order=header + "".join(textwrap.dedent(t) for t in tests))
    result = pytester.runpytest_subprocess(*ARGS, "-p", "no:randomly", timeout=120)
    result.assert_outcomes(passed=2)


CHORD_TASK = """
    from celery import chord

    @app.task
    def fan(n):
        # A chord sent from a task: its header's results wait on the backend of the worker
        # thread that ran this, past the end of the session.
        return chord([double.s(i) for i in range(n)], total.s()).delay().id

    @app.task
    def boom():
        raise ValueError("expected")
"""

CHORD_TEST = """
    import pytest
    from userproj import app, boom, fan

    def test_a_chord_sent_from_a_task(echomq_worker):
        body = app.AsyncResult(fan.delay(3).get(timeout=20))
        assert body.get(timeout=20) == 6

    def test_a_task_expected_to_fail(echomq_worker):
        with pytest.raises(ValueError, match="expected"):
            boom.delay().get(timeout=20)

    def test_the_worker_logs_through_pytest_alone(echomq_worker):
        # A handler on the process's own stderr prints what the worker's threads log while
        # no test's capture is on (between two tests) into the run's output.
        import logging, sys

        for name in ("", "celery", "celery.task"):
            for handler in logging.getLogger(name).handlers:
                assert getattr(handler, "stream", None) is not sys.__stderr__, (name, handler)
"""


def test_a_session_that_used_the_worker_ends_without_an_error_line(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The results left subscribed at the end (here by the worker's threads) are let go before
    # the plugin's Redis stops: no reconnect to a stopped server, no CRITICAL line. A task
    # that fails as a test expects is logged in that test's capture, not printed.
    monkeypatch.delenv("ECHOMQ_TEST_REDIS_URL", raising=False)
    pytester.makepyfile(userproj=textwrap.dedent(USER_APP + CHORD_TASK))
    pytester.makeconftest(textwrap.dedent(USER_CONFTEST))
    pytester.makepyfile(test_chord=textwrap.dedent(CHORD_TEST))
    result = pytester.runpytest_subprocess(*ARGS, timeout=120)
    result.assert_outcomes(passed=3)
    output = "\n".join(result.outlines + result.errlines)
    for noise in ("CRITICAL", "ERROR", "Traceback", "Retry limit exceeded"):
        assert noise not in output, output
