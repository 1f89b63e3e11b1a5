"""A job of a flow as a node, and the whole tree under it (what a retry with a new deadline
reads; every other read, retry and release included, goes a page at a time: pages.py,
failures.py). Plain reads, never a write (HMGET, GET, HLEN, ZSCORE,
a chunk per command), safe against a live system; a snapshot, not a transaction.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import chain
from typing import Any

from celery_echomq.errors import EchoMQError
from celery_echomq.ops.listing import QueueStats, held_parents, queue_stats
from celery_echomq.ops.nodes import (
    FINISHED,
    MISSING,
    ChildPage,
    FlowInfo,
    JobNode,
    node_dict,
    shown_dict,
)
from celery_echomq.ops.timing import finish_times
from celery_echomq.store.codec import Delta, Step, load_job, stored_of
from celery_echomq.store.connection import text
from celery_echomq.store.planned import held_of
from celery_echomq.store.reads import counts_of, indexed_children, locate, scan_queues
from celery_echomq.store.state import EchoMQ

__all__ = [
    "FINISHED",
    "MISSING",
    "ChildPage",
    "FlowInfo",
    "JobNode",
    "QueueStats",
    "held_parents",
    "node_dict",
    "queue_stats",
    "read_tree",
    "shown_dict",
    "walk",
]

ROW_FIELDS = (
    "state",
    "attempts",
    "payload",
    "parent",
    "parent_policy",
    "policy",
    "credited_failed",
    "error",
    "failed_child",
    "started",
    "dispatched",
    "delta",
    "template",
    "failed_children",
    "cut_children",  # a parent's: its children cut (reads.counts_of)
    "cut",  # "deadline": cut by its flow's deadline before it started
    "steps",  # a linked chain's last step: every step's id, in order
    "input",  # a chain's step: the value of the step before it, its first argument
    "replaced_by",  # Task.replace: the parent of the flow that runs in the job's place
    "batch",  # the batch message that carried its latest delivery (flow(..., batch=N))
)
# Fields kept as bytes: a stored job (a pickle payload is not UTF-8).
_STORED = frozenset({"payload", "delta", "template", "input"})
# A nested flow is a child that is itself a parent; a cycle cannot be written (enqueue_flow
# refuses an id that exists), and the depth a flow may have (echomq_max_depth) caps the walk,
# so a corrupted store cannot hang the CLI either.


def _int(value: Any) -> int | None:
    found = text(value)
    return int(found) if found not in (None, "") else None


def load_value(state: EchoMQ, raw: Any) -> Any:
    """A stored value as the app's serializer reads it, else its bytes as text."""
    try:
        return state.loads(raw)
    except Exception:
        # A value the app's serializer cannot read (another serializer, content not accepted):
        # show the stored bytes rather than fail the whole read.
        return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


def _row(fields: list[Any]) -> dict[str, Any]:
    pairs = zip(ROW_FIELDS, fields, strict=True)
    return {name: v if name in _STORED else text(v) for name, v in pairs}


def _task_and_children(
    state: EchoMQ, queue: str, job_id: str, row: dict[str, Any], template: bytes | None = None
) -> tuple[str | None, list[str], tuple[str | None, str | None]]:
    """A row's task name, for a parent its children's ids, and its arguments as Celery shows
    them, from its stored job.

    ``template``: the encoded template on the parent's row, when the caller has it (a
    child's delta is joined with it; else it is read)."""
    stored = stored_of(row["payload"], row["delta"], row["parent"], row["input"])
    if stored is None:
        return None, [], (None, None)
    if isinstance(stored, (Delta, Step)):
        try:
            known: dict[str, bytes | None] | None = None
            if template is not None and isinstance(stored, Delta):
                known = {stored.parent: template}
            job = load_job(state, queue, job_id, stored, known)
        except Exception:
            return None, [], (None, None)  # its template gone, or not readable
    else:
        job = load_value(state, stored)
    if not isinstance(job, dict):
        return None, [], (None, None)
    children = held_of(job).children
    return job.get("task"), [str(c) for c in children], arguments(state, job)


