"""Pure reads of a flow's state in the store: plain reads of its keys, never a write (a flow
running eagerly is read from memory instead: ``send/flow_reads.py`` chooses).

Each takes the parent's job id. The queue whose slot holds the flow is found from, in order:
the ``queue`` argument, the current task's own headers (a parent reading its own flow), the
flow's locator key written when it started, and a look at every queue that holds flows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from celery import current_app, current_task

from celery_echomq.errors import CursorError, InvalidIdError, ListingError, UnknownFlowError
from celery_echomq.store.codec import load_job
from celery_echomq.store.connection import text
from celery_echomq.store.cursor import Cursor, cursor_text, hash_page
from celery_echomq.store.headers import H_NEXT, H_QUEUE
from celery_echomq.store.keyspace import check_id, check_queue
from celery_echomq.store.state import EchoMQ, get_state

logger = logging.getLogger("celery_echomq")

__all__ = [
    "Dependencies",
    "UnknownFlowError",
    "children_values",
    "counts_of",
    "dependencies",
    "ignored_failures",
    "locate",
]

# The parent row's field prefix of a child failed under fail, remove or continue (its error),
# and the field counting them (settle_child.lua).
FAILED_PREFIX = "failed:"
# The parent row's count of its children cut: the flow ended without them (cancel.lua,
# release.lua, deadline.lua, cancel_elsewhere.lua, deadline_cut.lua, credit_cut.lua, quorum).
CUT_FIELD = "cut_children"


class _Four(NamedTuple):
    outstanding: int
    done: int
    failed: int
    ignored: int


class Dependencies(_Four):
    """Where a flow's children stand: ``outstanding + done + failed + ignored + cut`` is its
    number of children, and a finished flow has none outstanding.

    ``outstanding``: not settled yet (pending, running); ``done``: succeeded, their values are
    the parent's; ``failed``: failed under policy ``fail``, ``fail_at_end``, ``remove`` or
    ``continue``; ``ignored``: failed under ``ignore``; ``cut``: the flow ended without them
    (cancelled, revoked by a release, cut by a deadline or by a quorum before they started;
    under a quorum also one that succeeded once its parent no longer waited, whose value was
    not taken).

    A tuple of the first four, as before ``cut`` was counted: ``a, b, c, d = deps`` and
    ``deps == (0, 3, 0, 0)`` read as they always did; ``cut`` is an attribute beside them.
    """

    cut: int

    def __new__(
        cls, outstanding: int, done: int, failed: int, ignored: int, cut: int = 0
    ) -> Dependencies:
        self = super().__new__(cls, outstanding, done, failed, ignored)
        self.cut = cut
        return self

    @property
    def total(self) -> int:
        """Every child counted: the five counts added up."""
        return sum(self) + self.cut

    def __repr__(self) -> str:
        return (
            f"Dependencies(outstanding={self.outstanding}, done={self.done}, "
            f"failed={self.failed}, ignored={self.ignored}, cut={self.cut})"
        )

    def _asdict(self) -> dict[str, Any]:
        return {**super()._asdict(), "cut": self.cut}

    def _replace(self, **changes: int) -> Dependencies:
        cut = changes.pop("cut", self.cut)
        return Dependencies(*_Four(*self)._replace(**changes), cut=cut)


def counts_of(
    counter: Any, values: Any, ignored: Any, credited_failed: Any, recorded: Any, cut: Any = None
) -> Dependencies:
    """The counts from what the store keeps: the ``:dependencies`` counter, ``HLEN`` of
    ``:processed`` and of ``:ignored``, and the row's ``credited_failed``, ``failed_children``
    and ``cut_children``.

    A child failed under ``fail`` is never counted down (settle_child returns before the
    DECR), so the counter still includes it; the row's record of failed children tells it
    from one still outstanding. A cut child is never counted down either (it never settles):
    the row's ``cut_children`` counts it, written by the script that cut it. A flow written
    before that record existed reads as before (its cut children outstanding).
    """
    n_ignored = int(ignored or 0)
    n_cut = int(cut or 0)
    credited_others = max(0, int(credited_failed or 0) - n_ignored)  # remove and continue
    under_fail = max(0, int(recorded or 0) - credited_others)
    return Dependencies(
        outstanding=max(0, int(counter or 0) - under_fail - n_cut),
        done=int(values or 0),
        failed=credited_others + under_fail,
        ignored=n_ignored,
        cut=n_cut,
    )


def locate(state: EchoMQ, job_id: str, queue: str | None = None, *, verify: bool = False) -> str:
    """The queue whose slot holds ``job_id``'s keys: ``queue`` if given, the running task's own
    queue, the flow's locator key (a parent's), else a look at every queue that holds flows
    (a child has no locator).

    ``verify``: trust ``queue`` and the locator only where the job's row exists (what the CLI
    and :mod:`~celery_echomq.ops.views` read), and tell an expired flow from an unknown one.
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
            f"flow {job_id!r} has expired or was forgotten (its keys are gone from Redis)",
            job_id,
        )
    raise UnknownFlowError(f"no job {job_id!r} in Redis (never started, or expired)", job_id)


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


def state_of(app: Any) -> EchoMQ:
    """The extension's state of ``app`` (None: the current app)."""
    return get_state(app or current_app)


