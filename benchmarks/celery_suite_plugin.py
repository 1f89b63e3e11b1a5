"""A pytest plugin for Celery's own integration suite: every app its fixtures make gets
``echomq_chords = True`` and ``celery_echomq.install``, so that the suite's chords, unmodified,
run on the flow engine (see benchmarks/celery_canvas.py, which loads it with ``-p``)."""

from __future__ import annotations

from typing import Any

import pytest

import celery_echomq

# Celery's fixtures that make the apps of its suite: the session worker's and each test's.
APP_FIXTURES = frozenset({"celery_session_app", "celery_app"})


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: Any) -> Any:
    app = yield
    if fixturedef.argname in APP_FIXTURES:
        app.conf.echomq_chords = True
        celery_echomq.install(app)
    return app
