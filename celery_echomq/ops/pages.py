"""A flow read a page at a time: its row, its counts and one page of its children.

What every operator's read of one flow costs (``show``, ``watch``, the dashboard's pages and
``/api/flows/<id>``), whatever the flow's size: a few round trips of bounded commands. The
children are read from the parent's index by position (its ``:children`` list, written with
them by enqueue_flow, grow_flow and the chunked path), never from the payload's whole list
(a parent of the chunked path also keeps a ``head``, its job without that list), and the
counts from the counter and the ``HLEN`` of ``:processed`` and ``:ignored``. A state filter
pages a set of its own where the store keeps one (``failed``: ``:failures`` then
``:ignored``; ``done``: ``:processed``), else examines the index a bounded stretch at a
time, as SCAN does: a page may come short, or empty, with a cursor to go on. A nested flow
is one line with its own counts; it is opened by reading it as a flow of its own.

And a flow's fan-in as operators read it (``with_fan_in``): its window's size and how many
children wait for a slot, its quorum, its reducer and the accumulator so far; one LLEN for a
window, one HGET for a reducer, whatever the flow's size.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from celery_echomq.errors import EchoMQError
from celery_echomq.ops.timing import finish_times
from celery_echomq.ops.views import (
    MISSING,
    ROW_FIELDS,
    ChildPage,
    FlowInfo,
    JobNode,
    child_outcome,
    load_value,
    node_of,
    root_value,
    with_steps,
)
from celery_echomq.send.fan_in import empty
from celery_echomq.store.connection import text
from celery_echomq.store.cursor import Cursor, cursor_text, hash_page
from celery_echomq.store.planned import held_of
from celery_echomq.store.reads import FAILED_PREFIX, counts_of, locate, scan_queues
from celery_echomq.store.state import EchoMQ

__all__ = ["FILTERS", "PAGE", "child_positions", "iter_children", "read_flow"]


PAGE = 50  # children per page unless asked otherwise
MAX_PAGE = 1000
# What a page may be filtered by: "failed" first (what an operator looks for).
_ROW_STATES = ("failed", "done", "active", "pending", "waiting", "awaiting_children", "cancelled")
FILTERS = (*_ROW_STATES, "missing")
# Children examined for one page of a filter without a set of its own (a SCAN's COUNT).
SCAN_BUDGET = 2000
# How many HSCAN calls one page may make, and their COUNT over the row of a flow written
# before ``:failures`` existed (its failed:<id> fields).
ROW_SCAN = 1000
ROW_SCANS = 20
# A payload is read whole only up to this size: a huge flow's parent keeps a ``head``.
PAYLOAD_MAX = 1 << 20

_FIELDS = (*(f for f in ROW_FIELDS if f != "payload"), "head")
_STORED = frozenset({"delta", "template", "head"})


def _row(values: list[Any]) -> dict[str, Any]:
    return {k: v if k in _STORED else text(v) for k, v in zip(_FIELDS, values, strict=True)}


def read_flow(
    state: EchoMQ,
    job_id: str,
    *,
    queue: str | None = None,
    cursor: str | None = None,
    count: int = PAGE,
    only: str | None = None,
    with_result: bool = True,
    with_times: bool = False,
) -> JobNode:
    """The job ``job_id`` with, if it is a flow parent, its counts (``flow``) and one page of
    its children (``children``; ``page`` says which, and the next page's cursor).

    ``only``: children in that state (see :data:`FILTERS`); ``cursor``: the ``next_cursor``
    of the page before. A nested child is one node with its own counts and no children.
    Raises :class:`CursorError` for a cursor no page gave, :class:`EchoMQError` for a bad
    filter or page size."""
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_PAGE:
        raise EchoMQError(f"a page holds 1 to {MAX_PAGE} children, not {count!r}")
    if only is not None and only not in FILTERS:
        raise EchoMQError(f"state must be one of {', '.join(FILTERS)}, not {str(only)[:40]!r}")
    where = locate(state, job_id, queue, verify=True)
    root, info, row = root_node(state, where, job_id)
    if info is not None:
        info = with_fan_in(state, where, job_id, row["payload"], info)
        ids, after = _page_ids(state, where, job_id, row, cursor, count, only)
        children = child_nodes(state, where, row, info, ids)
        page = ChildPage(only=only, cursor=cursor, next_cursor=after, count=count)
        root = replace(root, flow=info, children=tuple(children), page=page)
    if with_times:
        ends = finish_times(state, [root, *root.children])
        root = replace(
            root,
            finished_ms=ends.get(root.id),
            children=tuple(replace(c, finished_ms=ends.get(c.id)) for c in root.children),
        )
    if with_result and root.state == "done":
        has_value, value = root_value(state, root)
        if has_value:
            root = replace(root, has_value=True, value=value)
    return root


def iter_children(
    state: EchoMQ, job_id: str, *, count: int = 500, only: str | None = None
) -> Iterator[JobNode]:
    """Every child of ``job_id`` (or those in state ``only``), read a page at a time."""
    cursor: str | None = None
    while True:
        node = read_flow(state, job_id, cursor=cursor, count=count, only=only, with_times=True)
        yield from node.children
        cursor = node.page.next_cursor if node.page else None
        if cursor is None:
            return


def child_positions(
    state: EchoMQ, queue: str, job_id: str, *, batch: int = 1000
) -> Iterator[tuple[str, int]]:
    """``(child id, position)`` of every child of ``job_id``, read from its index ``batch``
    at a time (from its payload for a flow written before the index)."""
    row: dict[str, Any] = {"children_n": None, "_listed": []}
    total = 0
    indexed = state.client.llen(state.keys.children_key(queue, job_id))
    if indexed:
        row["children_n"] = total = indexed
    else:
        (full,) = _stored_rows(state, queue, [job_id])
        full["payload"] = state.client.hget(state.keys.job_key(queue, job_id), "payload")
        row["_listed"] = node_of(state, queue, job_id, full, {})[1]
        total = len(row["_listed"])
    for start in range(0, total, batch):
        ids = _positions(state, queue, job_id, row, start, start + batch)
        yield from ((cid, start + i) for i, cid in enumerate(ids))


def _stored_rows(state: EchoMQ, queue: str, ids: list[str]) -> list[dict[str, Any]]:
    """The rows of ``ids`` on ``queue``, each with its flow keys' counts (``_counter``,
    ``_values``, ``_ignored``) and its payload only when it needs one and it is small."""
    keys, client = state.keys, state.client
    pipe = client.pipeline(transaction=False)
    for job_id in ids:
        key = keys.job_key(queue, job_id)
        deps, processed, ignored = keys.flow_keys(queue, job_id)
        pipe.hmget(key, _FIELDS)
        pipe.hstrlen(key, "payload")
        pipe.get(deps)
        pipe.hlen(processed)
        pipe.hlen(ignored)
        pipe.llen(keys.children_key(queue, job_id))
    replies = pipe.execute()
    rows: list[dict[str, Any]] = []
    for i in range(len(ids)):
        values, size, counter, n_values, n_ignored, listed = replies[6 * i : 6 * i + 6]
        row = _row(values)
        row.update(_size=int(size), _counter=counter, _values=n_values, _ignored=n_ignored)
        # No list: a flow written before the index existed, or not a flow parent.
        row["children_n"] = int(listed) or None
        rows.append(row)
    wanted = [
        (job_id, row)
        for job_id, row in zip(ids, rows, strict=True)
        if not row["head"] and not row["delta"] and 0 < row["_size"] <= PAYLOAD_MAX
    ]
    if wanted:
        pipe = client.pipeline(transaction=False)
        for job_id, _ in wanted:
            pipe.hget(keys.job_key(queue, job_id), "payload")
        for (_, row), payload in zip(wanted, pipe.execute(), strict=True):
            row["payload"] = payload
    for row in rows:
        row.setdefault("payload", row["head"])
    return rows


def root_node(
    state: EchoMQ, queue: str, job_id: str
) -> tuple[JobNode, FlowInfo | None, dict[str, Any]]:
    """The job ``job_id`` as a node without its children, its flow's counts (None: not a
    flow) and its stored row."""
    (row,) = _stored_rows(state, queue, [job_id])
    if not row["payload"] and row["children_n"] is None and row["_size"] > 0:
        # A flow written before the index existed: its payload is what names its children.
        row["payload"] = state.client.hget(state.keys.job_key(queue, job_id), "payload")
    node, listed = node_of(state, queue, job_id, row, {})
    row["_listed"], row["_id"] = listed, job_id
    return node, _info(row, listed), row


def _info(row: dict[str, Any], listed: list[str]) -> FlowInfo | None:
    """A row's counts when it is a flow parent, else None."""
    indexed = row["children_n"]
    if row["_counter"] is None and indexed is None and not listed and row["policy"] is None:
        return None
    counts = counts_of(
        row["_counter"], row["_values"], row["_ignored"], row["credited_failed"],
        row["failed_children"], row["cut_children"],
    )  # fmt: skip
    return FlowInfo(
        policy=row["policy"] or "fail",
        outstanding=None if row["_counter"] is None else counts.outstanding,
        done=counts.done,
        failed=counts.failed,
        ignored=counts.ignored,
        cut=counts.cut,
        total=int(indexed) if indexed is not None else len(listed),
        failed_child=row["failed_child"],
    )


