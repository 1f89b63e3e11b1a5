"""Running a batch message (send/batches.py): its children, one after another, in this process.

The message names children by id and queue, nothing more. Each child's stored message is read
from its row (one pipelined read for the batch), built into the request Celery's worker would
build from that message, and run through the task's own trace: its signals (the claim on
``task_prerun``, the completion on ``task_success``), ``self.request``, ``bind``,
``autoretry_for``, ``self.retry()`` (a message of its own) and its stored result are those of a
delivery of its own. So a child another delivery holds or finished skips its body, as a
duplicate does, and each body runs once whatever copies of a batch come. One thing differs:
a child's claim is sent with the outcome of the child before it, in that outcome's round trip
(:func:`claim_next`), and read at the child's ``task_prerun`` (:func:`claimed_ahead`).

What a batch shares is its pool process and Celery's time limits: a hard limit ends the process,
and with it the children not yet run. They stay pending rows with no message, which recovery
re-publishes, each on its own; the child that was running is recovered as any killed job is.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from celery.app.task import Context
from celery.app.trace import trace_task

from celery_echomq.errors import InvalidIdError
from celery_echomq.send.batches import BATCH_TASK, OWN_MESSAGE
from celery_echomq.send.start import with_since
from celery_echomq.store.codec import STORED_FIELDS, TemplateMissingError, load_job, stored_of
from celery_echomq.store.headers import (
    H_BATCH,
    H_QUEUE,
    H_QUORUM,
    H_SINCE,
    H_STORE,
    H_TEMPLATE,
    H_VIA,
    parent_ref,
)
from celery_echomq.store.keyspace import check_id, check_queue
from celery_echomq.store.planned import is_row_job
from celery_echomq.store.replies import Status
from celery_echomq.store.state import EchoMQ, find_state, get_state
from celery_echomq.wire.publish import MessageBuilder
from celery_echomq.wire.results import store_revoked
from celery_echomq.worker.claims import claim_riding, new_token
from celery_echomq.worker.settle import runs_here, settle_failure

logger = logging.getLogger("celery_echomq")

# What a child's message takes from its batch's where its own options name none: the lineage
# and reply address of the producer that sent the batch, not of the batch task running it.
_LINEAGE = ("root_id", "parent_id", "reply_to")


def register_batch_task(app: Any) -> None:
    """The batch task on ``app``: what a worker runs for a batch message."""
    if BATCH_TASK not in app.tasks:
        app.task(name=BATCH_TASK, bind=True, shared=False, lazy=False, ignore_result=True)(
            run_batch
        )


def run_batch(task: Any, ids: list[str]) -> int:
    """Run each child ``ids`` names, in order; how many had a stored message to run."""
    request = task.request
    try:
        queue = check_queue(getattr(request, H_BATCH, None))
    except InvalidIdError as exc:
        logger.warning("echomq: batch message %s ignored: %s", request.id, exc)
        return 0
    if not isinstance(ids, list):
        logger.warning("echomq: batch message %s names no list of ids; ignored", request.id)
        return 0
    state = get_state(task.app)
    valid = _valid(ids, queue)
    if valid:
        _claim_first(state, request, queue, valid[0])
    stored = _stored_jobs(state, queue, valid, getattr(request, H_TEMPLATE, None))
    jobs = [job for job in stored if _known(task.app, job)]
    children = _requests(MessageBuilder(task.app), request, queue, jobs)
    try:
        for parent in _run_children(task.app, request, queue, children):
            _turn.running = parent["options"]["task_id"]
            run_released(task.app, request, parent)
    finally:
        runs_here.asked = None
        _turn.running, _turn.after = None, []
        _turn.ahead.clear()
        state.scripts.runner.unride()
    return len(jobs)


def _run_children(
    app: Any, batch: Any, queue: str, children: list[tuple[dict[str, Any], dict[str, Any]]]
) -> list[dict[str, Any]]:
    """Run each child in turn; the parents the last child's completion released to run next
    in this process (:func:`_runs_here`), for the caller to run."""
    released: list[dict[str, Any]] = []

    def keep(parent: dict[str, Any]) -> bool:
        if not _runs_here(app, batch, queue, parent):
            return False
        released.append(parent)
        return True

    for index, (job, child) in enumerate(children):
        _turn.running, _turn.after = job["options"]["task_id"], children[index + 1 :][:1]
        # Asked by the last child's completion only: the parent it releases runs next, here.
        runs_here.asked = None if _turn.after else keep
        _run_child(app, job, child, batch.hostname)
    runs_here.asked = None
    return released


def _runs_here(app: Any, batch: Any, queue: str, parent: dict[str, Any]) -> bool:
    """Whether the parent that a batch's last child released runs next in this process, as its
    own message would run on this worker: it would be sent to this batch's queue, its task is
    one this worker has, it keeps no delay or expiry (what only a message keeps), and no time
    limit applies, neither its own nor its batch's (Celery enforces a limit per message: run
    here, the parent would be under its batch's)."""
    options = parent["options"]
    task = app.tasks.get(parent["task"])
    if task is None or (options.get("headers") or {}).get(H_QUEUE) != queue:
        return False
    if any(options.get(name) is not None for name in OWN_MESSAGE):
        return False
    if any(getattr(batch, "timelimit", None) or ()):
        return False
    return not any(
        options.get(name) or getattr(task, name, None) or app.conf.get(setting)
        for name, setting in (
            ("time_limit", "task_time_limit"),
            ("soft_time_limit", "task_soft_time_limit"),
        )
    )


