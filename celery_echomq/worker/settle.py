"""Settling a finished job: complete or fail it, credit its parent on whichever slot it
lives, and act on what that made of the parent (dispatch it, or record its failure).

What the worker's signal receivers and recovery call; each step is one script call, and what
follows it (a publish, a result written to Celery's backend) is repeated by recovery if the
process dies in between.

A store that refuses writes (store/refusals.py) refuses the transition whole: it wrote nothing.
The delivery that ran the body retries it (:func:`retry_refused`), with backoff, for as long as
it still holds the job's lease: the outcome lands once the store heals, and nothing else
records it (where the store writes the job's result, not even Celery's backend), so giving up
early would have recovery run the body again. Renewals are writes too: none lands while the
store refuses, so the lease lapses at most ``echomq_stall_timeout`` after the last one, which
the worker made no more than a third of a stall timeout before the refusal began. A refusal
that ends within two thirds of ``echomq_stall_timeout`` therefore costs no second run; a
longer one may: the lease lapses, this delivery gives up, and recovery runs the body again
once the store takes writes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from celery.utils.functional import maybe_list

from celery_echomq import tracing
from celery_echomq.errors import FlowFailed, StoreFormatError
from celery_echomq.send.dispatch import dispatch_parent, publish_handed, publish_step
from celery_echomq.send.errbacks import FAN, errbacks_left, ran_by_child
from celery_echomq.send.freed import publish_freed
from celery_echomq.store.connection import backoff, describe, text
from celery_echomq.store.headers import H_CHORD, outer_ref
from celery_echomq.store.planned import held_of
from celery_echomq.store.pulse import note_done
from celery_echomq.store.reads import steps_from
from celery_echomq.store.refusals import refusal_of
from celery_echomq.store.replies import UNSETTLED, Status
from celery_echomq.store.script_values import Freed, Handed
from celery_echomq.store.scripts import ParentRef, ResultWrite
from celery_echomq.store.state import EchoMQ

logger = logging.getLogger("celery_echomq")
# The states whose stored error fails a chord in Celery (``celery.states.PROPAGATE_STATES``).
PROPAGATE = ("FAILURE", "REVOKED")

T = TypeVar("T")

# A refused transition is tried again after 0.1 s, doubling up to 2 s, half jittered: a full
# server is asked a few times a second per pool process at first, then every second or two.
REFUSED_BASE, REFUSED_CAP = 0.1, 2.0


def lease_held(state: EchoMQ, queue: str, job_id: str, token: str) -> bool:
    """Whether the job is still active under ``token`` with a lease that has not lapsed, by
    the store's clock: reads, which a store that refuses writes still answers."""
    keys = state.keys
    pipe = state.client.pipeline(transaction=False)
    pipe.hget(keys.job_key(queue, job_id), "token")
    pipe.zscore(keys.queue_key(queue, "active"), job_id)
    holder, lease = pipe.execute()
    seconds, micros = state.client.time()
    now = int(seconds) * 1000 + int(micros) // 1000
    return bool(token) and text(holder) == token and lease is not None and float(lease) > now


def retry_refused(
    state: EchoMQ, do: Callable[[], T], holds: Callable[[], bool], what: str, left: str
) -> T:
    """``do()``, a step after a body ran, retried with backoff while the store refuses writes
    and ``holds()`` says it is still this worker's to make; any other error is raised at once.

    A refused script wrote nothing, so trying it again is safe (and every transition is
    idempotent under its own checks besides). ``what`` names the step; ``left``, what becomes
    of it if ``holds()`` ends first (the refusal is then raised)."""
    failures = 0
    while True:
        try:
            result = do()
        except Exception as exc:
            refusal = refusal_of(exc)
            if refusal is None:
                raise
            failures += 1
            if not holds():
                logger.warning(
                    "echomq: the flow store %s still refuses writes (%s): %s was not made; %s",
                    describe(state.settings),
                    refusal.cause,
                    what,
                    left,
                )
                raise
            if failures == 1:
                logger.warning(
                    "echomq: the flow store %s refuses writes: %s. %s is retried until it "
                    "lands (once %s)",
                    describe(state.settings),
                    refusal.cause,
                    what[:1].upper() + what[1:],
                    refusal.heal,
                )
            time.sleep(backoff(failures, REFUSED_BASE, REFUSED_CAP))
            continue
        if failures:
            logger.warning("echomq: %s landed, after %d refused attempts", what, failures)
        return result


def while_leased(state: EchoMQ, queue: str, job_id: str, token: str) -> Callable[[], bool]:
    """A delivery's outcome is its to record while it holds the job's lease."""
    return lambda: lease_held(state, queue, job_id, token)


