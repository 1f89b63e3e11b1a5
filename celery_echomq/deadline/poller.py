"""Every worker with ``install(app)`` polls each queue's deadline index, a few times a second,
and fires what has come due: whichever worker gets there first fires it (deadline.lua
decides), the others find nothing to do. A thread of the worker's main process, beside the
recovery loop, so that a long recovery pass never delays a deadline; ``recovery.run_pass``
(``celery echomq recover``) fires due deadlines too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from celery import bootsteps

from ..errors import InvalidIdError
from ..keyspace import check_id
from ..state import EchoMQ, find_state
from ..store import text
from .fire import fire_due
from .store import index_key

logger = logging.getLogger("celery_echomq")

POLL = 0.25  # seconds between two looks at the indexes: a deadline is acted on within this
BATCH = 100  # entries read per queue and look (the earliest: every due one is among them)
QUEUES_EVERY = 5.0  # seconds between two reads of the registry of queues


def due_entries(
    state: EchoMQ, queues: Iterable[str], batch: int = BATCH
) -> list[tuple[str, str, float]]:
    """``(queue, parent id, due ms)`` of the entries due now, on the store's clock: one
    round trip (TIME and the head of every queue's index)."""
    names = list(queues)
    if not names:
        return []
    pipe = state.client.pipeline(transaction=False)
    pipe.time()
    for queue in names:
        pipe.zrange(index_key(state, queue), 0, batch - 1, withscores=True)
    (seconds, micros), *heads = pipe.execute()
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
    lines = []
    for queue, parent_id, _ in due_entries(state, queues, batch):
        try:
            line = fire_due(state, queue, parent_id)
        except Exception as exc:  # one flow's trouble must not stop the others
            logger.warning("echomq deadlines: %s on %s: %r", parent_id, queue, exc)
            continue
        if line:
            lines.append(line)
    return lines


def registered(state: EchoMQ) -> list[str]:
    from ..recovery.sweep import queues_of

    return queues_of(state, None)


class DeadlinePoller:
    """A daemon thread that fires due deadlines of every queue that holds flows."""

    def __init__(self, state: EchoMQ, poll: float = POLL) -> None:
        self.state = state
        self.poll = poll
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="echomq-deadlines", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        queues: list[str] = []
        read_at = 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() >= read_at:
                    queues, read_at = registered(self.state), time.monotonic() + QUEUES_EVERY
                fire_all(self.state, queues)
            except Exception as exc:
                logger.warning("echomq deadlines: poll failed: %r", exc)
            self._stop.wait(self.poll)


class DeadlineStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """The worker step that runs :class:`DeadlinePoller` (added by ``celery_echomq.install``)."""

    label = "echomq deadlines"
    requires = ("celery.worker.components:Pool",)

    def create(self, worker: Any) -> DeadlinePoller | None:
        state = find_state(worker.app)
        if state is None:
            return None
        return DeadlinePoller(state)
