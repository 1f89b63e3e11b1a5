"""What every example needs and none is about: a private redis-server and a real worker.

``with local_worker("fanout", configure) as url:`` starts a ``redis-server`` on a free
loopback port (``celery_echomq.embedded``), configures the example's app on it, and runs
``celery -A fanout worker`` (prefork) in a subprocess; both stop when the block ends.
The worker learns the Redis URL from ``ECHOMQ_EXAMPLE_REDIS``, which each example reads at
import time, so that the example process and its worker agree.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from celery import Celery

import celery_echomq
from celery_echomq.embedded import RedisServer, WorkerProcess

HERE = Path(__file__).resolve().parent
ENV_VAR = "ECHOMQ_EXAMPLE_REDIS"


def configure(app: Celery, url: str) -> None:
    """Broker, result backend and flow store on three databases of one Redis."""
    app.conf.update(
        broker_url=f"{url}/0",
        result_backend=f"{url}/1",
        echomq_redis_url=f"{url}/2",
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=1,
    )
    celery_echomq.install(app)


def configure_from_env(app: Celery) -> None:
    """At import: the worker subprocess gets its URL from the example that started it."""
    url = os.environ.get(ENV_VAR)
    if url:
        configure(app, url)


@contextmanager
def local_worker(
    module: str, app: Celery, *, concurrency: int = 2, ready_timeout: float = 90
) -> Iterator[str]:
    """Run the example ``module``'s worker on a private Redis; yield that Redis's base URL."""
    with RedisServer() as server:
        url = f"redis://127.0.0.1:{server.port}"
        path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
        # Waiting for "ready" is not needed for correctness (messages wait in the broker); it
        # turns a worker that cannot start into an error with its log.
        with WorkerProcess(
            module,
            log=Path(server.dir) / "worker.log",
            cwd=HERE,
            env={**os.environ, ENV_VAR: url, "PYTHONPATH": path},
            concurrency=concurrency,
            ready_timeout=ready_timeout,
        ) as worker:
            configure(app, url)
            print(f"redis-server on {url}, celery worker pid {worker.pid} (x{concurrency})")
            yield url