def for_a_while(state: EchoMQ) -> Callable[[], bool]:
    """A step that follows an outcome that landed (crediting a parent on another slot,
    dispatching a released one) is retried for ``echomq_store_retry_timeout``, as through a
    failover; recovery makes it after that."""
    until = time.monotonic() + state.settings.store_retry_timeout
    return lambda: time.monotonic() < until


def outcome_of(
    state: EchoMQ, queue: str, job_id: str, token: str, what: str, do: Callable[[], T]
) -> T:
    """The transition that records what a delivery's body did (``what``), retried while the
    store refuses writes and the delivery holds the job's lease; without a token (a failure
    the main process reports for a pool process it lost) it is tried once."""
    if not token:
        return do()
    return retry_refused(
        state,
        do,
        while_leased(state, queue, job_id, token),
        f"{what} of {job_id} on {queue}",
        "its lease lapsed: recovery takes the job back and runs its body again once the "
        "store takes writes (a refusal shorter than two thirds of echomq_stall_timeout "
        "costs no second run)",
    )


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def record_failure(
    state: EchoMQ,
    job_id: str,
    exc: BaseException,
    job: dict[str, Any] | None,
    *,
    call_errbacks: bool = True,
    status: str = "FAILURE",
) -> None:
    """Store FAILURE for a job that never ran (a flow's parent), as its own worker would:
    with its request, so that its ``link_error`` callbacks run and a result backend that
    replies to the caller (``rpc://``) finds the caller's ``reply_to`` in it.

    ``status="REVOKED"``: a cancelled flow, stored as Celery stores a revoked task (no
    callbacks), with ``exc`` (a FlowCancelled) as what ``get()`` raises."""
    from celery.app.task import Context

    job = job or {"task": None, "options": {}}
    options = job.get("options") or {}
    request = Context(
        id=job_id,
        task=job.get("task"),
        errbacks=maybe_list(options.get("link_error")) if call_errbacks else None,
        args=job.get("args", []),
        kwargs=job.get("kwargs", {}),
        reply_to=options.get("reply_to"),
        correlation_id=job_id,
        delivery_info={},
        # What follows it in a chain fails too, and a chord it is part of counts it, as for a
        # task that failed on a worker (the backend's mark_as_failure reads them).
        chain=options.get("chain"),
        chord=options.get("chord"),
        group=options.get("group_id"),
        group_index=options.get("group_index"),
    )
    if status == "REVOKED":
        state.app.backend.store_result(job_id, exc, status, request=request)
        return
    state.app.backend.mark_as_failure(job_id, exc, request=request, call_errbacks=call_errbacks)


def own_error(
    state: EchoMQ, job_id: str, states: tuple[str, ...] = ("FAILURE",)
) -> BaseException | None:
    """The exception a failed job's worker stored in Celery's result backend, if it did (in
    one of ``states``: a revoked job's is stored ``REVOKED``)."""
    try:
        meta = state.app.backend.get_task_meta(job_id)
    except Exception:
        return None  # the backend cannot say: the flow's own error stands
    result = meta.get("result")
    return result if meta.get("status") in states and isinstance(result, BaseException) else None


def fail_later_steps(state: EchoMQ, queue: str, next_step: str, exc: BaseException) -> None:
    """A chain's step failed: store its error for each step after it, as Celery's chain does,
    so that the chain's result (its last step's) raises it. The steps' rows name the next."""
    for step in steps_from(state, queue, next_step):
        state.app.backend.store_result(step, exc, "FAILURE")


def held_on_step(state: EchoMQ, queue: str, job_id: str) -> bool:
    """Whether ``job_id`` is a chain's step held on the step before it (a group after a step,
    say): failed, it was failed by that step, never by work of its own."""
    payload = state.client.hget(state.keys.job_key(queue, job_id), "payload")
    return bool(payload) and held_of(state.loads(payload)).single


def errbacks_ran_by(state: EchoMQ, queue: str, job_id: str) -> list[Any]:
    """The errbacks a failed flow parent ``job_id`` ran when its own child failed it (a chord
    nested in a chord's header, whose body Celery gives the outer chord's errback too)."""
    payload, failed_by = state.client.hmget(
        state.keys.job_key(queue, job_id), ["payload", "failed_child"]
    )
    if not payload or not failed_by:
        return []  # a task that failed on its own, or a row that is gone
    return maybe_list(state.loads(payload).get("options", {}).get("link_error")) or []


