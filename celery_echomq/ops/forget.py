"""Forgetting a finished flow: deleting its keys before they expire (``echomq forget``).

A flow of any size is deleted a chunk of children (``echomq_chunk_size``) at a time, read
from its parent's index, each nested flow before the chunk that lists it, and its parent's
own keys last: a forget cut short leaves the parent and what is left of its index, so the
same forget run again finishes it. Big keys go with UNLINK (freed off Redis's main thread).

A cancelled child's message may still wait in its queue (a queue no worker consumed when it
was revoked, a countdown, a worker that missed Celery's revoke broadcast). Its row is what
turns that message away (the claim finds it cancelled), and a message whose row is gone runs
as a plain task; so a cancelled child's row is not deleted but cut down to what the claim
reads (its state and parent), expiring when the row would have: forgetting a flow never lets
a cancelled job run that keeping it would have stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from celery_echomq.ops.cancel import where_children
from celery_echomq.ops.pages import child_positions
from celery_echomq.ops.views import FINISHED, JobNode
from celery_echomq.store.connection import text
from celery_echomq.store.state import EchoMQ
from celery_echomq.store.store_format import newer_than_known


@dataclass
class Forgotten:
    """What a forget deleted: every job of the tree (parents before their children), those
    not finished, and the keys that were there."""

    jobs: list[str] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    # Cancelled children whose rows were cut down to what turns their messages away.
    kept: list[str] = field(default_factory=list)


def forget_flow(state: EchoMQ, node: JobNode) -> Forgotten:
    """Delete every key of the flow ``node`` heads (nested flows too) and its locators.

    Each chunk's keys on one queue go in one script (forget.lua: they share a slot), which
    takes the ids out of the queue's sets and counts too, so ``stats`` and recovery stop
    seeing them; the locators live on other slots (``emq:loc:{id}``), one command each. A flow
    a newer release wrote (its parent's format) raises ``StoreFormatError``: nothing deleted.
    """
    row = state.keys.job_key(node.queue, node.id)
    newer = newer_than_known(state.client.hget(row, "format"), row)
    if newer is not None:
        raise newer
    done = Forgotten()
    _forget(state, node.queue, node.id, node.state, done)
    return done


def _forget(state: EchoMQ, queue: str, parent_id: str, parent_state: str, done: Forgotten) -> None:
    keys, client = state.keys, state.client
    done.jobs.append(parent_id)
    if parent_state not in FINISHED:
        done.unfinished.append(parent_id)
    chunk = state.settings.chunk_size
    part: list[str] = []
    for cid, _ in child_positions(state, queue, parent_id, batch=chunk):
        part.append(cid)
        if len(part) == chunk:
            _forget_children(state, queue, parent_id, part, done)
            part = []
    if part:
        _forget_children(state, queue, parent_id, part, done)
    deleted, _ = state.scripts.forget(queue, [parent_id], [parent_id])
    done.keys.extend(deleted)
    locator = keys.locator_key(parent_id)
    if client.delete(locator):
        done.keys.append(locator)


def _forget_children(
    state: EchoMQ, queue: str, parent_id: str, ids: list[str], done: Forgotten
) -> None:
    """One chunk of a parent's children: nested flows first (each a flow to forget), then
    the plain children's rows, per queue, by one script each (forget.lua)."""
    keys, client = state.keys, state.client
    where = where_children(state, queue, ids)
    pipe = client.pipeline(transaction=False)
    found = [cid for cid in ids if cid in where]
    for cid in found:
        row = keys.job_key(where[cid], cid)
        pipe.hmget(row, "state", "steps")
        pipe.exists(keys.flow_keys(where[cid], cid)[0], keys.children_key(where[cid], cid))
    answers = iter(pipe.execute())
    plain: dict[str, list[str]] = {}
    for cid in found:
        (raw_state, steps), nested = next(answers), next(answers)
        child_state = text(raw_state) or "missing"
        if steps:
            # A linked chain's last step: the steps before it are the flow's too, though only
            # the last is in its index (a first step may hold children of its own).
            _forget_children(state, where[cid], parent_id, text(steps).split()[:-1], done)
        if nested:
            _forget(state, where[cid], cid, child_state, done)
            continue
        done.jobs.append(cid)
        if child_state not in FINISHED:
            done.unfinished.append(cid)
        plain.setdefault(where[cid], []).append(cid)
    for child_queue, cids in plain.items():
        # A cancelled child's message may still be queued: the row that turns it away stays,
        # cut down, for as long as the row would have lived.
        # Children on another slot than their parent's: its window there (its :window and
        # :slots on theirs) goes with them.
        elsewhere = [parent_id] if child_queue != queue else []
        deleted, kept = state.scripts.forget(
            child_queue, cids, elsewhere, keep_cancelled_ms=state.settings.result_ttl * 1000
        )
        done.keys.extend(deleted)
        done.kept.extend(kept)
