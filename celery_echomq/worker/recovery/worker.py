"""The worker's side: renew its leases, end those of its dead pool processes, and run the
pass, one worker per queue at a time under a Redis lease (:class:`RecoveryStep`)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from celery import bootsteps

from celery_echomq.send.start import publish
from celery_echomq.store.connection import backoff, describe
from celery_echomq.store.headers import H_QUEUE
from celery_echomq.store.pulse import record_pass, sample
from celery_echomq.store.reads import queues_of
from celery_echomq.store.refusals import refusal_of
from celery_echomq.store.replies import Status
from celery_echomq.store.state import EchoMQ, find_state
from celery_echomq.worker.batches import batch_children, revoke_waiting
from celery_echomq.worker.checks import wait_for_store
from celery_echomq.worker.claims import holder_prefix, pid_alive
from celery_echomq.worker.recovery.common import (
    LEASE,
    LEASE_MIN_MS,
    STORE_ERRORS,
    TICK,
    decode_job,
    with_values,
)
from celery_echomq.worker.recovery.sweep import anything_due, run_pass

logger = logging.getLogger("celery_echomq")


def leased_pass(
    state: EchoMQ, holder: str, queues: Iterable[str] | None = None
) -> list[str] | None:
    """:func:`run_pass` over each of ``queues`` (every queue that holds flows, if None) whose
    recovery lease this process takes; None when another process holds every one of them.

    One lease per queue: the workers of a queue take turns, and the workers of other queues
    never wait on them. A worker that dies holding a lease delays only the next pass of that
    queue, and a long pass over a big queue never starves a small one (whose replaced jobs,
    for one, settle only in a pass). Nothing due (:func:`anything_due`): an empty list,
    without taking a lease.
    """
    if not anything_due(state, queues):
        return []
    ttl_ms = max(LEASE_MIN_MS, int(state.settings.recovery_interval * 3000))
    repairs: list[str] = []
    passed = False
    for queue in queues_of(state, queues):
        lease = state.keys.lease_key(LEASE, queue)
        if not state.client.set(lease, holder, nx=True, px=ttl_ms):
            continue
        passed = True
        try:
            repairs += run_pass(state, queues=[queue])
        finally:
            # If Redis is gone the lease expires on its own.
            with contextlib.suppress(*STORE_ERRORS):
                state.scripts.lease_release(LEASE, holder, queue)
    return repairs if passed else None


@dataclass(frozen=True)
class Held:
    """A flow job this worker holds: running (in pool process ``pid`` on a pool of processes,
    else None), or received, not started."""

    queue: str
    running: bool
    pid: int | None
    # A child of a batch message: while its batch runs, it may be running or still waiting
    # its turn, so both its lease and a hold are renewed.
    batched: bool = False


def has_processes(pool: Any) -> bool:
    """Whether the worker's ``pool`` runs its jobs in processes of its own (prefork).

    A threads, solo, gevent or eventlet pool runs them in the worker's own process, and the
    ``worker_pid`` Celery records for a job there is that process's id or a greenlet's
    address: nothing that can die apart from the worker, nothing to signal.
    """
    from celery.concurrency.prefork import TaskPool

    return isinstance(pool, TaskPool)


def held_jobs(processes: bool = True) -> dict[str, Held]:
    """The flow jobs this worker holds now, by id (Celery's worker state, read in its main
    process): running, prefetched and waiting for a pool process, or waiting for an eta.
    ``processes``: the pool's jobs run in processes of their own, whose pids are kept."""
    from celery.worker import state as worker_state

    held: dict[str, Held] = {}
    # Copies: the worker's event loop adds and removes requests while this thread reads.
    groups = (
        (True, list(worker_state.active_requests)),
        (False, list(worker_state.reserved_requests)),
        (False, list(getattr(worker_state, "scheduled_requests", ()))),
    )
    for running, requests in groups:
        for request in requests:
            headers = getattr(request, "request_dict", None) or {}
            queue = headers.get(H_QUEUE)
            pid = getattr(request, "worker_pid", None) if running and processes else None
            if queue and str(request.id) not in held:
                held[str(request.id)] = Held(str(queue), running, pid)
            elif (batch := batch_children(request)) is not None:
                for child_id in batch[1]:
                    held.setdefault(child_id, Held(batch[0], running, pid, batched=True))
    return held


