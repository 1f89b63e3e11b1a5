"""Starting and growing a flow as typed calls: enqueue (one step), or open, add children in
chunks and seal (the chunked path), and children added while it runs (each ``lua/<name>.lua``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_echomq.store.replies import Status
from celery_echomq.store.runner import Value
from celery_echomq.store.script_base import (
    RECENT_MAX,
    RECENT_TTL_MS,
    BrokerPushes,
    ParentRef,
    ScriptsBase,
    status_of,
)


class StartScripts(ScriptsBase):
    """The transitions that write a flow: its enqueue, its chunks, children it grows."""

    def enqueue_flow(self, *args: Any, **kwargs: Any) -> int:
        """:meth:`enqueue_flow_at` (same arguments), returning the counter (N) alone."""
        return self.enqueue_flow_at(*args, **kwargs)[0]

    def enqueue_flow_at(
        self,
        queue: str,
        parent_id: str,
        parent_payload: Value,
        children: Sequence[tuple[str, Value]],
        outer: str = "",
        *,
        recent_ttl_ms: int = RECENT_TTL_MS,
        recent_max: int = RECENT_MAX,
        template: Value = b"",
        kinds: str = "",
        policy: str = "",
        locator_ttl: int = 0,
        register: Sequence[str] = (),
        check: bool = False,
        publish: BrokerPushes | None = None,
    ) -> tuple[int, int | None]:
        """Hold the parent and write its children; ``recent_ttl_ms`` and ``recent_max`` bound
        the queue's recent-flow index (normally the result TTL and ``echomq_recent_flows``).
        Returns ``(N, ms)``: the counter, and the server time (ms) the script read, every
        child's pending score (None when the call was recognised as landed by an earlier
        attempt whose reply was lost: its time is not known).

        ``template``: kept on the parent's row; ``kinds``: a character per child, ``d`` where
        its value is a delta against ``template``, ``p`` where it is a whole payload (empty:
        every value is a payload). See :mod:`~celery_echomq.store.codec`. ``policy``: kept on the
        parent's row ('' writes none, which reads as ``fail``). ``locator_ttl``: also write the
        parent's locator (a key of another slot: not on a Redis Cluster), with this TTL in
        seconds; ``register``: queue names to add to the registry of queues (also a key of
        another slot), in the same step. ``check``: the script checks every id against every
        other queue itself (``includes/taken.lua``: a store of one server only, whose scripts may
        read keys of any queue). ``publish``: the children's messages, pushed into
        the broker's database of this server by the same step (not on a Redis Cluster)."""
        parent_key = self.keys.job_key(queue, parent_id)
        keys = [
            parent_key,
            f"{parent_key}:dependencies",
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "recent"),
            self.keys.queue_key(queue, "counters"),
            *(self.keys.job_key(queue, cid) for cid, _ in children),
        ]
        argv: list[Value] = [parent_id, parent_payload, str(len(children))]
        for cid, payload in children:
            argv += [cid, payload]
        argv += [outer, str(recent_ttl_ms), str(recent_max)]
        if policy or locator_ttl or register or check or publish:
            argv += [template, kinds, policy, str(locator_ttl) if locator_ttl else "", queue]
            argv += [str(len(register)), *register]
            argv += self.keys.check_parts() if check else ["", "", "", ""]
            if locator_ttl:
                keys.append(self.keys.locator_key(parent_id))
            if register or check:
                keys.append(self.keys.queues_key())
            if publish:
                keys += publish.lists
                argv.append(str(publish.db))
                for index, head, tail in publish.messages:
                    argv += [str(index), head, tail]
        elif kinds:
            argv += [template, kinds]
        reply = self._run("enqueue_flow", keys, argv)
        if isinstance(reply, list):
            return int(reply[0]), int(reply[1]) if reply[1] not in (b"", "", None) else None
        return int(reply), None

    def open_flow(
        self,
        queue: str,
        parent_id: str,
        payload: Value,
        n: int,
        policy: str,
        outer: str = "",
        *,
        recent_ttl_ms: int = RECENT_TTL_MS,
        recent_max: int = RECENT_MAX,
        template: Value = b"",
    ) -> int:
        """Hold the parent for the chunked path; ``template``: kept on its row, for the
        deltas add_children writes on its slot (see :mod:`~celery_echomq.store.codec`)."""
        row = self.keys.job_key(queue, parent_id)
        keys = [
            row,
            self.keys.flow_keys(queue, parent_id)[0],
            self.keys.queue_key(queue, "open"),
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "recent"),
            self.keys.queue_key(queue, "counters"),
        ]
        argv = [parent_id, payload, str(n), policy, outer, str(recent_ttl_ms), str(recent_max)]
        if template:
            argv.append(template)
        return int(self._run("open_flow", keys, argv))

    def add_children(
        self,
        queue: str,
        parent: ParentRef,
        children: Sequence[tuple[str, Value, str]],
        kinds: str = "",
    ) -> int:
        """Write one chunk of children that live on ``queue``: (id, payload, policy or '').

        ``kinds``: a character per child, ``d`` where its value is a delta against the
        template open_flow kept on the parent's row (on the parent's own slot only), ``p``
        where it is a whole payload (empty: every value is a payload)."""
        keys = [
            self.keys.queue_key(queue, "pending"),
            *(self.keys.job_key(queue, cid) for cid, _, _ in children),
        ]
        argv: list[Value] = [
            parent.id,
            parent.queue if parent.queue != queue else "",
            str(len(children)),
        ]
        for cid, payload, policy in children:
            argv += [cid, payload, policy]
        if kinds:
            argv.append(kinds)
        return int(self._run("add_children", keys, argv))

    def grow_flow(
        self,
        parent: ParentRef,
        payload_sha: str,
        new_payload: Value,
        local: Sequence[tuple[str, Value, str]],
        remote: Sequence[tuple[str, Value, str]],
    ) -> tuple[Status, int]:
        """Add children to a held flow on its parent's slot: write ``local`` (id, payload,
        policy or ''), stage ``remote``, raise the counter. ``(status, counter)``: see
        grow_flow.lua (``stale``: the payload is no longer ``payload_sha``)."""
        row = self.keys.job_key(parent.queue, parent.id)
        keys = [
            row,
            self.keys.flow_keys(parent.queue, parent.id)[0],
            self.keys.queue_key(parent.queue, "pending"),
            self.keys.adding_key(parent.queue, parent.id),
            self.keys.queue_key(parent.queue, "adding"),
            *(self.keys.job_key(parent.queue, cid) for cid, _, _ in local),
        ]
        argv: list[Value] = [
            parent.id,
            payload_sha,
            new_payload,
            str(len(local)),
            str(len(remote)),
        ]
        for cid, payload, policy in (*local, *remote):
            argv += [cid, payload, policy]
        status, counter = self._run("grow_flow", keys, argv)
        return status_of(status), int(counter)

    def grow_done(self, parent: ParentRef, child_ids: Sequence[str]) -> int:
        """Unstage children of other slots whose rows were written; how many stay staged."""
        keys = [
            self.keys.adding_key(parent.queue, parent.id),
            self.keys.queue_key(parent.queue, "adding"),
        ]
        return int(self._run("grow_done", keys, [parent.id, *child_ids]))

    def seal_flow(self, queue: str, parent_id: str) -> Status:
        keys = [
            self.keys.job_key(queue, parent_id),
            self.keys.flow_keys(queue, parent_id)[0],
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "open"),
            self.keys.queue_key(queue, "counters"),
        ]
        return status_of(self._run("seal_flow", keys, [parent_id])[0])
