"""The Celery app the benchmark's producer and its `celery worker` subprocesses share.

The worker subprocess imports this module with the environment ``modes.Worker`` sets, so both
sides agree on the Redis server and on whether celery-echomq is installed. Broker, result
backend and flow store are on one private Redis (the store on the backend's database, where a
flow job's completion writes its result too), so one ``INFO commandstats`` covers them all.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from app_setup import announce_ready, configure_app
from celery import Celery

ENV_URL = "ECHOMQ_BENCH_REDIS"
ENV_INSTALL = "ECHOMQ_BENCH_INSTALL"
ENV_READY = "ECHOMQ_BENCH_READY_FILE"
# "1": this worker traces (the bench's flow-traced mode): OpenTelemetry's SDK and
# opentelemetry-instrumentation-celery, spans dropped by the exporter (tests/otel_setup.py,
# as benchmarks/tracing_cost.py's workers have them).
ENV_OTEL = "ECHOMQ_BENCH_OTEL"
# A directory of another tree's scripts (its celery_echomq/store/lua): this process's store
# runs those (bench peers --against: the worker of the "flow (against)" peer).
ENV_LUA = "ECHOMQ_BENCH_LUA"
# The flow store shares the result backend's database: then a flow job's completion writes its
# result too (celery_echomq/wire/results.py).
BROKER_DB, BACKEND_DB, STORE_DB = 0, 1, 1

app = Celery("bench_app")


def against_dir(text: str) -> Path:
    """``--against DIR``: another tree's ``celery_echomq/store/lua``, made absolute, since the
    workers that read it run in another directory."""
    path = Path(text).resolve()
    if not (path / "claim.lua").is_file():
        raise argparse.ArgumentTypeError(
            f"{text}: no claim.lua there (give another tree's celery_echomq/store/lua)"
        )
    return path


def read_scripts_from(lua_dir: Path) -> None:
    """Every script this process's store loads from now on is read from ``lua_dir``."""
    from celery_echomq.store import loader

    def read(*parts: str) -> str:
        return lua_dir.joinpath(*parts).read_text("utf-8")

    loader._read_lua = read


def registered_from(client: Any, lua_dir: Path) -> dict[str, Any]:
    """Every transition of the tree whose scripts are in ``lua_dir``, registered on ``client``
    (store/loader.py's expansion, reading that directory), this process's own left as they
    are: ``bench peers --against`` and ``script_cost.py --against`` swap them in per round."""
    from celery_echomq.store import loader

    own = loader._read_lua
    read_scripts_from(lua_dir)
    try:
        return {n: client.register_script(loader.load_source(n)) for n in loader.TRANSITIONS}
    finally:
        loader._read_lua = own


if os.environ.get(ENV_LUA):
    read_scripts_from(Path(os.environ[ENV_LUA]))


def configure(url: str, *, install: bool = True) -> Celery:
    """Point the app at ``url``; ``install=False`` is the control for the plain-task ratio."""
    return configure_app(
        app,
        broker=f"{url}/{BROKER_DB}",
        backend=f"{url}/{BACKEND_DB}",
        store=f"{url}/{STORE_DB}",
        install=install,
        # A held flow may wait a long time in the memory phase; recovery must not re-publish it.
        echomq_stall_timeout=3600,
    )


# Without the variable the module is being imported by a producer (bench.py, peers/runner.py,
# script_cost.py, script_profile.py), which calls configure itself.
if os.environ.get(ENV_URL):
    configure(os.environ[ENV_URL], install=os.environ.get(ENV_INSTALL, "1") == "1")
if os.environ.get(ENV_OTEL) == "1":
    from tests.otel_setup import configure as configure_otel

    configure_otel("", service="bench-worker")


@app.task(name="bench.add")
def add(x: int, y: int) -> int:
    return x + y


@app.task(name="bench.tsum")
def tsum(values: list[int]) -> int:
    return sum(values)


@app.task(name="bench.nap")
def nap(i: int, ms: float) -> int:
    """A child that costs ``ms`` milliseconds of wall time (a sleep): batch_size.py's."""
    if ms:
        time.sleep(ms / 1000)
    return i


announce_ready(ENV_READY)
