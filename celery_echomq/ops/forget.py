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

# The per-queue sorted sets that hold job ids: a forgotten job leaves every one of them.
# (outbox: children of another slot's parent awaiting credit; open: flows not sealed yet;
# adding: flows with children staged for another slot; recent: the flows the dashboard lists,
# an index, not a state set.)
JOB_SETS = ("pending", "active", "failed", "outbox", "open", "recent", "adding")


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

    Each chunk's keys on one queue go in one MULTI (they share a slot); the locators live on
    other slots (``emq:loc:{id}``), so they go one command each, which works on a cluster.
    Ids leave the queue's state sets too, so ``stats`` and recovery stop seeing them. A flow
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
    names = [
        keys.job_key(queue, parent_id),
        *keys.flow_keys(queue, parent_id),
        keys.settled_key(queue, parent_id),
        keys.adding_key(queue, parent_id),
        keys.children_key(queue, parent_id),
        keys.failures_key(queue, parent_id),
        keys.window_key(queue, parent_id),
        keys.slots_key(queue, parent_id),
    ]
    held = parent_state == "awaiting_children"
    _delete(state, queue, names, [parent_id], held, done)
    locator = keys.locator_key(parent_id)
    if client.delete(locator):
        done.keys.append(locator)


def _forget_children(
    state: EchoMQ, queue: str, parent_id: str, ids: list[str], done: Forgotten
) -> None:
    """One chunk of a parent's children: nested flows first (each a flow to forget), then
    the plain children's rows, per queue; those still waiting for a slot of the flow's window
    by a script that counts them out of the queue's children waiting in windows."""
    keys, client = state.keys, state.client
    where = where_children(state, queue, ids)
    pipe = client.pipeline(transaction=False)
    found = [cid for cid in ids if cid in where]
    for cid in found:
        row = keys.job_key(where[cid], cid)
        pipe.hmget(row, "state", "parent", "chain", "steps")
        pipe.pttl(row)
        pipe.exists(keys.flow_keys(where[cid], cid)[0], keys.children_key(where[cid], cid))
    answers = iter(pipe.execute())
    plain: dict[str, list[str]] = {}
    kept: dict[str, dict[str, tuple[str, int]]] = {}
    waiting: dict[str, list[str]] = {}
    ttl_ms = state.settings.result_ttl * 1000
    for cid in found:
        (raw_state, parent, chain, steps), pttl, nested = (
            next(answers),
            next(answers),
            next(answers),
        )
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
        if child_state == "cancelled" and parent is not None:
            # Its message may still be queued: the row that turns it away stays, cut down.
            kept.setdefault(where[cid], {})[cid] = (text(parent), pttl if pttl > 0 else ttl_ms)
        if child_state == "waiting" and chain is None:
            waiting.setdefault(where[cid], []).append(cid)
        plain.setdefault(where[cid], []).append(cid)
    for child_queue, cids in waiting.items():
        dropped = state.scripts.drop_waiting(child_queue, parent_id, cids)
        done.keys.extend(keys.job_key(child_queue, cid) for cid in dropped)
    for child_queue, cids in plain.items():
        names = [keys.job_key(child_queue, cid) for cid in cids]
        _delete(state, child_queue, names, cids, False, done, kept.get(child_queue, {}))


def _delete(
    state: EchoMQ,
    queue: str,
    names: list[str],
    ids: list[str],
    held: bool,
    done: Forgotten,
    kept: dict[str, tuple[str, int]] | None = None,
) -> None:
    """UNLINK ``names`` and take ``ids`` out of the queue's sets, in one MULTI; the rows of
    ``kept`` (cancelled children: id -> (parent, ms to live)) are written back as tombstones
    (state and parent alone) in the same MULTI."""
    keys = state.keys
    pipe = state.client.pipeline(transaction=True)
    for name in names:
        pipe.exists(name)  # to report only the keys that were there
    pipe.unlink(*names)
    for cid, (parent, ttl) in (kept or {}).items():
        row = keys.job_key(queue, cid)
        pipe.hset(row, mapping={"state": "cancelled", "parent": parent})
        pipe.pexpire(row, ttl)
        done.kept.append(cid)
    for set_name in JOB_SETS:
        pipe.zrem(keys.queue_key(queue, set_name), *ids)
    if held:
        # A held parent forgotten (--force) leaves the queue's count of held parents.
        pipe.hincrby(keys.queue_key(queue, "counters"), "held", -1)
    existed = pipe.execute()[: len(names)]
    rows = {keys.job_key(queue, cid) for cid in kept or {}}
    done.keys.extend(
        name for name, there in zip(names, existed, strict=True) if there and name not in rows
    )