def _page_ids(
    state: EchoMQ,
    queue: str,
    job_id: str,
    row: dict[str, Any],
    cursor: str | None,
    count: int,
    only: str | None,
) -> tuple[list[str], str | None]:
    if only == "failed":
        return _failed_ids(state, queue, job_id, row["children_n"] is not None, cursor, count)
    if only == "done":
        processed = state.keys.flow_keys(queue, job_id)[1]
        ids, following = hscan_ids(state, processed, "", Cursor.parse(cursor, "page"), count, count)
        return ids, cursor_text(following)
    start = Cursor.parse(cursor, "page", after="none").at
    if only is None:
        ids = _positions(state, queue, job_id, row, start, start + count)
        after = start + len(ids)
        return ids, (str(after) if len(ids) == count and after < _total(row) else None)
    return _matching(state, queue, job_id, row, start, count, only)


def _total(row: dict[str, Any]) -> int:
    indexed = row["children_n"]
    return int(indexed) if indexed is not None else len(row["_listed"])


def _positions(
    state: EchoMQ, queue: str, job_id: str, row: dict[str, Any], start: int, stop: int
) -> list[str]:
    """The ids at positions ``start`` to ``stop`` (exclusive) of the parent's children."""
    stop = min(stop, _total(row))
    if start >= stop:
        return []
    if row["children_n"] is None:
        return list(row["_listed"][start:stop])
    found = state.client.lrange(state.keys.children_key(queue, job_id), start, stop - 1)
    return [text(cid) for cid in found]


