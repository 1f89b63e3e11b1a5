"""The host side of a flow's transitions: start it, dispatch its released parent, settle a
parent whose child failed under policy ``fail``.

Each step is one script call; what follows it (a publish, a result written to Celery's
backend) is repeated by recovery if the process dies in between.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from celery.canvas import Signature

from .config import safe_url
from .errors import (
    EchoMQError,
    FlowCancelled,
    FlowExistsError,
    FlowFailed,
    StoreUnavailableError,
)
from .keyspace import check_id, check_queue, check_unique
from .publish import send_jobs
from .scripts import UNSETTLED, ParentRef, Status
from .state import EchoMQ, get_state

logger = logging.getLogger("celery_echomq")

POLICIES = ("fail", "ignore", "remove", "continue")

# Message headers that mark a flow job; Celery keeps custom headers across retries.
H_QUEUE = "echomq_q"  # the queue whose slot holds this job's row
H_PARENT = "echomq_p"  # the parent's job id, on a child
H_PARENT_QUEUE = "echomq_pq"  # the queue whose slot holds the parent's keys
H_FLOW = "echomq_f"  # "1" on a flow parent: it has keys of its own to expire

# Options that belong to the flow's parent alone: the rest reach every child too.
PARENT_ONLY = frozenset(
    {"task_id", "link", "link_error", "chain", "chord", "group_id", "group_index", "reply_to"}
)
# Options that delay or expire the children's messages; the parent is sent when released.
CHILD_ONLY = frozenset({"task_id", "countdown", "eta", "expires"})
# Options a stored payload must not carry: they are per-send, not per-job.
NOT_STORED = frozenset({"producer", "connection", "router", "add_to_parent", "publisher"})


def new_job_id() -> str:
    return "JOB" + uuid.uuid4().hex


def job_id_of(options: dict[str, Any], fallback: str | None = None) -> str:
    """The signature's own ``task_id`` (gated: an empty one is an error, not a default)."""
    given = options.get("task_id")
    if given is None:
        given = fallback if fallback is not None else new_job_id()
    return check_id(given)


def check_policy(policy: object, where: str) -> str:
    if policy not in POLICIES:
        from .errors import PolicyError

        raise PolicyError(
            f"{where}: unknown parent_policy {policy!r}; allowed: " + ", ".join(POLICIES)
        )
    return str(policy)


@dataclass
class Plan:
    """A flow with every id assigned and every message built, before anything is sent.

    A nested flow's entry in ``children`` is ``{"nested": <its Plan as a dict>}``; its
    ``outer`` is the id of the flow it is a child of.
    """

    queue: str
    parent_id: str
    parent: dict[str, Any]
    children: list[dict[str, Any]] = field(default_factory=list)
    policy: str = "fail"
    child_policies: dict[str, str] = field(default_factory=dict)
    outer: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        return cls(**data)

    def levels(self) -> Iterator[Plan]:
        """This flow, then every nested flow, outer before inner."""
        yield self
        for job in self.children:
            if "nested" in job:
                yield from Plan.from_dict(job["nested"]).levels()

    def child_ids(self) -> list[str]:
        return [child_id(job) for job in self.children]

    def chunked(self, chunk_size: int) -> bool:
        """Whether this level takes open/add/seal instead of the one-EVAL seed path."""
        return len(self.children) > chunk_size or any(
            child_queue(job) != self.queue for job in self.children
        )


def child_queue(job: dict[str, Any]) -> str:
    if "nested" in job:
        return str(job["nested"]["queue"])
    return str(job["options"]["headers"][H_QUEUE])


def child_id(job: dict[str, Any]) -> str:
    if "nested" in job:
        return str(job["nested"]["parent_id"])
    return str(job["options"]["task_id"])


def route_queue(app: Any, sig: Signature, options: dict[str, Any]) -> str:
    """The Celery queue a signature is sent to: its ``queue`` option, else the app's router."""
    queue = sig.options.get("queue") or options.get("queue")
    if queue is None:
        route = app.amqp.router.route({}, sig.task, sig.args, sig.kwargs)
        queue = route.get("queue")
    name = getattr(queue, "name", queue) or app.conf.task_default_queue
    return check_queue(str(name))


