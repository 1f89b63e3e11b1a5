"""The bench's modes, shared by ``bench.py``, the peers bench (``peers/runner.py``),
``script_cost.py`` and ``script_profile.py``: the canvas each mode sends (K flows, chords or
groups of N no-op children on ``bench_app``'s app), the value it must give, the worker that runs
them (a real `celery worker -P prefork -c 2`), the wait for their results, and the BullMQ
peer's install.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import bench_app
from celery import chain, chord, group
from measure import HERE, ROOT, Size, log

from celery_echomq import flow
from celery_echomq.embedded import RedisServer, WorkerProcess

MODES = ("group", "chord", "flow")
# flow with echomq_child_results = False: the children's values reach the parent through the
# store alone, without a result-backend write per child.
LEAN = "flow-lean"
# The costs of two capabilities, each beside a plain flow in the same rounds: a flow with a
# deadline (``flow(..., deadline=3600)``, never due here), and a traced flow (the [otel]
# extra with an OpenTelemetry SDK in the producer and in the worker that runs it). Tracing is
# process-wide, so the traced flow runs on a second worker of the same configuration that
# consumes a queue of its own, its SDK exporting to a processor that drops the spans.
DEADLINE = "flow-deadline"
TRACED = "flow-traced"

# A Celery chord sent with echomq_chords on: the same canvas as ``chord``, fanned in by the
# flow engine (celery_echomq/chords.py).
CHORD_ENGINE = "chord-engine"
DEADLINE_S = 3600
# A flow with a window (``max_active``): ``flow-window`` (the peers bench's "flow window").
WINDOW = "flow-window"
WINDOW_SIZE = int(os.environ.get("BENCH_WINDOW", "20"))
# A flow whose children go out BATCH_SIZE to a broker message (``flow(..., batch=50)``, the
# internal task celery_echomq.batch), each child still a job of its own: a module constant,
# so that a flow of up to 50 children goes out in one message.
BATCH = "flow-batch"
BATCH_SIZE = 50
# A plain group with one task more than a flow's children: as many Celery messages as a flow
# sends (its children and its parent), none of them fanned in (the peers bench's "celery group
# + 1"). A flow beside it shows what the fan-in costs beyond the parent's own message.
GROUP_ONE_MORE = "group-one-more"
BULLMQ_DIR = HERE / "bullmq"


# --- the worker -------------------------------------------------------------------------


class Worker(WorkerProcess):
    """A real `celery -A bench_app worker` (prefork) in its own process group, started at once."""

    def __init__(
        self,
        url: str,
        queue: str,
        *,
        install: bool = True,
        concurrency: int = 2,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.name = f"bench-{queue}-{uuid.uuid4().hex[:6]}"
        self.dir = Path(tempfile.mkdtemp(prefix="echomq-bench-"))
        ready_file = self.dir / "ready"
        env = dict(os.environ)
        env.update(
            {
                bench_app.ENV_URL: url,
                bench_app.ENV_INSTALL: "1" if install else "0",
                bench_app.ENV_READY: str(ready_file),
                "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), env.get("PYTHONPATH", "")]),
            }
        )
        env.update(extra_env or {})
        # The group kill after a warm shutdown makes sure no pool process outlives the bench.
        super().__init__(
            "bench_app",
            log=self.dir / "worker.log",
            cwd=HERE,
            env=env,
            queues=queue,
            concurrency=concurrency,
            name=self.name,
            loglevel="WARNING",
            ready_file=ready_file,
            stop_timeout=15,
        )
        try:
            self.start()
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise

    def output(self) -> str:
        return super().output()[-4000:]

    def pids(self) -> list[int]:
        """The main process and its pool processes."""
        return [self.pid, *self.pool_pids()]

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def private_worker(stack: contextlib.ExitStack) -> str:
    """A private redis-server, ``bench_app`` pointed at it and one real worker on it (queue
    ``celery``), each stopped by ``stack``: the server's URL (without a database)."""
    server = stack.enter_context(RedisServer())
    stack.callback(release_results)
    base = f"redis://127.0.0.1:{server.port}"
    bench_app.configure(base)
    worker = Worker(base, "celery")
    stack.callback(worker.stop)
    return base


# --- the modes' canvases ------------------------------------------------------------------


