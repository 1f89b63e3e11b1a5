"""The dashboard's workers: which consume the store's queues, whether each has the extension,
its clock's offset from the store's, and its last recovery pass.

The doctor's two broadcasts (ops/fleet.py: Celery's ``active_queues``, which every worker
answers, and ``echomq_clock``, which only a worker with the extension answers with a
measure), and one HGETALL of the hash where each worker's recovery loop records its last
pass (store/pulse.py). A worker that has stopped answering stays listed by its last pass
until that hash expires.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from celery_echomq.ops.dashboard.overview import queue_names
from celery_echomq.ops.fleet import ask_workers, has_extension
from celery_echomq.store.pulse import read_passes
from celery_echomq.store.state import EchoMQ


@dataclass(frozen=True)
class WorkerRow:
    name: str
    answered: bool  # it answered the broadcast now
    extension: bool
    queues: tuple[str, ...]  # every queue it consumes
    store_queues: tuple[str, ...]  # those of them the store holds flows of
    offset_ms: float | None  # its clock minus the store's (the extension's measure)
    rtt_ms: float | None
    last_pass_ms: int | None  # when its recovery loop last ran a pass (its clock)
    pass_age_s: float | None

    @property
    def wrong(self) -> bool:
        """It runs a flow's jobs as plain tasks: a store's queue, no extension."""
        return self.answered and bool(self.store_queues) and not self.extension


def read_workers(state: EchoMQ, timeout: float = 1.0) -> tuple[list[WorkerRow], str]:
    """Every worker that answered or has recorded a pass, and why the broadcast could not be
    sent ('' when it was)."""
    problem = ""
    clocks: dict[str, dict[str, Any]] = {}
    consumers: dict[str, list[str]] = {}
    try:
        clocks, consumers = ask_workers(state.app, timeout)
    except Exception as exc:  # a broker down: the passes still say something
        problem = f"{type(exc).__name__}: {exc}"
    passes = read_passes(state)
    ours = set(queue_names(state))
    now = time.time() * 1000
    rows = []
    for name in sorted(set(clocks) | set(consumers) | set(passes)):
        answer = clocks.get(name)
        queues = tuple(consumers.get(name) or passes.get(name, {}).get("queues") or ())
        at = passes.get(name, {}).get("at_ms")
        measured = answer if isinstance(answer, dict) and "offset_ms" in answer else {}
        rows.append(
            WorkerRow(
                name=name,
                answered=name in clocks or name in consumers,
                extension=has_extension(answer) or (name not in consumers and name in passes),
                queues=queues,
                store_queues=tuple(q for q in queues if q in ours),
                offset_ms=measured.get("offset_ms"),
                rtt_ms=measured.get("rtt_ms"),
                last_pass_ms=int(at) if at is not None else None,
                pass_age_s=max(0.0, (now - at) / 1000) if at is not None else None,
            )
        )
    return rows, problem
