"""Worker signal receivers: each calls one transition script for a flow job.

Receivers run in the pool process (revocation in the main process), and Celery logs and
swallows their exceptions, so every transition is idempotent and recovery repairs the ones a
receiver could not make. A task without the flow headers costs nothing here: no Redis command.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Any

from billiard.exceptions import TimeLimitExceeded, WorkerLostError
from celery import signals
from celery.app.task import Task
from celery.exceptions import Ignore, Reject, TaskRevokedError

from celery_echomq import tracing
from celery_echomq.errors import ReplicationError, StoreFormatError
from celery_echomq.send.fan_in import refusal
from celery_echomq.store.connection import describe
from celery_echomq.store.headers import (
    H_BATCH,
    H_FLOW,
    H_HANDED,
    H_NEXT,
    H_QUEUE,
    H_SINCE,
    Headers,
    parent_ref,
)
from celery_echomq.store.refusals import refusal_of
from celery_echomq.store.replies import DUPLICATE_DELIVERY, STARTED, Status
from celery_echomq.store.state import Deliveries, EchoMQ, find_state
from celery_echomq.wire.results import (
    hold_result,
    marked,
    store_failure,
    store_refused,
    store_retry,
    store_revoked,
    store_started,
    store_success,
    success_write,
)
from celery_echomq.worker.batches import claim_next, claimed_ahead, revoked_children
from celery_echomq.worker.checks import on_worker_ready
from celery_echomq.worker.claims import claim, named_by, warn_no_row
from celery_echomq.worker.received import may_expire, on_rejected, on_unknown
from celery_echomq.worker.settle import (
    error_text,
    fail_later_steps,
    outcome_of,
    settle_failure,
    settle_success,
)

logger = logging.getLogger("celery_echomq")

# What an app without the extension keeps of its deliveries: nothing is ever put in it.
_NONE = Deliveries()


def _deliveries(app: Any) -> Deliveries:
    """What this process keeps of ``app``'s flow jobs delivered to it (on the app's state)."""
    state = find_state(app)
    return state.deliveries if state is not None else _NONE


def _flow_state(task: Any, request: Any) -> EchoMQ | None:
    if request is None or not getattr(request, H_QUEUE, None):
        return None
    return find_state(task.app)


def on_prerun(sender: Any = None, task_id: str = "", task: Any = None, **_: Any) -> None:
    request = task.request
    state = _flow_state(task, request)
    if state is None:
        return
    queue = getattr(request, H_QUEUE)
    token, first = claimed_ahead(state, task_id)
    try:
        _claim_delivery(state, task, request, token, first)
        claim_next(state, task_id)
    except StoreFormatError as exc:
        # A newer release wrote the row: this one writes nothing of it, and its body does not
        # run here. The message is acknowledged (before_start's Ignore; early acks had
        # acknowledged it already); the row stays as it was, pending in its queue's set, where
        # a worker of the newer release finds it (recovery re-publishes a pending job whose
        # message is gone) and finishes it.
        state.deliveries.skipped.add(task_id)
        state.tell_newer(exc, f"delivery of {task_id} on {queue} (its body is skipped)")
    except Exception as exc:
        if task_id in state.deliveries.tokens:
            raise  # claimed: what failed came after (its STARTED state), and the body runs
        # No claim, whatever the reason (a store that refuses writes, one out of reach, a
        # claim not replicated): a body run unclaimed could run again, or settle nothing.
        _defer(state, task_id, queue, exc)


def _defer(state: EchoMQ, task_id: str, queue: str, exc: Exception) -> None:
    """The claim failed: the body does not run here (before_start's Ignore acknowledges the
    message) and the job is left to recovery. A claim that wrote nothing leaves the row
    pending, whose message is gone: recovery re-publishes it on the claim marks' or the
    broker's evidence. A claim that landed but whose reply was lost leaves the row active under
    a token no process holds: nothing renews its lease, and recovery takes it back once the
    lease lapses (echomq_stall_timeout)."""
    state.deliveries.skipped.add(task_id)
    if isinstance(exc, ReplicationError):
        # The claim is on the primary alone: a failover may lose it, and with it whatever this
        # body would do (a parent run on a release the new primary never had runs again).
        logger.warning(
            "echomq: %s; the body of %s is deferred to recovery, and runs once the primary has "
            "%d replica(s) connected (or echomq_min_replicas is lowered)",
            exc,
            task_id,
            exc.wanted,
        )
        return
    store = describe(state.settings)
    refusal = refusal_of(exc)
    if refusal is not None:
        logger.warning(
            "echomq: the flow store %s refuses writes: %s. The claim of %s on %s wrote "
            "nothing, so its body does not run here: it is deferred to recovery, which "
            "re-publishes the job once the store takes writes again (once %s)",
            store,
            refusal.cause,
            task_id,
            queue,
            refusal.heal,
        )
        return
    logger.warning(
        "echomq: the claim of %s on %s failed against the flow store %s (%s: %s), so its body "
        "does not run here: it is deferred to recovery, which takes the job back once the "
        "store answers (a claim that landed unanswered: once its lease lapses)",
        task_id,
        queue,
        store,
        type(exc).__name__,
        exc,
    )


def _claim_delivery(
    state: EchoMQ, task: Any, request: Any, token: str, first: tuple[Status, int, str] | None
) -> None:
    """This delivery's claim (or a handed step's take), and what its status means.
    ``first``: the claim's reply, when it was sent ahead (a batch's child)."""
    # The parent the message names: the claim compares it with the row's own.
    queue, task_id, named = named_by(request)
    if getattr(request, H_HANDED, None) and state.scripts.take_handed(queue, task_id, token, named):
        # A chain's step the completion of the step before handed out active: taken.
        _started(state, task, task_id, token)
        logger.debug("echomq: took handed step %s", task_id)
        return
    # A claim that raises (a refusal, the store out of reach, a claim not replicated) is
    # deferred by on_prerun: the body waits, and recovery re-publishes the job.
    status, attempts = claim(state, request, token, first)
    if status in STARTED:
        _started(state, task, task_id, token)
        if status is Status.CLAIMED:
            logger.debug("echomq: claim %s (attempt %d)", task_id, attempts)
        else:
            logger.info("echomq: claim %s -> taken over (attempt %d)", task_id, attempts)
    elif status is Status.MISSING:
        warn_no_row(state, request, task_id, queue)
    elif status is Status.FORGED:
        # The row's own parent is not the one this message names: a forged or copied header.
        # The body does not run, and nothing of the flow changes.
        state.deliveries.skipped.add(task_id)
        logger.warning(
            "echomq: refused delivery of %s on %s: its message names parent %r, which is not "
            "the job's own (its body is skipped; counted as forged_refused)",
            task_id,
            queue,
            named or None,
        )
    elif status in DUPLICATE_DELIVERY:
        # A duplicate delivery: the job runs under a live lease elsewhere, or it is finished,
        # or (a parent) it still waits for its children. Its body is skipped and its message
        # acknowledged; the holder's outcome is the job's.
        state.deliveries.skipped.add(task_id)
        logger.info("echomq: skip duplicate delivery of %s (%s)", task_id, status)


def _started(state: EchoMQ, task: Any, task_id: str, token: str) -> None:
    """This delivery holds the job: its token for the outcome, its STARTED state stored, and
    (a job whose result the store writes) Celery's own SUCCESS store held back; after
    store_started, which reads what the message said."""
    state.deliveries.tokens[task_id] = token
    store_started(task, task.request)
    hold_result(task.request)


def skip_duplicate(self: Any, task_id: str, args: Any, kwargs: Any) -> None:
    """``Task.before_start`` for every task: a duplicate's body ends here, as ``Ignore``.

    A signal receiver cannot stop a task (Celery logs and swallows its exceptions), while
    ``before_start`` runs inside the task's trace, where ``Ignore`` acknowledges the message
    and stores nothing. For a task that is not a flow job this is one set lookup.
    """
    state = find_state(self.app)
    if state is None:
        return
    if task_id in state.deliveries.skipped:
        state.deliveries.skipped.discard(task_id)
        raise Ignore(f"echomq: duplicate delivery of {task_id} skipped")
    if tracing.ON and getattr(self.request, H_FLOW, None):
        tracing.parent_started(state, getattr(self.request, H_QUEUE), task_id, self.request)


_celery_signature_from_request = Task.signature_from_request


def retry_signature(self: Any, request: Any = None, *args: Any, **options: Any) -> Any:
    """``Task.signature_from_request`` for every task, which Celery's retry sends: a job whose
    result the store writes is sent again as its producer sent it, silent on
    ``ignore_result`` (``hold_result`` set it on the running request alone), so that a worker
    without the extension that takes the retry stores its result, and recovery settles the
    job from it rather than run it again. One header lookup for any other task's retry."""
    sig = _celery_signature_from_request(self, request, *args, **options)
    if "ignore_result" not in options and marked(self.request if request is None else request):
        sig.options.pop("ignore_result", None)
    return sig


