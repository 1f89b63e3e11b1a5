"""An id names one job in the whole store, on whichever queue its row lives.

A script refuses an id whose row exists on its own slot; a row of another queue lives on
another slot, where the script cannot look. So before a flow (or children added to one)
lands, the host looks for each of its ids on every other queue that holds flows: one
pipelined EXISTS per id and other queue, nothing at all on a store with one queue. The
queues are read at most once a second (``EchoMQ.known_queues``).
"""

from __future__ import annotations

from collections.abc import Mapping

from .errors import FlowExistsError
from .state import EchoMQ


def refuse_taken(state: EchoMQ, placed: Mapping[str, str]) -> None:
    """Raise :class:`FlowExistsError` when an id of ``placed`` (id -> the queue it will live
    on) has a row on another queue."""
    queues = sorted(state.known_queues())
    if len(queues) < 2 and set(placed.values()) <= set(queues):
        return
    keys, chunk = state.keys, state.settings.chunk_size
    checks = [(job_id, q) for job_id, own in placed.items() for q in queues if q != own]
    for start in range(0, len(checks), chunk):
        part = checks[start : start + chunk]
        pipe = state.client.pipeline(transaction=False)
        for job_id, queue in part:
            pipe.exists(keys.job_key(queue, job_id))
        for (job_id, queue), there in zip(part, pipe.execute(), strict=True):
            if there:
                raise FlowExistsError(
                    f"job id {job_id!r} already exists in Redis, on queue {queue!r}; an id "
                    "names one job in the whole store, and a flow never overwrites a job "
                    "(nothing was written or published)"
                )
