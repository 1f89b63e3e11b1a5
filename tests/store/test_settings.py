"""Settings a store refuses, and a store that cannot be reached, as a producer meets them: a
ConfigError or StoreUnavailableError that names the setting and what was tried, quickly, and
nothing written or published."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

import celery_echomq
from celery_echomq import ConfigError, flow
from celery_echomq.store.state import get_state
from tests.helpers import Env


def producer(env: Env, **conf: Any) -> Celery:
    """An app that sends flows of its own tasks to the test broker, with ``conf`` on top."""
    app = Celery(f"producer-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update({"broker_url": env.broker, "result_backend": env.backend, **conf})
    celery_echomq.install(app)

    @app.task(name="settings.add")
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
