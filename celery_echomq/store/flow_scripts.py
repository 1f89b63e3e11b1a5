"""A flow's own transitions as typed calls: claim, complete, fail, credit, retry and
dispatch (each ``lua/<name>.lua``, loaded by ``loader.py``); those that write a flow are
in ``start_scripts.py``.

Every wrapper builds its KEYS through the :class:`~celery_echomq.store.keyspace.Keyspace` gate
and maps the scripts' replies to :class:`~celery_echomq.store.replies.Status` and their error
replies to Python errors (``EMQKIND`` -> :class:`KindError`).
"""

from __future__ import annotations

from typing import Any

from celery_echomq.store.connection import text
from celery_echomq.store.replies import Status
from celery_echomq.store.runner import Value
from celery_echomq.store.script_base import (
    ParentRef,
    ResultWrite,
    status_of,
)
from celery_echomq.store.start_scripts import StartScripts

# A released parent handed to one caller to publish: its payload, and its children's values.
Handed = tuple[bytes, dict[str, bytes]]


class FlowScripts(StartScripts):
    """The transitions of a flow's life, from its enqueue (:class:`StartScripts`) to its
    parent's dispatch."""

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

    def complete_writing(self, *args: Any, **kwargs: Any) -> tuple[Status, bool]:
        """:meth:`complete_releasing` (same arguments), without the parent to publish."""
        status, written, _ = self.complete_releasing(*args, **kwargs)
        return status, written

    def complete_releasing(
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
        inline_max: int = 0,
        next_step: str = "",
    ) -> tuple[Status, bool, Handed | None]:
        """Finish an active job (complete.lua) and credit its parent; returns the status,
        whether it wrote ``result``, the job's result for Celery's Redis backend (see
        results.py): only the job's real active -> done transition writes it, never a stale or
        repeated completion; and, with ``inline_max``, the parent this completion released
        for the caller to publish (what :meth:`dispatch` would hand out), else None.

        ``next_step``: the job is a chain's step but its last; its value goes to that step,
        made pending: the status is then ``advanced`` and the handed payload that step's
        (``(payload, {"since": its pending score})``), for the caller to publish."""
        remote = parent is not None and parent.queue != queue and not next_step
        if next_step:
            onward = [self.keys.job_key(queue, next_step), self.keys.queue_key(queue, "pending")]
        elif remote:
            onward = [self.keys.queue_key(queue, "outbox")]
        else:
            onward = self._parent_keys(
                parent, "row", "dependencies", "processed", "pending", "counters"
            )
        keys = [
            self.keys.job_key(queue, job_id),
            self.keys.queue_key(queue, "active"),
            *self.keys.flow_keys(queue, job_id),
            *onward,
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
        if next_step:
            argv += [*([] if result is not None else ["", "", ""]), "", next_step]
        elif inline_max and not remote and parent is not None:
            if result is None:
                argv += ["", "", ""]
            argv.append(str(inline_max))
        reply = self._run("complete", keys, argv)
        status, written = status_of(reply[0]), len(reply) > 1 and text(reply[1]) == "1"
        if status is Status.ADVANCED:
            return status, written, (reply[2], {"since": reply[3]})
        handed = None
        if status is Status.RELEASED and len(reply) > 2 and parent is not None:
            handed = self._handed(parent, reply[2:], inline_max)
        return status, written, handed

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
    ) -> Handed | None:
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
        return self._handed(ParentRef(parent_id, queue), reply, inline_max)

    def _handed(self, parent: ParentRef, reply: list[Any], inline_max: int) -> Handed:
        """A parent to publish, from hand_out's reply: its payload and its children's values
        (read in chunks of ``inline_max`` where the script left them out)."""
        if text(reply[1]) == "scan":
            _, processed, _ = self.keys.flow_keys(parent.queue, parent.id)
            values = {text(k): v for k, v in self.client.hscan_iter(processed, count=inline_max)}
        else:
            values = {text(reply[i]): reply[i + 1] for i in range(2, len(reply), 2)}
        return reply[0], values
