"""What the tests share: the environment and workers they run, waits, the CLI, served
dashboards, and the helpers of each concern's tests. No test module imports another; what
two of them use lives here (fixtures in the conftest.py of their folder)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.bin.celery import celery as celery_main
from click.testing import CliRunner, Result
from kombu.transport import redis as kombu_redis

from celery_echomq import flow
from celery_echomq.embedded import WorkerProcess
from celery_echomq.result import FlowResult
from celery_echomq.store.keyspace import Keyspace, new_job_id
from celery_echomq.store.scripts import ParentRef, Scripts
from celery_echomq.store.state import _ATTR, EchoMQ, get_state

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
# Worker logs of this test session (kept after the run for reading a failure).
LOGDIR = Path(os.environ.get("ECHOMQ_TEST_LOGDIR") or tempfile.mkdtemp(prefix="echomq-logs-"))
# One directory per pytest-xdist process: each has its own "session" worker and logs.
LOGDIR = LOGDIR / os.environ.get("PYTEST_XDIST_WORKER", "")
LOGDIR.mkdir(parents=True, exist_ok=True)  # ECHOMQ_TEST_LOGDIR may name a new directory
# The store's keys under the default prefix, built as the package builds them.
KEYS = Keyspace("emq")


class Env:
    """The URLs one test run uses: broker, result backend and flow store on separate DBs."""

    def __init__(self, base: str, broker: str | None = None) -> None:
        self.base = base
        self.broker = broker or f"{base}/11"
        # ECHOMQ_TEST_SHARED_DB=1: the result backend on the store's database, where the store
        # writes a flow job's result itself (celery_echomq/wire/results.py). For the behaviour
        # tests: those that list the store's keys or watch its commands (ops/test_cli's forget and
        # show) leave Celery's result keys out; those that need the two apart (worker/test_held's
        # MONITOR of the store's database, some of store/test_results) skip with
        # ``needs_own_backend_db``.
        self.shared = os.environ.get("ECHOMQ_TEST_SHARED_DB") == "1"
        self.backend = f"{base}/13" if self.shared else f"{base}/12"
        self.store = f"{base}/13"

    def environ(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            ECHOMQ_T_BROKER=self.broker,
            ECHOMQ_T_BACKEND=self.backend,
            ECHOMQ_T_STORE=self.store,
            PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        )
        env.update(extra)
        return env


class Worker(WorkerProcess):
    """A real `celery worker` subprocess (prefork) running tests/proj.py, started at once."""

    def __init__(
        self,
        env: Env,
        *,
        queues: str = "celery",
        concurrency: int = 2,
        name: str = "",
        pool: str = "prefork",
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.name = name or f"w{uuid.uuid4().hex[:8]}"
        super().__init__(
            "tests.proj",
            log=LOGDIR / f"{self.name}.log",
            cwd=ROOT,
            env=env.environ(**(extra_env or {})),
            queues=queues,
            concurrency=concurrency,
            name=self.name,
            pool=pool,
        )
        self.start()


def worker_pair(
    env: Env, first: str, second: str, name: str, extra_env: dict[str, str]
) -> tuple[Worker, Worker]:
    """A worker on ``first`` (concurrency 2) and one on ``second`` (1); none left if one fails."""
    one = Worker(env, queues=first, concurrency=2, name=f"{name}-1", extra_env=extra_env)
    try:
        two = Worker(env, queues=second, concurrency=1, name=f"{name}-2", extra_env=extra_env)
    except BaseException:
        one.stop()
        raise
    return one, two


def wait_for(predicate: Any, timeout: float = 30, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


def quiet(read: Any) -> Any:
    """What ``read()`` returns once it stays the same over a quarter of a second: a worker
    may still be tidying after a flow settles (its lease loop ends the holds it made on its
    next tick), and a snapshot to compare against must not catch it midway."""
    last = [read()]

    def same() -> bool:
        time.sleep(0.25)
        now = read()
        unchanged = now == last[0]
        last[0] = now
        return unchanged

    wait_for(same, timeout=30)
    return last[0]


def release_tree(release: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A landed release's tree (``git archive`` of its commit in this repository's history),
    for subprocesses that put it first on their PYTHONPATH; skips without that history."""
    git = shutil.which("git")
    known = git and subprocess.run(
        [git, "-C", str(ROOT), "cat-file", "-e", f"{release}^{{commit}}"],
        capture_output=True,
    )
    if not git or not known or known.returncode != 0:
        pytest.skip(
            f"no git history with commit {release} (an sdist, a shallow clone, no git): "
            "the test needs that release's tree from the repository's history"
        )
    tree = tmp_path_factory.mktemp(f"release-{release}")
    archive = subprocess.run(
        [git, "-C", str(ROOT), "archive", release], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


needs_own_backend_db = pytest.mark.skipif(
    os.environ.get("ECHOMQ_TEST_SHARED_DB") == "1",
    reason="needs the result backend on a database of its own (ECHOMQ_TEST_SHARED_DB=1)",
)


# --- the CLI, in-process and as a user runs it --------------------------------------------------


def with_id(sig: Any) -> Any:
    """``sig`` with a job id of its own, so that the test knows which row is which."""
    return sig.set(task_id=new_job_id())


def id_of(sig: Any) -> str:
    """The job id ``sig`` was given (:func:`with_id`)."""
    return str(sig.options["task_id"])


def echomq(*args: str) -> Result:
    """Run `celery -A tests.proj echomq ARGS` in this process."""
    return CliRunner().invoke(
        celery_main, ["-A", "tests.proj", "echomq", *args], catch_exceptions=False
    )


def echomq_process(env: Env, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """Run `celery -A tests.proj echomq ARGS` as a subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.proj", "echomq", *args],
        cwd=ROOT,
        env=env.environ(**extra),
        capture_output=True,
        text=True,
        timeout=120,
    )


def state_of(store: redis.Redis, job_id: str, queue: str = "celery") -> str | None:
    value = store.hget(KEYS.job_key(queue, job_id), "state")
    return value.decode() if value is not None else None


def settle(res: Any, queue: str = "celery") -> Any:
    """The flow's value, once its parent's row has finished too.

    Celery stores a task's result before task_success (which finishes the row) fires, so
    ``get()`` can return a moment before ``show`` would say "done".
    """
    value = res.get(timeout=60)
    store = redis.Redis.from_url(os.environ["ECHOMQ_T_STORE"])
    wait_for(lambda: state_of(store, res.id, queue) in ("done", "failed", "cancelled"))
    return value


# --- the dashboard served in this process -------------------------------------------------------


CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# A DNS name of an attacker's that resolves to this machine (a rebinding attack).
REBOUND = "rebound.attacker.test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """A dashboard served by uvicorn in a thread of this process."""

    def __init__(self, app: Any, *, allow_actions: bool, exposure: Any = None) -> None:
        import uvicorn

        from celery_echomq.ops.dashboard import make_app

        self.asgi = make_app(app, allow_actions=allow_actions, exposure=exposure)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.asgi, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, timeout=30)

    @property
    def token(self) -> str:
        return str(self.asgi.state.dashboard.token)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


# --- RabbitMQ -----------------------------------------------------------------------------------


RABBIT = "amqp://guest:guest@127.0.0.1:5672//"


def rabbit_answers() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=2):
            return True
    except OSError:
        return False


# --- kombu --------------------------------------------------------------------------------------


# kombu's Redis transport batches publishes from 5.7 on; with an older kombu every message takes
# Producer.publish, and there is no second path to compare.
needs_batching = pytest.mark.skipif(
    not hasattr(kombu_redis.Channel, "create_publish_batch"),
    reason="this kombu's Redis transport does not batch publishes (kombu < 5.7)",
)


# --- eagerly and on a worker (Celery's own chord tests' way) ------------------------------------


def ways(*, worker_for_both: bool) -> list[Any]:
    eager_marks = [pytest.mark.e2e] if worker_for_both else []
    return [
        pytest.param("apply", id="eager", marks=eager_marks),
        pytest.param("apply_async", id="worker", marks=[pytest.mark.e2e]),
    ]


def run(sig: Any, how: str, args: tuple[Any, ...] = (), kwargs: Any = None, **options: Any) -> Any:
    """``sig.apply(...)`` or ``sig.apply_async(...)``: the result."""
    return getattr(sig, how)(args, kwargs, **options)


# --- counters, duplicates and recovery in a worker's log ----------------------------------------


def skipped(worker: Any, job_id: str, why: str) -> bool:
    return f"skip duplicate delivery of {job_id} ({why})" in worker.output()


def counters(client: Any, queue: str) -> dict[str, int]:
    raw = client.hgetall(KEYS.queue_key(queue, "counters"))
    return {k.decode(): int(v) for k, v in raw.items()}


RECOVERY_STALL = 3.0  # the stall timeout of the recovery tests' workers, in seconds


def fast_recovery(**extra: str) -> dict[str, str]:
    """A worker that treats a job as lost after RECOVERY_STALL seconds and looks twice a second."""
    return {"ECHOMQ_T_STALL": str(RECOVERY_STALL), "ECHOMQ_T_RECOVERY_INTERVAL": "0.5", **extra}


def logged(worker: Any, text: str, timeout: float = 30) -> None:
    """Wait until the worker's log shows ``text`` (a repair is logged as it is made); if it
    never does, the assertion carries the end of the log, what a reader of a failed run needs."""
    try:
        wait_for(lambda: text in worker.output(), timeout=timeout)
    except AssertionError:
        tail = "\n".join(worker.output().splitlines()[-40:])
        message = f"{text!r} not logged within {timeout}s; the log ends:\n{tail}"
        raise AssertionError(message) from None


def jobs(n: int) -> list[str]:
    """``n`` new job ids."""
    return [new_job_id() for _ in range(n)]


def row(client: Any, queue: str, job_id: str) -> dict[str, str]:
    """A job's row as a person reads it (without its stored job)."""
    raw = client.hgetall(KEYS.job_key(queue, job_id))
    stored = (b"payload", b"delta", b"template")
    return {k.decode(): v.decode(errors="replace") for k, v in raw.items() if k not in stored}


# --- a backlog of flows -------------------------------------------------------------------------


# A backlog worker's stall timeout (seconds) and environment: recovery looks twice a second.
BACKLOG_STALL = "1"
BACKLOG_WORKER = {"ECHOMQ_T_STALL": BACKLOG_STALL, "ECHOMQ_T_RECOVERY_INTERVAL": "0.5"}


Sent = list[tuple[FlowResult, str, list[str]]]


def send_flows(
    proj: Any, queue: str, flows: int, size: int, seconds: float, app: Any = None
) -> Sent:
    """``flows`` flows of ``size`` children; child i of flow f returns ``f * 100 + i``."""
    sent = []
    for f in range(flows):
        tag, ids = uuid.uuid4().hex, [new_job_id() for _ in range(size)]
        kids = [
            proj.slow_child.s(f * 100 + i, seconds).set(task_id=cid) for i, cid in enumerate(ids)
        ]
        res = flow(proj.collect.s(tag=tag), kids, app=app).apply_async(queue=queue)
        sent.append((res, tag, ids))
    return sent


def check_each_ran_once(store: redis.Redis, sent: Sent, timeout: float, first: int = 0) -> None:
    for f, (res, tag, ids) in enumerate(sent, start=first):
        assert res.get(timeout=timeout) == {
            "values": [f * 100 + i for i in range(len(ids))],
            "tag": tag,
        }
        assert res.dependencies() == (0, len(ids), 0, 0)
        assert int(store.get(f"test:ran:collect:{tag}") or 0) == 1, "the parent ran twice"
        runs = [int(store.get(f"test:ran:slow:{cid}") or 0) for cid in ids]
        assert runs == [1] * len(ids), f"bodies ran {runs}"


# --- the scripts one by one ---------------------------------------------------------------------


TTL = 600  # seconds a settled flow's keys live
LEASE = 60_000  # ms a claim holds


def enqueue(scripts: Scripts, queue: str, n: int) -> tuple[str, list[str]]:
    parent = new_job_id()
    children = [new_job_id() for _ in range(n)]
    scripts.enqueue_flow(queue, parent, b"parent", [(c, f"payload-{c}".encode()) for c in children])
    return parent, children


def run_child(scripts: Scripts, queue: str, parent: str, child: str, value: bytes) -> str:
    token = uuid.uuid4().hex
    assert scripts.claim(queue, child, token, LEASE)[0] == "claimed"
    return scripts.complete(
        queue, child, token, ttl=TTL, is_parent=False, parent=ParentRef(parent, queue), value=value
    )


# What a live worker's recovery loop writes whenever it likes: a lease of the store's
# (emq:lease:<name>) or of a queue's (emq:{<queue>}:lease:<name>), taken with SET NX PX and
# given back with a DEL; and what it records for the dashboard (emq:workers, a queue's
# per-minute samples).
WORKER_LOOP_KEY = re.compile(rb"emq:((\{[^}]*\}:)?lease:|workers$|\{[^}]*\}:minutes$)")


def kept_keys(db: redis.Redis) -> frozenset[bytes]:
    """Every key but what a live worker's recovery loop writes (:data:`WORKER_LOOP_KEY`): what
    "nothing was written" compares while workers run beside the test."""
    return frozenset(k for k in db.scan_iter(count=1000) if not WORKER_LOOP_KEY.match(k))


def keys_written(db: redis.Redis, before: frozenset[bytes]) -> list[bytes]:
    """The keys of :func:`kept_keys` that ``before`` lacks, sorted: what a refused send must
    leave empty. Only new keys count: a key of another test's flow may expire or empty
    (a drained active set) while the test runs."""
    return sorted(kept_keys(db) - before)


def snapshot(db: redis.Redis, *ids: str) -> dict[bytes, Any]:
    """Every key with its value and whether it expires: what "nothing changed" compares.

    With ``ids``, only what concerns those jobs (a live worker elsewhere renews leases and
    counters): their keys, and their scores in the queues' state sets.
    """
    out: dict[bytes, Any] = {}
    for key in sorted(db.keys("*")):
        if ids and key.endswith(b":reserved"):
            # A live worker's holds on the messages it received: its lease loop ends each a
            # moment after the job's claim, whenever it next runs.
            continue
        kind = db.type(key)
        mine = not ids or any(i.encode() in key for i in ids)
        if kind == b"zset":
            # Members only: a live worker's lease renewals move the active set's scores.
            value: Any = [m for m in db.zrange(key, 0, -1) if not ids or m.decode() in ids]
            if ids and not value:
                continue  # a set that holds none of them (another test's may come and go)
        elif not mine:
            continue
        elif kind == b"hash":
            value = db.hgetall(key)
        elif kind == b"string":
            value = db.get(key)
        else:
            value = kind
        out[key] = (value, db.ttl(key) > 0)
    return out


def script_args(store: redis.Redis) -> list[int]:
    """How many arguments each script call SLOWLOG holds had (it keeps 32 and counts the rest):
    what a test reads to show that a big flow's work went a chunk per call."""
    sizes = []
    for entry in store.slowlog_get(100_000):
        words = entry["command"].split(b" ")
        if words[0].upper() not in (b"EVALSHA", b"EVAL"):
            continue
        more = re.search(rb"\.\.\. \((\d+) more arguments\)", entry["command"])
        sizes.append(31 + int(more.group(1)) if more else len(words))
    return sizes


# --- which bodies ran, and a store of one test's own ------------------------------------------


_SUCCEEDED = re.compile(r"Task (\S+)\[(JOB\w+)\] succeeded")


def runs_in_log(*logs: Path) -> Counter[str]:
    """How many times each task id's body ran to success, from the workers' INFO logs."""
    counts: Counter[str] = Counter()
    for log in logs:
        text = log.read_text(errors="replace") if log.exists() else ""
        counts.update(m.group(2) for m in _SUCCEEDED.finditer(text))
    return counts


@contextlib.contextmanager
def store_of(app: Any, **changes: Any) -> Iterator[EchoMQ]:
    """This process's app stores its flows elsewhere for one test, then goes back."""
    saved = get_state(app)
    state = EchoMQ(app, dataclasses.replace(saved.settings, **changes))
    setattr(app, _ATTR, state)
    try:
        yield state
    finally:
        setattr(app, _ATTR, saved)
        if state._client is not None:
            state._client.close()