def run_released(app: Any, batch: Any, parent: dict[str, Any]) -> None:
    """Run a parent its batch's last child released, as its own message delivered with the
    batch's would run: its claim, signals, result and completion. Until its claim lands it is
    a released parent with no message, as when a worker dies before publishing one: recovery
    publishes it once the stall timeout has passed."""
    # Pending since its release, not since its batch's children were sent.
    delivered = _as_delivered(parent, {**vars(batch), H_SINCE: None})
    _run_child(app, parent, _child_request(MessageBuilder(app), delivered, batch), batch.hostname)


class _Turn(threading.local):
    """This thread's batch, as its children's claims see it: the child running, the one
    after it (whose claim rides with the running child's outcome), and the claims sent
    ahead so, by child id: the token and the reply (None: its round trip failed)."""

    def __init__(self) -> None:
        self.running: str | None = None
        self.after: list[tuple[dict[str, Any], dict[str, Any]]] = []
        self.ahead: dict[str, tuple[str, tuple[Status, int, str] | None]] = {}


_turn = _Turn()


def claimed_ahead(state: EchoMQ, task_id: str) -> tuple[str, tuple[Status, int, str] | None]:
    """At a delivery's claim: the token and reply of its claim if it rode with the outcome of
    the batch child before it; else a new token and None (claim now). A claim still waiting
    for an outcome to ride with (the child before recorded none: a duplicate, a body that
    did not run) is taken back: this claim is made now."""
    state.scripts.runner.unride()
    return _turn.ahead.pop(task_id, None) or (new_token(), None)


def _claim_first(state: EchoMQ, batch: Any, queue: str, job_id: str) -> None:
    """The claim of a batch's first child, sent with the read of the batch's rows, in its
    round trip: the first child's turn is the batch's start, as a later child's is the
    outcome of the child before it. Made before the child's message is read, it names no
    parent (the row's own decides) and takes its delivery from the batch message's, which
    carries only children of its priority. A first child then found not to run here (a
    task this worker lacks, a message that does not build) keeps the claim until its lease
    lapses, and recovery re-publishes it on its own, as a killed child's."""
    token = new_token()
    delivery = Context(
        {
            "id": job_id,
            H_QUEUE: queue,
            H_SINCE: getattr(batch, H_SINCE, None),
            H_VIA: batch.id,
            "delivery_info": batch.delivery_info,
        }
    )

    def landed(first: tuple[Status, int, str] | None) -> None:
        _turn.ahead[job_id] = (token, first)

    claim_riding(state, delivery, token, landed, names_parent=False)


def claim_next(state: EchoMQ, task_id: str) -> None:
    """After the claim of ``task_id``, a batch's child: the claim of the child after it,
    sent with this one's outcome, in its round trip, so that it sees what that outcome
    wrote (a quorum met, a flow cut). A child runs with one round trip to the store rather
    than two, and the child after it is claimed no earlier than its turn but for the
    outcome's reply."""
    if _turn.running != task_id or not _turn.after:
        return
    _, child = _turn.after[0]
    if child.get(H_QUORUM):
        # A quorum's cut is made after its release, by the host that published the parent
        # (send/fan_in.py, cut_rest): a claim sent with the release would come before it.
        return
    request, token = Context(child), new_token()

    def landed(first: tuple[Status, int, str] | None) -> None:
        _turn.ahead[str(request.id)] = (token, first)

    claim_riding(state, request, token, landed)


