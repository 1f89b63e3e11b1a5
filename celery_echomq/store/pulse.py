"""What the dashboard draws over time, kept small: per queue a ring of per-minute samples of
its counters, and per worker its last recovery pass.

Written by each worker's recovery loop, never by the scripts (a succeeding child costs no
command more): once a minute, for the queues it consumes, one pipelined round trip reads
each queue's counters hash and state-set sizes, and one writes them as that minute's sample
(``HSETNX``: the first worker of the minute writes it, the others' is a no-op) and drops the
sample ``RING`` minutes older (``HDEL``). O(1) per write, at most ``RING`` fields per queue;
the ring expires two hours after its last sample. A rate is the difference of two samples
over the minutes between them.

Children done are tallied in the process that completed them (a dict, no command), and the
tally of a minute is added to the ring (``HINCRBY`` of the field ``<minute>:done``) by that
process's first completion of a later minute: one command per process and minute, whatever
the number of children (a process idle since keeps its last minute's tally until its next).

Each pass the loop runs also sets its worker's field in ``{prefix}:workers`` (name -> JSON:
when, the queues, the pid), a hash that expires a week after its last write.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from celery_echomq.store.connection import text
from celery_echomq.store.state import EchoMQ

RING = 60  # minutes of samples kept per queue
SAMPLED = (
    "released",
    "dispatched",
    "held",
    "window_waiting",  # children waiting for a slot of their flow's window (max_active)
    "failed_fail",
    "failed_ignore",
    "failed_remove",
    "failed_continue",
    "failed_fail_at_end",
)
WORKERS_TTL = 7 * 24 * 3600


def minutes_key(state: EchoMQ, queue: str) -> str:
    return state.keys.queue_key(queue, "minutes")


def workers_key(state: EchoMQ) -> str:
    return f"{state.keys.prefix}:workers"


def sample(state: EchoMQ, queues: Iterable[str], now: float | None = None) -> int:
    """Write this minute's sample of each queue (unless one is there); the minute's number."""
    minute = int((time.time() if now is None else now) // 60)
    queues = list(queues)
    pipe = state.client.pipeline(transaction=False)
    for queue in queues:
        pipe.hmget(state.keys.queue_key(queue, "counters"), SAMPLED)
        pipe.zcard(state.keys.queue_key(queue, "pending"))
        pipe.zcard(state.keys.queue_key(queue, "active"))
    replies = pipe.execute()
    pipe = state.client.pipeline(transaction=False)
    for i, queue in enumerate(queues):
        values, pending, active = replies[3 * i : 3 * i + 3]
        found = {k: int(text(v) or 0) for k, v in zip(SAMPLED, values, strict=True)}
        found.update(pending=int(pending), active=int(active))
        key = minutes_key(state, queue)
        pipe.hsetnx(key, str(minute), json.dumps(found, separators=(",", ":")))
        pipe.hdel(key, str(minute - RING), f"{minute - RING}:done")
        pipe.expire(key, 2 * RING * 60)  # gone two hours after the last worker sampled it
    pipe.execute()
    return minute


_tally: dict[tuple[int, str], int] = {}  # (minute, queue) -> children done, not yet added
_tally_lock = threading.Lock()


def note_done(state: EchoMQ, queue: str, now: float | None = None) -> None:
    """A child of a flow on ``queue`` completed: tallied, and earlier minutes' tallies added
    to their queues' rings."""
    minute = int((time.time() if now is None else now) // 60)
    with _tally_lock:
        _tally[(minute, queue)] = _tally.get((minute, queue), 0) + 1
        due = {k: v for k, v in _tally.items() if k[0] < minute}
        for k in due:
            del _tally[k]
    if not due:
        return
    pipe = state.client.pipeline(transaction=False)
    for (then, name), count in due.items():
        pipe.hincrby(minutes_key(state, name), f"{then}:done", count)
    pipe.execute()


def record_pass(state: EchoMQ, name: str, queues: Iterable[str] | None) -> None:
    """This worker ran a recovery pass now."""
    when = {"at_ms": int(time.time() * 1000), "queues": sorted(queues or []), "pid": os.getpid()}
    pipe = state.client.pipeline(transaction=False)
    pipe.hset(workers_key(state), name, json.dumps(when))
    pipe.expire(workers_key(state), WORKERS_TTL)
    pipe.execute()


def read_passes(state: EchoMQ) -> dict[str, dict[str, Any]]:
    """``{worker name: {at_ms, queues, pid}}``: each worker's last pass (HGETALL of a hash of
    one field per worker)."""
    out = {}
    for name, raw in state.client.hgetall(workers_key(state)).items():
        try:
            out[str(text(name))] = json.loads(str(text(raw)))
        except ValueError:
            continue
    return out


@dataclass(frozen=True)
class Minute:
    minute: int  # minutes since the epoch
    values: dict[str, int]
    done: int = 0  # children done in that minute (the workers' tallies added so far)


def read_minutes(state: EchoMQ, queue: str) -> list[Minute]:
    """The queue's samples, oldest first (at most ``RING``), each with its minute's tally
    of children done."""
    samples: dict[int, dict[str, int]] = {}
    done: dict[int, int] = {}
    for field, raw in state.client.hgetall(minutes_key(state, queue)).items():
        name = str(text(field))
        try:
            if name.endswith(":done"):
                done[int(name[: -len(":done")])] = int(text(raw) or 0)
            else:
                samples[int(name)] = json.loads(str(text(raw)))
        except ValueError:
            continue
    return [Minute(m, samples[m], done.get(m, 0)) for m in sorted(samples)]
