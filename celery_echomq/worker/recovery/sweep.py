"""One recovery pass over every queue that holds flows."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from celery_echomq.store.reads import queues_of
from celery_echomq.store.state import EchoMQ
from celery_echomq.worker.recovery.common import BATCH, FAILED_MARK, HOLD_MS, now_ms
from celery_echomq.worker.recovery.lost import lost_pending
from celery_echomq.worker.recovery.stalled import lost_active, unrecorded_failures
from celery_echomq.worker.recovery.unfinished import (
    uncredited_edges,
    uncredited_outbox,
    unsealed_flows,
    unwritten_children,
)

logger = logging.getLogger("celery_echomq")


def anything_due(state: EchoMQ, queues: Iterable[str] | None = None) -> bool:
    """Whether a pass would find anything to look at: two read-only round trips.

    The worker step checks this before it takes the lease, so an idle system's passes are pure
    reads: no lease written every interval (which an fsync-always AOF would pay for), nothing
    for a person watching the store to mistake for activity.
    """
    client, keys, stall = state.client, state.keys, state.settings.stall_ms
    names = queues_of(state, queues)
    if not names:
        return False
    now = now_ms(client)
    due = {
        "adding": now - stall,
        "outbox": now - stall,
        "joined": now - stall,
        "open": now - stall,
        "pending": now - stall,
        "active": now,
        "deadlines": now,
    }
    pipe = client.pipeline(transaction=False)
    for queue in names:
        for set_name, before in due.items():
            pipe.zrangebyscore(keys.queue_key(queue, set_name), "-inf", before, start=0, num=1)
        pipe.get(keys.queue_key(queue, FAILED_MARK))
    replies = pipe.execute()
    width = len(due) + 1
    if any(any(replies[i * width : i * width + len(due)]) for i in range(len(names))):
        return True
    # Failed entries are due (d) past the queue's mark, and past a stall timeout.
    pipe = client.pipeline(transaction=False)
    for i, queue in enumerate(names):
        mark = int(float(replies[i * width + len(due)] or 0))
        low = max(mark, now - state.settings.result_ttl * 1000)
        pipe.zrangebyscore(keys.queue_key(queue, "failed"), f"({low}", now - stall, start=0, num=1)
    return any(pipe.execute())


def run_pass(
    state: EchoMQ, *, queues: Iterable[str] | None = None, batch: int = BATCH
) -> list[str]:
    """One recovery pass over every queue in ``emq:queues`` (or only those of them named in
    ``queues``): one line per repair, with ids."""
    from celery_echomq.worker.deadline_poller import fire_all

    names = queues_of(state, queues)
    # Deadlines due and not yet fired (the workers' pollers fire them within a poll).
    repairs: list[str] = fire_all(state, names, batch)
    for queue in names:
        # Outbox and open flows first: they can release parents that (c) then finds pending.
        for step in (
            unwritten_children,
            uncredited_outbox,
            uncredited_edges,
            unsealed_flows,
            lost_pending,
            lost_active,
            unrecorded_failures,
        ):
            for line in step(state, queue, batch):
                logger.warning("echomq recovery: %s", line)
                repairs.append(line)
    return repairs


def recover_now(state: EchoMQ, *, queues: Iterable[str] | None = None) -> list[str]:
    """Two passes :data:`HOLD_MS` apart: what ``celery echomq recover`` runs. The first look
    records the evidence that a message is gone; the second confirms it and re-publishes."""
    repairs = run_pass(state, queues=queues)
    time.sleep(HOLD_MS / 1000 + 0.1)
    return repairs + run_pass(state, queues=queues)
