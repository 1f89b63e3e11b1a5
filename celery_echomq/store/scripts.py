"""Each transition script (``lua/<name>.lua``, loaded by ``loader.py``) as a typed call:
:class:`Scripts` is a flow's own transitions (``flow_scripts.py``) and, here, those of
operators and recovery (cancel, retry, release, requeue, leases, hand-over, abandon).

``register_script`` runs EVALSHA and falls back to EVAL on NOSCRIPT.
"""

from __future__ import annotations

from collections.abc import Sequence

from celery_echomq.store.codec import Stored, stored_of
from celery_echomq.store.connection import text
from celery_echomq.store.flow_scripts import FlowScripts
from celery_echomq.store.replies import Status
from celery_echomq.store.script_base import ParentRef, ResultWrite, status_of, stored_children

__all__ = ["ParentRef", "ResultWrite", "Scripts"]


class Scripts(FlowScripts):
    """The EchoMQ transitions, bound to one Redis client and one keyspace."""

    def cancel(
        self, queue: str, parent_id: str, child_ids: Sequence[str], *, ttl: int
    ) -> tuple[Status, Status, list[str]]:
        """Cancel a held flow: its status, the parent's state before, and the children that
        were still outstanding."""
        keys = [
            self.keys.job_key(queue, parent_id),
            *self.keys.flow_keys(queue, parent_id),
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "active"),
            self.keys.queue_key(queue, "counters"),
            *(self.keys.job_key(queue, cid) for cid in child_ids),
        ]
        reply = self._run("cancel", keys, [parent_id, str(ttl), *child_ids])
        if len(reply) < 2:
            return status_of(reply[0]), status_of(reply[0]), []
        return status_of(reply[0]), status_of(reply[1]), [text(cid) for cid in reply[2:]]

    def cancel_elsewhere(
        self,
        queue: str,
        parent_id: str,
        child_ids: Sequence[str],
        *,
        ttl: int,
        started: bool,
    ) -> list[str]:
        """Cancel ``parent_id``'s outstanding children on ``queue``'s slot (``started``: the
        running ones too): the ids cancelled (cancel_elsewhere.lua)."""
        keys = [
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "active"),
            self.keys.queue_key(queue, "counters"),
            *(self.keys.job_key(queue, cid) for cid in child_ids),
        ]
        argv = [parent_id, str(ttl), "1" if started else "0", *child_ids]
        return [text(cid) for cid in self._run("cancel_elsewhere", keys, argv)]

    def retry_flow(
        self,
        queue: str,
        parent_id: str,
        local: Sequence[str],
        others: Sequence[str] = (),
    ) -> tuple[Status, list[tuple[str, Stored]]]:
        """Put a flow failed under policy fail back to awaiting_children (retry_flow.lua).

        ``local``: failed children on the parent's slot to make pending again; ``others``:
        children retried elsewhere (another slot, or a nested flow) whose :settled entry goes.
        Returns the status and ``(id, stored job)`` of each child made pending.
        """
        keys = [
            *self.held_keys(queue, parent_id),
            *(self.keys.job_key(queue, cid) for cid in local),
        ]
        reply = self._run("retry_flow", keys, [parent_id, str(len(local)), *local, *others])
        return status_of(reply[0]), stored_children(reply[1:], parent_id)

    def retry_counted(
        self, queue: str, parent_id: str, child_id: str
    ) -> tuple[Status, list[tuple[str, Stored]]]:
        """Make a child failed under ignore, remove or continue pending again and count it
        toward its parent again (retry_counted.lua): the status and its stored job."""
        deps, _, ignored = self.keys.flow_keys(queue, parent_id)
        keys = [
            self.keys.job_key(queue, child_id),
            self.keys.job_key(queue, parent_id),
            deps,
            ignored,
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "failed"),
        ]
        status, *stored = self._run("retry_counted", keys, [child_id, parent_id])
        pairs = stored_children([child_id, *stored], parent_id) if stored else []
        return status_of(status), pairs

    def retry_parent(self, queue: str, job_id: str, outer: str = "") -> Status:
        """Make a flow parent whose own body failed pending again (retry_parent.lua), for the
        host to dispatch; ``outer``: the flow it is a child of."""
        deps, processed, ignored = self.keys.flow_keys(queue, job_id)
        keys = [
            self.keys.job_key(queue, job_id),
            deps,
            processed,
            ignored,
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "failed"),
        ]
        return status_of(self._run("retry_parent", keys, [job_id, outer])[0])

    def retry_children(
        self, queue: str, parent_id: str, child_ids: Sequence[str]
    ) -> list[tuple[str, Stored]]:
        """Make failed children of another slot than their parent's pending again: the
        ``(id, stored job)`` of each one made pending."""
        keys = [
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "failed"),
            *(self.keys.job_key(queue, cid) for cid in child_ids),
        ]
        reply = self._run("retry_children", keys, [parent_id, *child_ids])
        return stored_children(reply, parent_id)

    def release(
        self, queue: str, parent_id: str, child_ids: Sequence[str], *, revoke: bool, ttl: int
    ) -> tuple[Status, list[str]]:
        """Release a held parent now; with ``revoke``, cancel its outstanding children on its
        slot. Returns the status and the ids cancelled."""
        keys = [
            self.keys.job_key(queue, parent_id),
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "active"),
            self.keys.queue_key(queue, "counters"),
            *(self.keys.job_key(queue, cid) for cid in (child_ids if revoke else ())),
        ]
        argv = [parent_id, str(ttl), "1" if revoke else "0", *(child_ids if revoke else ())]
        reply = self._run("release", keys, argv)
        return status_of(reply[0]), [text(cid) for cid in reply[1:]]

    def requeue(
        self, queue: str, job_id: str, stall_ms: int, seen_state: str, token: str = ""
    ) -> tuple[Status, Stored | None]:
        """Take back a lost job: ``("requeued", stored job)`` to re-publish, or
        ``(status, None)`` when it is not (or no longer) stalled in ``seen_state``."""
        keys = [
            self.keys.job_key(queue, job_id),
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "active"),
            self.keys.queue_key(queue, "reserved"),
            self.keys.queue_key(queue, "counters"),
        ]
        reply = self._run("requeue", keys, [job_id, str(stall_ms), seen_state, token])
        status = status_of(reply[0])
        return (status, stored_of(*reply[1:5])) if status is Status.REQUEUED else (status, None)

    def extend(
        self,
        queue: str,
        running: Sequence[str],
        lease_ms: int,
        held: Sequence[str] = (),
        released: Sequence[str] = (),
    ) -> int:
        """Renew this worker's leases on ``queue``: the deadlines of the ``running`` jobs (still
        active) and the holds on the ``held`` ones (received, not started), to now + lease;
        end the holds on the ``released`` ones (held before, started or gone since)."""
        if not running and not held and not released:
            return 0
        keys = [self.keys.queue_key(queue, "active"), self.keys.queue_key(queue, "reserved")]
        argv = [str(lease_ms), str(len(running)), str(len(held)), *running, *held, *released]
        return int(self._run("extend", keys, argv))

    def drop(self, queue: str, job_id: str, holder_prefix: str) -> tuple[Status, Stored | None]:
        """End the lease of a holder known dead: ``("lapsed", None)``, ``("requeued", stored
        job)`` (the host re-publishes it) or ``("noop", None)``."""
        keys = [
            self.keys.job_key(queue, job_id),
            self.keys.queue_key(queue, "active"),
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "counters"),
        ]
        reply = self._run("drop", keys, [job_id, holder_prefix])
        status = status_of(reply[0])
        return (status, stored_of(*reply[1:5])) if status is Status.REQUEUED else (status, None)

    def hand_over(self, queue: str, job_id: str, token: str) -> Status:
        """The job was replaced (Task.replace): its outcome is the replacement's."""
        keys = [self.keys.job_key(queue, job_id), self.keys.queue_key(queue, "active")]
        return status_of(self._run("hand_over", keys, [job_id, token])[0])

    def lease_release(self, name: str, token: str) -> bool:
        """Give up the lease ``name`` if ``token`` still holds it."""
        return bool(self._run("lease_release", [self.keys.lease_key(name)], [token]))

    def abandon_flow(
        self, queue: str, parent_id: str, stall_ms: int, error: str, *, ttl: int
    ) -> Status:
        """Fail an open flow (chunked path) whose producer stopped before writing every child."""
        keys = self.held_keys(queue, parent_id, entry="open")
        return status_of(
            self._run("abandon_flow", keys, [parent_id, str(stall_ms), str(ttl), error])[0]
        )
