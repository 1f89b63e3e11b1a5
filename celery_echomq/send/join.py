"""``apply_async(on_exists=...)``: what a flow whose ids name jobs in the store already does.

``"raise"`` (the default) refuses it (:class:`FlowExistsError`, as the enqueue scripts do).
``"join"`` joins every such job instead of writing it:

- the flow's parent exists: the same flow was sent before; if it is the same (its task, its
  arguments and its children's ids) its :class:`FlowResult` is returned and nothing is
  written, published or run again;
- a child exists (the parent is new): the new parent waits for that job as for its own child,
  which gains an edge to it (``<row>:parents``, see store/keyspace.py). A job done already is
  credited at once with its value, one failed or cancelled is settled at once under the new
  parent's policy for it, one pending or running is credited when it finishes.

A joined id whose stored job is another task, or takes other arguments, is refused before
anything is written (``FlowExistsError`` naming both).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from celery_echomq.errors import FlowExistsError, OnExistsError
from celery_echomq.send.ids import check_ids
from celery_echomq.send.plan import Plan
from celery_echomq.store.codec import (
    STORED_FIELDS,
    Delta,
    Stored,
    TemplateMissingError,
    load_job,
    stored_of,
)
from celery_echomq.store.connection import text
from celery_echomq.store.planned import PlannedJob, held_of, stored_message
from celery_echomq.store.replies import Status
from celery_echomq.store.script_values import ParentRef
from celery_echomq.store.state import EchoMQ

ON_EXISTS = ("raise", "join")


def check_on_exists(value: object) -> str:
    """``value`` if it is an allowed ``on_exists``; else :class:`OnExistsError`, before any
    Redis command or publish."""
    if value not in ON_EXISTS:
        raise OnExistsError(
            f"apply_async(on_exists={value!r}): allowed values are 'raise' (the default: a "
            "flow whose ids exist is refused) and 'join' (jobs that exist are joined, not "
            "written); nothing was written or published"
        )
    return str(value)


@dataclass(frozen=True)
class Joined:
    """A child of the new flow that names a job the store holds already."""

    id: str
    queue: str
    state: str
    job: Any
    # The flow (its parent's id) of this same tree that writes the job, for a job shared by
    # several of its flows (send/ids.py); '' for a job in the store already.
    owner: str = ""

    def joined_by(self, flow_id: str) -> bool:
        """Whether ``flow_id`` joins this job rather than writing it."""
        return self.owner != flow_id


def describe(job: Any) -> str:
    """``task(args, kwargs)`` of a job dict, as an error names it."""
    if job is None:
        return "a finished job whose message (64 KiB or more) was dropped, so it cannot be compared"
    if not isinstance(job, dict):
        return repr(job)
    args = ", ".join(
        [repr(a) for a in job.get("args") or ()]
        + [f"{k}={v!r}" for k, v in (job.get("kwargs") or {}).items()]
    )
    return f"{job.get('task')}({args})"


def _same_call(state: EchoMQ, stored: Any, planned: Mapping[str, Any]) -> bool:
    """Whether ``stored`` (as the store decoded it) is ``planned``'s task with its arguments.

    The planned job goes through the serializer first: a tuple argument is stored as a list."""
    mine = state.loads(state.dumps({k: planned.get(k) for k in ("task", "args", "kwargs")}))
    return isinstance(stored, dict) and all(stored.get(k) == mine[k] for k in mine)


def _refuse(job_id: str, stored: Any, planned: Mapping[str, Any], what: str = "") -> None:
    raise FlowExistsError(
        f"job id {job_id!r} already exists in Redis as {describe(stored)}; this flow gives it "
        f"as {describe(planned)}{what}: on_exists='join' joins only the same job "
        "(nothing was written or published)"
    )


def _read(state: EchoMQ, wanted: list[tuple[str, str]]) -> list[tuple[str, Any] | None]:
    """``(state, job)`` of each ``(queue, id)``'s row, None where there is none. One round
    trip (only a flow sent with on_exists='join' pays it)."""
    pipe = state.client.pipeline(transaction=False)
    for queue, job_id in wanted:
        pipe.hmget(state.keys.job_key(queue, job_id), ("state", *STORED_FIELDS))
    found: list[tuple[str, Any] | None] = []
    templates: dict[str, bytes | None] = {}
    for (queue, job_id), row in zip(wanted, pipe.execute(), strict=True):
        if row[0] is None:
            found.append(None)
            continue
        stored = stored_of(*row[1:])
        try:
            job = load_job(state, queue, job_id, stored, templates) if stored is not None else None
        except TemplateMissingError:
            job = None  # a finished flow's large template, dropped (complete.lua)
        found.append((text(row[0]), job))
    return found


def existing_flow(state: EchoMQ, plan: Plan) -> bool:
    """Whether ``plan``'s flow is in the store already, the same flow: True means nothing is
    to be sent. False: its parent is new. A parent that exists as another job, or with other
    children, raises :class:`FlowExistsError`."""
    (row,) = _read(state, [(plan.queue, plan.parent_id)])
    if row is None:
        return False
    _, stored = row
    if not _same_call(state, stored, plan.parent):
        _refuse(plan.parent_id, stored, plan.parent)
    had = list(held_of(stored).children)
    if had != plan.child_ids():
        raise FlowExistsError(
            f"flow {plan.parent_id!r} already exists in Redis with children {had!r}; this "
            f"flow gives it children {plan.child_ids()!r}: on_exists='join' joins only the "
            "same flow (nothing was written or published)"
        )
    return True


def joined_children(state: EchoMQ, plan: Plan) -> dict[str, Joined]:
    """The children of every level of ``plan`` that name jobs in the store already, each
    checked to be the same task with the same arguments (else :class:`FlowExistsError`).
    Only a task is joined: a nested flow's parent or a chain's step that exists is refused
    by the enqueue, as with on_exists="raise"."""
    wanted: list[tuple[str, str, Mapping[str, Any]]] = []
    for level in plan.levels():
        for entry in level.children:
            if isinstance(entry, PlannedJob):
                wanted.append((entry.queue, entry.id, entry.message))
    rows = _read(state, [(q, cid) for q, cid, _ in wanted])
    joined: dict[str, Joined] = {}
    for (queue, cid, job), row in zip(wanted, rows, strict=True):
        if row is None:
            continue
        found_state, stored = row
        if not _same_call(state, stored, job):
            _refuse(cid, stored, job)
        joined[cid] = Joined(cid, queue, found_state, stored)
    return joined


# --- eager mode ---------------------------------------------------------------------------------
# A flow run in process has no store: what on_exists="join" finds there is the jobs run eagerly
# before, in this process (the last EAGER_KEPT of them), by id: (task, args, kwargs) and the
# result. A job listed twice in one canvas is found the second time: it runs once.
EAGER_KEPT = 10_000
EAGER_RAN: OrderedDict[str, tuple[dict[str, Any], Any]] = OrderedDict()
EAGER_JOIN: ContextVar[bool] = ContextVar("echomq_eager_join", default=False)


def _call_of(job: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "task": job.get("task"),
        "args": list(job.get("args") or ()),
        "kwargs": dict(job.get("kwargs") or {}),
    }


def eager_joined(job_id: str, job: Mapping[str, Any]) -> Any:
    """The result of ``job_id`` run eagerly before, when this run joins (else None); a job run
    before as another task or with other arguments raises :class:`FlowExistsError`."""
    if not EAGER_JOIN.get() or job_id not in EAGER_RAN:
        return None
    call, result = EAGER_RAN[job_id]
    if call != _call_of(job):
        _refuse(job_id, call, job)
    return result


def eager_ran(job_id: str, job: Mapping[str, Any], result: Any) -> Any:
    """Keep ``result`` as what ``job_id`` gave; returns it."""
    EAGER_RAN[job_id] = (_call_of(job), result)
    EAGER_RAN.move_to_end(job_id)
    while len(EAGER_RAN) > EAGER_KEPT:
        EAGER_RAN.popitem(last=False)
    return result


def shared_in_canvas(plan: Plan, joined: dict[str, Joined]) -> dict[str, Joined]:
    """The tasks several flows of ``plan``'s tree list (send/ids.py), not in the store:
    written by the first of those flows, joined by the others."""
    writes = check_ids(list(plan.levels()), plan.parent_id, True)
    found: dict[str, Joined] = {}
    for level in plan.levels():
        for entry in level.children:
            cid = entry.id
            if not isinstance(entry, PlannedJob) or cid not in writes:
                continue  # only a task is shared (send/ids.py)
            if cid not in joined and cid not in found:
                found[cid] = Joined(cid, entry.queue, "pending", stored_message(entry), writes[cid])
    return found


def joins_by_level(plan: Plan, joined: dict[str, Joined]) -> dict[str, dict[str, Joined]]:
    """Each flow of ``plan``'s tree (its parent's id) -> the children it joins, not writes."""
    return {
        level.parent_id: {
            c: joined[c]
            for c in level.child_ids()
            if c in joined and joined[c].joined_by(level.parent_id)
        }
        for level in plan.levels()
    }


# --- a new parent joined to jobs that exist ---------------------------------------------------


def _value_of(state: EchoMQ, joined: Joined, first_parent: str) -> bytes | None:
    """A done job's value, where its first parent keeps it (its ``:processed``; a child of
    another slot keeps it on its row until credited)."""
    queue = joined.queue
    pq = state.client.hget(state.keys.job_key(queue, joined.id), "pq")
    where = text(pq) if pq else queue
    found = state.client.hget(state.keys.flow_keys(where, first_parent)[1], joined.id)
    if found is None:
        found = state.client.hget(state.keys.job_key(queue, joined.id), "value")
    return found if found is None or isinstance(found, bytes) else str(found).encode()


def check_joinable(state: EchoMQ, joined: dict[str, Joined]) -> None:
    """Refuse, before any write, a joined job the new parent could not be credited for: one
    done whose value is gone from the store."""
    for job in joined.values():
        parent = state.client.hget(state.keys.job_key(job.queue, job.id), "parent")
        if job.state == "done" and (not parent or _value_of(state, job, text(parent)) is None):
            raise FlowExistsError(
                f"job id {job.id!r} is done but its value is no longer in the store (its "
                "flow expired or was forgotten): it cannot be joined (nothing was written or "
                "published)"
            )


def join_level(
    state: EchoMQ, level: Plan, joined: dict[str, Joined]
) -> list[tuple[Status, str, str]]:
    """Join the jobs of ``joined`` that are ``level``'s children to its parent, held with one
    extra unit on its counter (open_flow's): each gains the edge, and the parent is credited
    with a done job's value or settled under its policy for a failed or cancelled one, once
    per child (credit.lua's ``:settled``). Returns ``(status, child id, error)`` per credit,
    for the host to follow (a parent failed by a joined child)."""
    parent = ParentRef(level.parent_id, level.queue)
    settled: list[tuple[Status, str, str]] = []
    for cid in level.child_ids():
        job = joined.get(cid)
        if job is None:
            continue
        policy = level.child_policies.get(cid, "")
        found, error, first = state.scripts.join_edge(job.queue, cid, parent, policy)
        ttl = state.settings.result_ttl
        if found == "done":
            value = _value_of(state, job, first) or b""
            status, _ = state.scripts.credit(parent, cid, Status.DONE, value, "", ttl=ttl)
        elif found not in ("failed", "cancelled", ""):
            continue  # not finished: its completion (or failure) credits this parent too
        else:
            error = error or f"FlowCancelled: job {cid} was {found or 'forgotten'}"
            status, _ = state.scripts.credit(parent, cid, Status.FAILED, error, policy, ttl=ttl)
        settled.append((status, cid, error))
    return settled


def against_own_flow(
    state: EchoMQ, stored: list[tuple[str, Stored]], queue_of: dict[str, str]
) -> list[tuple[str, Stored]]:
    """Stored jobs a retry made pending, each delta told against its own flow's template: a
    job joined to the retried flow (its edge) was written by its first parent, whose
    template its delta is stored against (one read of the rows' ``parent``, for deltas only)."""
    deltas = [(i, cid) for i, (cid, job) in enumerate(stored) if isinstance(job, Delta)]
    if not deltas:
        return stored
    pipe = state.client.pipeline(transaction=False)
    for _, cid in deltas:
        pipe.hget(state.keys.job_key(queue_of[cid], cid), "parent")
    fixed = list(stored)
    for (i, cid), first in zip(deltas, pipe.execute(), strict=True):
        job = stored[i][1]
        if first and isinstance(job, Delta) and text(first) != job.parent:
            fixed[i] = (cid, Delta(job.data, text(first)))
    return fixed