def renew(state: EchoMQ, jobs: dict[str, Held], released: dict[str, Held] | None = None) -> int:
    """Renew this worker's leases on ``jobs`` and end its holds on ``released`` (jobs it held
    unstarted at the last look, started or gone since); how many moved."""
    by_queue: dict[str, tuple[list[str], list[str], list[str]]] = {}
    for job_id, job in jobs.items():
        running, waiting, _ = by_queue.setdefault(job.queue, ([], [], []))
        (running if job.running else waiting).append(job_id)
        if job.batched and job.running:
            waiting.append(job_id)
    for job_id, job in (released or {}).items():
        by_queue.setdefault(job.queue, ([], [], []))[2].append(job_id)
    moved = 0
    for queue, (running, waiting, ended) in by_queue.items():
        moved += state.scripts.extend(queue, running, state.settings.stall_ms, waiting, ended)
    return moved


def drop_dead(state: EchoMQ, jobs: dict[str, Held]) -> list[str]:
    """End the leases of ``jobs``, whose pool processes this worker saw die; one line each."""
    lines = []
    for job_id, job in jobs.items():
        if job.pid is None:
            continue
        status, payload = state.scripts.drop(job.queue, job_id, holder_prefix(job.pid))
        if status is Status.NOOP:
            continue
        if status is Status.REQUEUED:
            # A duplicate was skipped while this holder looked alive: no message is left.
            found = decode_job(state, job.queue, job_id, payload)
            if found is not None:
                if "children" in found:
                    found = with_values(state, job.queue, job_id, found)
                publish(state.app, [found])
            line = f"{job.queue}: re-published {job_id} (its pool process {job.pid} died)"
        else:
            line = f"{job.queue}: lease of {job_id} ended (its pool process {job.pid} died)"
        logger.warning("echomq recovery: %s", line)
        lines.append(line)
    return lines


