"""What ``retry`` and ``release`` read of a flow: its row and counts, and its children a chunk
at a time, whatever the flow's size.

The parent is read as a page of ``show`` reads it (its row, its counter, the ``HLEN`` of its
values and ignored failures), never its whole tree. ``retry`` finds the children to run again
in the flow's record of failed children (``<row>:failures``: failed under ``fail``, ``remove``
or ``continue``; the row's ``failed:<id>`` fields on a flow written before that hash existed),
HSCAN a chunk (``echomq_chunk_size``) at a time, and reads only those children's rows;
``--child`` reads that one child's row. ``release --revoke`` reads the children from the
index by position, a chunk at a time, as ``cancel`` does (see cancel.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from celery_echomq.ops.pages import ROW_SCAN, child_nodes, hscan_ids, root_node
from celery_echomq.ops.views import JobNode
from celery_echomq.store.cursor import Cursor
from celery_echomq.store.reads import FAILED_PREFIX, locate
from celery_echomq.store.state import EchoMQ


@dataclass(frozen=True)
class FlowRoot:
    """A flow's parent as one page read it: ``node`` (its counts in ``node.flow``, no
    children) and the row fields the reads of its children need."""

    node: JobNode
    row: dict[str, Any]


def flow_root(state: EchoMQ, job_id: str, queue: str | None = None) -> FlowRoot:
    """The parent ``job_id`` (its row and counts), without reading any of its children."""
    where = locate(state, job_id, queue, verify=True)
    node, info, row = root_node(state, where, job_id)
    return FlowRoot(replace(node, flow=info, children=()), row)


def failed_chunks(state: EchoMQ, root: FlowRoot) -> Iterator[list[JobNode]]:
    """The children in the flow's record of failed children, as nodes, a chunk at a time
    (each chunk one HSCAN of the record and the rows of those children)."""
    node, chunk = root.node, state.settings.chunk_size
    if node.flow is None:
        return
    key, prefix, batch = state.keys.failures_key(node.queue, node.id), "", chunk
    if root.row["children_n"] is None:
        # A flow written before its record existed: the row's failed:<id> fields.
        key, prefix, batch = state.keys.job_key(node.queue, node.id), FAILED_PREFIX, ROW_SCAN
    cursor: Cursor | None = Cursor()
    while cursor is not None:
        ids, cursor = hscan_ids(state, key, prefix, cursor, chunk, batch)
        if ids:
            yield child_nodes(state, node.queue, root.row, node.flow, ids)


def child_of(state: EchoMQ, root: FlowRoot, child_id: str) -> JobNode | None:
    """The child ``child_id`` of the flow (a linked chain's step among them: each step's row
    names the flow), read alone; None when it is no child of this flow."""
    node = root.node
    if node.flow is None:
        return None
    (found,) = child_nodes(state, node.queue, root.row, node.flow, [child_id])
    if found.parent != node.id:
        return None
    if found.steps:
        # A chain's last step: the step itself (retry runs again the step that failed).
        found = replace(found, steps=())
    return found