def on_success(sender: Any = None, result: Any = None, **_: Any) -> None:
    request = sender.request
    state = _flow_state(sender, request)
    if state is None:
        return
    token = state.deliveries.tokens.pop(request.id, None)
    if token is None:
        return
    parent = parent_ref(request)
    if tracing.ON:
        tracing.record_child(state, request.id, parent)
    value = state.dumps(result)
    reason = refusal(parent.reduce, value) if parent is not None and parent.reduce else None
    if reason is not None:
        # A value its flow's reducer cannot fold: the child fails, its FAILURE stored first
        # (no SUCCESS was: hold_result held Celery's back), as for a task that raised.
        store_refused(sender, request, reason)
        settle_failure(
            state,
            getattr(request, H_QUEUE),
            request.id,
            token,
            f"ReduceError: {reason}",
            bool(getattr(request, H_FLOW, None)),
            parent,
        )
        return
    settle_success(
        state,
        getattr(request, H_QUEUE),
        request.id,
        token,
        bool(getattr(request, H_FLOW, None)),
        parent,
        value,
        success_write(state, sender, request, result),
        lambda: store_success(sender, request, result),
        str(getattr(request, H_NEXT, None) or ""),
        since if isinstance(since := getattr(request, H_SINCE, None), int) else None,
        lambda why: store_refused(sender, request, why),
    )