def _requests(
    builder: MessageBuilder, batch: Any, queue: str, jobs: list[dict[str, Any]]
) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each job with the request its own message would give it; a job whose message does not
    build is left as it is (pending: recovery re-publishes it on its own)."""
    built = []
    for job in jobs:
        try:
            built.append((job, _child_request(builder, _as_delivered(job, vars(batch)), batch)))
        except Exception:
            # Celery's trace reports what a body raises: this is the message not building.
            logger.exception(
                "echomq: batch child %s on %s could not be run here; left to recovery",
                job["options"]["task_id"],
                queue,
            )
    return built


def _known(app: Any, job: dict[str, Any]) -> bool:
    """Whether this worker has the child's task; a child it has not is left pending, for
    recovery to re-publish on its own to a worker that does."""
    if job["task"] in app.tasks:
        return True
    logger.warning(
        "echomq: batch child %s names task %r, which this worker does not have; left to recovery",
        job["options"]["task_id"],
        job["task"],
    )
    return False


def revoked_children(app: Any, request: Any) -> list[tuple[Any, Context]]:
    """At a batch message's receipt (the worker's main process): each child Celery's worker
    holds revoked by id, as its task and the request its own message would have given it.
    Celery checks a message's own id at receipt, and a batch's children have none: the
    revoke receiver settles these as it settles a revoked message. Empty for any other
    message."""
    found = batch_children(request)
    state = find_state(app)
    if found is None or state is None:
        return []
    from celery.worker import state as worker_state

    queue, ids = found
    revoked = [job_id for job_id in ids if job_id in worker_state.revoked]
    if not revoked:
        return []
    return _contexts(app, state, request, queue, revoked)


def _contexts(
    app: Any, state: EchoMQ, request: Any, queue: str, ids: list[str]
) -> list[tuple[Any, Context]]:
    """Each child of the batch ``request`` that ``ids`` names, as its task and the request its
    own message would have given it (a child whose task this worker lacks: none)."""
    contexts = []
    headers = getattr(request, "request_dict", None) or {}
    builder = MessageBuilder(app)
    for job in _stored_jobs(state, queue, ids):
        task = app.tasks.get(job["task"])
        if task is not None:
            delivered = _child_request(builder, _as_delivered(job, headers), request)
            contexts.append((task, Context(delivered)))
    return contexts


def revoke_waiting(app: Any) -> None:
    """In the worker's main process, each tick of its lease loop: revoke the children of the
    batches it holds (running or prefetched) that Celery's worker holds revoked by id and that
    have not started, as its worker drops a message it holds once its id is revoked. Each is
    failed in the store only if it is still pending (fail.lua's ``unstarted``), with its
    result ``REVOKED``; at its turn its claim finds it failed and its body never runs. A child
    that has started runs on, as a running task does under a revoke without ``terminate``.
    Nothing is read from the store unless a held batch names a revoked id."""
    state = find_state(app)
    if state is None:
        return
    from celery.worker import state as worker_state

    revoked = worker_state.revoked
    # A running request is both active and reserved: each once.
    held = {r.id: r for r in (*worker_state.active_requests, *worker_state.reserved_requests)}
    named = [(request, found) for request in held.values() if (found := batch_children(request))]
    doomed = [
        (request, queue, job_id)
        for request, (queue, ids) in named
        for job_id in ids
        if job_id in revoked
    ]
    if not doomed:
        return
    pipe = state.client.pipeline(transaction=False)
    for _, queue, job_id in doomed:
        pipe.hget(state.keys.job_key(queue, job_id), "state")
    waiting = [d for d, row in zip(doomed, pipe.execute(), strict=True) if row == b"pending"]
    for request, queue, job_id in waiting:
        for task, child in _contexts(app, state, request, queue, [job_id]):
            # Stored before the flow hears of it, as for a revoked message (a chord's error
            # reads it); a child claimed meanwhile (stale) stores its own outcome over it.
            store_revoked(task, child, "revoked")
            reason, parent = "TaskRevokedError: revoked", parent_ref(child)
            status = settle_failure(state, queue, job_id, "", reason, False, parent, unstarted=True)
            if status is not Status.STALE:
                logger.info("echomq: batch child %s on %s revoked before its turn", job_id, queue)


def _valid(ids: list[Any], queue: str, *, say: bool = True) -> list[str]:
    """The ids, each once, in order; an ill-formed one (never written by a producer) skipped
    before any key is built from it, with a line when ``say`` (the run of the batch says it
    once; the lease loop, which reads a held batch every tick, says nothing)."""
    valid: list[str] = []
    seen: set[str] = set()
    for raw in ids:
        try:
            job_id = check_id(raw)
        except InvalidIdError:
            if say:
                logger.warning("echomq: batch on %s names an ill-formed id %r; skipped", queue, raw)
            continue
        if job_id not in seen:
            seen.add(job_id)
            valid.append(job_id)
    return valid


def _stored_jobs(
    state: EchoMQ, queue: str, ids: list[str], template_of: Any = None
) -> list[dict[str, Any]]:
    """Each child's stored message, read in one round trip with the template on the row of
    ``template_of`` (the batch message's :data:`H_TEMPLATE`: a parent's id, or None) and
    with a claim left to ride (the first child's); a child with none (expired, forgotten,
    never written) skipped with a line."""
    pipe = state.client.pipeline(transaction=False)
    for job_id in ids:
        pipe.hmget(state.keys.job_key(queue, job_id), STORED_FIELDS)
    hinted = _template_parent(template_of)
    if hinted:
        pipe.hget(state.keys.job_key(queue, hinted), "template")
    read = state.scripts.runner.read_carrying(pipe)
    templates: dict[str, bytes | None] = {}
    if hinted:
        # A template the hint found; one it did not (None) is read again where a row asks.
        found = read.pop()
        if found is not None:
            templates[hinted] = found
    jobs = []
    for job_id, fields in zip(ids, read, strict=True):
        stored = stored_of(*fields)
        if stored is None:
            logger.warning("echomq: batch child %s on %s has no stored job; skipped", job_id, queue)
            continue
        try:
            job = load_job(state, queue, job_id, stored, templates)
        except (TemplateMissingError, ValueError) as exc:
            logger.warning("echomq: batch child %s on %s: %s; skipped", job_id, queue, exc)
            continue
        if not is_row_job(job) or "options" not in job:
            logger.warning("echomq: batch child %s on %s is not a task; skipped", job_id, queue)
            continue
        jobs.append(job)
    return jobs


def _template_parent(hint: Any) -> str | None:
    """The parent a batch message's :data:`H_TEMPLATE` names, if it is an id (no key is built
    from an ill-formed one: a message from a producer of an earlier release names none)."""
    if not hint:
        return None
    try:
        return check_id(hint)
    except InvalidIdError:
        return None


def _as_delivered(job: dict[str, Any], batch: Mapping[str, Any]) -> dict[str, Any]:
    """``job`` as its own first message would have carried it: the enqueue time and store
    its batch message (``batch``: its headers) says, its producer's lineage where the job
    names none."""
    since = batch.get(H_SINCE)
    store = str(batch.get(H_STORE) or "")
    job = with_since(job, since if isinstance(since, int) else None, store)
    options = job["options"]
    options["headers"][H_VIA] = batch.get("id")
    for name in _LINEAGE:
        if options.get(name) is None and batch.get(name):
            options[name] = batch[name]
    return job


def _run_child(app: Any, job: dict[str, Any], request: dict[str, Any], hostname: str) -> None:
    """Run the child's request as the worker runs a delivered one (Celery's ``Request`` and
    the prefork pool's fast trace, in this process)."""
    task = app.tasks[job["task"]]
    task_id = str(job["options"]["task_id"])
    trace_task(
        task, task_id, request["args"], request["kwargs"], request, app=app, hostname=hostname
    )


