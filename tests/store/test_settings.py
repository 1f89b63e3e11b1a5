"""Settings a store refuses, and a store that cannot be reached, as a producer meets them: a
ConfigError or StoreUnavailableError that names the setting and what was tried, quickly, and
nothing written or published."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

import celery_echomq
from celery_echomq import ConfigError, StoreUnavailableError, flow
from celery_echomq.store.state import get_state
from tests.helpers import Env


def producer(env: Env, **conf: Any) -> Celery:
    """An app that sends flows of its own tasks to the test broker, with ``conf`` on top."""
    app = Celery(f"producer-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update({"broker_url": env.broker, "result_backend": env.backend, **conf})
    celery_echomq.install(app)

    @app.task(name="settings.add", shared=False)
    def add(a: int, b: int) -> int:
        return a + b

    return app


@pytest.fixture
def queue(env: Env) -> Iterator[str]:
    name = f"settings-{uuid.uuid4().hex[:10]}"
    yield name
    redis.Redis.from_url(env.broker).delete(name)


def nothing_sent(env: Env, queue: str) -> None:
    assert redis.Redis.from_url(env.broker).llen(queue) == 0


def test_a_database_the_server_does_not_have_is_a_config_error_naming_the_setting(
    env: Env, redis_base: str, queue: str
) -> None:
    url = f"{redis_base}/99"
    app = producer(env, echomq_redis_url=url)
    add = app.tasks["settings.add"]
    with pytest.raises(ConfigError) as info:
        flow(add.s(1, 1), [add.s(2, 2)], queue=queue).apply_async()
    message = str(info.value)
    assert message.startswith(f"echomq_redis_url={url!r}: the server has no database 99")
    assert "databases" in message and "DB index is out of range" in message
    nothing_sent(env, queue)
    # The CLI, and any read, says the same.
    with pytest.raises(ConfigError, match=r"echomq_redis_url=.*no database 99"):
        get_state(app).client.ping()


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_producer_meets_an_unreachable_store_within_echomq_producer_timeout(
    env: Env, queue: str
) -> None:
    url = f"redis://127.0.0.1:{unused_port()}/0"
    app = producer(
        env, echomq_redis_url=url, echomq_store_retry_timeout=30, echomq_producer_timeout=1
    )
    add = app.tasks["settings.add"]
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError) as info:
        flow(add.s(1, 1), [add.s(2, 2)], queue=queue).apply_async()
    took = time.monotonic() - started
    assert took < 5, took  # not the 30 s a worker's commands retry for
    message = str(info.value)
    assert f"Redis at {url!r} is unavailable" in message
    assert "retried for up to echomq_producer_timeout=1 s" in message
    assert "Connection refused" in message and "nothing was published" in message
    nothing_sent(env, queue)


@pytest.mark.parametrize("value", [-1, "soon"])
def test_a_producer_timeout_that_is_not_seconds_is_refused(env: Env, value: Any) -> None:
    app = producer(env, echomq_producer_timeout=value)
    with pytest.raises(ConfigError, match="echomq_producer_timeout"):
        _ = get_state(app).settings
