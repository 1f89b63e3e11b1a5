"""The deadline scripts (``lua/deadline*.lua``, ``lua/retry_deadline.lua``) as typed calls.

Each builds its KEYS through the keyspace gate and runs through the store's script runner
(EVALSHA, a resend through a failover, WAIT for replicas where that is set).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from celery_echomq.store.codec import Stored, stored_of
from celery_echomq.store.connection import text
from celery_echomq.store.state import EchoMQ

INDEX = "deadlines"  # the per-queue index: parent id -> when its deadline passes (ms)
# Children per script call when a deadline cuts them: deadline.lua takes the first chunk of
# each kind (on the parent's slot, on others), deadline_cut the rest, so that the deadline of
# a flow of 100,000 children is many short calls, never one that blocks Redis.
CUT_CHUNK = 1000


def index_key(state: EchoMQ, queue: str) -> str:
    return state.keys.queue_key(queue, INDEX)


@dataclass(frozen=True)
class Fired:
    """What deadline.lua answered for one flow."""

    status: str  # failed, released, fired, early, stale, moot, missing, noop
    due_ms: int = 0
    fired_ms: int = 0
    cut: tuple[str, ...] = ()  # children of the first chunk cut on the parent's slot
    running: tuple[str, ...] = ()  # children of it still running (active, held nested flows)
    remote: tuple[str, ...] = ()  # unsettled children of the first chunk of other slots'
    count: int = 0  # every child the parent still waited for, in the chunks or not
    outcome: str = ""  # for "fired": what it was ("failed" or "released"); for "moot": state
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def outstanding(self) -> tuple[str, ...]:
        """The outstanding children of the first chunks (``count`` says how many in all)."""
        return (*self.cut, *self.running, *self.remote)


def arm(state: EchoMQ, queue: str, parent_id: str, kind: str, ms: int, outer: str = "") -> int:
    """Arm ``parent_id``'s deadline (before its level is enqueued); the index score."""
    keys = [state.keys.job_key(queue, parent_id), index_key(state, queue)]
    reply = state.scripts._run("deadline_arm", keys, [parent_id, kind, str(ms), outer])
    return int(reply[1])


class Armed(NamedTuple):
    """A level's deadline entry as :func:`arm_levels` wrote it."""

    queue: str
    parent_id: str
    at: int  # its score: when the deadline passes, ms on the store's clock


def disarm(state: EchoMQ, armed: Sequence[Armed]) -> None:
    """Take back the arms of a flow that was refused (nothing of it was written)."""
    for entry in armed:
        state.client.zrem(index_key(state, entry.queue), entry.parent_id)


def rearm(state: EchoMQ, armed: Sequence[Armed]) -> None:
    """Once the flow has landed: write again, with the score it was armed with, each entry a
    poller dropped while the producer was between its arm and its enqueue (deadline.lua
    finds no row: 'missing', as for a producer that died there). A producer slower than its
    deadline keeps it: the entry, already due, fires at the next look. One round trip when
    every entry is there. An entry whose deadline has fired is never written again (its
    row's ``deadline_fired``; with no entry, no poller can fire it between the reads and the
    write). One a poller removed for a flow that no longer waits, written again, is removed
    again at the next look (deadline.lua: 'moot')."""
    if not armed:
        return
    client, keys = state.client, state.keys
    pipe = client.pipeline(transaction=False)
    for entry in armed:
        pipe.zscore(index_key(state, entry.queue), entry.parent_id)
    gone = [entry for entry, score in zip(armed, pipe.execute(), strict=True) if score is None]
    if not gone:
        return
    pipe = client.pipeline(transaction=False)
    for entry in gone:
        pipe.hget(keys.job_key(entry.queue, entry.parent_id), "deadline_fired")
    fired = pipe.execute()
    pipe = client.pipeline(transaction=False)
    for entry, mark in zip(gone, fired, strict=True):
        if mark is None:
            pipe.zadd(index_key(state, entry.queue), {entry.parent_id: entry.at}, nx=True)
    pipe.execute()


def _flow_keys(state: EchoMQ, queue: str, parent_id: str, child_ids: Sequence[str]) -> list[str]:
    """The KEYS deadline.lua and retry_deadline.lua share: the flow's own keys on its slot,
    the deadline index, then the rows of ``child_ids``."""
    return [
        *state.scripts.held_keys(queue, parent_id),
        index_key(state, queue),
        *(state.keys.job_key(queue, cid) for cid in child_ids),
    ]


