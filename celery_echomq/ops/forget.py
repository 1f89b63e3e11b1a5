"""Forgetting a finished flow: deleting its keys before they expire (``echomq forget``)."""

from __future__ import annotations

from celery_echomq.ops.views import JobNode, walk
from celery_echomq.store.state import EchoMQ

# The per-queue sorted sets that hold job ids: a forgotten job leaves every one of them.
# (outbox: children of another slot's parent awaiting credit; open: flows not sealed yet;
# adding: flows with children staged for another slot; recent: the flows the dashboard lists,
# an index, not a state set.)
JOB_SETS = ("pending", "active", "failed", "outbox", "open", "recent", "adding")


def forget_flow(state: EchoMQ, node: JobNode) -> list[str]:
    """Delete every key of the flow ``node`` heads; return the deleted keys.

    Each queue's keys go in one MULTI (they share a slot); the locators live on other slots
    (``emq:loc:{id}``), so they go after, one command each, which also works on a cluster.
    Ids leave the queue's state sets too, so ``stats`` and recovery stop seeing them.
    """
    keys, client = state.keys, state.client
    by_queue: dict[str, list[JobNode]] = {}
    for job in walk(node):
        by_queue.setdefault(job.queue, []).append(job)
    deleted: list[str] = []
    for queue, jobs in by_queue.items():
        names: list[str] = []
        for job in jobs:
            names.append(keys.job_key(queue, job.id))
            if job.flow is not None:
                names.extend(keys.flow_keys(queue, job.id))
                names.append(keys.settled_key(queue, job.id))
                names.append(keys.children_key(queue, job.id))
                names.append(keys.failures_key(queue, job.id))
                names.append(keys.adding_key(queue, job.id))
        pipe = client.pipeline(transaction=True)
        for name in names:
            pipe.exists(name)  # to report only the keys that were there
        pipe.delete(*names)
        ids = [job.id for job in jobs]
        for set_name in JOB_SETS:
            pipe.zrem(keys.queue_key(queue, set_name), *ids)
        held = sum(1 for job in jobs if job.flow is not None and job.state == "awaiting_children")
        if held:
            # A held parent forgotten (--force) leaves the queue's count of held parents.
            pipe.hincrby(keys.queue_key(queue, "counters"), "held", -held)
        existed = pipe.execute()[: len(names)]
        deleted.extend(name for name, there in zip(names, existed, strict=True) if there)
    for job in walk(node):
        if job.flow is not None:
            locator = keys.locator_key(job.id)
            if client.delete(locator):
                deleted.append(locator)
    return deleted