def on_failure(
    sender: Any = None,
    task_id: str = "",
    exception: BaseException | None = None,
    einfo: Any = None,
    **_: Any,
) -> None:
    request, deliveries = sender.request, _deliveries(sender.app)
    token = deliveries.tokens.pop(task_id, None)
    lost = token is None and isinstance(exception, (WorkerLostError, TimeLimitExceeded))
    # A Reject without requeue, reported by the main process too (the pool process that
    # raised it reports nothing): its message is dropped, the job never runs again.
    rejected = token is None and isinstance(exception, Reject)
    if lost or rejected:
        # Reported by the worker's main process: the pool process that held the token was
        # killed (acks early: the message is gone with it) or hit its hard time limit. The
        # failure applies whatever token the row has, at once, as a chord's header fails then.
        if getattr(request, "id", None) != task_id:
            request = deliveries.received.get(task_id)  # Celery versions that push none
        token = ""
    received = deliveries.received.pop(task_id)
    if exception is not None:
        # The main process (a lost or timed-out pool process, a Reject without requeue) stores
        # a failure without a traceback, and may push no request context.
        holder = request if getattr(request, "id", None) == task_id else received
        traceback = None if lost or holder is received else getattr(einfo, "traceback", None)
        store_failure(sender, holder, task_id, exception, traceback)
    state = _flow_state(sender, request)
    if state is None or token is None:
        return
    if tracing.ON:
        tracing.record_child(state, task_id, parent_ref(request))
    next_step = getattr(request, H_NEXT, None)
    # Not for a pool process lost or past its time limit (the main process reports it): the
    # step may have completed in the store before it died, and its next step runs on.
    revoked = isinstance(exception, TaskRevokedError)
    if next_step and exception is not None and not lost and not revoked:
        # Before the flow hears of it: a chord's result checks its header's results first.
        fail_later_steps(state, getattr(request, H_QUEUE), str(next_step), exception)
    settle_failure(
        state,
        getattr(request, H_QUEUE),
        task_id,
        token,
        error_text(exception) if exception is not None else "unknown error",
        bool(getattr(request, H_FLOW, None)),
        parent_ref(request),
    )


def _due_in_ms(reason: Any) -> int:
    """How long until a retry's message is due: its countdown or eta (Retry.when)."""
    when = getattr(reason, "when", None)
    if isinstance(when, (int, float)):
        return int(when * 1000)
    if isinstance(when, datetime):
        aware = when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)
        return int((aware - datetime.now(timezone.utc)).total_seconds() * 1000)
    return 0


def on_retry(
    sender: Any = None, request: Any = None, reason: Any = None, einfo: Any = None, **_: Any
) -> None:
    state = _flow_state(sender, request)
    if state is None:
        return
    if reason is not None:
        store_retry(
            sender, request, getattr(reason, "exc", None), getattr(einfo, "traceback", None)
        )
    token = state.deliveries.tokens.pop(request.id, None)
    if token is not None:
        queue = getattr(request, H_QUEUE)
        status = outcome_of(
            state,
            queue,
            request.id,
            token,
            "the retry",
            lambda: state.scripts.retry(queue, request.id, token, _due_in_ms(reason)),
        )
        logger.info("echomq: retry %s -> %s", request.id, status)