def _child_request(builder: MessageBuilder, job: dict[str, Any], batch: Any) -> dict[str, Any]:
    """The request dict Celery's worker builds from a delivered message, for ``job``'s own
    message, delivered as its ``batch`` was."""
    message = builder.build(job)
    args, kwargs, embed = message.body
    properties = message.properties
    delivery = batch.delivery_info or {}
    return {
        **message.headers,
        "properties": properties,
        "reply_to": properties.get("reply_to"),
        "correlation_id": properties.get("correlation_id"),
        "hostname": batch.hostname,
        "delivery_info": {
            "exchange": delivery.get("exchange"),
            "routing_key": delivery.get("routing_key"),
            "priority": properties.get("priority"),
            "redelivered": False,
        },
        # As a broker delivers them: JSON's lists.
        "args": list(args),
        "kwargs": kwargs,
        "is_eager": False,
        **(embed or {}),
    }


def batch_children(request: Any) -> tuple[str, list[str]] | None:
    """``(queue, child ids)`` of a batch message's request as the worker's state holds it (its
    request dict), or None for any other request."""
    headers = getattr(request, "request_dict", None) or {}
    named, ids = headers.get(H_BATCH), headers.get("args")
    if not named or not isinstance(ids, list | tuple) or not ids or not isinstance(ids[0], list):
        return None
    try:
        queue = check_queue(named)
    except InvalidIdError:
        return None  # a forged message: no key is ever built from it
    return queue, _valid(ids[0], queue, say=False)