def arguments(state: EchoMQ, job: dict[str, Any]) -> tuple[str | None, str | None]:
    """``(argsrepr, kwargsrepr)`` of a stored job: its own when the caller set them (what
    Celery shows in their place, e.g. to hide a secret), else Celery's ``saferepr``."""
    from celery.utils.saferepr import saferepr

    options = job.get("options") or {}
    amqp = state.app.amqp
    args, kwargs = options.get("argsrepr"), options.get("kwargsrepr")
    if args is None:
        args = saferepr(tuple(job.get("args") or ()), amqp.argsrepr_maxsize)
    if kwargs is None:
        kwargs = saferepr(dict(job.get("kwargs") or {}), amqp.kwargsrepr_maxsize)
    return str(args), str(kwargs)


def child_outcome(
    child_state: str,
    policy: str,
    credited: bool,
    ignored: bool,
    failed_child: str | None,
    child_id: str,
) -> str | None:
    """What the parent made of a child: the fan-in's view, not just the child's own state."""
    if credited:
        return "credited"  # its value is in the parent's :processed
    if ignored:
        return "ignored"  # failed; counted, error kept in :ignored
    if child_state != "failed":
        return None  # not settled yet (or cancelled / missing: nothing was credited)
    if failed_child == child_id:
        return "failed_flow"
    return {"remove": "removed", "continue": "continued"}.get(policy, "failed")


def read_tree(
    state: EchoMQ,
    job_id: str,
    *,
    queue: str | None = None,
    with_result: bool = True,
    with_times: bool = False,
) -> JobNode:
    """The job ``job_id`` and, if it is a flow parent, its children (nested flows recursively).

    ``with_result`` also reads the root's own value: from its parent's :processed when it is a
    child, else from Celery's result backend once it is done. ``with_times`` also reads when
    each finished job ended (what ``show`` and the dashboard print; see timing.py).
    """
    where = locate(state, job_id, queue, verify=True)
    key = state.keys.job_key(where, job_id)
    head = state.client.hget(key, "head")  # a huge parent's job, without its children's ids
    fields = [f if f != "payload" or not head else "head" for f in ROW_FIELDS]
    root_row = {**_row(state.client.hmget(key, fields)), "_indexed": bool(head)}
    node = _build(state, where, job_id, root_row, facts={}, depth=0)
    if with_times:
        node = _timed(node, finish_times(state, walk(node)))
    wanted = with_result and node.state == "done"
    has_value, value = root_value(state, node) if wanted else (False, None)
    return replace(node, has_value=True, value=value) if has_value else node


def _timed(node: JobNode, ends: dict[str, int]) -> JobNode:
    children = tuple(_timed(child, ends) for child in node.children)
    return replace(node, finished_ms=ends.get(node.id), children=children)


def root_value(state: EchoMQ, node: JobNode) -> tuple[bool, Any]:
    """Whether the node has a value, and the value: as its parent's fan-in recorded it, or
    (a top-level job) its Celery result."""
    if node.parent is not None:
        _, processed, _ = state.keys.flow_keys(node.queue, node.parent)
        raw = state.client.hget(processed, node.id)
        return (True, load_value(state, raw)) if raw is not None else (False, None)
    try:
        result = state.app.AsyncResult(node.id)
        if result.state == "SUCCESS":
            return True, result.result
    except Exception:
        # The result backend is optional for reading a tree (it may be disabled or down);
        # the flow's own keys are the source of truth for everything else shown.
        pass
    return False, None


def node_of(
    state: EchoMQ, queue: str, job_id: str, row: dict[str, Any], facts: dict[str, Any]
) -> tuple[JobNode, list[str]]:
    """A node from its row, without children, and the children's ids its stored job names;
    ``facts`` are what its parent knows of it (policy, value...)."""
    task, child_ids, (args, kwargs) = _task_and_children(
        state, queue, job_id, row, facts.get("template")
    )
    node = JobNode(
        id=job_id,
        queue=queue,
        state=row["state"] or MISSING,
        task=task,
        attempts=_int(row["attempts"]) or 0,
        parent=row["parent"],
        policy=facts.get("policy", row["parent_policy"]),
        policy_is_default=bool(facts.get("policy_is_default", False)),
        outcome=facts.get("outcome"),
        has_value="value" in facts,
        value=facts.get("value"),
        error=row["error"] or facts.get("ignored_error"),
        args=args,
        kwargs=kwargs,
        started_ms=_int(row["started"]),
        dispatched_ms=_int(row["dispatched"]),
        replaced_by=row.get("replaced_by"),
        batch=row.get("batch"),
    )
    return node, child_ids


