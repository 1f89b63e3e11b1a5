"""Chords on the engine whose header tasks are delivered many to a message
(``echomq_chord_batch = N``, chords.py, send/batches.py): the same values, results and order
as a message each; a header a batch cannot carry goes out as Celery sends it."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import chord

from celery_echomq.errors import ConfigError
from tests.helpers import Env, Worker, kept_keys, keys_written

pytestmark = pytest.mark.e2e

TIMEOUT = 60


@pytest.fixture(scope="module")
def queue(env: Env) -> Iterator[tuple[str, Worker]]:
    """A queue of this module's own, with a worker whose chords are on the engine."""
    name = f"chb-{uuid.uuid4().hex[:8]}"
    worker = Worker(env, queues=name, name=name, extra_env={"ECHOMQ_T_CHORDS": "1"})
    yield name, worker
    worker.stop()


@pytest.fixture
def batched(proj: Any) -> Iterator[Any]:
    """This process's chords on the engine, their header tasks 10 to a message."""
    conf = proj.app.conf
    conf.echomq_chords, conf.echomq_chord_batch = True, 10
    yield conf
    conf.echomq_chords, conf.echomq_chord_batch = False, None


def batches_run(worker: Worker) -> int:
    # Received: logged before any of its children runs, so counted whole once a chord's
    # result is in (its "succeeded" may come after).
    return len(re.findall(r"celery_echomq\.batch\[[^\]]+\] received", worker.output()))


def test_a_chords_header_goes_out_ten_to_a_message(
    proj: Any, batched: Any, queue: tuple[str, Worker]
) -> None:
    name, worker = queue
    before = batches_run(worker)
    res = chord([proj.add.s(i, i) for i in range(25)], proj.tsum.s()).apply_async(queue=name)
    assert res.get(timeout=TIMEOUT) == sum(2 * i for i in range(25))
    assert res.parent.get(timeout=TIMEOUT) == [2 * i for i in range(25)]
    assert batches_run(worker) - before == 3


def test_a_header_task_run_from_its_batch_knows_its_place_in_the_group(
    proj: Any, batched: Any, queue: tuple[str, Worker]
) -> None:
    # A batch runs each header task from its row: its request has the group and place
    # Celery's chord gives it.
    name, _ = queue
    res = chord([proj.group_of.s(i) for i in range(12)], proj.collect.s()).apply_async(queue=name)
    assert res.get(timeout=TIMEOUT)["values"] == [[res.parent.id, i] for i in range(12)]


def test_a_header_a_batch_cannot_carry_goes_out_a_message_a_task(
    proj: Any, batched: Any, queue: tuple[str, Worker]
) -> None:
    name, worker = queue
    before = batches_run(worker)
    header = [proj.add.s(1, 1), proj.add.s(2, 2) | proj.square.s()]
    res = chord(header, proj.tsum.s()).apply_async(queue=name)
    assert res.get(timeout=TIMEOUT) == 2 + 16
    assert batches_run(worker) == before


@pytest.mark.parametrize("value", [-1, 1001, "10", 2.5])
def test_a_setting_that_is_not_a_size_is_refused_and_nothing_is_sent(
    proj: Any, batched: Any, env: Env, store: redis.Redis, value: Any
) -> None:
    batched.echomq_chord_batch = value
    broker = redis.Redis.from_url(env.broker)
    before, queued = kept_keys(store), broker.llen("celery")
    with pytest.raises(ConfigError, match=r"echomq_chord_batch: .* allowed: an int from 1 to 1000"):
        chord([proj.add.s(1, 1)], proj.tsum.s()).apply_async()
    assert not keys_written(store, before)
    assert broker.llen("celery") == queued


def test_a_chords_own_batch_option_is_checked_as_the_chords(proj: Any, batched: Any) -> None:
    with pytest.raises(ValueError, match=r"chord\(batch=\.\.\.\): 0 is not allowed"):
        chord([proj.add.s(1, 1)], proj.tsum.s()).apply_async(batch=0)