def _matching(
    state: EchoMQ, queue: str, job_id: str, row: dict[str, Any], start: int, count: int, only: str
) -> tuple[list[str], str | None]:
    """Children in state ``only`` from position ``start``, examining at most SCAN_BUDGET."""
    total, at = _total(row), start
    found: list[str] = []
    while at < total and at - start < SCAN_BUDGET and len(found) < count:
        window = _positions(state, queue, job_id, row, at, at + min(500, count * 4))
        pipe = state.client.pipeline(transaction=False)
        for cid in window:
            pipe.hget(state.keys.job_key(queue, cid), "state")
        for i, (cid, raw) in enumerate(zip(window, pipe.execute(), strict=True)):
            if raw is None and only != MISSING:
                elsewhere = scan_queues(state, cid)  # a child routed to another queue
                if elsewhere is not None:
                    raw = state.client.hget(state.keys.job_key(elsewhere, cid), "state")
            if (text(raw) or MISSING) == only:
                found.append(cid)
                if len(found) == count:
                    at += i + 1
                    break
        else:
            at += len(window)
            if not window:
                break
    return found, (str(at) if at < total else None)


def _failed_ids(
    state: EchoMQ, queue: str, job_id: str, indexed: bool, cursor: str | None, count: int
) -> tuple[list[str], str | None]:
    """Children failed for good: those of ``:failures`` (the row's ``failed:<id>`` fields in a
    flow written before it existed), then ``:ignored``'s."""
    row_key, prefix, batch = state.keys.failures_key(queue, job_id), "", count
    if not indexed:
        row_key, prefix, batch = state.keys.job_key(queue, job_id), FAILED_PREFIX, ROW_SCAN
    ignored_key = state.keys.flow_keys(queue, job_id)[2]
    start = Cursor.parse(cursor, "page", "fi")
    ids: list[str] = []
    if start.phase == "f":
        ids, following = hscan_ids(state, row_key, prefix, start, count, batch)
        if following is not None:
            return ids, str(following)
        start = Cursor("i")
    more, following = hscan_ids(state, ignored_key, "", start, count - len(ids), count)
    return ids + more, cursor_text(following)