class RecoveryLoop:
    """A daemon thread in the worker's main process: leases and leased recovery passes.

    Every :data:`TICK` it compares the flow jobs the worker holds with the last look: a job it
    has just received is leased at once, a job whose pool process died has its lease ended at
    once; every third of a stall timeout it renews all its leases; every recovery interval it
    runs a pass. A thread rather than the worker's timer: the timer's callbacks run on the
    event loop, and a pass makes blocking calls to Redis, the broker and the result backend.
    """

    def __init__(
        self, state: EchoMQ, name: str, app: Any = None, *, processes: bool = True
    ) -> None:
        """``processes``: the worker's pool runs jobs in processes of their own (prefork;
        :func:`has_processes`), which may die apart from the worker and whose leases this loop
        then ends."""
        self.state = state
        self.app = app
        self.processes = processes
        self.holder = f"{name}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        settings = state.settings
        self.interval = settings.recovery_interval
        # Renew at least three times per stall timeout, so one slow renewal never lets the
        # lease of a live job lapse.
        self.renew_every = min(settings.recovery_interval, settings.stall_timeout / 3)
        self.tick = min(TICK, self.renew_every)
        self.name = name
        self._held: dict[str, Held] = {}
        self._sampled = 0  # the last minute this loop sampled the queues' counters (pulse.py)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="echomq-recovery", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def queues(self) -> set[str] | None:
        """The queues this worker consumes (read each pass: ``add_consumer`` can change them).

        A worker recovers only the flows of its own queues: it runs their tasks, so its
        ``echomq_stall_timeout`` is the one that fits them, and a worker for a queue of
        hour-long jobs is not second-guessed by one for a queue of quick ones.
        """
        if self.app is None:
            return None
        return {str(name) for name in self.app.amqp.queues.consume_from}

    def look(self, renew_all: bool) -> bool:
        """One tick: lease what is new (or everything), end the leases of dead holders.
        Whether it wrote to the store."""
        now = held_jobs(self.processes)
        if self.app is not None and any(job.batched for job in now.values()):
            self._revoke_waiting()
        before, self._held = self._held, now
        gone = {
            job_id: job
            for job_id, job in before.items()
            if job.running
            and job.pid is not None
            and (job_id not in now or now[job_id].pid != job.pid)
            and not pid_alive(job.pid)
        }
        if gone:
            drop_dead(self.state, gone)
        fresh = (
            now
            if renew_all
            else {job_id: job for job_id, job in now.items() if before.get(job_id) != job}
        )
        # Holds this loop made (received, not started at the last look) that have ended: the
        # claim leaves them to this call, one per tick, rather than a ZREM per claim.
        released = {
            job_id: job
            for job_id, job in before.items()
            if not job.running and (job_id not in now or now[job_id].running)
        }
        if fresh or released:
            renew(self.state, fresh, released)
        return bool(gone or fresh or released)

    def _revoke_waiting(self) -> None:
        """Revoke the children of the batches this worker holds that a revoke named after
        the batch arrived and that have not started (``revoke_waiting``); an error is told,
        and the next tick tries again."""
        try:
            revoke_waiting(self.app)
        except Exception as exc:
            logger.warning(
                "echomq recovery: could not revoke a held batch's children: %s: %s",
                type(exc).__name__,
                exc,
            )

    def _run(self) -> None:
        if not wait_for_store(self.state, self._stop):
            return
        start = time.monotonic()
        next_pass = start  # a worker that starts after a crash repairs at once
        next_renew = start
        next_look = start
        # Consecutive refusals of the store (store/refusals.py): of a renewal, of a pass.
        refused = {"renew": 0, "pass": 0}
        while not self._stop.is_set():
            if time.monotonic() >= next_look:
                renew_all = time.monotonic() >= next_renew
                if renew_all:
                    next_renew = time.monotonic() + self.renew_every
                try:
                    if self.look(renew_all):
                        refused["renew"] = 0
                except Exception as exc:
                    self._held = {}  # lease everything again at the next look
                    if self._refused(exc, refused, "renew", "leases are not renewed"):
                        # A renewal is a write: none lands while the store refuses them, and
                        # asking every tick adds load to a full server. Backoff, capped so a
                        # healed store has this worker's leases renewed well before any lapses.
                        wait = backoff(refused["renew"], self.tick, self.renew_every / 2)
                        next_look = time.monotonic() + wait
                    else:
                        logger.warning("echomq recovery: could not renew leases: %s", exc)
            if time.monotonic() >= next_pass:
                next_pass = time.monotonic() + self.interval
                try:
                    leased_pass(self.state, self.holder, self.queues())
                    record_pass(self.state, self.name, self.queues())
                    refused["pass"] = 0
                except Exception as exc:
                    if not self._refused(exc, refused, "pass", "recovery passes repair nothing"):
                        logger.warning(
                            "echomq recovery: pass failed: %s: %s", type(exc).__name__, exc
                        )
            self._pulse()
            self._stop.wait(self.tick)

    def _refused(self, exc: Exception, refused: dict[str, int], what: str, meaning: str) -> bool:
        """Whether ``exc`` is the store refusing writes; told once until ``what`` lands again."""
        refusal = refusal_of(exc)
        if refusal is None:
            return False
        refused[what] += 1
        if refused[what] == 1:
            logger.warning(
                "echomq recovery: the flow store %s refuses writes (%s): %s until it takes them "
                "again (once %s)",
                describe(self.state.settings),
                refusal.cause,
                meaning,
                refusal.heal,
            )
        return True

    def _pulse(self) -> None:
        """Once a minute: that minute's sample of the counters of the queues this worker
        consumes (the dashboard's rates over time)."""
        if int(time.time() // 60) == self._sampled:
            return
        try:
            queues = queues_of(self.state, self.queues())
            if queues:  # else again at the next tick: a first flow makes its queue known
                self._sampled = sample(self.state, queues)
        except Exception as exc:
            logger.debug("echomq recovery: could not sample the counters: %s", exc)


class RecoveryStep(bootsteps.StartStopStep):  # type: ignore[misc]
    """The worker step that runs :class:`RecoveryLoop` (added by ``celery_echomq.install``)."""

    label = "echomq recovery"
    # After the pool: the loop reads the requests the pool is running.
    requires = ("celery.worker.components:Pool",)

    def create(self, worker: Any) -> RecoveryLoop | None:
        state = find_state(worker.app)
        if state is None:
            return None
        processes = has_processes(getattr(worker, "pool", None))
        return RecoveryLoop(state, str(worker.hostname), worker.app, processes=processes)
