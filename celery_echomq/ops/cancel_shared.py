"""A cancelled flow's children that other flows were joined to (``on_exists="join"``): the
cancel leaves them running (includes/cancel_children.lua), since another flow may wait for
them; one that no parent waits for any more is stopped here (cancel_shared.lua).

Read a chunk of children at a time: whether each is shared (its ``:parents``, its row's own
parent), then every one of its parents' states. A parent waits while it is
``awaiting_children``; any other state (cancelled, failed, released) needs the job no more.
"""

from __future__ import annotations

from collections.abc import Iterable

from celery_echomq.store.connection import text
from celery_echomq.store.replies import Status
from celery_echomq.store.state import EchoMQ


def _parents(state: EchoMQ, queue: str, job_id: str, first: str, pq: str) -> list[str]:
    """The row keys of every parent of a shared job: its first, then its edges."""
    keys = state.keys
    found = [keys.job_key(pq or queue, first)] if first else []
    for raw_id, spec in state.client.hscan_iter(keys.parents_key(queue, job_id), count=100):
        found.append(keys.job_key(text(spec).partition("|")[2], text(raw_id)))
    return found


def cut_shared(state: EchoMQ, where: dict[str, str], ids: Iterable[str]) -> list[str]:
    """Cancel those of ``ids`` (children of a flow just cancelled, ``where``: each one's
    queue) that are shared and that none of their parents waits for: the ids cancelled."""
    client, keys = state.client, state.keys
    ids = [cid for cid in ids if cid in where]
    pipe = client.pipeline(transaction=False)
    for cid in ids:
        pipe.hlen(keys.parents_key(where[cid], cid))
        pipe.hmget(keys.job_key(where[cid], cid), ("state", "parent", "pq"))
    answers = iter(pipe.execute())
    cancelled: list[str] = []
    for cid in ids:
        edges, (found, first, pq) = next(answers), next(answers)
        if not edges or found not in (b"pending", b"waiting", b"active"):
            continue
        rows = _parents(state, where[cid], cid, text(first or b""), text(pq or b""))
        pipe = client.pipeline(transaction=False)
        for row in rows:
            pipe.hget(row, "state")
        if b"awaiting_children" in pipe.execute():
            continue  # another flow still waits for it
        ttl = state.settings.result_ttl
        if state.scripts.cancel_shared(where[cid], cid, edges, ttl=ttl) is Status.CANCELLED:
            cancelled.append(cid)
    return cancelled
