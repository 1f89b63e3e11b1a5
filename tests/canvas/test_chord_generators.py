"""A chord whose header is a generator, on the flow engine: sent as it is read, as Celery
sends it, and failed (not held forever) when the reading stops: the generator raises, or its
producer dies. Each beside the same chord with the setting off."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import chord
from celery.exceptions import ChordError
from celery.result import AsyncResult

import celery_echomq
from tests.canvas.test_chords import chords_env, engine, held_by_engine, queue, queues
from tests.helpers import KEYS, ROOT, Env, fast_recovery, logged, wait_for

pytestmark = pytest.mark.e2e
__all__ = ["engine", "queue", "queues"]  # the fixtures this module shares


def finished(proj: Any, task_id: str, within: float = 20.0) -> bool:
    """Whether the task ``task_id`` finished within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if AsyncResult(task_id, app=proj.app).ready():
            return True
        time.sleep(0.1)
    return False


def waits_for_its_first(proj: Any, first_id: str, seen: list[bool]) -> Iterator[Any]:
    """Four tasks; before the last is read, the first must have run (it was sent already)."""
    yield proj.add.s(0, 0).set(task_id=first_id)
    yield proj.add.s(1, 1)
    yield proj.add.s(2, 2)
    seen.append(finished(proj, first_id))
    yield proj.add.s(3, 3)


def test_a_generator_header_is_sent_as_it_is_read(proj: Any, engine: str, queue: str) -> None:
    first_id, seen = str(uuid.uuid4()), []
    res = chord(waits_for_its_first(proj, first_id, seen), proj.tsum.s()).apply_async(queue=queue)
    assert res.get(timeout=60) == 12
    assert seen == [True], "the first task had not run when the last was read"
    assert held_by_engine(res.id) is (engine == "on")
    if engine == "on":
        deps = celery_echomq.dependencies(res.id)
        assert (deps.outstanding, deps.done) == (0, 4)


def test_a_generator_header_that_raises(
    proj: Any, store: redis.Redis, engine: str, queue: str
) -> None:
    def header() -> Iterator[Any]:
        yield proj.add.s(1, 1)
        yield proj.add.s(2, 2)
        raise RuntimeError("the header broke")

    body_id = str(uuid.uuid4())
    with pytest.raises(RuntimeError, match="the header broke"):
        chord(header(), proj.tsum.s()).apply_async(queue=queue, task_id=body_id)
    body = AsyncResult(body_id, app=proj.app)
    if engine == "off":
        # Celery's chord waits for a header that will never end: its body stays pending.
        time.sleep(3)
        assert body.state == "PENDING"
        return
    # On the engine the flow fails at once, saying why; nothing holds it.
    wait_for(lambda: body.state == "FAILURE", timeout=10)
    assert isinstance(body.result, ChordError)
    assert "the header broke" in str(body.result)
    assert store.zscore(KEYS.queue_key(queue, "open"), body_id) is None


PRODUCER = """
import os, signal, sys
from celery import chord
from tests import proj

queue, body_id = sys.argv[1:]

def header():
    yield proj.add.s(1, 1)
    yield proj.add.s(2, 2)
    yield proj.add.s(3, 3)
    os.kill(os.getpid(), signal.SIGKILL)  # the producer dies while reading its header
    yield proj.add.s(4, 4)

chord(header(), proj.tsum.s()).apply_async(queue=queue, task_id=body_id)
print("not killed")
"""


def test_the_producer_killed_while_reading_a_generator_header(
    proj: Any, env: Env, own_queue: Any, start_worker: Any, engine: str
) -> None:
    queue = str(own_queue("chgen"))
    body_id = str(uuid.uuid4())
    proc = subprocess.run(
        [sys.executable, "-c", PRODUCER, queue, body_id],
        cwd=ROOT,
        env={**env.environ(), **chords_env(engine)},
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode(errors="replace")
    w = start_worker(queues=queue, extra_env=chords_env(engine, **fast_recovery()))
    body = AsyncResult(body_id, app=proj.app)
    if engine == "off":
        time.sleep(6)
        assert body.state == "PENDING"  # Celery's chord: a header never ended, a body never run
        return
    # The tasks read before the producer died ran; the header was never read to its end, so
    # recovery fails the flow (its body would get a part of its values) instead of holding it.
    logged(w, f"failed flow {body_id}", timeout=60)
    wait_for(lambda: body.state == "FAILURE", timeout=10)
    assert isinstance(body.result, ChordError)
    assert "producer stopped while reading its chord's header" in str(body.result)