def parent_failed(
    state: EchoMQ, queue: str, parent_id: str, child_id: str, error: str
) -> tuple[BaseException, ParentRef | None]:
    """Record FAILURE for a parent whose child failed under ``fail``, and run its errbacks.
    Under ``fail_at_end`` the child that settled last failed it: the row names the child
    whose failure it gives.

    Returns the error and, for a nested flow, where its own parent lives (the failure is
    that flow's child's failure next).
    """
    row = state.keys.job_key(queue, parent_id)
    payload, failed_by = state.client.hmget(row, ["payload", "failed_child"])
    if failed_by and text(failed_by) != child_id:
        # Failed under fail_at_end: by the first child that failed, when the last settled.
        child_id = text(failed_by)
        error = text(state.client.hget(row, f"failed:{child_id}") or b"")
    job = state.loads(payload) if payload else {"task": None, "options": {}}
    headers = (job.get("options") or {}).get("headers") or {}
    body = headers.get(H_CHORD)
    # A chord's error is worded from the header task's error as its result holds it (a
    # failed or a revoked task's), as Celery's chord reads it back from the result backend.
    raised = own_error(state, child_id, PROPAGATE) if body else None
    exc: BaseException = FlowFailed.of_child(
        parent_id, child_id, error, chord=bool(body), raised=raised
    )
    outer = outer_ref(headers, queue)
    if isinstance(body, dict):
        # A chord on the engine: Celery's own handling of a failed header, from its body.
        from celery import signature

        # As Celery's chord error is raised from the header task's: a group body's tasks
        # fail with that task's own error, as Celery's handling reads it from the cause.
        exc.__cause__ = own_error(state, child_id)
        callback = signature(body, app=state.app)
        # An errback a nested chord's body ran for this failure runs once, as in Celery.
        ran = errbacks_ran_by(state, queue, child_id)
        if ran:
            own = maybe_list(callback.options.get("link_error")) or []
            callback.options["link_error"] = [e for e in own if e not in ran]
        try:
            # Celery's handling reads the error from the current stack: a success or a
            # recovery pass settling the header (fail_at_end) has none of its own.
            raise exc
        except FlowFailed:
            state.app.backend.chord_error_from_stack(callback, exc)
        logger.info("echomq: chord body %s failed: child %s failed: %s", parent_id, child_id, error)
        return exc, outer
    held = held_of(job)
    if body == FAN and child_id == held.fan_in:
        # A chord whose header another job held: that job's failure ran Celery's handling.
        record_failure(state, parent_id, exc, job, call_errbacks=False)
        return exc, outer
    if body == FAN and held_on_step(state, queue, child_id):
        # A chord's chain body whose step failed: the step ran its own errbacks, and what
        # follows it in the chain fails with its error and runs none, as in Celery's chain.
        exc = own_error(state, child_id) or exc
        record_failure(state, parent_id, exc, job, call_errbacks=False)
        return exc, outer
    if held.quorum:
        # Fewer than its quorum can still succeed: the script's words. Its other children
        # go on, as under policy fail (a retry counts their successes).
        said = state.client.hget(state.keys.job_key(queue, parent_id), "error")
        exc = FlowFailed(f"flow {parent_id}: {text(said or '')}", child_id, error, parent_id)
    elif held.single or ran_by_child(job, child_id):
        # A chain's step held on the step before it, or a group parent's task: that task's
        # own error, as a chord's chain or group body raises it (Celery's chain stores it
        # for every task after the one that failed).
        exc = own_error(state, child_id) or exc
    # A group parent's tasks, or a chain parent's steps, ran its errbacks themselves
    # (send/errbacks.py).
    left = errbacks_left(job, child_id)
    job = {**job, "options": {**(job.get("options") or {}), "link_error": left}}
    record_failure(state, parent_id, exc, job, call_errbacks=bool(left))
    logger.info("echomq: parent %s failed: child %s failed: %s", parent_id, child_id, error)
    return exc, outer


def credit_remote(
    state: EchoMQ,
    queue: str,
    job_id: str,
    parent: ParentRef,
    outcome: str,
    data: bytes | str,
    policy: str,
) -> tuple[Status, str]:
    """Count a child staged in ``queue``'s outbox on its parent's slot, then unstage it.

    Idempotent per child id: recovery repeats it for an outbox entry left by a crash.
    """
    status, applied = state.scripts.credit(
        parent, job_id, outcome, data, policy, ttl=state.settings.result_ttl
    )
    state.client.zrem(state.keys.queue_key(queue, "outbox"), job_id)
    logger.info("echomq: child %s (%s) credited to %s: %s", job_id, outcome, parent.id, status)
    return status, applied