def build(mode: str, size: Size, queue: str | None = None) -> list[Any]:
    """K canvases of N trivial children; built before the clock starts, as a caller would.

    In a ``-chain`` mode each child is ``chain(add.s(i, 1), add.s(1), ...)`` of
    ``size.steps`` tasks, and ``chord-chain`` is a chord with those chains in its header.
    """
    opts = {"queue": queue} if queue else {}
    canvases: list[Any] = []
    for _ in range(size.flows):
        children: list[Any]
        if mode.endswith("-chain"):
            children = [
                chain(
                    bench_app.add.s(i, 1).set(**opts),
                    *(bench_app.add.s(1).set(**opts) for _ in range(size.steps - 1)),
                )
                for i in range(size.children)
            ]
        else:
            children = [bench_app.add.s(i, i).set(**opts) for i in range(size.children)]
        parent = bench_app.tsum.s().set(**opts)
        if mode == "group":
            canvases.append(group(children))
        elif mode == GROUP_ONE_MORE:
            canvases.append(group([*children, bench_app.add.s(0, 0).set(**opts)]))
        elif mode in ("chord", "chord-chain", CHORD_ENGINE):
            canvases.append(chord(children, parent))
        elif mode == DEADLINE:
            canvases.append(flow(parent, children, deadline=DEADLINE_S))
        elif mode == WINDOW:
            canvases.append(flow(parent, children, max_active=WINDOW_SIZE))
        elif mode == BATCH:
            canvases.append(flow(parent, children, batch=BATCH_SIZE))
        elif mode.startswith("flow"):
            canvases.append(flow(parent, children))
        else:
            raise ValueError(mode)
    return canvases


def expected(mode: str, size: Size) -> Any:
    if mode.endswith("-chain"):
        return sum(i + size.steps for i in range(size.children))
    values = [2 * i for i in range(size.children)]
    if mode == GROUP_ONE_MORE:
        return [*values, 0]
    return values if mode == "group" else sum(values)


class Waiter:
    """Waits for result keys to appear in the result backend, one EXISTS per chunk and poll.

    Every mode is timed to the moment its results are stored, with the same cheap poll, so
    the clock does not also measure how a client collects results (``GroupResult.get`` decodes
    all N values, a chord's ``get`` one). The values are checked after the clock stops.
    """

    CHUNK = 256

    def __init__(self, backend_client: Any) -> None:
        self.client = backend_client
        self.polls = 0

    def wait(self, task_ids: Sequence[str], timeout: float) -> None:
        keys = [bench_app.app.backend.get_key_for_task(t) for t in task_ids]
        deadline = time.monotonic() + timeout
        while keys:
            chunk = keys[: self.CHUNK]
            self.polls += 1
            if self.client.exists(*chunk) == len(chunk):
                del keys[: self.CHUNK]
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(keys)} results not stored within {timeout:.0f} s")
            time.sleep(0.005)


def only_queue(queue: str) -> None:
    """Leave ``queue`` the only one the store's registry (``emq:queues``) names, before a
    round, outside its counters. A producer looks for each id of a flow on every other queue
    that holds flows (send/ids.py: one EXISTS per id and other queue): flow-traced's own
    queue would add one command per job to every other flow's round, and the other queues
    one to flow-traced's. Each mode's round thus runs as on a store of one queue, as the
    bench's rounds did before flow-traced had a queue of its own. The producer's one-second
    cache of the registry is dropped too (its next enqueue reads it, as after any pause)."""
    from celery_echomq.store.connection import text
    from celery_echomq.store.state import get_state

    state = get_state(bench_app.app)
    key = state.keys.queues_key()
    others = [q for q in state.client.smembers(key) if text(q) != queue]
    if others:
        state.client.srem(key, *others)
    state._queues = (0.0, frozenset())


def result_ids(mode: str, res: Any) -> list[str]:
    return [r.id for r in res.results] if mode in ("group", GROUP_ONE_MORE) else [res.id]


def release_results() -> None:
    """Before the private Redis stops: a result object collected later would try to
    unsubscribe from a server that is gone (and print a traceback at interpreter exit)."""
    gc.collect()
    consumer = getattr(bench_app.app.backend, "result_consumer", None)
    if consumer is not None:
        consumer.cancel_for = lambda task_id: None


def bullmq_ready() -> str | None:
    """Why the BullMQ peer cannot run, or None when it can (installing its pinned bullmq from
    package-lock.json with ``npm ci`` the first time)."""
    if shutil.which("node") is None:
        return "node is not installed"
    if not (BULLMQ_DIR / "node_modules" / "bullmq" / "package.json").is_file():
        if shutil.which("npm") is None:
            return f"bullmq is not installed and npm is absent (npm ci in {BULLMQ_DIR})"
        log(f"bench: npm ci in {BULLMQ_DIR}")
        done = subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"],
            cwd=BULLMQ_DIR,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            return f"npm ci failed: {done.stderr.strip()[-500:]}"
    return None
