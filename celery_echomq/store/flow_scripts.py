"""A flow's own transitions as typed calls: enqueue, claim, complete, fail, grow, credit,
dispatch (each ``lua/<name>.lua``, loaded by ``loader.py``).

Every wrapper builds its KEYS through the :class:`~celery_echomq.store.keyspace.Keyspace` gate
and maps the scripts' replies to :class:`~celery_echomq.store.replies.Status` and their error
replies to Python errors (``EMQKIND`` -> :class:`KindError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_echomq.store.connection import text
from celery_echomq.store.replies import Status
from celery_echomq.store.runner import Value
from celery_echomq.store.script_base import (
    RECENT_MAX,
    RECENT_TTL_MS,
    ParentRef,
    ResultWrite,
    ScriptsBase,
    status_of,
)


class FlowScripts(ScriptsBase):
    """The transitions of a flow's life, from its enqueue to its parent's dispatch."""

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
    ) -> tuple[int, int | None]:
        """Hold the parent and write its children; ``recent_ttl_ms`` and ``recent_max`` bound
        the queue's recent-flow index (normally the result TTL and ``echomq_recent_flows``).
        Returns ``(N, ms)``: the counter, and the server time (ms) the script read, every
        child's pending score (None when the call was recognised as landed by an earlier
        attempt whose reply was lost: its time is not known).

        ``template``: kept on the parent's row; ``kinds``: a character per child, ``d`` where
        its value is a delta against ``template``, ``p`` where it is a whole payload (empty:
        every value is a payload). See :mod:`~celery_echomq.stored`. ``policy``: kept on the
        parent's row ('' writes none, which reads as ``fail``). ``locator_ttl``: also write the
        parent's locator (a key of another slot: not on a Redis Cluster), with this TTL in
        seconds; ``register``: queue names to add to the registry of queues (also a key of
        another slot), in the same step."""
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
        if policy or locator_ttl or register:
            argv += [template, kinds, policy, str(locator_ttl) if locator_ttl else "", queue]
            if locator_ttl:
                keys.append(self.keys.locator_key(parent_id))
            if register:
                keys.append(self.keys.queues_key())
                argv += list(register)
        elif kinds:
            argv += [template, kinds]
        reply = self._run("enqueue_flow", keys, argv)
        if isinstance(reply, list):
            return int(reply[0]), int(reply[1]) if reply[1] not in (b"", "", None) else None
        return int(reply), None

    def claim(
        self,
        queue: str,
        job_id: str,
        token: str,
        lease_ms: int,
        *,
        priority: int = 0,
        force: bool = False,
        retries: int = 0,
        since: int | None = None,
        parent: str | None = None,
    ) -> tuple[Status, int, str]:
        """``(status, attempts, holder)``: see claim.lua (holder: the live token when busy).

        ``since``: the server time (ms) read just before the job was enqueued (its message's
        ``echomq_t`` header), which spares the claim reading its pending score."""
        keys = [
            self.keys.job_key(queue, job_id),
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "active"),
            self.keys.queue_key(queue, "marks"),
            self.keys.queue_key(queue, "reserved"),
            self.keys.queue_key(queue, "counters"),
        ]
        marks = self._known_marks
        known = marks.get((queue, priority), 0)
        argv = [
            job_id,
            token,
            str(lease_ms),
            str(priority),
            "1" if force else "0",
            str(retries),
            str(known) if known else "",
            str(since) if since else "",
        ]
        if parent is not None:
            argv.append(parent)
        status, attempts, holder, mark = self._run("claim", keys, argv)
        if mark not in (b"", "", None) and int(mark) > known:
            marks[(queue, priority)] = int(mark)
        return status_of(status), int(attempts), text(holder)

    def complete(self, *args: Any, **kwargs: Any) -> Status:
        """:meth:`complete_writing` (same arguments), returning the status alone."""
        return self.complete_writing(*args, **kwargs)[0]

    def complete_writing(
        self,
        queue: str,
        job_id: str,
        token: str,
        *,
        ttl: int,
        is_parent: bool,
        parent: ParentRef | None,
        value: Value,
        result: ResultWrite | None = None,
    ) -> tuple[Status, bool]:
        """Finish an active job (complete.lua) and credit its parent; returns the status and
        whether it wrote ``result``, the job's result for Celery's Redis backend (see
        results.py): only the job's real active -> done transition writes it, never a stale or
        repeated completion."""
        remote = parent is not None and parent.queue != queue
        keys = [
            self.keys.job_key(queue, job_id),
            self.keys.queue_key(queue, "active"),
            *self.keys.flow_keys(queue, job_id),
            *(
                [self.keys.queue_key(queue, "outbox")]
                if remote
                else self._parent_keys(
                    parent, "row", "dependencies", "processed", "pending", "counters"
                )
            ),
        ]
        argv: list[Value] = [
            job_id,
            token,
            str(ttl),
            "1" if is_parent else "0",
            parent.id if parent else "",
            value,
            "1" if remote else "0",
        ]
        if result is not None:
            keys.append(result.key)
            expires = str(result.expires) if result.expires else ""
            argv += ["1", result.meta, expires]
        reply = self._run("complete", keys, argv)
        return status_of(reply[0]), len(reply) > 1 and text(reply[1]) == "1"

    def fail(
        self,
        queue: str,
        job_id: str,
        token: str,
        error: str,
        *,
        ttl: int,
        is_parent: bool,
        parent: ParentRef | None,
        carry: bool = False,
    ) -> tuple[Status, str]:
        """Fail a job and apply its failure to its parent under the child's policy.

        ``token`` '' accepts any delivery (revoke, recovery, a hard time limit). ``carry``: the
        job is a nested flow's parent, failed already by one of its own children; carry that
        failure, once, to the flow it is a child of (``token`` is not read).
        """
        remote = parent is not None and parent.queue != queue
        keys = [
            self.keys.job_key(queue, job_id),
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "active"),
            self.keys.queue_key(queue, "failed"),
            *self.keys.flow_keys(queue, job_id),
            *(
                [self.keys.queue_key(queue, "outbox")]
                if remote
                else self._parent_keys(
                    parent,
                    "row",
                    "dependencies",
                    "processed",
                    "ignored",
                    "pending",
                    "failed",
                    "counters",
                )
            ),
        ]
        argv = [
            job_id,
            token,
            error,
            str(ttl),
            "1" if is_parent else "0",
            parent.id if parent else "",
            "1" if remote else "0",
            "1" if carry else "0",
        ]
        status, policy = self._run("fail", keys, argv)
        return status_of(status), text(policy)

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
        deltas add_children writes on its slot (see :mod:`~celery_echomq.stored`)."""
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

    def credit(
        self,
        parent: ParentRef,
        child_id: str,
        outcome: str,
        data: Value,
        policy: str,
        *,
        ttl: int,
    ) -> tuple[Status, str]:
        """Count a child of another slot on its parent's slot, once per child id."""
        deps, processed, ignored = self.keys.flow_keys(parent.queue, parent.id)
        keys = [
            self.keys.job_key(parent.queue, parent.id),
            deps,
            processed,
            ignored,
            self.keys.settled_key(parent.queue, parent.id),
            self.keys.queue_key(parent.queue, "pending"),
            self.keys.queue_key(parent.queue, "failed"),
            self.keys.queue_key(parent.queue, "counters"),
        ]
        status, applied = self._run(
            "credit", keys, [parent.id, child_id, outcome, data, policy, str(ttl)]
        )
        return status_of(status), text(applied)

    def retry(self, queue: str, job_id: str, token: str, due_in_ms: int = 0) -> Status:
        keys = [
            self.keys.job_key(queue, job_id),
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "active"),
        ]
        return status_of(self._run("retry", keys, [job_id, token, str(max(0, due_in_ms))])[0])

    def dispatch(
        self, queue: str, parent_id: str, redispatch_after_ms: int = 0, inline_max: int = 1000
    ) -> tuple[bytes, dict[str, bytes]] | None:
        """The parent's payload and its children's values, or None if it is not ours to publish.

        More than ``inline_max`` values are read after the claim in chunks of that size.
        """
        row = self.keys.job_key(queue, parent_id)
        _, processed, _ = self.keys.flow_keys(queue, parent_id)
        counters = self.keys.queue_key(queue, "counters")
        reply = self._run(
            "dispatch",
            [row, processed, counters],
            [parent_id, str(redispatch_after_ms), str(inline_max)],
        )
        if not reply:
            return None
        if text(reply[1]) == "scan":
            values = {text(k): v for k, v in self.client.hscan_iter(processed, count=inline_max)}
        else:
            values = {text(reply[i]): reply[i + 1] for i in range(2, len(reply), 2)}
        return reply[0], values