def _job_dict(sig: Signature, options: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    opts = {k: v for k, v in {**options, **sig.options}.items() if k not in NOT_STORED}
    opts["headers"] = {**(opts.get("headers") or {}), **headers}
    return {
        "task": sig.task,
        "args": list(sig.args),
        "kwargs": dict(sig.kwargs),
        "options": opts,
        "subtask_type": None,
        "immutable": sig.immutable,
    }


def is_flow(sig: Any) -> bool:
    return getattr(sig, "subtask_type", None) == "flow"


def plan_flow(
    app: Any,
    parent: Signature,
    children: Sequence[Signature],
    *,
    policy: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    options: dict[str, Any],
    outer: str = "",
    outer_queue: str = "",
) -> Plan:
    """Assign and gate every id and build every message; touches neither Redis nor the broker.

    Each job's keys live on the slot of the queue it is sent to: a child routed elsewhere
    than its parent is credited across slots (see ``start_flow``).
    """
    parent_id = job_id_of(parent.options, options.get("task_id"))
    queue = route_queue(app, parent, options)
    shared = {k: v for k, v in options.items() if k not in PARENT_ONLY}
    plan = Plan(queue=queue, parent_id=parent_id, parent={}, policy=policy, outer=outer)
    for child in children:
        child_policy = child.options.get("parent_policy")
        if is_flow(child):
            inner_opts = {**shared, **child.options}
            inner_opts.pop("parent_policy", None)
            inner_args = () if child.immutable else (*args, *child.args)
            inner = plan_flow(
                app,
                child.kwargs["parent"],
                child.kwargs["children"],
                policy=child.kwargs["policy"],
                args=inner_args,
                kwargs=kwargs,
                options=inner_opts,
                outer=parent_id,
                outer_queue=queue,
            )
            cid = inner.parent_id
            plan.children.append({"nested": inner.to_dict()})
        else:
            cid = job_id_of(child.options)
            if args or kwargs:
                child = child.clone(args=args, kwargs=kwargs)
            child_queue = route_queue(app, child, shared)
            headers = {H_QUEUE: child_queue, H_PARENT: parent_id}
            if child_queue != queue:
                headers[H_PARENT_QUEUE] = queue
            job = _job_dict(child, shared, headers)
            job["options"].pop("parent_policy", None)
            job["options"]["task_id"] = cid
            plan.children.append(job)
        if child_policy is not None:
            plan.child_policies[cid] = check_policy(child_policy, f"child {cid}")
    parent_opts = {k: v for k, v in options.items() if k not in CHILD_ONLY}
    headers = {H_QUEUE: queue, H_FLOW: "1"}
    if outer:
        headers[H_PARENT] = outer
        if outer_queue != queue:
            headers[H_PARENT_QUEUE] = outer_queue
    plan.parent = _job_dict(parent, parent_opts, headers)
    plan.parent["options"]["task_id"] = parent_id
    plan.parent["children"] = plan.child_ids()
    if not outer:
        # Every id of the tree once: a nested parent is listed as its outer flow's child.
        check_unique([parent_id, *(cid for level in plan.levels() for cid in level.child_ids())])
    return plan


def _payloads(state: EchoMQ, plan: Plan) -> list[tuple[str, bytes]]:
    return [(child_id(job), state.dumps(job)) for job in plan.children]


def start_flow(state: EchoMQ, plan: Plan) -> None:
    """Enqueue the flow (each level of a tree, outer first), then publish its leaves.

    A level whose children all live on its parent's slot, and are no more than
    ``echomq_chunk_size``, is one EVAL of the seed's enqueue_flow. Any other level takes the
    chunked path: open_flow holds the parent with one extra unit on its counter,
    add_children writes the children per queue and chunk, seal_flow removes the extra unit.

    A nested flow's parent is first written by its outer flow as a pending child whose
    payload is the nested plan, then held by its own level: a crash between the two leaves a
    pending child that recovery re-publishes, which resumes the nested flow (``publish``).
    """
    scripts = state.scripts
    keys = state.keys
    chunk = state.settings.chunk_size
    levels = list(plan.levels())
    written: list[tuple[str, str, list[str]]] = []
    try:
        # Before the flow lands, not after: a producer killed right after the EVAL must still
        # leave its queues where recovery looks (SADD is idempotent).
        queues = {level.queue for level in levels}
        queues.update(child_queue(job) for level in levels for job in level.children)
        state.client.sadd(keys.queues_key(), *sorted(queues))
        seeded = []
        try:
            for level in levels:
                if level.chunked(chunk):
                    _enqueue_chunked(state, level, chunk, written)
                else:
                    scripts.enqueue_flow(
                        level.queue,
                        level.parent_id,
                        state.dumps(level.parent),
                        _payloads(state, level),
                        outer=level.outer,
                    )
                    written.append((level.queue, level.parent_id, level.child_ids()))
                    seeded.append(level)
        except EchoMQError:
            # A refusal after an earlier level or chunk landed: take back exactly what this
            # call wrote, so bad input leaves nothing behind.
            _rollback(state, written)
            logger.info(
                "echomq: flow %s refused; %d steps taken back", plan.parent_id, len(written)
            )
            raise
        # After the atomic land: each flow's default policy and each child's own, on the
        # same slot (one MULTI per slot, as Redis Cluster requires), before any child can run
        # (none is published yet).
        for level in seeded:
            pipe = state.client.pipeline(transaction=True)
            pipe.hset(keys.job_key(level.queue, level.parent_id), "policy", level.policy)
            for cid, child_policy in level.child_policies.items():
                pipe.hset(keys.job_key(level.queue, cid), "parent_policy", child_policy)
            pipe.execute()
        # Outside the flow's slot: where a bare id lives.
        side = state.client.pipeline(transaction=False)
        for level in levels:
            side.set(keys.locator_key(level.parent_id), level.queue, ex=_locator_ttl(state))
        side.execute()
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        where = f"Redis at {safe_url(state.settings.redis_url)!r}"
        if not written:
            raise StoreUnavailableError(
                f"{where} is unavailable ({exc}); the flow was not started and nothing was "
                "published"
            ) from exc
        raise StoreUnavailableError(
            f"{where} became unavailable ({exc}) after flow {plan.parent_id} was enqueued; "
            "nothing was published: recovery publishes its children once Redis is back"
        ) from exc
    logger.info(
        "echomq: flow %s enqueued on %s with %d children%s",
        plan.parent_id,
        plan.queue,
        len(plan.children),
        f" ({len(levels) - 1} nested flows)" if len(levels) > 1 else "",
    )
    leaves = [job for level in levels for job in level.children if "nested" not in job]
    if leaves:
        publish(state.app, leaves)
    for level in levels:
        if not level.children:
            dispatch_parent(state, level.queue, level.parent_id)


def _rollback(state: EchoMQ, written: list[tuple[str, str, list[str]]]) -> None:
    """Delete what a refused start wrote: ``(queue, parent id or '', child ids)`` per step."""
    keys = state.keys
    for queue, parent_id, child_ids in reversed(written):
        pipe = state.client.pipeline(transaction=False)
        for cid in child_ids:
            pipe.delete(keys.job_key(queue, cid))
        if child_ids:
            pipe.zrem(keys.queue_key(queue, "pending"), *child_ids)
        if parent_id:
            pipe.delete(keys.job_key(queue, parent_id), keys.flow_keys(queue, parent_id)[0])
            pipe.zrem(keys.queue_key(queue, "open"), parent_id)
            pipe.zrem(keys.queue_key(queue, "pending"), parent_id)
        pipe.execute()


def _enqueue_chunked(
    state: EchoMQ, level: Plan, chunk: int, written: list[tuple[str, str, list[str]]]
) -> None:
    scripts = state.scripts
    scripts.open_flow(
        level.queue,
        level.parent_id,
        state.dumps(level.parent),
        len(level.children),
        level.policy,
        outer=level.outer,
    )
    written.append((level.queue, level.parent_id, []))
    by_queue: dict[str, list[tuple[str, bytes, str]]] = {}
    for job in level.children:
        cid = child_id(job)
        by_queue.setdefault(child_queue(job), []).append(
            (cid, state.dumps(job), level.child_policies.get(cid, ""))
        )
    parent = ParentRef(level.parent_id, level.queue)
    open_key = state.keys.queue_key(level.queue, "open")
    for queue, rows in by_queue.items():
        for start in range(0, len(rows), chunk):
            rows_chunk = rows[start : start + chunk]
            scripts.add_children(queue, parent, rows_chunk)
            written.append((queue, "", [cid for cid, _, _ in rows_chunk]))
            # A producer still writing is alive: recovery takes an open flow for abandoned a
            # stall timeout after its last chunk, not after its first, however large it is.
            seconds, micros = state.client.time()
            state.client.zadd(open_key, {level.parent_id: seconds * 1000 + micros // 1000}, xx=True)
    scripts.seal_flow(level.queue, level.parent_id)
    logger.info(
        "echomq: flow %s opened, %d children added on %d queue(s), sealed",
        level.parent_id,
        len(level.children),
        len(by_queue),
    )


def resume_nested(state: EchoMQ, plan: Plan) -> None:
    """Finish starting a nested flow whose outer flow landed but which did not (recovery)."""
    # FlowExistsError: it landed after all; its own children are pending rows that recovery
    # re-publishes.
    with contextlib.suppress(FlowExistsError):
        start_flow(state, plan)


def _locator_ttl(state: EchoMQ) -> int:
    # A held flow may wait long; the locator only has to outlive the flow's readable life.
    return max(state.settings.result_ttl * 7, 7 * 86400)


def publish(app: Any, jobs: Iterable[dict[str, Any]]) -> None:
    """Publish stored job dicts in one batch (a nested flow's entry resumes that flow)."""
    jobs = list(jobs)
    send_jobs(app, [job for job in jobs if "nested" not in job])
    for job in jobs:
        if "nested" in job:
            resume_nested(get_state(app), Plan.from_dict(job["nested"]))


def dispatch_parent(
    state: EchoMQ, queue: str, parent_id: str, redispatch_after_ms: int = 0
) -> bool:
    """Publish a released parent, once: the dispatch script decides who may."""
    claimed = state.scripts.dispatch(
        queue, parent_id, redispatch_after_ms, inline_max=state.settings.chunk_size
    )
    if claimed is None:
        return False
    payload, stored = claimed
    job = state.loads(payload)
    values = [state.loads(stored[cid]) for cid in job["children"] if cid in stored]
    if not job.get("immutable"):
        job["args"] = [values, *job["args"]]
    publish(state.app, [job])
    logger.info("echomq: parent %s dispatched with %d values", parent_id, len(values))
    return True


def parent_failed(
    state: EchoMQ, queue: str, parent_id: str, child_id: str, error: str
) -> tuple[FlowFailed, ParentRef | None]:
    """Record FAILURE for a parent whose child failed under ``fail``, and run its errbacks.

    Returns the error and, for a nested flow, where its own parent lives (the failure is
    that flow's child's failure next).
    """
    from celery.app.task import Context

    payload = state.client.hget(state.keys.job_key(queue, parent_id), "payload")
    job = state.loads(payload) if payload else {"task": None, "options": {}}
    exc = FlowFailed(f"flow {parent_id}: child {child_id} failed: {error}", child_id, error)
    request = Context(
        id=parent_id,
        task=job["task"],
        errbacks=job["options"].get("link_error"),
        args=job.get("args", []),
        kwargs=job.get("kwargs", {}),
        delivery_info={},
    )
    state.app.backend.mark_as_failure(parent_id, exc, request=request, call_errbacks=True)
    logger.info("echomq: parent %s failed: child %s failed: %s", parent_id, child_id, error)
    headers = job["options"].get("headers") or {}
    outer = headers.get(H_PARENT)
    return exc, ParentRef(outer, headers.get(H_PARENT_QUEUE) or queue) if outer else None


def cancel_flow(state: EchoMQ, queue: str, parent_id: str, terminate: bool = False) -> list[str]:
    """Cancel a flow whose parent has not started: the ids of the children it revoked.

    Returns an empty list when the parent already started or finished (nothing to cancel).
    """
    row = state.keys.job_key(queue, parent_id)
    payload = state.client.hget(row, "payload")
    children = state.loads(payload)["children"] if payload else []
    # Nested flows first, inner before outer: each is a flow of its own to cancel.
    pipe = state.client.pipeline(transaction=False)
    for cid in children:
        pipe.exists(state.keys.flow_keys(queue, cid)[0])
    revoked = []
    for cid, nested in zip(children, pipe.execute(), strict=True):
        if nested and state.client.hget(state.keys.job_key(queue, cid), "state") in (
            b"awaiting_children",
            b"pending",
        ):
            revoked += cancel_flow(state, queue, cid, terminate)
    status, was, outstanding = state.scripts.cancel(
        queue, parent_id, children, ttl=state.settings.result_ttl
    )
    if status is not Status.CANCELLED:
        return revoked
    # A released parent's message is on its way: revoke it too, so it never runs.
    to_revoke = [*outstanding, parent_id] if was is Status.PENDING else outstanding
    if to_revoke:
        state.app.control.revoke(to_revoke, terminate=terminate)
    exc = FlowCancelled(f"flow {parent_id} was cancelled; it will not run", parent_id)
    state.app.backend.mark_as_failure(parent_id, exc)
    logger.info(
        "echomq: flow %s cancelled; revoked %d outstanding children", parent_id, len(outstanding)
    )
    return revoked + outstanding


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


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


def follow(state: EchoMQ, status: Status, job_id: str, parent: ParentRef, error: str = "") -> None:
    """Act on what a child's transition made of its parent: publish it, or settle its failure."""
    if status is Status.RELEASED:
        logger.info("echomq: parent %s released by child %s", parent.id, job_id)
        dispatch_parent(state, parent.queue, parent.id)
    elif status is Status.PARENT_FAILED:
        exc, outer = parent_failed(state, parent.queue, parent.id, job_id, error)
        if outer is not None:
            # A nested flow failed: that is a failed child of the flow it belongs to.
            settle_failure(
                state, parent.queue, parent.id, "", error_text(exc), True, outer, carry=True
            )


def settle_success(
    state: EchoMQ,
    queue: str,
    job_id: str,
    token: str,
    is_parent: bool,
    parent: ParentRef | None,
    value: bytes,
) -> Status:
    """A job succeeded: complete it and credit its parent (on whichever slot it lives)."""
    status = state.scripts.complete(
        queue,
        job_id,
        token,
        ttl=state.settings.result_ttl,
        is_parent=is_parent,
        parent=parent,
        value=value,
    )
    if status is Status.STAGED and parent is not None:
        status, _ = credit_remote(state, queue, job_id, parent, Status.DONE, value, "")
    if parent is not None:
        follow(state, status, job_id, parent)
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
) -> Status:
    """A job failed for good: fail it and apply its parent_policy to the parent.

    ``carry``: the job is a nested flow's parent, already failed by one of its own children;
    apply that failure, once, to the flow it belongs to (see fail.lua).
    """
    status, policy = state.scripts.fail(
        queue,
        job_id,
        token,
        error,
        ttl=state.settings.result_ttl,
        is_parent=is_parent,
        parent=parent,
        carry=carry,
    )
    if status is Status.STAGED and parent is not None:
        status, policy = credit_remote(state, queue, job_id, parent, Status.FAILED, error, policy)
    if parent is None or status in UNSETTLED:
        return status
    logger.info("echomq: child %s failed under policy %s: %s", job_id, policy, error)
    follow(state, status, job_id, parent, error)
    return status


def parent_ref(headers: Any) -> ParentRef | None:
    parent_id = getattr(headers, H_PARENT, None)
    if not parent_id:
        return None
    return ParentRef(
        str(parent_id), str(getattr(headers, H_PARENT_QUEUE, None) or getattr(headers, H_QUEUE))
    )
