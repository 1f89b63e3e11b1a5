"""What the benchmarks' Celery apps share (``bench_app.py``, ``ha.py``, ``large.py``,
``window.py``): their configuration, and the file a worker writes once it is ready.

A benchmark's worker runs at log level WARNING (per-task INFO lines would be measured too),
where its "ready." line is not logged: it writes its pid into the file its driver names in
an environment variable instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from celery import Celery, signals

import celery_echomq


def configure_app(
    app: Celery, *, broker: str, backend: str, store: str, install: bool = True, **conf: Any
) -> Celery:
    """Point ``app`` at its broker, result backend and flow store, with ``conf`` beside;
    ``install=False`` leaves celery-echomq out (a control)."""
    app.conf.update(
        broker_url=broker,
        result_backend=backend,
        echomq_redis_url=store,
        broker_connection_retry_on_startup=True,
        **conf,
    )
    if install:
        celery_echomq.install(app)
    return app


def announce_ready(env_var: str) -> None:
    """Once this process's worker is ready, write its pid into the file ``$env_var`` names
    (nothing when the variable is unset)."""

    def announce(**_: Any) -> None:
        path = os.environ.get(env_var)
        if path:
            Path(path).write_text(str(os.getpid()))

    signals.worker_ready.connect(announce, weak=False)
