"""The chunked path of a flow's start: a level too large for one script, or whose children
live on other slots, or that joins jobs in the store.

open_flow holds the parent with one extra unit on its counter, add_children writes the
children per queue and chunk (a chain's steps together), seal_flow removes the extra unit:
until the seal, no completion can release the parent, however many chunks have landed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from celery_echomq.send.dispatch import dispatch_parent
from celery_echomq.send.encoding import Encoded
from celery_echomq.send.join import Joined, join_level
from celery_echomq.send.plan import Plan
from celery_echomq.store.headers import is_open_header
from celery_echomq.store.planned import stored_message
from celery_echomq.store.replies import Status
from celery_echomq.store.scripts import ParentRef
from celery_echomq.store.state import EchoMQ

logger = logging.getLogger("celery_echomq")

# What a start wrote so far, level by level: (queue, parent id or '', row ids), what a
# refusal takes back.
Written = list[tuple[str, str, list[str]]]


def takes_chunked_path(level: Plan, chunk_size: int, joins: dict[str, Joined]) -> bool:
    """Whether ``level`` starts open/add/seal: too many children for one script, children on
    other slots, jobs it joins, or a chord's header read as it yields (sealed by its sender)."""
    return level.chunked(chunk_size) or bool(joins) or is_open_header(level.parent)


def enqueue_chunked(
    state: EchoMQ,
    level: Plan,
    encoded: Encoded,
    chunk: int,
    written: Written,
    joined: dict[str, Joined],
) -> list[tuple[Status, str, str]]:
    """Open, add per queue and chunk, seal: each step recorded in ``written`` as it lands.
    Returns what crediting the joined jobs that had finished made of their new parents."""
    scripts = state.scripts
    scripts.open_flow(
        level.queue,
        level.parent_id,
        encoded.parent,
        len(level.children),
        level.policy,
        outer=level.outer,
        recent_ttl_ms=state.settings.result_ttl * 1000,
        recent_max=state.settings.recent_flows,
        template=encoded.template,
    )
    written.append((level.queue, level.parent_id, []))
    index_children(
        state, level.queue, level.parent_id, stored_message(level), level.child_ids(), chunk
    )
    # Per queue, each child's rows with their kinds: one row, or a chain's steps, which one
    # add_children call writes together (a step names the next, which must be there).
    by_queue: dict[str, list[list[tuple[str, bytes, str, str]]]] = {}
    kinds = encoded.kinds or "p" * len(encoded.children)
    rows = iter(zip(encoded.children, kinds, strict=True))
    for job in level.children:
        group = []
        for _ in job.row_ids():
            (cid, payload), kind = next(rows)
            group.append((cid, payload, level.child_policies.get(cid, ""), kind))
        if group[0][0] not in joined:  # a joined job has its row: it gains an edge instead
            by_queue.setdefault(job.queue, []).append(group)
    parent = ParentRef(level.parent_id, level.queue)
    open_key = state.keys.queue_key(level.queue, "open")
    for queue, groups in by_queue.items():
        for part in _chunks(groups, chunk):
            rows_chunk = [(cid, payload, policy) for cid, payload, policy, _ in part]
            kinds = "".join(kind for *_, kind in part)
            kinds = "" if set(kinds) == {"p"} else kinds
            scripts.add_children(queue, parent, rows_chunk, kinds, level.max_active)
            written.append((queue, "", [cid for cid, _, _ in rows_chunk]))
            # A producer still writing is alive: recovery takes an open flow for abandoned a
            # stall timeout after its last chunk, not after its first, however large it is.
            seconds, micros = state.client.time()
            state.client.zadd(open_key, {level.parent_id: seconds * 1000 + micros // 1000}, xx=True)
    settled = join_level(state, level, joined) if joined else []
    if is_open_header(level.parent):
        # A chord's header read as it yields: its producer adds the rest, then seals.
        return settled
    if scripts.seal_flow(level.queue, level.parent_id) is Status.RELEASED:
        # Every child was a joined job that had finished: released by the seal.
        dispatch_parent(state, level.queue, level.parent_id)
    logger.info(
        "echomq: flow %s opened, %d children added on %d queue(s), sealed",
        level.parent_id,
        len(level.children),
        len(by_queue),
    )
    return settled


def _chunks(groups: list[list[Any]], size: int) -> Iterator[list[Any]]:
    """The rows of ``groups`` in chunks of about ``size``, a group never split (a long chain
    makes one chunk of its own, however many steps it has)."""
    part: list[Any] = []
    for group in groups:
        if part and len(part) + len(group) > size:
            yield part
            part = []
        part.extend(group)
    if part:
        yield part


def index_children(
    state: EchoMQ, queue: str, parent_id: str, parent: dict[str, Any], ids: list[str], chunk: int
) -> None:
    """The parent's index of its children by position (what enqueue_flow writes in its
    script), for the chunked path: its ``:children`` list, a chunk per RPUSH; and ``head`` on
    its row, its stored job without its children's ids, so that a page of a huge flow never
    reads the payload."""
    head = {k: v for k, v in parent.items() if k != "children"}
    index = state.keys.children_key(queue, parent_id)
    pipe = state.client.pipeline(transaction=False)
    pipe.hset(state.keys.job_key(queue, parent_id), "head", state.dumps(head))
    for start in range(0, len(ids), chunk):
        pipe.rpush(index, *ids[start : start + chunk])
    pipe.execute()
