"""A flow's failed children, read a page at a time: ``failed_children``.

Where the store keeps them: the flow's record of children failed under ``fail``, ``remove``
or ``continue`` (``<row>:failures``, their errors on the row's ``failed:<id>`` fields; a flow
written before that record existed has the fields alone), its ``:ignored`` (id -> error),
and, once its deadline fired, the rows of the children it cut (``cut=deadline``), found in
its index by position. Every command reads a page of one of them, never a whole hash, the
payload that lists a huge flow's children, or every child's row in one round trip.
"""

from __future__ import annotations

from typing import Any

from celery_echomq.errors import CursorError, ListingError
from celery_echomq.store.connection import text
from celery_echomq.store.cursor import Cursor, hash_page
from celery_echomq.store.reads import FAILED_PREFIX, locate, scan_queues, state_of
from celery_echomq.store.state import EchoMQ

__all__ = ["failed_children", "failed_page"]

# Children of the index examined for one page of deadline cuts (as SCAN's COUNT).
CUT_WINDOW = 1000
_PHASES = "fic"  # failures, then ignored, then deadline cuts


def failed_children(
    job_id: str,
    *,
    app: Any = None,
    queue: str | None = None,
    cursor: str | None = None,
    count: int | None = None,
) -> Any:
    """``{child_job_id: "ExcType: message"}`` for every child that failed for good, under any
    policy (``fail``, ``ignore``, ``remove``, ``continue``), and those its deadline cut before
    they started (``FlowDeadlineExceeded: ...``); a child retried since is not.

    With ``count``: one page of at most ``count`` of them and the next page's cursor,
    ``(failures, next_cursor)`` (None after the last), as ``children_values`` pages; a page
    of deadline cuts examines at most 1,000 children of the index, so it may come short.
    Without, every one of them, read a page at a time.
    """
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ListingError(f"failed_children: count must be a whole number >= 1, not {count!r}")
    if count is None and cursor is not None:
        raise CursorError("failed_children: a cursor needs a count (the page size)")
    state = state_of(app)
    q = locate(state, job_id, queue)
    if count is not None:
        return failed_page(state, q, job_id, cursor, count)
    found: dict[str, str] = {}
    following: str | None = None
    while True:
        page, following = failed_page(state, q, job_id, following, 1000)
        found.update(page)
        if following is None:
            return found


def failed_page(
    state: EchoMQ, queue: str, job_id: str, cursor: str | None, count: int
) -> tuple[dict[str, str], str | None]:
    """One page of ``job_id``'s failed children from ``cursor`` (its phase: failures,
    ignored, deadline cuts), and the next page's cursor (None after the last)."""
    start = Cursor.parse(cursor, "failed_children", _PHASES)
    found: dict[str, str] = {}
    for name in _PHASES[_PHASES.index(start.phase) :]:
        here = start if name == start.phase else Cursor(name)
        more, following = _READS[name](state, queue, job_id, here, count - len(found))
        found.update(more)
        if following is not None:
            return found, str(following)
        if len(found) >= count:
            rest = _PHASES[_PHASES.index(name) + 1 :]
            return found, str(Cursor(rest[0])) if rest else None
    return found, None


def _failures(
    state: EchoMQ, queue: str, job_id: str, start: Cursor, count: int
) -> tuple[dict[str, str], Cursor | None]:
    """Failed under fail, remove or continue: their ids, then their errors on the row."""
    keys, row, client = state.keys, state.keys.job_key(queue, job_id), state.client
    if count <= 0:
        return {}, start
    if not client.llen(keys.children_key(queue, job_id)):
        # A flow written before its record existed: the row's failed:<id> fields, as they are.
        page, following = hash_page(client, row, start, count, FAILED_PREFIX + "*")
        return {text(k)[len(FAILED_PREFIX) :]: text(v) for k, v in page.items()}, following
    page, following = hash_page(client, keys.failures_key(queue, job_id), start, count)
    ids = list(page)
    errors = client.hmget(row, [FAILED_PREFIX + cid for cid in ids]) if ids else []
    return {cid: text(e) or "" for cid, e in zip(ids, errors, strict=True)}, following


def _ignored(
    state: EchoMQ, queue: str, job_id: str, start: Cursor, count: int
) -> tuple[dict[str, str], Cursor | None]:
    if count <= 0:
        return {}, start
    ignored = state.keys.flow_keys(queue, job_id)[2]
    page, following = hash_page(state.client, ignored, start, count)
    return {k: text(v) for k, v in page.items()}, following


def _cut(
    state: EchoMQ, queue: str, job_id: str, start: Cursor, count: int
) -> tuple[dict[str, str], Cursor | None]:
    """The children a deadline cut before they started (their rows say ``cut=deadline``),
    looked for in the index from ``start``'s position, CUT_WINDOW of them per page."""
    client, keys = state.client, state.keys
    if count <= 0 or client.hget(keys.job_key(queue, job_id), "deadline_fired") is None:
        return {}, None if count > 0 else start  # no deadline fired: nothing cut
    if start.after is not None:
        raise CursorError(
            f"not a failed_children cursor: {str(start)!r} (pass the one a page gave)"
        )
    index = keys.children_key(queue, job_id)
    total = client.llen(index)
    window = [text(c) for c in client.lrange(index, start.at, start.at + CUT_WINDOW - 1)]
    pipe = client.pipeline(transaction=False)
    for cid in window:
        pipe.hmget(keys.job_key(queue, cid), "state", "error", "cut")
    found: dict[str, str] = {}
    at = start.at
    for cid, (row_state, error, cut) in zip(window, pipe.execute(), strict=True):
        at += 1
        if row_state is None:  # a child of another slot
            where = scan_queues(state, cid)
            if where is None:
                continue
            row_state, error, cut = client.hmget(keys.job_key(where, cid), "state", "error", "cut")
        if cut == b"deadline":
            found[cid] = text(error) or ""
            if len(found) >= count:
                break
    return found, Cursor("c", at) if at < total else None


_READS = {"f": _failures, "i": _ignored, "c": _cut}
