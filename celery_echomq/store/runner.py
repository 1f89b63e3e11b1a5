"""Running one transition script on the store, through a failover.

:class:`ScriptRunner`, the part of :class:`~celery_echomq.store.scripts.Scripts` that runs a
script, registers every ``lua/<name>.lua`` (redis-py's ``register_script``:
EVALSHA, SCRIPT LOAD on NOSCRIPT) and runs it with the store client's retry: a script is resent
after a connection error or a ``READONLY`` reply (a primary demoted under us), a ``WAIT`` follows a
transition that must survive a failover (``echomq_min_replicas``), and a refusal caused by our
own first attempt, whose reply was lost, is recognised as the success it was.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    ReadOnlyError,
    TryAgainError,
)

from celery_echomq.errors import FlowExistsError, ReplicationError, StoreConnectionError
from celery_echomq.store import connection as store
from celery_echomq.store.connection import CLUSTER_RETRYABLE, call_until, text
from celery_echomq.store.loader import TRANSITIONS, load_source
from celery_echomq.store.refusals import refusal_of, refused
from celery_echomq.store.replies import server_error

Value = bytes | str

logger = logging.getLogger("celery_echomq.store")


def _demoted(client: Any, exc: Exception) -> Exception:
    """``exc``, or a ``ReadOnlyError`` when it is a script's write refused by a replica.

    Redis wraps a script's READONLY in a generic script error, which neither redis-py's retry
    nor its Sentinel connection (which re-asks the Sentinels on READONLY) recognise: the
    client is connected to a primary that was demoted. Its connections are closed so the next
    attempt connects again, through Sentinel to the current primary.
    """
    if isinstance(exc, redis.ResponseError) and "READONLY You can't write" in str(exc):
        with contextlib.suppress(Exception):
            client.connection_pool.disconnect(inuse_connections=False)
        return ReadOnlyError(str(exc))
    return exc


def run_script(
    client: Any, script: Script, keys: Sequence[str], args: Sequence[Any], retry_timeout: float
) -> Any:
    """Run ``script``; retried as any command is (see the module's docstring), and also when
    a demoted primary refused its writes."""

    def attempt() -> Any:
        try:
            return script(keys=list(keys), args=list(args))
        except redis.ResponseError as exc:
            raised = _demoted(client, exc)
            if raised is exc:
                raise
            raise raised from exc

    return call_until(retry_timeout, attempt, CLUSTER_RETRYABLE)


# A pipelined EVALSHA meets these as replies, not exceptions: the script did not run (not
# loaded on a new primary; a demoted primary; a slot that moved to a promoted replica), so
# running it again is safe.
_RERUN_REPLIES: tuple[type[Exception], ...] = (
    NoScriptError,
    ReadOnlyError,
    MovedError,
    AskError,
    ClusterDownError,
    TryAgainError,
)


def run_replicated(
    client: Any,
    script: Script,
    keys: Sequence[str],
    args: Sequence[Any],
    *,
    replicas: int,
    wait_timeout: float,
    retry_timeout: float,
    name: str,
) -> Any:
    """Run ``script``, then ``WAIT replicas`` on the same connection, in one round trip.

    WAIT counts the replicas that acknowledged every write this connection made so far, so
    it must follow the script on its connection: a pipeline gives both one connection (on a
    Redis Cluster, the connection to the master that owns ``keys[0]``). The script's reply is
    returned once ``replicas`` replicas have it; fewer within ``wait_timeout`` raises
    :class:`ReplicationError` (the write stays on the primary: it is not taken back).
    """
    wait_ms = max(1, round(wait_timeout * 1000))
    cluster = isinstance(client, RedisCluster)

    def attempt() -> Any:
        target = client.get_node_from_key(keys[0]).redis_connection if cluster else client
        pipe = target.pipeline(transaction=False)
        script(keys=list(keys), args=list(args), client=pipe)
        pipe.execute_command("WAIT", replicas, wait_ms)
        reply, acked = pipe.execute(raise_on_error=False)
        if isinstance(reply, Exception):
            raise _demoted(target, reply)
        if isinstance(acked, Exception):
            raise acked
        if int(acked) < replicas:
            raise ReplicationError(
                f"{name}: {int(acked)} of echomq_min_replicas={replicas} replicas acknowledged "
                f"it within echomq_min_replicas_timeout={wait_timeout:g} s; it is applied on "
                "the primary but may not survive a failover",
                acked=int(acked),
                wanted=replicas,
                reply=reply,
            )
        return reply

    def refresh(exc: Exception) -> None:
        if cluster:
            # The slot map is stale after a failover: ask the live nodes who owns what now.
            with contextlib.suppress(Exception):
                client.nodes_manager.initialize()

    return call_until(
        retry_timeout, attempt, (*CLUSTER_RETRYABLE, *_RERUN_REPLIES), on_failure=refresh
    )


def confirm_replicated(
    client: Any, key: str, field: str, value: Any, *, replicas: int, wait_timeout: float
) -> None:
    """Make sure ``replicas`` replicas have ``key``'s ``field`` = ``value``, already written
    (by an attempt whose reply was lost): write it again, unchanged, and WAIT for that write.

    A write that the replicas acknowledged comes after every earlier write in the
    replication stream, so they have the first one too.
    """
    wait_ms = max(1, round(wait_timeout * 1000))
    if isinstance(client, RedisCluster):
        client = client.get_node_from_key(key).redis_connection  # type: ignore[no-untyped-call]
    pipe = client.pipeline(transaction=False)
    pipe.hset(key, field, value)
    pipe.execute_command("WAIT", replicas, wait_ms)
    _, acked = pipe.execute()
    if int(acked) < replicas:
        raise ReplicationError(
            f"{int(acked)} of echomq_min_replicas={replicas} replicas acknowledged {key} "
            f"within echomq_min_replicas_timeout={wait_timeout:g} s",
            acked=int(acked),
            wanted=replicas,
        )


@dataclass(frozen=True)
class Rider:
    """A script sent in the round trip of the next outcome its thread records (see
    :meth:`ScriptRunner.ride`): ``landed`` hears its reply, or the error that left its
    outcome unknown."""

    name: str
    keys: list[str]
    args: list[Value]
    landed: Callable[[Any], None]


def _queue_of(keys: Sequence[str]) -> str:
    """The queue whose slot a script's first key is on (``emq:{queue}:...``), else ""."""
    first = text(keys[0]) if keys else ""
    start, end = first.find("{"), first.find("}")
    own = 0 <= start < end and first[:start].count(":") == 1
    return first[start + 1 : end] if own else ""


class ScriptRunner:
    """Runs the transition scripts on one Redis client: EVALSHA (SCRIPT LOAD on NOSCRIPT), resent
    through a failover, WAIT for replicas where a transition must survive one."""

    def __init__(
        self,
        client: redis.Redis,
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
        ``store``: the store's URL without a password, which a refusal names.
        """
        self.client = client
        self.store = store
        self.retry_timeout = retry_timeout
        self.min_replicas = min_replicas
        self.min_replicas_timeout = min_replicas_timeout
        # Renewing a lease and giving one up need not survive a failover: a lost renewal is
        # a false stall alarm (a body run twice, never a double count), a lost release a
        # recovery pass that waits for the lease to expire. Every other script waits.
        self.unreplicated = frozenset({"extend", "lease_release"})
        # A transition whose reply hands its caller a released parent to publish: the parent
        # row is marked handed out on the primary, so a reply dropped for a replica's late
        # acknowledgement (a new primary whose replica is still syncing) would leave it
        # marked and never published. Its reply is followed, and the shortfall logged: if a
        # failover does lose the write, the new primary has the parent still held, and the
        # message the caller published is a duplicate that its claim turns away.
        self.hands_out = frozenset({"complete", "dispatch", "credit"})
        self.registered: dict[str, Script] = {
            name: client.register_script(load_source(name)) for name in TRANSITIONS
        }
        # The scripts that record a running job's outcome, which a rider may follow: what a
        # batch's child did, then the claim of the child after it (worker/batches.py).
        self.carries_riders = frozenset({"complete", "fail", "retry", "hand_over"})
        # One rider per thread: a thread pool's batches run side by side.
        self._riders = threading.local()
        # Where a pipeline of two scripts is one round trip to one server: not a Cluster
        # (their keys' slots could differ), nor a store that must WAIT for its replicas.
        self._rides = not isinstance(client, RedisCluster) and not min_replicas

    def ride(self, rider: Rider) -> None:
        """Send ``rider`` after the next outcome script this thread runs, in its round trip,
        so that it sees what that outcome wrote, or after the reads of the next
        :meth:`read_carrying`. A rider that finds no such script (this
        store is a Cluster, or one that WAITs for replicas: it is never sent) stays until
        :meth:`unride` takes it back."""
        if self._rides:
            self._riders.waiting = rider

    def unride(self) -> Rider | None:
        """The rider this thread left waiting, not sent (None: sent, or none)."""
        rider: Rider | None = getattr(self._riders, "waiting", None)
        self._riders.waiting = None
        return rider

    def read_carrying(self, pipe: Any) -> list[Any]:
        """The replies of ``pipe``, a pipeline of reads, run with this thread's waiting rider
        after them in their round trip (none waiting: the reads alone). The rider hears its
        reply, or the error that left it unknown; an error of a read is raised, as the
        pipeline alone would raise it."""
        rider = self.unride()
        if rider is None:
            return list(pipe.execute())
        self._add_rider(pipe, rider)
        try:
            replies = list(pipe.execute(raise_on_error=False))
        except Exception as exc:
            rider.landed(exc)
            raise
        rider.landed(replies.pop())
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    def run(self, name: str, keys: Sequence[str], args: Sequence[Value]) -> Any:
        """Run the script ``name`` with ``keys`` and ``args``: its reply, or the error its
        error reply names (store/replies.py)."""
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
        script = self.registered[name]
        try:
            if self.min_replicas and name not in self.unreplicated:
                return run_replicated(
                    self.client,
                    script,
                    keys,
                    args,
                    replicas=self.min_replicas,
                    wait_timeout=self.min_replicas_timeout,
                    retry_timeout=self.retry_timeout,
                    name=name,
                )
            if name in self.carries_riders and (rider := self.unride()) is not None:
                return self._carrying(script, keys, args, rider)
            return run_script(self.client, script, keys, args, self.retry_timeout)
        except ReplicationError as exc:
            if name not in self.hands_out:
                raise
            logger.warning("echomq: %s; its reply is followed", exc)
            return exc.reply
        except store.CLUSTER_RETRYABLE as exc:
            refusal = refusal_of(exc)
            if refusal is not None:  # READONLY past the retry: no failover promoted a primary
                raise refused(refusal, self.store, f"{name} wrote nothing", exc) from exc
            seconds, setting = store.bound_of(self.retry_timeout)
            raise StoreConnectionError(
                f"the flow store is unavailable: {name} failed, retried for up to "
                f"{setting}={seconds:g} s "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        except redis.ResponseError as exc:
            refusal = refusal_of(exc)
            if refusal is not None:
                # Refused at its first write (OOM, MISCONF, NOREPLICAS): it wrote nothing. Not
                # retried here: a producer is told at once, a claim defers its body, and a
                # worker's outcome is retried by its caller while it holds the job's lease
                # (worker/settle.py), with backoff that adds no load to a full server.
                raise refused(refusal, self.store, f"{name} wrote nothing", exc) from exc
            raised = server_error(exc, _queue_of(keys))
            if (
                isinstance(raised, FlowExistsError)
                and name in ("enqueue_flow", "open_flow")
                and store.retries_here() != retries
                and str(exc) == f"EMQEXISTS {text(args[0])}"
            ):
                # Refused by our own first attempt, whose reply was lost: the parent row
                # holds exactly the payload this call sent (a payload carries every job id
                # of its flow, so no other flow's parent has it).
                landed = self.client.hget(keys[0], "payload")
                sent = args[1].encode() if isinstance(args[1], str) else args[1]
                if landed == sent:
                    if self.min_replicas:
                        confirm_replicated(
                            self.client,
                            keys[0],
                            "payload",
                            sent,
                            replicas=self.min_replicas,
                            wait_timeout=self.min_replicas_timeout,
                        )
                    # enqueue_flow's reply also has the time it read: not known here.
                    count = int(text(args[2]))
                    return [count, b""] if name == "enqueue_flow" else count + 1
            if raised is exc:
                raise
            raise raised from None

    def _add_rider(self, pipe: Any, rider: Rider) -> None:
        """``rider``'s script last in ``pipe`` (raw EVALSHA: redis-py's script pipeline would
        first send a SCRIPT EXISTS of its own)."""
        ridden = self.registered[rider.name]
        pipe.evalsha(ridden.sha, len(rider.keys), *rider.keys, *rider.args)

    def _carrying(
        self, script: Script, keys: Sequence[str], args: Sequence[Value], rider: Rider
    ) -> Any:
        """``script``, then ``rider``, in one round trip (raw EVALSHA: redis-py's script
        pipeline would first send a SCRIPT EXISTS of its own). What the pipeline could not
        answer for ``script`` is asked again as any script is, with the client's retry (a
        first attempt that landed is recognised as after a lost reply); the rider then hears
        the error, and its caller sends it again on its own."""
        pipe = self.client.pipeline(transaction=False)
        pipe.evalsha(script.sha, len(keys), *keys, *args)
        self._add_rider(pipe, rider)
        try:
            reply, carried = pipe.execute(raise_on_error=False)
        except Exception as exc:
            rider.landed(exc)
            return run_script(self.client, script, keys, args, self.retry_timeout)
        rider.landed(carried)
        if isinstance(reply, NoScriptError | ReadOnlyError):
            # Not loaded on this server (a restart, a failover), or a demoted primary: run
            # as any script is, which loads it or waits for the new primary.
            return run_script(self.client, script, keys, args, self.retry_timeout)
        if isinstance(reply, Exception):
            raise _demoted(self.client, reply)
        return reply