class _RunsHere(threading.local):
    """Who on this thread may run a parent its child's completion released, rather than
    publish it: a batch's runner sets ``asked`` while its last child runs."""

    asked: Callable[[dict[str, Any]], bool] | None = None


runs_here = _RunsHere()


def follow(
    state: EchoMQ,
    status: Status,
    job_id: str,
    parent: ParentRef,
    error: str = "",
    handed: Handed | None = None,
) -> None:
    """Act on what a child's transition made of its parent: publish it, or settle its failure.

    ``handed``: the released parent, already handed to this caller by the transition itself
    (see complete.lua); else the dispatch script decides who publishes it."""
    if status is Status.RELEASED:
        logger.info("echomq: parent %s released by child %s", parent.id, job_id)
        tracing.released(job_id, parent.id)
        if handed is not None:
            publish_handed(state, parent.id, handed, job_id, runs_here.asked)
        else:
            dispatch_parent(state, parent.queue, parent.id, released_by=job_id)
    elif status is Status.PARENT_FAILED:
        exc, outer = parent_failed(state, parent.queue, parent.id, job_id, error)
        if outer is not None:
            # A nested flow failed: that is a failed child of the flow it belongs to.
            settle_failure(
                state, parent.queue, parent.id, "", error_text(exc), True, outer, carry=True
            )


def _complete(
    state: EchoMQ,
    queue: str,
    job_id: str,
    token: str,
    is_parent: bool,
    parent: ParentRef | None,
    value: bytes,
    result: ResultWrite | None,
    next_step: str,
) -> tuple[Status, bool, Handed | None, bool]:
    """The completion script (complete.lua) for a job that succeeded, as ``outcome_of``
    reports it, and the window slots it freed published."""
    freed: list[Freed] = []
    outcome = outcome_of(
        state,
        queue,
        job_id,
        token,
        "the completion",
        lambda: state.scripts.complete_settling(
            queue,
            job_id,
            token,
            ttl=state.settings.result_ttl,
            is_parent=is_parent,
            parent=parent,
            value=value,
            result=result,
            inline_max=state.settings.chunk_size,
            next_step=next_step,
            freed=freed,
            hand_ms=state.settings.stall_ms if next_step else 0,
        ),
    )
    if freed:
        publish_freed(state, queue, freed)
    return outcome


def settle_success(
    state: EchoMQ,
    queue: str,
    job_id: str,
    token: str,
    is_parent: bool,
    parent: ParentRef | None,
    value: bytes,
    result: ResultWrite | None = None,
    unwritten: Callable[[], None] | None = None,
    next_step: str = "",
    since: int | None = None,
    refused: Callable[[str], None] | None = None,
) -> Status:
    """A job succeeded: complete it and credit its parent (on whichever slot it lives).

    ``result``: its result for Celery's backend, written by the completion itself; where the
    completion was not the job's transition (a stale token, a job cancelled meanwhile) it
    writes nothing and ``unwritten`` is called, to store it as Celery would. ``next_step``: the
    job is a chain's step but its last (:data:`H_NEXT`): the completion makes that step
    pending, and this publishes it with the value; ``since``: the pending time this step's
    message carried (:data:`H_SINCE`), which the next step's carries on (an older time than
    its own pending score, which only spares its claim the claim marks, see claim.lua). The
    next step is handed out active, under a lease of the stall timeout: its first delivery
    takes it without a claim (``take_handed``), and recovery makes it pending again if no
    delivery took it before the lease lapsed (``stalled.py``). ``refused``: stores the
    child's FAILURE with the reason its flow's reducer gave for not folding its value (the
    worker's own check, send/fan_in.py's ``refusal``, says the same first)."""
    status, written, handed, shared = _complete(
        state, queue, job_id, token, is_parent, parent, value, result, next_step
    )
    if status is Status.UNFOLDABLE and handed is not None:
        # Its flow's reducer cannot fold its value: the child fails, under its policy.
        reason = text(handed[1]["reason"])
        if refused is not None:
            refused(reason)
        return settle_failure(
            state, queue, job_id, token, f"ReduceError: {reason}", is_parent, parent
        )
    if parent is not None and status in (Status.RELEASED, Status.CREDITED, Status.STAGED):
        with contextlib.suppress(Exception):  # the dashboard's tally: never the job's concern
            note_done(state, queue)
    if status is Status.FORGED:
        logger.warning(
            "echomq: completion of %s refused: parent %s is not the job's own", job_id, parent
        )
    if result is not None and not written and unwritten is not None:
        unwritten()
    if shared:
        credit_edges(state, queue, job_id, Status.DONE, value)
    if status is Status.ADVANCED and handed is not None:
        if since is None:
            since = int(handed[1]["since"])
        publish_step(state, next_step, handed[0], value, previous=job_id, since=since, handed=True)
        return status
    if status is Status.STAGED and parent is not None:
        status, _ = _credited(
            state,
            token,
            job_id,
            parent,
            lambda: credit_remote(state, queue, job_id, parent, Status.DONE, value, ""),
        )
    if parent is not None:
        follow(state, status, job_id, parent, handed=handed)
    return status


