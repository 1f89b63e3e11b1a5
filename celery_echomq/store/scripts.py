"""Each transition script (``lua/<name>.lua``, loaded by ``loader.py``) as a typed call.

Every wrapper builds its KEYS through the :class:`~celery_echomq.keyspace.Keyspace` gate and
maps the scripts' replies to :class:`~celery_echomq.replies.Status` and their error replies
to Python errors (``EMQKIND`` -> :class:`KindError`).
``register_script`` runs EVALSHA and falls back to EVAL on NOSCRIPT.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from celery_echomq.store.codec import Stored, stored_of
from celery_echomq.store.connection import text
from celery_echomq.store.replies import Status
from celery_echomq.store.runner import ScriptRunner, Value

# The recent-flow index's bounds when a caller gives none (``install`` passes the app's
# result TTL and ``echomq_recent_flows``).
RECENT_TTL_MS = 86400 * 1000
RECENT_MAX = 10000


def _status(value: Any) -> Status:
    return Status(text(value))


def _stored_children(reply: Sequence[Any], parent_id: str) -> list[tuple[str, Stored]]:
    """``(id, stored job)`` from a retry script's flat reply ``id, payload, delta, ...``."""
    found = []
    for i in range(0, len(reply), 3):
        stored = stored_of(reply[i + 1], reply[i + 2], parent_id)
        if stored is not None:
            found.append((text(reply[i]), stored))
    return found


@dataclass(frozen=True)
class ParentRef:
    """Where a job's parent lives: its id and the queue whose slot holds its keys."""

    id: str
    queue: str


@dataclass(frozen=True)
class ResultWrite:
    """A job's result for Celery's Redis backend, as ``RedisBackend._set`` would send it for a
    SUCCESS: SET (EX ``expires`` when set) and PUBLISH of ``meta`` under ``key``."""

    key: str
    meta: Value
    expires: int | None


class Scripts(ScriptRunner):
    """The EchoMQ transitions, bound to one Redis client and one keyspace."""

    # (queue, priority) -> a claim mark this process has seen the queue reach. Marks only
    # grow, so a claim of a job pending since no later than that need not read them (the
    # children of one flow share one pending time: one read per flow and process, not per
    # child). A stale value (marks deleted) only leaves a mark lower, which delays recovery's
    # evidence and never makes a false one.
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._known_marks: dict[tuple[str, int], int] = {}

    def _parent_keys(self, parent: ParentRef | None, *names: str) -> list[str]:
        if parent is None:
            return []
        row = self.keys.job_key(parent.queue, parent.id)
        deps, processed, ignored = self.keys.flow_keys(parent.queue, parent.id)
        known = {
            "row": row,
            "dependencies": deps,
            "processed": processed,
            "ignored": ignored,
            "pending": self.keys.queue_key(parent.queue, "pending"),
            "failed": self.keys.queue_key(parent.queue, "failed"),
            "counters": self.keys.queue_key(parent.queue, "counters"),
        }
        return [known[name] for name in names]

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
        return _status(status), int(attempts), text(holder)

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
        return _status(reply[0]), len(reply) > 1 and text(reply[1]) == "1"

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
        return _status(status), text(policy)

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
        return _status(status), int(counter)

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
        return _status(self._run("seal_flow", keys, [parent_id])[0])

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
        return _status(status), text(applied)

    def retry(self, queue: str, job_id: str, token: str, due_in_ms: int = 0) -> Status:
        keys = [
            self.keys.job_key(queue, job_id),
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "active"),
        ]
        return _status(self._run("retry", keys, [job_id, token, str(max(0, due_in_ms))])[0])

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
            return _status(reply[0]), _status(reply[0]), []
        return _status(reply[0]), _status(reply[1]), [text(cid) for cid in reply[2:]]

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
        deps, processed, ignored = self.keys.flow_keys(queue, parent_id)
        keys = [
            self.keys.job_key(queue, parent_id),
            deps,
            processed,
            ignored,
            self.keys.settled_key(queue, parent_id),
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "failed"),
            self.keys.queue_key(queue, "counters"),
            *(self.keys.job_key(queue, cid) for cid in local),
        ]
        reply = self._run("retry_flow", keys, [parent_id, str(len(local)), *local, *others])
        return _status(reply[0]), _stored_children(reply[1:], parent_id)

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
        pairs = _stored_children([child_id, *stored], parent_id) if stored else []
        return _status(status), pairs

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
        return _status(self._run("retry_parent", keys, [job_id, outer])[0])

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
        return _stored_children(reply, parent_id)

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
        return _status(reply[0]), [text(cid) for cid in reply[1:]]

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
        status = _status(reply[0])
        return (status, stored_of(*reply[1:4])) if status is Status.REQUEUED else (status, None)

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
        status = _status(reply[0])
        return (status, stored_of(*reply[1:4])) if status is Status.REQUEUED else (status, None)

    def hand_over(self, queue: str, job_id: str, token: str) -> Status:
        """The job was replaced (Task.replace): its outcome is the replacement's."""
        keys = [self.keys.job_key(queue, job_id), self.keys.queue_key(queue, "active")]
        return _status(self._run("hand_over", keys, [job_id, token])[0])

    def lease_release(self, name: str, token: str) -> bool:
        """Give up the lease ``name`` if ``token`` still holds it."""
        return bool(self._run("lease_release", [self.keys.lease_key(name)], [token]))

    def abandon_flow(
        self, queue: str, parent_id: str, stall_ms: int, error: str, *, ttl: int
    ) -> Status:
        """Fail an open flow (chunked path) whose producer stopped before writing every child."""
        deps, processed, ignored = self.keys.flow_keys(queue, parent_id)
        keys = [
            self.keys.job_key(queue, parent_id),
            deps,
            processed,
            ignored,
            self.keys.settled_key(queue, parent_id),
            self.keys.queue_key(queue, "open"),
            self.keys.queue_key(queue, "failed"),
            self.keys.queue_key(queue, "counters"),
        ]
        return _status(
            self._run("abandon_flow", keys, [parent_id, str(stall_ms), str(ttl), error])[0]
        )
