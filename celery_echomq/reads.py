"""Pure reads of a flow's state: plain reads of its keys, never a write.

Each takes the parent's job id. The queue whose slot holds the flow is found from, in order:
the ``queue`` argument, the current task's own headers (a parent reading its own flow), the
flow's locator key written when it started, and a look at every queue that holds flows.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from celery import current_app, current_task

from .errors import EchoMQError
from .keyspace import check_id
from .plan import H_QUEUE
from .state import EchoMQ, get_state
from .store import text


class Dependencies(NamedTuple):
    outstanding: int
    processed: int


class UnknownFlowError(EchoMQError, LookupError):
    """No flow with that id is known to Redis (never started, or expired)."""


def locate(state: EchoMQ, job_id: str, queue: str | None = None, *, verify: bool = False) -> str:
    """The queue whose slot holds ``job_id``'s keys: ``queue`` if given, the running task's own
    queue, the flow's locator key (a parent's), else a look at every queue that holds flows
    (a child has no locator).

    ``verify``: trust ``queue`` and the locator only where the job's row exists (what the CLI
    and :mod:`~celery_echomq.views` read), and tell an expired flow from an unknown one.
    Raises :class:`UnknownFlowError` when nothing is found.
    """
    check_id(job_id)
    client, keys = state.client, state.keys

    def there(name: str) -> bool:
        return not verify or bool(client.exists(keys.job_key(name, job_id)))

    if queue and there(queue):
        return queue
    if not verify and current_task and getattr(current_task.request, "id", None) == job_id:
        own = getattr(current_task.request, H_QUEUE, None)
        if own:
            return str(own)
    located: str | None = text(client.get(keys.locator_key(job_id)))
    if located is not None and there(located):
        return located
    scanned = scan_queues(state, job_id)
    if scanned is not None:
        return scanned
    if verify and located is not None:
        raise UnknownFlowError(
            f"flow {job_id!r} has expired or was forgotten (its keys are gone from Redis)"
        )
    raise UnknownFlowError(f"no job {job_id!r} in Redis (never started, or expired)")


def scan_queues(state: EchoMQ, job_id: str) -> str | None:
    """The queue, among those that hold flows, whose slot has ``job_id``'s row (one round trip).

    What finds a job without a locator: a child, or a flow whose producer died before writing
    its locator.
    """
    keys, client = state.keys, state.client
    names = sorted(text(q) for q in client.smembers(keys.queues_key()))
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.exists(keys.job_key(name, job_id))
    return next((name for name, there in zip(names, pipe.execute(), strict=True) if there), None)


# Flows whose parent is running eagerly in this process (``flow.apply()``), by parent id: the
# reads inside its body answer from memory, as they answer from Redis on a worker.
EAGER: dict[str, Any] = {}


def _state(app: Any) -> EchoMQ:
    return get_state(app or current_app)


def children_values(job_id: str, *, app: Any = None, queue: str | None = None) -> dict[str, Any]:
    """``{child_job_id: value}`` for the children of ``job_id`` completed so far."""
    if job_id in EAGER:
        return dict(EAGER[job_id].values)
    state = _state(app)
    _, processed, _ = state.keys.flow_keys(locate(state, job_id, queue), job_id)
    return {text(k): state.loads(v) for k, v in state.client.hgetall(processed).items()}


def dependencies(job_id: str, *, app: Any = None, queue: str | None = None) -> Dependencies:
    """The counter (children outstanding) and how many children have been credited."""
    if job_id in EAGER:
        return Dependencies(EAGER[job_id].outstanding, EAGER[job_id].credited)
    state = _state(app)
    q = locate(state, job_id, queue)
    deps, processed, _ = state.keys.flow_keys(q, job_id)
    pipe = state.client.pipeline(transaction=False)
    pipe.get(deps)
    # Credited: one :processed field per child whose value counted, plus the failed children
    # counted as resolved (ignore, remove, continue).
    pipe.hlen(processed)
    pipe.hget(state.keys.job_key(q, job_id), "credited_failed")
    outstanding, values, failed = pipe.execute()
    return Dependencies(int(outstanding or 0), int(values or 0) + int(failed or 0))


def ignored_failures(job_id: str, *, app: Any = None, queue: str | None = None) -> dict[str, str]:
    """``{child_job_id: "ExcType: message"}`` for children that failed under policy ``ignore``."""
    if job_id in EAGER:
        return dict(EAGER[job_id].ignored)
    state = _state(app)
    _, _, ignored = state.keys.flow_keys(locate(state, job_id, queue), job_id)
    return {text(k): text(v) for k, v in state.client.hgetall(ignored).items()}


def failed_children(job_id: str, *, app: Any = None, queue: str | None = None) -> dict[str, str]:
    """``{child_job_id: "ExcType: message"}`` for the children of ``job_id`` that failed, under
    any policy, and those its deadline cut before they started (``FlowDeadlineExceeded: ...``)."""
    if job_id in EAGER:
        return dict(EAGER[job_id].failed_children())
    state = _state(app)
    q = locate(state, job_id, queue)
    client, keys = state.client, state.keys
    payload = client.hget(keys.job_key(q, job_id), "payload")
    children = [str(c) for c in (state.loads(payload).get("children") or [])] if payload else []
    pipe = client.pipeline(transaction=False)
    for cid in children:
        pipe.hmget(keys.job_key(q, cid), "state", "error", "cut")
    found: dict[str, str] = {}
    for cid, (row_state, error, cut) in zip(children, pipe.execute(), strict=True):
        if row_state is None:  # a child of another slot
            where = scan_queues(state, cid)
            if where is None:
                continue
            row_state, error, cut = client.hmget(keys.job_key(where, cid), "state", "error", "cut")
        if row_state == b"failed" or cut == b"deadline":
            found[cid] = text(error) or ""
    return found
