"""Loads ``lua/*.lua`` (one file per transition) and wraps each in a typed call.

Every wrapper builds its KEYS through the :class:`~celery_echomq.keyspace.Keyspace` gate and
maps the scripts' server errors to Python errors (``EMQKIND`` -> :class:`KindError`).
``register_script`` runs EVALSHA and falls back to EVAL on NOSCRIPT.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from importlib import resources
from typing import Any

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10

    class StrEnum(str, Enum):
        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return str(self.value).__format__(spec)


import redis
from redis.commands.core import Script

from . import store
from .errors import FlowExistsError, KindError, StoreConnectionError
from .keyspace import Keyspace

Value = bytes | str


class Status(StrEnum):
    """Every status a script replies with (each script's header says which it can give).

    A member is a ``str``, so a reply compares equal to its text; code compares against the
    members, never against bare strings.
    """

    # a job's states, also the reply of a transition that found the job in another state
    PENDING = "pending"
    ACTIVE = "active"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    AWAITING_CHILDREN = "awaiting_children"
    MISSING = "missing"  # no row
    # claim
    CLAIMED = "claimed"
    TAKEN_OVER = "taken_over"
    BUSY = "busy"
    HELD = "held"  # also requeue: a live worker holds the job it received
    # complete, fail, credit, seal_flow: the fan-in
    RELEASED = "released"
    CREDITED = "credited"
    STAGED = "staged"
    PARENT_FAILED = "parent_failed"
    DUPLICATE = "duplicate"
    FINISHED = "finished"
    SEALED = "sealed"
    # any transition that checks the caller's token
    STALE = "stale"
    NOOP = "noop"
    # retry, requeue, drop, hand_over, abandon_flow
    RETRIED = "retried"
    REQUEUED = "requeued"
    FRESH = "fresh"
    LAPSED = "lapsed"
    HANDED_OVER = "handed_over"
    ABANDONED = "abandoned"


# What a claim means for the delivery that made it.
STARTED = frozenset({Status.CLAIMED, Status.TAKEN_OVER})
DUPLICATE_DELIVERY = frozenset(
    {Status.BUSY, Status.DONE, Status.FAILED, Status.CANCELLED, Status.HELD}
)
# What settling a finished job can answer when it changed nothing for the parent.
UNSETTLED = frozenset({Status.STALE, Status.FINISHED, Status.FAILED, Status.DUPLICATE})
TRANSITIONS = (
    "enqueue_flow",
    "claim",
    "complete",
    "fail",
    "retry",
    "dispatch",
    "cancel",
    # the chunked / cross-slot path: open, add per queue and chunk, seal; credit on the parent
    "open_flow",
    "add_children",
    "seal_flow",
    "credit",
    # recovery.py's: take back a lost job, renew a live worker's leases, end a dead holder's
    # lease, watch a job replaced by another task, give up the recovery lease
    "requeue",
    "extend",
    "drop",
    "hand_over",
    "lease_release",
    "abandon_flow",
)


INCLUDE = re.compile(r'^--- @include "([a-z_]+)"$', re.MULTILINE)


def _read_lua(*parts: str) -> str:
    return resources.files(__package__).joinpath("lua", *parts).read_text("utf-8")


def load_source(name: str) -> str:
    """The source of ``lua/<name>.lua`` with its includes expanded.

    A line ``--- @include "piece"`` is replaced by ``lua/includes/piece.lua`` (itself expanded
    the same way), at most once per script: a piece included twice, directly or through
    another piece, is written only where it first appears, so each Lua local is defined once.
    """
    seen: set[str] = set()

    def expand(source: str) -> str:
        def piece(match: re.Match[str]) -> str:
            included = match.group(1)
            if included in seen:
                return f"-- ({included} is included above)"
            seen.add(included)
            return expand(_read_lua("includes", f"{included}.lua")).rstrip("\n")

        return INCLUDE.sub(piece, source)

    return expand(_read_lua(f"{name}.lua"))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _status(value: Any) -> Status:
    return Status(_text(value))


def server_error(exc: redis.ResponseError) -> Exception:
    """The Python error for a script's error reply (others come back unchanged)."""
    message = str(exc)
    if message.startswith("EMQKIND"):
        return KindError(message)
    if message.startswith("EMQEXISTS"):
        job_id = message.split(" ", 1)[1] if " " in message else "?"
        return FlowExistsError(
            f"job id {job_id!r} already exists in Redis; a flow never overwrites a job "
            "(nothing was written or published)"
        )
    return exc


@dataclass(frozen=True)
class ParentRef:
    """Where a job's parent lives: its id and the queue whose slot holds its keys."""

    id: str
    queue: str


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
    ) -> None:
        """``retry_timeout``: how long a transition waits for an unreachable store (the
        client's own retry, see store.py) before :class:`StoreUnavailableError`.
        ``min_replicas``: WAIT for that many replicas after each transition that must survive
        a failover, up to ``min_replicas_timeout`` seconds, else :class:`ReplicationError`.
        """
        self.keys = keyspace
        self.client = client
        self.retry_timeout = retry_timeout
        self.min_replicas = min_replicas
        self.min_replicas_timeout = min_replicas_timeout
        # Renewing a lease and giving one up need not survive a failover: a lost renewal is
        # a false stall alarm (a body run twice, never a double count), a lost release a
        # recovery pass that waits for the lease to expire. Every other script waits.
        self.unreplicated = frozenset({"extend", "lease_release"})
        self._scripts: dict[str, Script] = {
            name: client.register_script(load_source(name)) for name in TRANSITIONS
        }

    def _run(self, name: str, keys: Sequence[str], args: Sequence[Value]) -> Any:
        # A transition may be sent twice: the client resends it after a connection error or a
        # READONLY reply (a failover), when the first attempt may have been applied and only
        # its reply lost. That is safe only because every script is idempotent under its own
        # checks: it writes nothing unless the job is in the state it moves from and, for a
        # running job, holds the caller's token (credit: once per child id; enqueue_flow and
        # open_flow: no row of the flow exists yet). A second run of a transition that landed
        # changes nothing and says so ("stale", no payload from dispatch, ...): its caller
        # does nothing more, and what the first run would have had it do (publish a released
        # parent) is left to recovery, as after a crash.
        retries = store.retries_here()
        script = self._scripts[name]
        try:
            if self.min_replicas and name not in self.unreplicated:
                return store.run_replicated(
                    self.client,
                    script,
                    keys,
                    args,
                    replicas=self.min_replicas,
                    wait_timeout=self.min_replicas_timeout,
                    retry_timeout=self.retry_timeout,
                    name=name,
                )
            return store.run_script(self.client, script, keys, args, self.retry_timeout)
        except store.CLUSTER_RETRYABLE as exc:
            raise StoreConnectionError(
                f"the flow store is unavailable: {name} failed, retried for up to "
                f"echomq_store_retry_timeout={self.retry_timeout:g} s "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        except redis.ResponseError as exc:
            raised = server_error(exc)
            if (
                isinstance(raised, FlowExistsError)
                and name in ("enqueue_flow", "open_flow")
                and store.retries_here() != retries
                and str(exc) == f"EMQEXISTS {_text(args[0])}"
            ):
                # Refused by our own first attempt, whose reply was lost: the parent row
                # holds exactly the payload this call sent (a payload carries every job id
                # of its flow, so no other flow's parent has it).
                landed = self.client.hget(keys[0], "payload")
                sent = args[1].encode() if isinstance(args[1], str) else args[1]
                if landed == sent:
                    if self.min_replicas:
                        store.confirm_replicated(
                            self.client,
                            keys[0],
                            "payload",
                            sent,
                            replicas=self.min_replicas,
                            wait_timeout=self.min_replicas_timeout,
                        )
                    count = int(_text(args[2]))
                    return count if name == "enqueue_flow" else count + 1
            if raised is exc:
                raise
            raise raised from None

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
        }
        return [known[name] for name in names]

    def enqueue_flow(
        self,
        queue: str,
        parent_id: str,
        parent_payload: Value,
        children: Sequence[tuple[str, Value]],
        outer: str = "",
    ) -> int:
        parent_key = self.keys.job_key(queue, parent_id)
        keys = [
            parent_key,
            f"{parent_key}:dependencies",
            self.keys.queue_key(queue, "pending"),
            *(self.keys.job_key(queue, cid) for cid, _ in children),
        ]
        argv: list[Value] = [parent_id, parent_payload, str(len(children))]
        for cid, payload in children:
            argv += [cid, payload]
        if outer:
            argv.append(outer)
        return int(self._run("enqueue_flow", keys, argv))

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
    ) -> tuple[Status, int, str]:
        """``(status, attempts, holder)``: see claim.lua (holder: the live token when busy)."""
        keys = [
            self.keys.job_key(queue, job_id),
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "active"),
            self.keys.queue_key(queue, "marks"),
            self.keys.queue_key(queue, "reserved"),
            self.keys.queue_key(queue, "counters"),
        ]
        argv = [job_id, token, str(lease_ms), str(priority), "1" if force else "0", str(retries)]
        status, attempts, holder = self._run("claim", keys, argv)
        return _status(status), int(attempts), _text(holder)

    def complete(
        self,
        queue: str,
        job_id: str,
        token: str,
        *,
        ttl: int,
        is_parent: bool,
        parent: ParentRef | None,
        value: Value,
    ) -> Status:
        remote = parent is not None and parent.queue != queue
        keys = [
            self.keys.job_key(queue, job_id),
            self.keys.queue_key(queue, "active"),
            *self.keys.flow_keys(queue, job_id),
            *(
                [self.keys.queue_key(queue, "outbox")]
                if remote
                else self._parent_keys(parent, "row", "dependencies", "processed", "pending")
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
        return _status(self._run("complete", keys, argv)[0])

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
                    parent, "row", "dependencies", "processed", "ignored", "pending", "failed"
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
        return _status(status), _text(policy)

    def open_flow(
        self, queue: str, parent_id: str, payload: Value, n: int, policy: str, outer: str = ""
    ) -> int:
        row = self.keys.job_key(queue, parent_id)
        keys = [
            row,
            self.keys.flow_keys(queue, parent_id)[0],
            self.keys.queue_key(queue, "open"),
            self.keys.queue_key(queue, "pending"),
        ]
        return int(self._run("open_flow", keys, [parent_id, payload, str(n), policy, outer]))

    def add_children(
        self,
        queue: str,
        parent: ParentRef,
        children: Sequence[tuple[str, Value, str]],
    ) -> int:
        """Write one chunk of children that live on ``queue``: (id, payload, policy or '')."""
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
        return int(self._run("add_children", keys, argv))

    def seal_flow(self, queue: str, parent_id: str) -> Status:
        keys = [
            self.keys.job_key(queue, parent_id),
            self.keys.flow_keys(queue, parent_id)[0],
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "open"),
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
        ]
        status, applied = self._run(
            "credit", keys, [parent.id, child_id, outcome, data, policy, str(ttl)]
        )
        return _status(status), _text(applied)

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
        reply = self._run(
            "dispatch", [row, processed], [parent_id, str(redispatch_after_ms), str(inline_max)]
        )
        if not reply:
            return None
        if _text(reply[1]) == "scan":
            values = {_text(k): v for k, v in self.client.hscan_iter(processed, count=inline_max)}
        else:
            values = {_text(reply[i]): reply[i + 1] for i in range(2, len(reply), 2)}
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
            *(self.keys.job_key(queue, cid) for cid in child_ids),
        ]
        reply = self._run("cancel", keys, [parent_id, str(ttl), *child_ids])
        if len(reply) < 2:
            return _status(reply[0]), _status(reply[0]), []
        return _status(reply[0]), _status(reply[1]), [_text(cid) for cid in reply[2:]]

    def requeue(
        self, queue: str, job_id: str, stall_ms: int, seen_state: str, token: str = ""
    ) -> tuple[Status, bytes | None]:
        """Take back a lost job: ``("requeued", payload)`` to re-publish, or ``(status, None)``
        when it is not (or no longer) stalled in ``seen_state``."""
        keys = [
            self.keys.job_key(queue, job_id),
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "active"),
            self.keys.queue_key(queue, "reserved"),
            self.keys.queue_key(queue, "counters"),
        ]
        reply = self._run("requeue", keys, [job_id, str(stall_ms), seen_state, token])
        status = _status(reply[0])
        return (status, reply[1]) if status is Status.REQUEUED else (status, None)

    def extend(
        self, queue: str, running: Sequence[str], lease_ms: int, held: Sequence[str] = ()
    ) -> int:
        """Renew this worker's leases on ``queue``: the deadlines of the ``running`` jobs (still
        active) and the holds on the ``held`` ones (received, not started), to now + lease."""
        if not running and not held:
            return 0
        keys = [self.keys.queue_key(queue, "active"), self.keys.queue_key(queue, "reserved")]
        argv = [str(lease_ms), str(len(running)), *running, *held]
        return int(self._run("extend", keys, argv))

    def drop(self, queue: str, job_id: str, holder_prefix: str) -> tuple[Status, bytes | None]:
        """End the lease of a holder known dead: ``("lapsed", None)``, ``("requeued", payload)``
        (the host re-publishes it) or ``("noop", None)``."""
        keys = [
            self.keys.job_key(queue, job_id),
            self.keys.queue_key(queue, "active"),
            self.keys.queue_key(queue, "pending"),
            self.keys.queue_key(queue, "counters"),
        ]
        reply = self._run("drop", keys, [job_id, holder_prefix])
        status = _status(reply[0])
        return (status, reply[1]) if status is Status.REQUEUED else (status, None)

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
        ]
        return _status(
            self._run("abandon_flow", keys, [parent_id, str(stall_ms), str(ttl), error])[0]
        )