def fire(
    state: EchoMQ,
    queue: str,
    parent_id: str,
    check: str,
    on_deadline: str,
    local: Sequence[str],
    remote: Sequence[str],
) -> Fired:
    """Run deadline.lua for one flow whose entry came due, with the first :data:`CUT_CHUNK`
    of its children of each kind: the caller cuts the rest (:func:`cut_children`). ``check``
    says the children are still all of them: ``n:<count>``, its index's length, or the SHA1
    of the payload they were read from."""
    local, remote = local[:CUT_CHUNK], remote[:CUT_CHUNK]
    keys = _flow_keys(state, queue, parent_id, local)
    argv = [
        parent_id,
        check,
        on_deadline,
        str(state.settings.result_ttl),
        str(state.settings.stall_ms),
        str(len(local)),
        *local,
        *remote,
    ]
    reply = [text(item) or "" for item in state.scripts._run("deadline", keys, argv)]
    status = reply[0]
    if status in ("failed", "released"):
        ncut, nrun, nremote, count = (int(x) for x in reply[3:7])
        ids = tuple(reply[7:])
        return Fired(
            status,
            int(reply[1]),
            int(reply[2]),
            ids[:ncut],
            ids[ncut : ncut + nrun],
            ids[ncut + nrun : ncut + nrun + nremote],
            count=count,
        )
    if status == "fired":
        return Fired(status, int(float(reply[1] or 0)), int(reply[2]), outcome=reply[3])
    if status == "early":
        return Fired(status, int(float(reply[1])))
    if status == "moot":
        return Fired(status, outcome=reply[1])
    return Fired(status)


def cut_children(
    state: EchoMQ,
    queue: str,
    parent_id: str,
    child_ids: Sequence[str],
    error: str,
    parent_queue: str,
) -> list[str]:
    """Cut the children of ``parent_id`` on ``queue``'s slot that have not started, a
    :data:`CUT_CHUNK` per call, each counted as cut on the parent (``parent_queue``'s slot):
    in the same call where the parent shares the slot, else by ``credit_cut`` after it."""
    here = queue == parent_queue
    cut: list[str] = []
    for start in range(0, len(child_ids), CUT_CHUNK):
        chunk = child_ids[start : start + CUT_CHUNK]
        keys = [
            state.keys.queue_key(queue, "pending"),
            state.keys.queue_key(queue, "counters"),
            state.keys.job_key(queue, parent_id) if here else state.keys.unused_key(queue),
            *(state.keys.job_key(queue, cid) for cid in chunk),
        ]
        argv = [parent_id, str(state.settings.result_ttl), error, *chunk]
        reply = [text(cid) or "" for cid in state.scripts._run("deadline_cut", keys, argv)]
        n = int(reply[0])
        if n and not here:  # every child cut there, now or before: each counted once
            state.scripts.credit_cut(parent_queue, parent_id, reply[1 : 1 + n])
        cut += reply[1 + n :]
    return cut


def before_start(parent_id: str) -> str:
    """The error a child cut by its flow's deadline keeps (deadline.lua writes the same)."""
    return f"FlowDeadlineExceeded: flow {parent_id} passed its deadline before this child started"


def done(state: EchoMQ, queue: str, parent_id: str, fired_ms: int) -> bool:
    """End the follow-up of a fired deadline: its index entry goes."""
    keys = [state.keys.job_key(queue, parent_id), index_key(state, queue)]
    return bool(state.scripts._run("deadline_done", keys, [parent_id, str(fired_ms)]))


def retry(
    state: EchoMQ, queue: str, parent_id: str, child_ids: Sequence[str], kind: str, ms: int
) -> tuple[str, int, list[tuple[str, Stored]]]:
    """retry_deadline.lua: ``(status, new deadline ms, [(child id, stored job)])``."""
    keys = _flow_keys(state, queue, parent_id, child_ids)
    reply = state.scripts._run("retry_deadline", keys, [parent_id, kind, str(ms), *child_ids])
    status = text(reply[0]) or ""
    if status not in ("retried", "released"):
        return status, 0, []
    found = []
    rest = reply[2:]
    for i in range(0, len(rest), 4):
        stored = stored_of(rest[i + 1], rest[i + 2], parent_id, rest[i + 3])
        if stored is not None:
            found.append((text(rest[i]) or "", stored))
    return status, int(reply[1]), found


def arm_levels(state: EchoMQ, levels: Sequence[Any]) -> list[Armed]:
    """Arm every planned level that has a deadline, before any of them is enqueued: each
    entry armed (what :func:`disarm` takes back on a refusal, :func:`rearm` checks after the
    land)."""
    from celery_echomq.store.deadline_spec import level_deadline, spec_ms

    armed: list[Armed] = []
    for level in levels:
        found = level_deadline(level)
        if found is None:
            continue
        kind, ms = spec_ms(found[0])
        try:
            at = arm(state, level.queue, level.parent_id, kind, ms, level.outer)
        except Exception:
            disarm(state, armed)  # a refused flow leaves no entry behind
            raise
        armed.append(Armed(level.queue, level.parent_id, at))
    return armed