def on_postrun(
    sender: Any = None, task_id: str = "", state: str = "", retval: Any = None, **_: Any
) -> None:
    skipped = _deliveries(sender.app).skipped
    if task_id in skipped:
        skipped.discard(task_id)  # skipped before before_start ran (e.g. it was overridden)
        return
    if state != "IGNORED":
        return
    request = sender.request
    store = _flow_state(sender, request)
    token = store.deliveries.tokens.pop(task_id, None) if store is not None else None
    if store is None or token is None:
        return
    # Ignore without a duplicate: the body replaced itself (Task.replace) or chose to leave its
    # state to another task. The job waits for the outcome stored under its id.
    queue = getattr(request, H_QUEUE)
    status = outcome_of(
        store,
        queue,
        task_id,
        token,
        "the hand-over",
        lambda: store.scripts.hand_over(queue, task_id, token),
    )
    logger.info("echomq: %s handed over to its replacement (%s)", task_id, status)


def on_received(sender: Any = None, request: Any = None, **_: Any) -> None:
    headers = getattr(request, "request_dict", None) or {}
    app = getattr(request, "app", None)
    if headers.get(H_BATCH):
        for task, child in revoked_children(app, request):
            on_revoked(sender=task, request=child)
        return
    state = find_state(app) if headers.get(H_QUEUE) else None
    if state is not None:
        state.deliveries.received.put(request.id, Headers(headers))


def on_revoked(
    sender: Any = None,
    request: Any = None,
    terminated: bool = False,
    expired: bool = False,
    **_: Any,
) -> None:
    # Celery passes the request's Context here: the message headers are its attributes.
    headers = request
    if sender is None or not getattr(headers, H_QUEUE, None):
        return
    state = find_state(sender.app)
    if state is None:
        return
    state.deliveries.received.pop(request.id)
    reason = "TaskRevokedError: expired" if expired else "TaskRevokedError: revoked"
    queue = getattr(headers, H_QUEUE)
    if expired and not may_expire(state, queue, request.id):
        # An expired copy of a job whose own message never expires (a forged or replayed
        # message): the row decides, and its job runs as sent.
        logger.warning(
            "echomq: ignored an expired delivery of %s on %s: the job's stored message has no "
            "expiry",
            request.id,
            queue,
        )
        return
    store_revoked(
        sender, request, "expired" if expired else "terminated" if terminated else "revoked"
    )
    is_parent = bool(getattr(headers, H_FLOW, None))
    if is_parent and not expired and _cancelled(state, queue, request.id):
        # A flow's parent revoked by Celery's revoke (a chord's ``res.revoke()``): the flow
        # is cancelled, as by ``echomq cancel``, not failed; its outer flow counts it failed.
        if (outer := parent_ref(headers)) is not None:
            settle_failure(state, queue, request.id, "", reason, True, outer, carry=True)
        return
    settle_failure(state, queue, request.id, "", reason, is_parent, parent_ref(headers))


def _cancelled(state: EchoMQ, queue: str, parent_id: str) -> bool:
    """Cancel the released flow parent ``parent_id`` whose message was revoked: whether this
    did (a parent already cancelled, by ``echomq cancel`` say, is not cancelled again)."""
    status, was, _ = state.scripts.cancel(queue, parent_id, [], ttl=state.settings.result_ttl)
    if status is not Status.CANCELLED or was is Status.CANCELLED:
        return False
    logger.info("echomq: flow %s cancelled: its parent's message was revoked", parent_id)
    return True


def connect() -> None:
    """Connect the receivers (once per process; each checks the sender's app)."""
    signals.task_prerun.connect(on_prerun, weak=False, dispatch_uid="echomq_prerun")
    signals.task_success.connect(on_success, weak=False, dispatch_uid="echomq_success")
    signals.task_failure.connect(on_failure, weak=False, dispatch_uid="echomq_failure")
    signals.task_retry.connect(on_retry, weak=False, dispatch_uid="echomq_retry")
    signals.task_revoked.connect(on_revoked, weak=False, dispatch_uid="echomq_revoked")
    signals.task_unknown.connect(on_unknown, weak=False, dispatch_uid="echomq_unknown")
    signals.task_rejected.connect(on_rejected, weak=False, dispatch_uid="echomq_rejected")
    signals.task_received.connect(on_received, weak=False, dispatch_uid="echomq_received")
    signals.task_postrun.connect(on_postrun, weak=False, dispatch_uid="echomq_postrun")
    signals.worker_ready.connect(on_worker_ready, weak=False, dispatch_uid="echomq_ready")
    # On Celery's base class, so that tasks with a custom base get it too; Celery's tracer
    # calls an overridden before_start (see celery.app.trace.task_has_custom).
    if Task.before_start is not skip_duplicate:
        Task.before_start = skip_duplicate
    if Task.signature_from_request is not retry_signature:
        Task.signature_from_request = retry_signature
