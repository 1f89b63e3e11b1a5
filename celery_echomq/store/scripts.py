"""Each transition script (``lua/<name>.lua``, loaded by ``loader.py``) as a typed call: one
:class:`Scripts` with a method per transition, from a flow's enqueue to its parent's
dispatch, and those of operators and recovery (cancel, retry, release, requeue, leases,
hand-over, abandon).

Every method builds its KEYS through the :class:`~celery_echomq.store.keyspace.Keyspace` gate
(each slot one key, always passed: the queue's placeholder where a call has none), packs the
options a call may leave out into one map, the last ARGV
(:func:`~celery_echomq.store.script_values.packed_options`), and maps the script's replies to
:class:`~celery_echomq.store.replies.Status` and its error replies to Python errors
(``EMQKIND`` -> :class:`KindError`). Running a script (EVALSHA, EVAL on NOSCRIPT, resent
through a failover, the ``WAIT`` of ``echomq_min_replicas``) is the part it holds,
:class:`~celery_echomq.store.runner.ScriptRunner`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis

from celery_echomq.store.codec import Stored, stored_of
from celery_echomq.store.connection import text
from celery_echomq.store.keyspace import Keyspace
from celery_echomq.store.replies import Status
from celery_echomq.store.runner import Rider, ScriptRunner, Value
from celery_echomq.store.script_values import (
    RECENT_MAX,
    RECENT_TTL_MS,
    BrokerPushes,
    Freed,
    Handed,
    ParentRef,
    ResultWrite,
    packed,
    packed_options,
    status_of,
    stored_children,
    window_freed,
)

__all__ = ["Handed", "ParentRef", "ResultWrite", "Scripts"]


class Scripts:
    """The EchoMQ transitions, bound to one Redis client and one keyspace."""

    def __init__(
        self,
        client: redis.Redis,
        keyspace: Keyspace,
        *,
        retry_timeout: float = 20.0,
        min_replicas: int = 0,
        min_replicas_timeout: float = 1.0,
        store: str = "",
    ) -> None:
        """``retry_timeout``: how long a transition waits for an unreachable store (the
        client's own retry, see connection.py) before :class:`StoreUnavailableError`.
        ``min_replicas``: WAIT for that many replicas after each transition that must survive
        a failover, up to ``min_replicas_timeout`` seconds, else :class:`ReplicationError`.
        """
        self.client = client
        self.keys = keyspace
        self.runner = ScriptRunner(
            client,
            retry_timeout=retry_timeout,
            min_replicas=min_replicas,
            min_replicas_timeout=min_replicas_timeout,
            store=store,
        )
        # (queue, priority) -> a claim mark this process has seen the queue reach. Marks only
        # grow, so a claim of a job pending since no later than that need not read them (the
        # children of one flow share one pending time: one read per flow and process, not per
        # child). A stale value (marks deleted) only leaves a mark lower, which delays recovery's
        # evidence and never makes a false one.
        self._known_marks: dict[tuple[str, int], int] = {}

    def _run(self, name: str, keys: Sequence[str], args: Sequence[Value]) -> Any:
        return self.runner.run(name, keys, args)

    def held_keys(self, queue: str, parent_id: str, entry: str = "pending") -> list[str]:
        """The first eight KEYS of the scripts that settle a whole flow on its slot (retry_flow,
        abandon_flow, deadline, retry_deadline): its row, counter, values, ignored errors and
        cross-slot credits, then its queue's ``entry`` set, failed set and counters."""
        keys = self.keys
        return [
            keys.job_key(queue, parent_id),
            *keys.flow_keys(queue, parent_id),
            keys.settled_key(queue, parent_id),
            keys.queue_key(queue, entry),
            keys.queue_key(queue, "failed"),
            keys.queue_key(queue, "counters"),
        ]

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

    # --- Writing a flow: its enqueue, its chunks, children it grows -----------------------------

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
            *self.keys.job_keys(queue, [cid for cid, _ in children]),
        ]
        argv: list[Value] = [
            parent_id,
            parent_payload,
            str(len(children)),
            packed([value for child in children for value in child]),
            str(recent_ttl_ms),
            str(recent_max),
        ]
        options: dict[str, Any] = {}
        for name, given in (("outer", outer), ("template", template), ("kinds", kinds)):
            if given:
                options[name] = given
        if policy:
            options["policy"] = policy
        if locator_ttl:
            options["locator_ttl"] = locator_ttl
            keys.append(self.keys.locator_key(parent_id))
        if locator_ttl or check:
            options["queue"] = queue
        if register:
            options["register"] = list(register)
        if check:
            options["check"] = self.keys.check_parts()
        if register or check:
            keys.append(self.keys.queues_key())
        if publish:
            keys += publish.lists
            options["broker_db"] = publish.db
            options["messages"] = [value for message in publish.messages for value in message]
        if options:
            argv.append(packed(options))
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
        argv.append(packed_options(template=template or None))
        return int(self._run("open_flow", keys, argv))

    def add_children(
        self,
        queue: str,
        parent: ParentRef,
        children: Sequence[tuple[str, Value, str]],
        kinds: str = "",
        max_active: int = 0,
    ) -> int:
        """Write one chunk of children that live on ``queue``: (id, payload, policy or '').

        ``kinds``: a character per child, ``d`` where its value is a delta against the
        template open_flow kept on the parent's row (on the parent's own slot only), ``p``
        where it is a whole payload (empty: every value is a payload); ``D``, ``P`` the same
        for a child that waits for a slot of the flow's window, ``e``, ``q`` for one that holds
        a slot from the start (``includes/window.lua``)."""
        keys = [
            self.keys.queue_key(queue, "pending"),
            self.keys.window_key(queue, parent.id),
            self.keys.queue_key(queue, "counters"),
            *(self.keys.job_key(queue, cid) for cid, _, _ in children),
        ]
        argv: list[Value] = [
            parent.id,
            parent.queue if parent.queue != queue else "",
            str(len(children)),
        ]
        for cid, payload, policy in children:
            argv += [cid, payload, policy]
        # The window's size, for its waiting children.
        argv.append(
            packed_options(kinds=kinds or None, max_active=str(max_active) if max_active else None)
        )
        return int(self._run("add_children", keys, argv))

    def grow_flow(
        self,
        parent: ParentRef,
        payload_sha: str,
        new_payload: Value,
        local: Sequence[tuple[str, Value, str]],
        remote: Sequence[tuple[str, Value, str]],
        max_active: int = 0,
    ) -> tuple[Status, int]:
        """Add children to a held flow on its parent's slot: write ``local`` (id, payload,
        policy or ''), stage ``remote``, raise the counter. ``(status, counter)``: see
        grow_flow.lua (``stale``: the payload is no longer ``payload_sha``).

        ``max_active``: the flow's window; the first of ``local`` it has room for are written
        pending, the others waiting (:meth:`grow_flow_windowed` says how many started)."""
        status, counter, _ = self.grow_flow_windowed(
            parent, payload_sha, new_payload, local, remote, max_active
        )
        return status, counter

    def grow_flow_windowed(
        self,
        parent: ParentRef,
        payload_sha: str,
        new_payload: Value,
        local: Sequence[tuple[str, Value, str]],
        remote: Sequence[tuple[str, Value, str]],
        max_active: int = 0,
    ) -> tuple[Status, int, int]:
        """:meth:`grow_flow`, and how many of ``local`` (the first ones) are pending."""
        row = self.keys.job_key(parent.queue, parent.id)
        keys = [
            row,
            self.keys.flow_keys(parent.queue, parent.id)[0],
            self.keys.queue_key(parent.queue, "pending"),
            self.keys.adding_key(parent.queue, parent.id),
            self.keys.queue_key(parent.queue, "adding"),
            self.keys.queue_key(parent.queue, "counters"),  # its children waiting in windows
            self.keys.window_key(parent.queue, parent.id),
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
        argv.append(packed_options(max_active=str(max_active) if max_active else None))
        reply = self._run("grow_flow", keys, argv)
        started = int(reply[2]) if len(reply) > 2 else len(local)
        return status_of(reply[0]), int(reply[1]), started

    def grow_done(self, parent: ParentRef, child_ids: Sequence[str]) -> int:
        """Unstage children of other slots whose rows were written; how many stay staged."""
        keys = [
            self.keys.adding_key(parent.queue, parent.id),
            self.keys.queue_key(parent.queue, "adding"),
        ]
        return int(self._run("grow_done", keys, [parent.id, *child_ids]))

    def join_edge(
        self, queue: str, job_id: str, parent: ParentRef, policy: str
    ) -> tuple[str, str, str]:
        """Record ``parent`` as one more parent of the job ``job_id`` (join_edge.lua); returns
        the job's state ('' when its row is gone), its error and its first parent's id."""
        keys = [self.keys.job_key(queue, job_id), self.keys.parents_key(queue, job_id)]
        found, error, first = self._run(
            "join_edge", keys, [job_id, parent.id, parent.queue, policy]
        )
        return text(found), text(error), text(first)

    def seal_flow(self, queue: str, parent_id: str) -> Status:
        keys = [
            self.keys.job_key(queue, parent_id),
            self.keys.flow_keys(queue, parent_id)[0],
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "open"),
            self.keys.queue_key(queue, "counters"),
        ]
        return status_of(self._run("seal_flow", keys, [parent_id])[0])

    # --- A flow's own transitions: claim, complete, fail, credit, retry, dispatch ---------------

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
        batch: str | None = None,
    ) -> tuple[Status, int, str]:
        """``(status, attempts, holder)``: see claim.lua (holder: the live token when busy).

        ``since``: the server time (ms) read just before the job was enqueued (its message's
        ``echomq_t`` header), which spares the claim reading its pending score. ``batch``:
        the batch message that carried this delivery, recorded on the row."""
        keys, argv, claimed = self._claim_call(
            queue, job_id, token, lease_ms, priority, force, retries, since, parent, batch
        )
        return claimed(self._run("claim", keys, argv))

    def claim_riding(
        self,
        queue: str,
        job_id: str,
        token: str,
        lease_ms: int,
        landed: Callable[[tuple[Status, int, str] | None], None],
        *,
        priority: int = 0,
        retries: int = 0,
        since: int | None = None,
        parent: str | None = None,
        batch: str | None = None,
    ) -> None:
        """The same claim as :meth:`claim`, sent after the next outcome this thread records,
        in its round trip (:meth:`ScriptRunner.ride`): ``landed`` hears its reply, or None
        when the round trip failed and it may or may not have landed (the caller claims
        again with the same ``token``, which a claim that landed recognises as its own)."""
        keys, argv, claimed = self._claim_call(
            queue, job_id, token, lease_ms, priority, False, retries, since, parent, batch
        )

        def heard(reply: Any) -> None:
            landed(None if isinstance(reply, Exception) else claimed(reply))

        self.runner.ride(Rider("claim", keys, argv, heard))

    def _claim_call(
        self,
        queue: str,
        job_id: str,
        token: str,
        lease_ms: int,
        priority: int,
        force: bool,
        retries: int,
        since: int | None,
        parent: str | None,
        batch: str | None,
    ) -> tuple[list[str], list[Value], Callable[[Any], tuple[Status, int, str]]]:
        """claim.lua's KEYS and ARGV, and what reads its reply (and keeps the mark it saw)."""
        keys = [
            self.keys.job_key(queue, job_id),
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "active"),
            self.keys.queue_key(queue, "marks"),
            self.keys.queue_key(queue, "counters"),
        ]
        marks = self._known_marks
        known = marks.get((queue, priority), 0)
        argv: list[Value] = [
            job_id,
            token,
            str(lease_ms),
            str(priority),
            "1" if force else "0",
            str(retries),
            packed_options(
                mark=str(known) if known else None,
                since=str(since) if since else None,
                parent=parent,
                batch=batch,
            ),
        ]

        def claimed(reply: Any) -> tuple[Status, int, str]:
            status, attempts, holder, mark = reply
            if mark not in (b"", "", None) and int(mark) > marks.get((queue, priority), 0):
                marks[(queue, priority)] = int(mark)
            return status_of(status), int(attempts), text(holder)

        return keys, argv, claimed

    def take_handed(self, queue: str, job_id: str, token: str, parent: str) -> bool:
        """Whether this delivery took a chain's step that the completion of the step before
        handed out (take_handed.lua): the row was active with no token, and now holds
        ``token``, as a claim would have left it. ``parent``: the one the message names, which
        must be the row's own. False: the row is anything else (taken by another delivery,
        cancelled, requeued, finished, forged, gone); the caller then claims as for any
        delivery."""
        keys = [self.keys.job_key(queue, job_id)]
        (status,) = self._run("take_handed", keys, [job_id, token, parent])
        return status_of(status) is Status.CLAIMED

    def complete(self, *args: Any, **kwargs: Any) -> Status:
        """:meth:`complete_writing` (same arguments), returning the status alone."""
        return self.complete_writing(*args, **kwargs)[0]

    def complete_writing(self, *args: Any, **kwargs: Any) -> tuple[Status, bool]:
        """:meth:`complete_releasing` (same arguments), without the parent to publish."""
        status, written, _, _ = self.complete_settling(*args, **kwargs)
        return status, written

    def complete_releasing(self, *args: Any, **kwargs: Any) -> tuple[Status, bool, Handed | None]:
        """:meth:`complete_settling` without whether the job was joined to more parents."""
        status, written, handed, _ = self.complete_settling(*args, **kwargs)
        return status, written, handed

    def complete_settling(
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
        freed: list[Freed] | None = None,
        hand_ms: int = 0,
    ) -> tuple[Status, bool, Handed | None, bool]:
        """Finish an active job (complete.lua) and credit its parent; returns the status,
        whether it wrote ``result``, the job's result for Celery's Redis backend (see
        wire/results.py): only the job's real active -> done transition writes it, never a stale or
        repeated completion; and, with ``inline_max``, the parent this completion released
        for the caller to publish (what :meth:`dispatch` would hand out), else None; and
        whether the job was joined to more parents (its :parents), which the caller credits.

        ``next_step``: the job is a chain's step but its last; its value goes to that step,
        made pending: the status is then ``advanced`` and the handed payload that step's
        (``(payload, {"since": its pending score})``), for the caller to publish. With
        ``hand_ms``, that step is handed out active under a lease of that many ms, for its
        first delivery to take (:meth:`take_handed`) without a claim.

        A child's completion also makes the next child of its flow's window pending, which
        goes into ``freed`` for the caller to publish (None: left to recovery, a stall
        timeout later)."""
        remote = parent is not None and parent.queue != queue and not next_step
        argv: list[Value] = [
            job_id,
            token,
            str(ttl),
            "1" if is_parent else "0",
            parent.id if parent else "",
            value,
            "1" if remote else "0",
            self._complete_options(result, next_step, hand_ms, parent, inline_max, remote),
        ]
        keys = self._complete_keys(queue, job_id, parent, next_step, result)
        reply = window_freed(self._run("complete", keys, argv), freed)
        return self._completed(reply, parent, inline_max)

    def _complete_keys(
        self,
        queue: str,
        job_id: str,
        parent: ParentRef | None,
        next_step: str,
        result: ResultWrite | None,
    ) -> list[str]:
        """complete.lua's sixteen KEYS: the job's keys, its queue's sets, its parent's keys
        (on this slot), its window, its chain's next step, its result's key; the queue's
        placeholder where this call has no such key."""
        unused = self.keys.unused_key(queue)
        return [
            self.keys.job_key(queue, job_id),
            self.keys.queue_key(queue, "active"),
            *self.keys.flow_keys(queue, job_id),
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "counters"),
            self.keys.queue_key(queue, "outbox"),
            *self._edge_keys(queue, job_id),
            *self._local_parent_keys(queue, parent, "row", "dependencies", "processed"),
            self._window_key(queue, parent),
            self.keys.job_key(queue, next_step) if next_step else unused,
            result.key if result is not None else unused,
        ]

    @staticmethod
    def _complete_options(
        result: ResultWrite | None,
        next_step: str,
        hand_ms: int,
        parent: ParentRef | None,
        inline_max: int,
        remote: bool,
    ) -> bytes:
        """complete.lua's options: the result to write (its meta, expiry and channel), the
        next step of a chain (and its lease), how large a released parent may be handed back
        inline, the flow's quorum and reducer."""
        releases = parent is not None and not remote and not next_step
        return packed_options(
            result=result.meta if result is not None else None,
            expires=str(result.expires) if result is not None and result.expires else None,
            channel=result.channel if result is not None else None,
            inline=str(inline_max) if inline_max and releases else None,
            next=next_step or None,
            lease=str(hand_ms) if next_step and hand_ms else None,
            quorum=parent.quorum or None if parent is not None else None,
            reduce=parent.reduce or None if parent is not None else None,
        )

    def _completed(
        self, reply: list[Any], parent: ParentRef | None, inline_max: int
    ) -> tuple[Status, bool, Handed | None, bool]:
        """complete.lua's reply: its status, whether it wrote the result, what it handed
        out (a chain's next step, or the parent it released), whether the job has more
        parents."""
        flag = text(reply[1]) if len(reply) > 1 else ""
        status, written, shared = status_of(reply[0]), flag.startswith("1"), flag.endswith("+")
        if status is Status.ADVANCED:
            return status, written, (reply[2], {"since": reply[3]}), shared
        if status is Status.UNFOLDABLE:  # what the flow's reducer could not fold, and why
            return status, False, (b"", {"reason": text(reply[2])}), False
        handed = None
        if status is Status.RELEASED and len(reply) > 2 and parent is not None:
            handed = self._handed(parent, reply[2:], inline_max)
        return status, written, handed, shared

    def fail(self, *args: Any, **kwargs: Any) -> tuple[Status, str]:
        """:meth:`fail_settling` without whether the job was joined to more parents."""
        status, policy, _ = self.fail_settling(*args, **kwargs)
        return status, policy

    def fail_settling(
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
        freed: list[Freed] | None = None,
        unstarted: bool = False,
    ) -> tuple[Status, str, bool]:
        """Fail a job and apply its failure to its parent under the child's policy.

        ``token`` '' accepts any delivery (revoke, recovery, a hard time limit); with
        ``unstarted``, only a job that has not started (pending: else ``stale``). ``carry``: the
        job is a nested flow's parent, failed already by one of its own children; carry that
        failure, once, to the flow it is a child of (``token`` is not read). A child that was
        out frees its slot of its flow's window: the next child, made pending, goes into
        ``freed`` (see :meth:`complete_settling`). Also returns whether the job was joined to
        more parents (on_exists="join"), which the caller settles it for.
        """
        remote = parent is not None and parent.queue != queue
        keys = [
            self.keys.job_key(queue, job_id),
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "active"),
            self.keys.queue_key(queue, "failed"),
            *self.keys.flow_keys(queue, job_id),
            self.keys.queue_key(queue, "counters"),
            self.keys.queue_key(queue, "outbox"),
            *self._edge_keys(queue, job_id),
            *self._local_parent_keys(queue, parent, "row", "dependencies", "processed", "ignored"),
            self._window_key(queue, parent),
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
            # Released by a quorum of its children: credited here only on the parent's slot.
            packed_options(
                quorum=parent.quorum or None if parent is not None and not remote else None,
                unstarted="1" if unstarted else None,
            ),
        ]
        reply = window_freed(self._run("fail", keys, argv), freed)
        return status_of(reply[0]), text(reply[1]), len(reply) > 2

    def _edge_keys(self, queue: str, job_id: str) -> list[str]:
        """The queue's index of joined jobs to credit and the job's :parents: where a job
        joined to more parents (on_exists="join") is staged as it finishes."""
        return [self.keys.queue_key(queue, "joined"), self.keys.parents_key(queue, job_id)]

    def _local_parent_keys(self, queue: str, parent: ParentRef | None, *names: str) -> list[str]:
        """``parent``'s keys of ``names`` when it lives on ``queue``'s slot; else as many of the
        queue's placeholder (no parent, or one on another slot: its keys cannot be passed)."""
        if parent is None or parent.queue != queue:
            return [self.keys.unused_key(queue)] * len(names)
        return self._parent_keys(parent, *names)

    def _window_key(self, queue: str, parent: ParentRef | None) -> str:
        """The window of ``parent``'s children on ``queue``'s slot (the queue's placeholder when
        there is no parent): where a finishing child's flow keeps its waiting children. Passed
        for every child; the script looks only where the child's row says it holds a slot
        (``windowed``), so a flow without a window costs no command for it."""
        if parent is None:
            return self.keys.unused_key(queue)
        return self.keys.window_key(queue, parent.id)

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
        argv = [parent.id, child_id, outcome, data, policy, str(ttl)]
        argv.append(packed_options(quorum=parent.quorum or None))  # released by a quorum of them
        status, applied = self._run("credit", keys, argv)
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
        if text(reply[1]) == "scan" and parent.reduce:
            values: dict[str, Any] = {}  # its parent gets the accumulator, not the values
        elif text(reply[1]) == "scan":
            _, processed, _ = self.keys.flow_keys(parent.queue, parent.id)
            values = {text(k): v for k, v in self.client.hscan_iter(processed, count=inline_max)}
        else:
            values = {text(reply[i]): reply[i + 1] for i in range(2, len(reply), 2)}
        return reply[0], values

    # --- Operators and recovery: cancel, retry, release, requeue, leases, hand-over, abandon -----

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
        parent_queue: str,
    ) -> list[str]:
        """Cancel ``parent_id``'s outstanding children on ``queue``'s slot (``started``: the
        running ones too): the ids cancelled (cancel_elsewhere.lua). Each child cancelled is
        counted as cut on its parent (on ``parent_queue``'s slot): in the same script where
        the parent shares the slot, else by :meth:`credit_cut` after it, given every child
        the slot's rows show cancelled (so a repeat makes a count a crash left undone)."""
        here = queue == parent_queue
        keys = [
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "active"),
            self.keys.queue_key(queue, "counters"),
            self.keys.job_key(queue, parent_id) if here else self.keys.unused_key(queue),
            *(self.keys.job_key(queue, cid) for cid in child_ids),
        ]
        argv = [parent_id, str(ttl), "1" if started else "0", *child_ids]
        reply = [text(item) for item in self._run("cancel_elsewhere", keys, argv)]
        n = int(reply[0])
        if n and not here:
            self.credit_cut(parent_queue, parent_id, reply[1 : 1 + n])
        return reply[1 + n :]

    def credit_cut(self, queue: str, parent_id: str, child_ids: Sequence[str]) -> int:
        """Count children cut on another slot as cut on their parent's (on ``queue``), once
        per child id: how many were counted now (credit_cut.lua)."""
        keys = [
            self.keys.job_key(queue, parent_id),
            self.keys.settled_key(queue, parent_id),
            self.keys.queue_key(queue, "counters"),
        ]
        reply = self._run("credit_cut", keys, [parent_id, *child_ids])
        return int(reply[1])

    def forget(
        self,
        queue: str,
        job_ids: Sequence[str],
        flows: Sequence[str] = (),
        *,
        keep_cancelled_ms: int = 0,
    ) -> tuple[list[str], list[str]]:
        """Delete the rows of ``job_ids`` on ``queue``, and the own keys of the flows
        ``flows`` heads there, taking the ids out of the queue's sets and counts
        (forget.lua). With ``keep_cancelled_ms``, a cancelled child's row is cut down to what
        turns its queued message away instead. Returns (the names deleted, the ids kept)."""
        keys = self.keys
        names = [
            keys.queue_key(queue, "counters"),
            *keys.job_set_keys(queue),
            *(keys.job_key(queue, job_id) for job_id in job_ids),
            *(name for parent_id in flows for name in keys.flow_own_keys(queue, parent_id)),
        ]
        args = [str(len(job_ids)), *job_ids, str(keep_cancelled_ms)]
        deleted, kept = self._run("forget", names, args)
        return [text(name) for name in deleted], [text(job_id) for job_id in kept]

    def cancel_shared(self, queue: str, job_id: str, edges: int, *, ttl: int) -> Status:
        """Cancel a job shared by several flows that none of them waits for any more, unless
        it gained a parent since its ``edges`` were read (cancel_shared.lua)."""
        keys = [
            self.keys.job_key(queue, job_id),
            self.keys.parents_key(queue, job_id),
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "active"),
            self.keys.queue_key(queue, "counters"),
        ]
        return status_of(self._run("cancel_shared", keys, [job_id, str(ttl), str(edges)])[0])

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

    def unhand(self, queue: str, job_id: str) -> Status:
        """A handed-out chain step no delivery took before its lease lapsed, back to pending
        (``pending``), or ``fresh`` / ``noop``: see unhand.lua."""
        keys = [
            self.keys.job_key(queue, job_id),
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "active"),
        ]
        return status_of(self._run("unhand", keys, [job_id])[0])

    def extend(
        self,
        queue: str,
        running: Sequence[str],
        lease_ms: int,
        held: Sequence[str] = (),
        released: Sequence[str] = (),
    ) -> int:
        """Renew this worker's leases on ``queue``: the deadlines of the ``running`` jobs (still
        active, and not handed over to a replacement) and the holds on the ``held`` ones
        (received, not started), to now + lease; end the holds on the ``released`` ones (held
        before, started or gone since)."""
        if not running and not held and not released:
            return 0
        keys = [
            self.keys.queue_key(queue, "active"),
            self.keys.queue_key(queue, "reserved"),
            *(self.keys.job_key(queue, job_id) for job_id in running),
        ]
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

    def lease_release(self, name: str, token: str, queue: str | None = None) -> bool:
        """Give up the lease ``name`` (``queue``'s, if given) if ``token`` still holds it."""
        return bool(self._run("lease_release", [self.keys.lease_key(name, queue)], [token]))

    def abandon_flow(
        self, queue: str, parent_id: str, stall_ms: int, error: str, *, ttl: int
    ) -> Status:
        """Fail an open flow (chunked path) whose producer stopped before writing every child."""
        keys = self.held_keys(queue, parent_id, entry="open")
        return status_of(
            self._run("abandon_flow", keys, [parent_id, str(stall_ms), str(ttl), error])[0]
        )