def hscan_ids(
    state: EchoMQ, key: str, prefix: str, start: Cursor, count: int, batch: int
) -> tuple[list[str], Cursor | None]:
    """Up to ``count`` fields of hash ``key`` that start with ``prefix`` (the prefix cut off),
    from ``start``, at most ROW_SCANS HSCAN calls of COUNT ``batch``; and the next page's
    cursor (None: the hash is done)."""
    if count <= 0:
        return [], start
    match = prefix + "*" if prefix else None
    page, following = hash_page(state.client, key, start, count, match, ROW_SCANS, batch)
    return [name[len(prefix) :] for name in page], following


def child_nodes(
    state: EchoMQ, queue: str, parent: dict[str, Any], info: FlowInfo, ids: list[str]
) -> list[JobNode]:
    """The page's children as nodes: each its row, what the parent made of it, its value."""
    if not ids:
        return []
    client, keys = state.client, state.keys
    rows = _stored_rows(state, queue, ids)
    _, processed_key, ignored_key = keys.flow_keys(queue, parent["_id"])
    pipe = client.pipeline(transaction=False)
    pipe.hmget(processed_key, ids)
    pipe.hmget(ignored_key, ids)
    for cid in ids:  # a job joined to more parents than its first: one HLEN a child
        pipe.hlen(keys.parents_key(queue, cid))
    values, errors, *edges = pipe.execute()
    nodes = []
    for cid, row, raw, ignored, more in zip(ids, rows, values, errors, edges, strict=True):
        child_queue = queue
        if row["state"] is None:
            # A child routed to another queue has its row on that queue's slot.
            elsewhere = scan_queues(state, cid)
            if elsewhere is not None:
                child_queue = elsewhere
                (row,) = _stored_rows(state, elsewhere, [cid])
        own = row["parent_policy"]
        policy = own or info.policy
        facts: dict[str, Any] = {
            "policy": policy,
            "policy_is_default": own is None,
            "template": parent["template"] if child_queue == queue else None,
            "outcome": child_outcome(
                row["state"] or MISSING,
                policy,
                raw is not None,
                ignored is not None,
                info.failed_child,
                cid,
            ),
        }
        if row["cut"] == "deadline":
            facts["outcome"] = "deadline"
        if raw is not None:
            facts["value"] = load_value(state, raw)
        if ignored is not None:
            facts["ignored_error"] = text(ignored)
        node, listed = node_of(state, child_queue, cid, row, facts)
        if row["steps"]:
            # A linked chain: its last step, with every step of the chain.
            failed = {cid: text(ignored)} if ignored is not None else {}
            node = with_steps(state, node, text(row["steps"]).split(), failed, info)
        nested = _info(row, listed)
        node = replace(node, shared_by=1 + int(more))
        nodes.append(node if nested is None else replace(node, flow=nested))
    return nodes


def with_fan_in(state: EchoMQ, queue: str, job_id: str, stored: Any, info: FlowInfo) -> FlowInfo:
    """``info`` (the flow parent ``job_id``'s counts on ``queue``, its stored job, payload or
    ``head``, ``stored``) with its window's size and waiting children, its quorum
    (``flow(..., quorum=K)``, send/fan_in.py) and its reducer with the accumulator so far
    (``flow(..., reduce=R)``, send/fan_in.py): one LLEN for a window, one HGET for a
    reducer, nothing more for a flow of any size."""
    try:
        job = state.loads(stored) if stored else None
    except Exception:  # a payload this app cannot read: no window to show
        return info
    held = held_of(job)
    if held.quorum:
        info = replace(info, quorum=held.quorum)
    if held.reduce:
        acc = state.client.hget(state.keys.job_key(queue, job_id), "acc")
        folded = empty(held.reduce) if acc is None else json.loads(acc)  # reduce.lua's JSON
        info = replace(info, reduce=held.reduce, acc=folded)
    if held.max_active:
        where = held.window_queue or queue
        waiting = state.client.llen(state.keys.window_key(where, job_id))
        info = replace(info, max_active=held.max_active, waiting=int(waiting))
    return info