@dataclass(frozen=True)
class _FlowRead:
    """What one round trip reads of a parent's flow: its counter and counts, and its
    children's values, ignored errors and rows, by position."""

    counter: Any
    n_values: int
    n_ignored: int
    processed: dict[str, bytes]
    ignored: dict[str, str]
    child_rows: list[Any]


def _read_flow(state: EchoMQ, queue: str, job_id: str, child_ids: list[str]) -> _FlowRead:
    """The flow keys of ``job_id`` and its children's rows, in one pipeline."""
    keys = state.keys
    deps_key, processed_key, ignored_key = keys.flow_keys(queue, job_id)
    pipe = state.client.pipeline(transaction=False)
    pipe.get(deps_key)
    pipe.hlen(processed_key)
    pipe.hlen(ignored_key)
    # The children's values and errors by id, a chunk per HMGET: never a whole hash at once.
    chunks = [child_ids[i : i + 1000] for i in range(0, len(child_ids), 1000)]
    for part in chunks:
        pipe.hmget(processed_key, part)
        pipe.hmget(ignored_key, part)
    for cid in child_ids:
        pipe.hmget(keys.job_key(queue, cid), ROW_FIELDS)
    counter, n_values, n_ignored, *replies = pipe.execute()
    found = zip(child_ids, chain(*replies[0 : 2 * len(chunks) : 2]), strict=True)
    processed = {c: v for c, v in found if v is not None}
    found = zip(child_ids, chain(*replies[1 : 2 * len(chunks) : 2]), strict=True)
    ignored = {c: text(v) for c, v in found if v is not None}
    return _FlowRead(counter, n_values, n_ignored, processed, ignored, replies[2 * len(chunks) :])


def _flow_info(row: dict[str, Any], read: _FlowRead, total: int) -> FlowInfo:
    counts = counts_of(
        read.counter,
        read.n_values,
        read.n_ignored,
        row["credited_failed"],
        row["failed_children"],
        row["cut_children"],
    )
    return FlowInfo(
        policy=row["policy"] or "fail",
        outstanding=None if read.counter is None else counts.outstanding,
        done=counts.done,
        failed=counts.failed,
        ignored=counts.ignored,
        cut=counts.cut,
        total=total,
        failed_child=row["failed_child"],
    )


def _child_row(state: EchoMQ, queue: str, cid: str, fields: Any) -> tuple[str, dict[str, Any]]:
    """A child's queue and row. A child routed to another queue has its row on that queue's
    slot; it is found among the queues that hold flows. One gone for good reads as
    "missing"."""
    child_row = _row(fields)
    if child_row["state"] is None:
        elsewhere = scan_queues(state, cid)
        if elsewhere is not None:
            key = state.keys.job_key(elsewhere, cid)
            return elsewhere, _row(state.client.hmget(key, ROW_FIELDS))
    return queue, child_row


def _child_facts(
    state: EchoMQ,
    row: dict[str, Any],
    info: FlowInfo,
    read: _FlowRead,
    cid: str,
    child_row: dict[str, Any],
    same_slot: bool,
) -> dict[str, Any]:
    """What a parent knows of its child ``cid``: its policy, outcome, value, ignored error."""
    own = child_row["parent_policy"]
    policy = own or info.policy
    facts: dict[str, Any] = {
        "policy": policy,
        "policy_is_default": own is None,
        # Its delta's template, where it has one: on this row, on the same slot.
        "template": row["template"] if same_slot else None,
        "outcome": "deadline"
        if child_row["cut"] == "deadline"
        else child_outcome(
            child_row["state"] or MISSING,
            policy,
            cid in read.processed,
            cid in read.ignored,
            info.failed_child,
            cid,
        ),
    }
    if cid in read.processed:
        facts["value"] = load_value(state, read.processed[cid])
    if cid in read.ignored:
        facts["ignored_error"] = read.ignored[cid]
    return facts


