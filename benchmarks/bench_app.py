"""The Celery app the benchmark's producer and its `celery worker` subprocesses share.

The worker subprocess imports this module with the environment that ``bench.py`` sets, so both
sides agree on the Redis server and on whether celery-echomq is installed. Broker, result
backend and flow store are on one private Redis (the store on the backend's database, where a
flow job's completion writes its result too), so one ``INFO commandstats`` covers them all.
"""

from __future__ import annotations

import cProfile
import os
from pathlib import Path
from typing import Any

from app_setup import announce_ready, configure_app
from celery import Celery, signals

ENV_URL = "ECHOMQ_BENCH_REDIS"
ENV_INSTALL = "ECHOMQ_BENCH_INSTALL"
ENV_PROFILE = "ECHOMQ_BENCH_PROFILE_DIR"
ENV_READY = "ECHOMQ_BENCH_READY_FILE"
# "1": this worker traces (the bench's flow-traced mode): OpenTelemetry's SDK and
# opentelemetry-instrumentation-celery, spans dropped by the exporter (tests/otel_setup.py,
# as benchmarks/tracing_cost.py's workers have them).
ENV_OTEL = "ECHOMQ_BENCH_OTEL"
# A directory of another tree's scripts (its celery_echomq/store/lua): this process's store
# runs those (bench --peers --against: the worker of the "flow (against)" peer).
ENV_LUA = "ECHOMQ_BENCH_LUA"
# "1": a what-if, never a mode of the package (bench --peers's "flow (claim in completion)"):
# this worker's pool processes hold each claim back and send it in one write
# with the completion (or failure) that follows, so the claim costs the server no wake-up of
# its own. The body then runs before anything has checked its delivery: a forged or duplicate
# message would run its body, which is what the claim is there to prevent. It measures what
# the claim's round trip costs, and nothing else.
ENV_CLAIM_WITH_COMPLETION = "ECHOMQ_BENCH_CLAIM_WITH_COMPLETION"
# The flow store shares the result backend's database: then a flow job's completion writes its
# result too (celery_echomq/store/results.py).
BROKER_DB, BACKEND_DB, STORE_DB = 0, 1, 1

app = Celery("bench_app")


def read_scripts_from(lua_dir: Path) -> None:
    """Every script this process's store loads from now on is read from ``lua_dir``."""
    from celery_echomq.store import loader

    def read(*parts: str) -> str:
        return lua_dir.joinpath(*parts).read_text("utf-8")

    loader._read_lua = read


if os.environ.get(ENV_LUA):
    read_scripts_from(Path(os.environ[ENV_LUA]))


def send_claims_with_completions() -> None:
    """The what-if of :data:`ENV_CLAIM_WITH_COMPLETION`: ``ScriptRunner.run`` answers a claim
    as claimed at once and sends it, as a raw EVALSHA, in one pipeline with the next
    completion or failure this process runs."""
    from celery_echomq.store.runner import ScriptRunner

    run = ScriptRunner.run
    held: list[tuple[Any, Any]] = []
    loaded: list[bool] = []

    def run_holding_claims(self: ScriptRunner, name: str, keys: Any, args: Any) -> Any:
        if name == "claim":
            held[:] = [(keys, args)]
            return [b"claimed", 1, b"", b""]
        if name not in ("complete", "fail") or not held:
            return run(self, name, keys, args)
        ((claim_keys, claim_args),) = held
        held.clear()
        if not loaded:  # a raw EVALSHA has no NOSCRIPT fallback: load them once
            for script in self.registered.values():
                self.client.script_load(script.script)
            loaded.append(True)
        pipe = self.client.pipeline(transaction=False)
        pipe.evalsha(self.registered["claim"].sha, len(claim_keys), *claim_keys, *claim_args)
        pipe.evalsha(self.registered[name].sha, len(keys), *keys, *args)
        return pipe.execute()[1]

    ScriptRunner.run = run_holding_claims  # type: ignore[method-assign]


if os.environ.get(ENV_CLAIM_WITH_COMPLETION) == "1":
    send_claims_with_completions()


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


# Without the variable the module is being imported by bench.py, which calls configure itself.
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


announce_ready(ENV_READY)


# Worker-side profile: each pool process profiles itself from fork to shutdown, so the numbers
# cover the task path (signals, scripts, result store) and not the parent's event loop.
_profiler: cProfile.Profile | None = None


@signals.worker_process_init.connect
def _start_profile(**_: Any) -> None:
    global _profiler
    if os.environ.get(ENV_PROFILE):
        _profiler = cProfile.Profile()
        _profiler.enable()


@signals.worker_process_shutdown.connect
def _dump_profile(**_: Any) -> None:
    directory = os.environ.get(ENV_PROFILE)
    if _profiler is not None and directory:
        _profiler.disable()
        _profiler.dump_stats(str(Path(directory) / f"pool-{os.getpid()}.prof"))