def children_values(
    job_id: str,
    *,
    app: Any = None,
    queue: str | None = None,
    cursor: str | None = None,
    count: int | None = None,
) -> Any:
    """``{child_job_id: value}`` for the children of ``job_id`` completed so far.

    With ``count``: one page of at most ``count`` values and the cursor of the next page,
    ``(values, next_cursor)``; ``next_cursor`` is None after the last page. Pages follow
    Redis's HSCAN, so a flow of any size is read a page at a time: every value completed
    before the first page is returned exactly once; one completed while paging may come
    once or not at all. A cursor no page gave raises :class:`CursorError`.
    """
    _check_page(cursor, count)
    state = state_of(app)
    _, processed, _ = state.keys.flow_keys(locate(state, job_id, queue), job_id)
    if count is None:
        # In chunks rather than one HGETALL: a flow's 100,000 values must not block Redis.
        scanned = state.client.hscan_iter(processed, count=1000)
        return {text(k): state.loads(v) for k, v in scanned}
    start = Cursor.parse(cursor, "children_values", after="id")
    raw, following = hash_page(state.client, processed, start, count)
    return {k: state.loads(v) for k, v in raw.items()}, cursor_text(following)


def _check_page(cursor: str | None, count: int | None) -> None:
    if count is None and cursor is not None:
        raise CursorError("children_values: a cursor needs a count (the page size)")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ListingError(f"children_values: count must be a whole number >= 1, not {count!r}")


def eager_values(values: dict[str, Any], cursor: str | None, count: int | None) -> Any:
    """The same pages over an eager flow's values, in memory (the cursor: a position)."""
    _check_page(cursor, count)
    if count is None:
        return values
    start = Cursor.parse(cursor, "children_values", after="none").at
    items = list(values.items())[start : start + count]
    after = start + count
    return dict(items), (str(after) if after < len(values) else None)


def dependencies(job_id: str, *, app: Any = None, queue: str | None = None) -> Dependencies:
    """Where the children stand: :class:`Dependencies` (outstanding, done, failed, ignored,
    and cut)."""
    state = state_of(app)
    q = locate(state, job_id, queue)
    deps, processed, ignored = state.keys.flow_keys(q, job_id)
    pipe = state.client.pipeline(transaction=False)
    pipe.get(deps)
    pipe.hlen(processed)
    pipe.hlen(ignored)
    pipe.hmget(state.keys.job_key(q, job_id), "credited_failed", "failed_children", CUT_FIELD)
    counter, values, n_ignored, (credited_failed, recorded, cut) = pipe.execute()
    return counts_of(counter, values, n_ignored, credited_failed, recorded, cut)


def ignored_failures(job_id: str, *, app: Any = None, queue: str | None = None) -> dict[str, str]:
    """``{child_job_id: "ExcType: message"}`` for children that failed under policy ``ignore``."""
    state = state_of(app)
    _, _, ignored = state.keys.flow_keys(locate(state, job_id, queue), job_id)
    # In chunks rather than one HGETALL: a flow's 100,000 failures must not block Redis.
    return {text(k): text(v) for k, v in state.client.hscan_iter(ignored, count=1000)}


def indexed_children(
    state: EchoMQ, queue: str, parent_id: str, batch: int = 1000
) -> list[str] | None:
    """A parent's children's ids from its index by position (``:children``), ``batch`` per
    LRANGE; None for a flow that has none (written before it existed)."""
    key = state.keys.children_key(queue, parent_id)
    total = state.client.llen(key)
    if not total:
        return None
    ids: list[str] = []
    for start in range(0, total, batch):
        ids += [text(c) for c in state.client.lrange(key, start, start + batch - 1)]
    return ids


def queues_of(state: EchoMQ, queues: Iterable[str] | None) -> list[str]:
    """The queues in ``emq:queues`` (those of them in ``queues``), well-formed ones only."""
    names = sorted(text(raw) for raw in state.client.smembers(state.keys.queues_key()))
    if queues is not None:
        wanted = set(queues)
        names = [name for name in names if name in wanted]
    valid = []
    for name in names:
        try:
            valid.append(check_queue(name))
        except InvalidIdError:
            logger.warning("echomq recovery: ignoring ill-formed queue name %r", name)
    return valid


def steps_after(state: Any, queue: str, job: dict[str, Any]) -> Iterator[str]:
    """The chain steps after ``job`` (none unless it is a chain's step): see steps_from."""
    return steps_from(state, queue, str(_headers(job).get(H_NEXT) or ""))


def steps_from(state: Any, queue: str, step: str) -> Iterator[str]:
    """``step`` and each chain step after it that the store keeps on ``queue``, in order:
    each step names the next (:data:`H_NEXT`). Stops at a row that is gone or whose payload
    this process cannot read (it names no further step)."""
    seen: set[str] = set()
    while step and step not in seen:
        seen.add(step)
        payload = state.client.hget(state.keys.job_key(queue, step), "payload")
        if payload is None:
            return
        yield step
        try:
            job = load_job(state, queue, step, payload)
        except Exception:
            return
        step = str(_headers(job).get(H_NEXT) or "")


def _headers(job: dict[str, Any]) -> dict[str, Any]:
    return dict((job.get("options") or {}).get("headers") or {})