def _check_depth(state: EchoMQ, job_id: str, depth: int) -> None:
    if depth >= state.settings.max_depth:
        raise EchoMQError(
            f"flow tree under {job_id!r} is deeper than {state.settings.max_depth} levels "
            "(the echomq_max_depth setting)"
        )


def _build(
    state: EchoMQ,
    queue: str,
    job_id: str,
    row: dict[str, Any],
    *,
    facts: dict[str, Any],
    depth: int,
) -> JobNode:
    """A node from its row; ``facts`` are what its parent knows of it (policy, value...)."""
    node, child_ids = node_of(state, queue, job_id, row, facts)
    if row.get("_indexed"):
        child_ids = indexed_children(state, queue, job_id) or child_ids
    read = _read_flow(state, queue, job_id, child_ids)
    if read.counter is None and not child_ids and row["policy"] is None:
        return node  # not a flow parent: a plain child (or a job whose flow keys expired)
    info = _flow_info(row, read, len(child_ids))
    children: list[JobNode] = []
    for cid, fields in zip(child_ids, read.child_rows, strict=True):
        child_queue, child_row = _child_row(state, queue, cid, fields)
        child_facts = _child_facts(state, row, info, read, cid, child_row, child_queue == queue)
        _check_depth(state, job_id, depth + 1)
        child = _build(state, child_queue, cid, child_row, facts=child_facts, depth=depth + 1)
        if child_row["steps"]:
            child = with_steps(state, child, child_row["steps"].split(), read.ignored, info, depth)
        children.append(child)
    return replace(node, flow=info, children=tuple(children))


def with_steps(
    state: EchoMQ,
    last: JobNode,
    ids: list[str],
    ignored: dict[str, str],
    info: FlowInfo,
    depth: int = 0,
) -> JobNode:
    """A linked chain's last step with every step of the chain (one pipelined read): what
    each ran with, its state, and what its failure made of the flow. A first step held on
    children of its own (a chain parent's, or the step after a group, chord or flow) is shown
    with them, as any flow parent is."""
    pipe = state.client.pipeline(transaction=False)
    earlier = ids[:-1]
    for sid in earlier:
        pipe.hmget(state.keys.job_key(last.queue, sid), ROW_FIELDS)
    steps = []
    policy = last.policy or info.policy
    rows = [_row(fields) for fields in pipe.execute()]
    # A step's value is the input of the step after it, once that one was made pending.
    inputs = [row["input"] for row in rows[1:]] + [last_input(state, last)]
    for sid, row, value in zip(earlier, rows, inputs, strict=True):
        task, held, (args, kwargs) = _task_and_children(state, last.queue, sid, row)
        step_state = row["state"] or MISSING
        step = JobNode(
            id=sid,
            queue=last.queue,
            state=step_state,
            task=task,
            attempts=_int(row["attempts"]) or 0,
            parent=row["parent"],
            policy=policy,
            policy_is_default=last.policy_is_default,
            outcome=child_outcome(
                step_state, policy, False, sid in ignored, info.failed_child, sid
            ),
            error=row["error"] or ignored.get(sid),
            has_value=value is not None,
            value=None if value is None else load_value(state, value),
            args=args,
            kwargs=kwargs,
            started_ms=_int(row["started"]),
        )
        if held:
            own = _build(state, last.queue, sid, row, facts={}, depth=depth + 1)
            step = replace(step, flow=own.flow, children=own.children)
        steps.append(step)
    return replace(last, steps=(*steps, last))


def last_input(state: EchoMQ, last: JobNode) -> Any:
    """The input a chain's last step was given (the value of the step before it)."""
    return state.client.hget(state.keys.job_key(last.queue, last.id), "input")


def walk(node: JobNode) -> list[JobNode]:
    """``node`` and every job under it, parents before their children."""
    out = [node]
    out.extend(node.steps[:-1])  # a linked chain's steps before its last (the node itself)
    for child in node.children:
        out.extend(walk(child))
    return out
