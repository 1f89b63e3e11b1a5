"""A flow's reads and its growth, each behind one interface, chosen once per call: a flow
running eagerly in this process (``eager.py``) answers from memory, any other from the store
(``store/reads.py``, ``send/grow.py``), which know nothing of eager mode.

An eager run registers its flow in :data:`IN_PROCESS`: readable while its parent's body runs
(the reads inside it), growing while its parent waits (``add_children`` from a child's body,
or with the flow's id). The public reads and ``add_children`` are these functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

from celery import current_app

from celery_echomq.send import grow
from celery_echomq.send.accepts import child_signatures
from celery_echomq.store import failed, reads
from celery_echomq.store.keyspace import check_id
from celery_echomq.store.reads import Dependencies


class FlowReads(Protocol):
    """What a flow's reads answer: the store's for a flow in Redis, the eager fan-in's
    (``result.FanIn``) for a flow whose parent runs in this process."""

    def children_values(self, cursor: str | None, count: int | None) -> Any: ...

    def dependencies(self) -> Dependencies: ...

    def ignored_failures(self) -> dict[str, str]: ...

    def failed_children(self, cursor: str | None, count: int | None) -> Any: ...


class FlowGrowth(Protocol):
    """A flow run eagerly whose parent still waits: children added to it run in memory."""

    def add(self, sigs: Sequence[Any]) -> list[str]: ...


@dataclass(frozen=True)
class StoredFlow:
    """A flow's reads from the store (``queue``: where it lives, when known)."""

    job_id: str
    app: Any = None
    queue: str | None = None

    def children_values(self, cursor: str | None, count: int | None) -> Any:
        return reads.children_values(
            self.job_id, app=self.app, queue=self.queue, cursor=cursor, count=count
        )

    def dependencies(self) -> Dependencies:
        return reads.dependencies(self.job_id, app=self.app, queue=self.queue)

    def ignored_failures(self) -> dict[str, str]:
        return reads.ignored_failures(self.job_id, app=self.app, queue=self.queue)

    def failed_children(self, cursor: str | None, count: int | None) -> Any:
        return failed.failed_children(
            self.job_id, app=self.app, queue=self.queue, cursor=cursor, count=count
        )


@dataclass
class InProcess:
    """The flows running eagerly in this process, by parent id."""

    # Flows whose parent's body runs now: the reads inside it answer from memory.
    readable: dict[str, FlowReads] = field(default_factory=dict)
    # Flows whose parent still waits: what add_children adds to.
    growing: dict[str, FlowGrowth] = field(default_factory=dict)
    # The parent of the eager child running in this context (add_children without parent_id).
    current: ContextVar[str | None] = field(
        default_factory=lambda: ContextVar("echomq_eager_parent", default=None)
    )


IN_PROCESS = InProcess()


def reads_of(job_id: str, *, app: Any = None, queue: str | None = None) -> FlowReads:
    """The reads of the flow ``job_id``: in memory when it runs eagerly here, else the store's."""
    return IN_PROCESS.readable.get(job_id) or StoredFlow(job_id, app, queue)


def children_values(
    job_id: str,
    *,
    app: Any = None,
    queue: str | None = None,
    cursor: str | None = None,
    count: int | None = None,
) -> Any:
    """``{child_job_id: value}`` for the children of ``job_id`` completed so far, or with
    ``count`` one page and the next page's cursor: from memory for a flow run eagerly in
    this process, else as :func:`celery_echomq.store.reads.children_values` pages."""
    return reads_of(job_id, app=app, queue=queue).children_values(cursor, count)


def dependencies(job_id: str, *, app: Any = None, queue: str | None = None) -> Dependencies:
    """Where the children stand: :class:`Dependencies` (outstanding, done, failed, ignored)."""
    return reads_of(job_id, app=app, queue=queue).dependencies()


def ignored_failures(job_id: str, *, app: Any = None, queue: str | None = None) -> dict[str, str]:
    """``{child_job_id: "ExcType: message"}`` for children that failed under policy ``ignore``."""
    return reads_of(job_id, app=app, queue=queue).ignored_failures()


def failed_children(
    job_id: str,
    *,
    app: Any = None,
    queue: str | None = None,
    cursor: str | None = None,
    count: int | None = None,
) -> Any:
    """``{child_job_id: "ExcType: message"}`` for every child that failed for good, or with
    ``count`` one page and the next page's cursor: from memory for a flow run eagerly in
    this process, else as :func:`celery_echomq.store.failed.failed_children` pages."""
    return reads_of(job_id, app=app, queue=queue).failed_children(cursor, count)


def add_children(
    children: Iterable[Any],
    parent_id: str | None = None,
    *,
    app: Any = None,
    queue: str | None = None,
) -> list[str]:
    """Add ``children`` (a list or group of signatures, flows among them) to a held flow.

    Without ``parent_id``: inside a flow child's body, siblings of that child (children of its
    parent). With it: children of the flow ``parent_id`` (``queue``: where it lives, when
    known). Their values reach the parent after the existing children's, in the order added.
    A child whose id is already one of the flow's children is skipped (a repeated add writes
    nothing twice). Returns the ids added.

    Raises :class:`FlowClosedError` when the parent no longer waits for children, and the
    id errors of ``apply_async`` (``KindError``, ``InvalidIdError``, ``DuplicateIdError``,
    ``FlowExistsError``) for bad ids: in every case nothing is written or published.
    """
    if parent_id is not None:
        check_id(parent_id)
    sigs = child_signatures(children, app or current_app)
    growing = IN_PROCESS.growing.get(parent_id or IN_PROCESS.current.get() or "")
    if growing is not None:
        return growing.add(sigs)
    return grow.add_to_stored(sigs, parent_id, app=app, queue=queue)
