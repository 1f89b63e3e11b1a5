"""A flow job's message as the plan builds it: its id, the queue it is routed to, its options
and the flow's headers, and whether the store writes its result. Pure."""

from __future__ import annotations

from typing import Any

from celery.canvas import Signature

from celery_echomq.errors import PolicyError
from celery_echomq.send.shape import CALLBACKS, STEP_ERRBACKS, merge_callbacks
from celery_echomq.store.headers import H_RESULT, RESERVED
from celery_echomq.store.keyspace import check_id, check_queue, new_job_id
from celery_echomq.store.planned import NOTHING_HELD, Held, JobMessage

POLICIES = ("fail", "ignore", "remove", "continue", "fail_at_end")
# The policies under which a failed child fails its parent: at once, or once every other
# child has settled (as a Celery chord's body fails after its whole header has run).
FAILING = ("fail", "fail_at_end")


# Options that belong to the flow's parent alone: the rest reach every child too.
PARENT_ONLY = frozenset(
    {"task_id", "link", "link_error", "chain", "chord", "group_id", "group_index", "reply_to"}
    | {STEP_ERRBACKS}
)
# Options that delay or expire the children's messages; the parent is sent when released.
CHILD_ONLY = frozenset({"task_id", "countdown", "eta", "expires"})
# Options a stored payload must not carry: they are per-send, not per-job.
NOT_STORED = frozenset({"producer", "connection", "router", "add_to_parent", "publisher"})


def job_id_of(options: dict[str, Any], fallback: str | None = None) -> str:
    """The signature's own ``task_id`` (gated: an empty one is an error, not a default)."""
    given = options.get("task_id")
    if given is None:
        given = fallback if fallback is not None else new_job_id()
    return check_id(given)


def child_job_id(options: dict[str, Any], position: int) -> str:
    """A child's id, gated; a refusal names the child's place among its siblings."""
    try:
        return job_id_of(options)
    except ValueError as exc:
        raise type(exc)(
            f"flow child {position}: {exc}; allowed: a signature without task_id, a frozen "
            "one (freeze(), task_id=celery.utils.uuid()), or task_id='JOB' + uuid.uuid4().hex"
        ) from exc


def check_policy(policy: object, where: str, name: str = "parent_policy") -> str:
    if policy not in POLICIES:
        raise PolicyError(f"{where}: unknown {name} {policy!r}; allowed: " + ", ".join(POLICIES))
    return str(policy)


def route_queue(app: Any, sig: Signature, options: dict[str, Any]) -> str:
    """The Celery queue a signature is sent to: its ``queue`` option, else the app's router."""
    queue = sig.options.get("queue") or options.get("queue")
    if queue is None:
        route = app.amqp.router.route({}, sig.task, sig.args, sig.kwargs)
        queue = route.get("queue")
    name = getattr(queue, "name", queue) or app.conf.task_default_queue
    return check_queue(str(name))


def job_dict(
    sig: Signature, options: dict[str, Any], headers: dict[str, str]
) -> tuple[JobMessage, Held]:
    """The message ``sig`` is sent as (sent with ``options``, ``headers`` over its own), and
    what its stored message keeps beside it: the errbacks its chain's steps ran, never an
    option Celery is sent (see send/errbacks.py); most jobs keep nothing."""
    opts = {k: v for k, v in {**options, **sig.options}.items() if k not in NOT_STORED}
    for name in CALLBACKS:
        if name in options and name in sig.options:
            # Both run, as a chord runs its body's own callbacks and those it was sent with.
            opts[name] = merge_callbacks(sig.options[name], options[name])
    given = opts.get("headers") or {}
    if any(str(name).startswith(RESERVED) for name in given):
        # The flow's own headers are the plan's alone: one a signature brings (copied from a
        # request, or from untrusted JSON) must not name another flow's job.
        given = {k: v for k, v in given.items() if not str(k).startswith(RESERVED)}
    opts["headers"] = {**given, **headers}
    job: JobMessage = {
        "task": sig.task,
        "args": list(sig.args),
        "kwargs": dict(sig.kwargs),
        "options": opts,
        "subtask_type": None,
        "immutable": sig.immutable,
    }
    ran = opts.pop(STEP_ERRBACKS, None)  # its own or its flow node's: never handed down
    return job, Held(step_errbacks=list(ran)) if ran else NOTHING_HELD


def mark_for_store(job: JobMessage) -> None:
    """Mark ``job`` with the :data:`H_RESULT` header: the store writes its result when it
    completes, in the same script call (see wire/results.py).

    The message does not say ``ignore_result``: a worker with the extension keeps Celery's
    trace from storing the SUCCESS itself once it holds the job (``hold_result``), while a
    worker without it (a fleet half upgraded) stores the result as for any task, and recovery
    settles the job from that result rather than run it again.

    Not for a job whose options decide ``ignore_result`` themselves, nor for one that is part
    of a chord (a flow in a chord's header): Celery's ``mark_as_done`` must store its result
    before ``on_chord_part_return`` counts it.
    """
    options = job["options"]
    if "ignore_result" in options or options.get("chord"):
        return
    options["headers"][H_RESULT] = "1"