def settle_failure(
    state: EchoMQ,
    queue: str,
    job_id: str,
    token: str,
    error: str,
    is_parent: bool,
    parent: ParentRef | None,
    *,
    carry: bool = False,
    unstarted: bool = False,
) -> Status:
    """A job failed for good: fail it and apply its parent_policy to the parent.

    ``carry``: the job is a nested flow's parent, already failed by one of its own children;
    apply that failure, once, to the flow it belongs to (see fail.lua). ``unstarted``: only
    if it has not started (``stale`` otherwise, nothing changed).
    """
    freed: list[Freed] = []
    status, policy, shared = outcome_of(
        state,
        queue,
        job_id,
        token,
        "the failure",
        lambda: state.scripts.fail_settling(
            queue,
            job_id,
            token,
            error,
            ttl=state.settings.result_ttl,
            is_parent=is_parent,
            parent=parent,
            carry=carry,
            freed=freed,
            unstarted=unstarted,
        ),
    )
    if freed:
        publish_freed(state, queue, freed)
    if parent is not None and status in (Status.RELEASED, Status.CREDITED, Status.STAGED):
        with contextlib.suppress(Exception):  # the dashboard's tally: never the job's concern
            note_done(state, queue)
    if status is Status.FORGED:
        logger.warning(
            "echomq: failure of %s refused: parent %s is not the job's own", job_id, parent
        )
    if shared:
        credit_edges(state, queue, job_id, Status.FAILED, error)
    if status is Status.STAGED and parent is not None:
        staged_policy = policy
        status, policy = _credited(
            state,
            token,
            job_id,
            parent,
            lambda: credit_remote(
                state, queue, job_id, parent, Status.FAILED, error, staged_policy
            ),
        )
    if parent is None or status in UNSETTLED:
        return status
    logger.info("echomq: child %s failed under policy %s: %s", job_id, policy, error)
    tracing.child_failed(job_id, parent.id, policy, error, status is Status.PARENT_FAILED)
    follow(state, status, job_id, parent, error)
    return status


def _credited(
    state: EchoMQ,
    token: str,
    job_id: str,
    parent: ParentRef,
    do: Callable[[], tuple[Status, str]],
) -> tuple[Status, str]:
    """A delivery's credit of its child to a parent on another slot, retried through a
    refusal for a while (the outcome it follows has landed: recovery credits the outbox's
    entries, so no body runs twice for it); recovery's own, once."""
    if not token:
        return do()
    return retry_refused(
        state,
        do,
        for_a_while(state),
        f"crediting {job_id} to its parent {parent.id}",
        "recovery credits it from the outbox once the store takes writes",
    )


def credit_edges(state: EchoMQ, queue: str, job_id: str, outcome: str, data: bytes | str) -> bool:
    """A finished job joined to more parents than its first (on_exists="join"): credit each of
    them (credit.lua, once per parent through its :settled, so a repeat changes nothing), act
    on what that made of it, then unstage the job. Recovery repeats it for a job left staged.
    False when a parent was of a newer store format: the job stays staged for that release's
    workers, whose recovery credits it.
    """
    keys = state.keys
    credited = True
    for raw_id, spec in state.client.hscan_iter(keys.parents_key(queue, job_id), count=100):
        policy, _, parent_queue = text(spec).partition("|")
        parent = ParentRef(text(raw_id), parent_queue)
        failed = outcome == Status.FAILED
        try:
            status, _ = state.scripts.credit(
                parent,
                job_id,
                outcome,
                data,
                policy if failed else "",
                ttl=state.settings.result_ttl,
            )
        except StoreFormatError as exc:
            state.tell_newer(exc, f"credit of joined {job_id} to {parent.id}")
            credited = False
            continue
        logger.info("echomq: joined %s (%s) credited to %s: %s", job_id, outcome, parent.id, status)
        if status is not Status.DUPLICATE:
            follow(state, status, job_id, parent, str(data) if failed else "")
    if credited:
        state.client.zrem(keys.queue_key(queue, "joined"), job_id)
    return credited
