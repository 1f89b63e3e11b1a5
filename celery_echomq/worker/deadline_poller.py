"""Every worker with ``install(app)`` polls the deadline index of each queue it consumes, four
times a second, and fires what has come due: whichever worker gets there first fires it
(deadline.lua decides), the others find nothing to do. Threads of the worker's main process,
beside the recovery loop (a long recovery pass never delays a deadline), one to look and
fire, one for what follows; ``recovery.run_pass`` (``celery echomq recover``) fires due
deadlines too.
"""

from __future__ import annotations

import logging
import queue as queues_
import threading
from collections.abc import Iterable
from typing import Any

from celery import bootsteps
from redis.cluster import RedisCluster

from celery_echomq.errors import InvalidIdError, StoreFormatError
from celery_echomq.store.connection import text
from celery_echomq.store.deadlines import index_key
from celery_echomq.store.keyspace import check_id
from celery_echomq.store.state import EchoMQ, find_state
from celery_echomq.worker.checks import wait_for_store
from celery_echomq.worker.deadlines import Step, finish, fire_one

logger = logging.getLogger("celery_echomq")

POLL = 0.25  # seconds between two looks at the indexes: a deadline is acted on within this
BATCH = 100  # entries read per queue and look (the earliest: every due one is among them)


def due_entries(
    state: EchoMQ, queues: Iterable[str], batch: int = BATCH
) -> list[tuple[str, str, float]]:
    """``(queue, parent id, due ms)`` of the entries due now, on the store's clock: one
    round trip (TIME and the head of every queue's index; on a Redis Cluster, whose pipelines
    take no keyless command, TIME first, from any node)."""
    names = list(queues)
    if not names:
        return []
    cluster = isinstance(state.client, RedisCluster)
    pipe = state.client.pipeline(transaction=False)
    if not cluster:
        pipe.time()
    for queue in names:
        pipe.zrange(index_key(state, queue), 0, batch - 1, withscores=True)
    heads = pipe.execute()
    seconds, micros = state.client.time() if cluster else heads.pop(0)
    now = int(seconds) * 1000 + int(micros) // 1000
    due = []
    for queue, head in zip(names, heads, strict=True):
        for member, score in head:
            if score > now:
                break
            try:
                due.append((queue, check_id(text(member)), float(score)))
            except InvalidIdError:
                logger.warning("echomq deadlines: ill-formed id %r in %s", member, queue)
    return due


def fire_all(state: EchoMQ, queues: Iterable[str], batch: int = BATCH) -> list[str]:
    """Fire every due deadline of ``queues``: one line per deadline acted on."""
    steps = fire_steps(state, queues, batch)
    return finish(state, steps) if steps else []


def fire_steps(state: EchoMQ, queues: Iterable[str], batch: int = BATCH) -> list[Step]:
    """Fire every due deadline of ``queues`` (the scripts are what "on time" means); what
    follows each is returned, for :func:`~.deadlines.finish`."""
    steps = []
    for queue, parent_id, _ in due_entries(state, queues, batch):
        try:
            step = fire_one(state, queue, parent_id)
        except StoreFormatError as exc:  # a newer release's flow: its workers fire it
            state.tell_newer(exc, f"deadline of {parent_id} on {queue}")
            continue
        except Exception as exc:  # one flow's trouble must not stop the others
            logger.warning("echomq deadlines: %s on %s: %r", parent_id, queue, exc)
            continue
        if step is not None:
            steps.append(step)
    return steps


def registered(state: EchoMQ) -> list[str]:
    from celery_echomq.store.reads import queues_of

    return queues_of(state, None)


class DeadlinePoller:
    """A daemon thread that fires due deadlines of every queue that holds flows."""

    def __init__(self, state: EchoMQ, poll: float = POLL, app: Any = None) -> None:
        self.state = state
        self.app = app
        self.poll = poll
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # What follows a fired deadline (a result written, a publish, a revoke) takes a few
        # ms per flow: a thread of its own, so that the next look is never held up by it.
        self._follow: queues_.Queue[list[Step] | None] = queues_.Queue()

    def start(self) -> None:
        for target, name in ((self._run, "echomq-deadlines"), (self._finish, "echomq-follow")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        self._follow.put(None)
        for thread in self._threads:
            thread.join(timeout=10)

    def queues(self) -> list[str]:
        """The queues this worker consumes (read at each look: ``add_consumer`` can change
        them), as recovery does: a queue's deadlines are kept by the workers that run its
        jobs. Without an app (a poller of one's own): every queue that holds flows."""
        if self.app is None:
            return registered(self.state)
        return sorted(str(name) for name in self.app.amqp.queues.consume_from)

    def _finish(self) -> None:
        while True:
            steps = self._follow.get()
            if steps is None:
                return
            try:
                finish(self.state, steps)
            except Exception as exc:  # the entries stay: found again once their lease lapses
                logger.warning("echomq deadlines: follow-up failed: %r", exc)

    def _run(self) -> None:
        if not wait_for_store(self.state, self._stop):
            return
        while not self._stop.is_set():
            try:
                steps = fire_steps(self.state, self.queues())
                if steps:
                    self._follow.put(steps)
            except Exception as exc:
                logger.warning("echomq deadlines: poll failed: %s: %s", type(exc).__name__, exc)
            self._stop.wait(self.poll)


class DeadlineStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """The worker step that runs :class:`DeadlinePoller` (added by ``celery_echomq.install``)."""

    label = "echomq deadlines"
    requires = ("celery.worker.components:Pool",)

    def create(self, worker: Any) -> DeadlinePoller | None:
        state = find_state(worker.app)
        if state is None:
            return None
        return DeadlinePoller(state, app=worker.app)
