"""Connecting to the flow store, and riding through a failover.

``make_client`` turns the settings into a redis-py client: ``redis://``, ``rediss://`` and
``redis+socket://`` URLs as they are, ``redis+cluster://`` (one or more seed nodes, joined with
``,``) as a ``RedisCluster``, and Celery's
``sentinel://`` form through ``redis.sentinel.Sentinel(...).master_for(...)``.

Every client retries a command that meets a connection error, a timeout, a ``READONLY`` reply
(a primary demoted under us) or a loading dataset (a primary restarted), with capped
exponential backoff and jitter, until ``echomq_store_retry_timeout`` has passed since the
command started: a Sentinel or Cluster failover takes seconds, and a worker's transition or a
producer's enqueue waits for it instead of failing. Resending a command whose first attempt
may have been applied is safe because every command celery-echomq sends is idempotent: the
transition scripts check the job's state and token before they write (see scripts.py), and the
plain commands are SET, HSET, SADD, ZREM or DEL of fixed values (a statistics counter may
count one event twice).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, overload

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    ClusterDownError,
    MasterDownError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.retry import Retry

from celery_echomq.config import (
    Settings,
    missing_url_error,
    parse_cluster_url,
    parse_sentinel_url,
    safe_url,
)
from celery_echomq.errors import ConfigError
from celery_echomq.store.server_versions import too_old

logger = logging.getLogger("celery_echomq.store")
# A worker's logging shows the retry notice; where nothing is configured (a CLI command), it is
# not printed to stderr ahead of the command's own one-line error.
logger.addHandler(logging.NullHandler())

T = TypeVar("T")

# What a failover looks like from a client: the old primary refuses or drops connections, a
# demoted primary answers READONLY, a restarted one answers LOADING (a ConnectionError in
# redis-py), and Sentinel names no primary for a moment (MasterNotFoundError, also one).
RETRYABLE: tuple[type[Exception], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    socket.timeout,
    ReadOnlyError,
)
# A Redis Cluster adds: no slot owner while a replica is being promoted, and the cluster-wide
# CLUSTERDOWN a failed master causes until then.
CLUSTER_RETRYABLE: tuple[type[Exception], ...] = (
    *RETRYABLE,
    ClusterDownError,
    MasterDownError,
    SlotNotCoveredError,
    TryAgainError,
)

# Defaults for the store's sockets: without a timeout a command to a primary that vanished
# from the network (rather than crashed) would hang forever instead of failing over.
SOCKET_TIMEOUT = 30.0
SOCKET_CONNECT_TIMEOUT = 5.0
SENTINEL_SOCKET_TIMEOUT = 2.0

_local = threading.local()


# What differs between the redis-py releases the package runs on (4.5.2, which Celery 5.3
# allows, to the newest), here alone.
#
# The connection's method that authenticates and selects the database once connected:
# redis-py 6 split it out of ``on_connect`` (which ``connect`` no longer calls); redis-py 5
# and older have ``on_connect`` alone.
HANDSHAKE = (
    "on_connect_check_health"
    if hasattr(redis.connection.Connection, "on_connect_check_health")
    else "on_connect"
)
OLD_REDIS_PY = HANDSHAKE == "on_connect"  # redis-py 5 and older
# A client's ``retry_on_error``: redis-py 5 and older end a command's retry at its first
# error unless the error is named there too (redis-py 6 leaves that to the Retry alone).
RETRY_ON_ERROR = list(RETRYABLE)
# redis-py 5 and older connect a pool's connection before the command's retry starts, and
# retry the connect itself on the Retry's errors alone, which the socket's own (a refused
# connection: an OSError) are not; redis-py 6 retries those with the command.
CONNECT_RETRYABLE: tuple[type[Exception], ...] = (OSError,) if OLD_REDIS_PY else ()
# A pool's ``get_connection`` needs a command name before redis-py 5.3, and warns of one after.
_NAMING = inspect.signature(redis.ConnectionPool.get_connection).parameters.get("command_name")
_NAMED = _NAMING is not None and _NAMING.default is inspect.Parameter.empty


def pool_connection(pool: Any) -> Any:
    """A connection taken from ``pool`` (give it back with ``pool.release``)."""
    return pool.get_connection("PING") if _NAMED else pool.get_connection()


@overload
def text(value: None) -> None: ...
@overload
def text(value: Any) -> str: ...
def text(value: Any) -> str | None:
    """A reply from Redis as text (bytes decoded as UTF-8); None stays None."""
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def retries_here() -> int:
    """How many times a command was resent in this thread so far (a monotonic count).

    A caller compares it before and after a call to learn whether its command may have been
    applied by an attempt whose reply was lost.
    """
    return int(getattr(_local, "retries", 0))


def backoff(failures: int, base: float = 0.05, cap: float = 1.0) -> float:
    """Seconds to wait before attempt ``failures + 1``: exponential, capped, half jittered
    (many workers retrying at once should not reach the new primary in lock step)."""
    delay = min(cap, base * 2.0 ** max(0, failures - 1))
    return delay / 2 + random.uniform(0, delay / 2)


@contextlib.contextmanager
def bounded(seconds: float, setting: str) -> Iterator[None]:
    """Within the block, this thread's store commands retry for ``seconds`` (named by
    ``setting`` in errors) instead of their own bound: a producer's (echomq_producer_timeout),
    which a web request that starts a flow waits for, rather than a worker's."""
    outer = getattr(_local, "bound", None)
    _local.bound = (seconds, setting)
    try:
        yield
    finally:
        _local.bound = outer


def bound_of(timeout: float, setting: str = "echomq_store_retry_timeout") -> tuple[float, str]:
    """How long a command that would retry for ``timeout`` retries here, and the setting that
    says so (a :func:`bounded` block's, else ``setting``)."""
    bound = getattr(_local, "bound", None)
    return bound if bound is not None else (timeout, setting)


def call_until(
    timeout: float,
    do: Callable[[], T],
    retryable: tuple[type[Exception], ...],
    on_failure: Callable[[Exception], None] | None = None,
) -> T:
    """``do()``, retried on ``retryable`` errors with backoff for up to ``timeout`` seconds;
    then the last error is raised.

    Inside ``do()`` every other retry loop of this module makes one attempt only, so a
    command is bounded by the outermost loop's ``timeout``, not by a product of nested ones.
    """
    timeout, _ = bound_of(timeout)
    deadline = time.monotonic() + timeout
    failures = 0
    while True:
        outer = getattr(_local, "inside", False)
        _local.inside = True
        try:
            return do()
        except retryable as exc:
            if isinstance(exc, (AuthenticationError, AuthorizationError)):
                raise  # a wrong password or user is not a failover: no waiting it out
            failures += 1
            if on_failure is not None:
                on_failure(exc)
            delay = backoff(failures)
            if time.monotonic() + delay > deadline:
                raise
            if failures == 1:
                logger.warning(
                    "echomq: flow store unavailable (%s: %s); retrying for up to %.0f s",
                    type(exc).__name__,
                    exc,
                    timeout,
                )
            _local.retries = retries_here() + 1
            time.sleep(delay)
        finally:
            _local.inside = outer


class DeadlineRetry(Retry):
    """redis-py's ``Retry`` bounded by time rather than by a count of attempts.

    A connection retries both its connect and the command that needed it through the same
    object; only the outermost call in a thread loops, so the whole command, reconnect
    included, is bounded by ``timeout``.
    """

    def __init__(self, timeout: float) -> None:
        super().__init__(NoBackoff(), -1, (*RETRYABLE, *CONNECT_RETRYABLE))
        self.timeout = timeout

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeadlineRetry) and other.timeout == self.timeout

    __hash__ = Retry.__hash__

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        failures = 0

        def failed(exc: Exception) -> None:
            nonlocal failures
            if is_retryable is not None and not is_retryable(exc):
                raise exc
            failures += 1
            # redis-py's callback disconnects, so the next attempt reconnects (through
            # Sentinel: to whichever primary it names now).
            if with_failure_count:
                fail(exc, failures)
            else:
                fail(exc)

        if getattr(_local, "inside", False):
            # An outer loop retries: one attempt, and the connection closed if it failed.
            try:
                return do()
            except self._supported_errors as exc:
                failed(exc)
                raise
        return call_until(self.timeout, do, self._supported_errors, failed)


class RetryingCluster(RedisCluster):
    """A ``RedisCluster`` whose commands ride through a master's failover.

    redis-py's cluster client retries a failed command a few times at once, re-reading the
    slot map each time, which is over long before a replica is promoted (after
    ``cluster-node-timeout``); this retries the whole command with backoff until
    ``retry_timeout`` has passed.
    """

    retry_timeout: float = 20.0

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        run = super().execute_command
        if getattr(_local, "inside", False):
            return run(*args, **kwargs)  # type: ignore[no-untyped-call, unused-ignore]
        return call_until(
            self.retry_timeout,
            lambda: run(*args, **kwargs),  # type: ignore[no-untyped-call, unused-ignore]
            CLUSTER_RETRYABLE,
        )


def _connection_kwargs(options: Mapping[str, Any]) -> dict[str, Any]:
    """redis-py connection arguments from the transport options (see config.TRANSPORT_OPTIONS)."""
    kwargs: dict[str, Any] = {
        "socket_timeout": SOCKET_TIMEOUT,
        "socket_connect_timeout": SOCKET_CONNECT_TIMEOUT,
    }
    for name in ("socket_timeout", "socket_connect_timeout", "socket_keepalive"):
        if options.get(name) is not None:
            kwargs[name] = options[name]
    for name in ("username", "password"):
        if options.get(name):
            kwargs[name] = options[name]
    ssl = options.get("ssl")
    if ssl:
        kwargs["ssl"] = True
        if isinstance(ssl, Mapping):
            kwargs.update(ssl)
    return kwargs


def _sentinel_client(
    settings: Settings, kwargs: dict[str, Any], minimum: tuple[int, ...] | None
) -> redis.Redis:
    from redis.sentinel import Sentinel

    options = settings.transport_options
    url = parse_sentinel_url(settings.redis_url or "")
    sentinel_kwargs: dict[str, Any] = dict(options.get("sentinel_kwargs") or {})
    sentinel_kwargs.setdefault("socket_timeout", SENTINEL_SOCKET_TIMEOUT)
    sentinel_kwargs.setdefault("socket_connect_timeout", SENTINEL_SOCKET_TIMEOUT)
    # One try per Sentinel per discovery: a Sentinel that is down is skipped at once, and the
    # store's own retry (above) asks them all again after a backoff.
    sentinel_kwargs.setdefault("retry", Retry(NoBackoff(), 0))
    # The URL's user and password are the primary's (as in Celery); the transport options'
    # win when both are given.
    if url.username and "username" not in kwargs:
        kwargs["username"] = url.username
    if url.password and "password" not in kwargs:
        kwargs["password"] = url.password
    sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
        list(url.hosts),
        min_other_sentinels=int(options.get("min_other_sentinels") or 0),
        sentinel_kwargs=sentinel_kwargs,
    )
    client = sentinel.master_for(  # type: ignore[no-untyped-call, unused-ignore]
        str(options["master_name"]),
        redis_class=redis.Redis,
        db=url.db,
        retry=DeadlineRetry(settings.store_retry_timeout),
        retry_on_error=RETRY_ON_ERROR,
        health_check_interval=30,
        **kwargs,
    )
    return _checked_select(client, settings, minimum)  # type: ignore[no-any-return]


def _checked(base: Any, settings: Settings, minimum: tuple[int, ...] | None) -> Any:
    """A connection class of ``base`` that turns the server's refusal of the URL's database
    (``ERR DB index is out of range``) into a ConfigError naming the setting (no retry waits
    it out); whose first connection checks the server's version against ``minimum`` (one
    INFO server for the client: once per process, inside its first command, which meets an
    unreachable store as it would); and whose health check takes a MISCONF answer for a live
    server."""
    where = f"{settings.url_setting}={safe_url(settings.redis_url or '')!r}"
    checked = threading.Event()

    class Checked(base):  # type: ignore[misc]
        def handshake(self, *args: Any, **kwargs: Any) -> None:
            try:
                getattr(super(), HANDSHAKE)(*args, **kwargs)
            except ResponseError as exc:
                if "DB index" not in str(exc):
                    raise
                self.disconnect()
                raise ConfigError(
                    f"{where}: the server has no database {getattr(self, 'db', '?')} "
                    f"(Redis: {exc}); name one below its `databases` setting (16 by default)"
                ) from None
            if minimum is not None and not checked.is_set():
                self.send_command("INFO", "server", check_health=False)
                try:
                    reply = text(self.read_response())
                except ResponseError:  # INFO refused to this user: doctor says what it cannot read
                    reply = ""
                fields = (line.split(":", 1) for line in reply.splitlines() if ":" in line)
                wrong = too_old(dict(fields), minimum) if reply else None
                if wrong is not None:
                    self.disconnect()
                    raise ConfigError(f"{where}: {wrong}")
                checked.set()

        def _send_ping(self) -> None:
            # The health check's PING (before a new connection's first command): a server whose
            # last snapshot or AOF write failed refuses PING with the writes (MISCONF), yet it
            # answers and serves reads, which say why it refuses writes (doctor, show).
            try:
                super()._send_ping()
            except ResponseError as exc:
                if not str(exc).startswith("MISCONF"):
                    raise

    setattr(Checked, HANDSHAKE, Checked.handshake)
    Checked.__name__ = Checked.__qualname__ = base.__name__
    return Checked


def _checked_select(client: Any, settings: Settings, minimum: tuple[int, ...] | None) -> Any:
    """``client`` with its pool's connections :func:`_checked`."""
    pool = client.connection_pool
    pool.connection_class = _checked(pool.connection_class, settings, minimum)
    return client


def make_client(settings: Settings | str, *, min_version: tuple[int, ...] | None = None) -> Any:
    """A redis-py client for the flow store that ``settings`` (or a bare URL) names; with
    ``min_version``, its first connection refuses an older server (ConfigError)."""
    if isinstance(settings, str):
        settings = Settings(redis_url=settings)
    url = settings.redis_url
    if url is None:
        raise missing_url_error()
    kwargs = _connection_kwargs(settings.transport_options)
    if url.startswith("sentinel://"):
        return _sentinel_client(settings, kwargs, min_version)
    if url.startswith("redis+cluster://"):
        first, seeds = parse_cluster_url(url)
        base = redis.SSLConnection if kwargs.get("ssl") else redis.Connection
        try:
            cluster = RetryingCluster(
                url=first,
                startup_nodes=[ClusterNode(host, port) for host, port in seeds],  # type: ignore[no-untyped-call, unused-ignore]
                connection_class=_checked(base, settings, min_version),
                **kwargs,
            )
        except RedisClusterException as exc:
            # The client reads the slot map as it is made: a refused server's ConfigError.
            if isinstance(exc.__cause__, ConfigError):
                raise exc.__cause__ from None
            raise
        cluster.retry_timeout = settings.store_retry_timeout
        return cluster
    if url.startswith("redis+socket://"):
        url = "unix://" + url[len("redis+socket://") :]
    # A plain URL says TLS by its scheme; the transport options' ssl=True upgrades redis://.
    if kwargs.pop("ssl", False) and url.startswith("redis://"):
        url = "rediss://" + url[len("redis://") :]
    if url.startswith("unix://"):
        kwargs = {k: v for k, v in kwargs.items() if not k.startswith("ssl_")}
    client = redis.Redis.from_url(
        url,
        retry=DeadlineRetry(settings.store_retry_timeout),
        retry_on_error=RETRY_ON_ERROR,
        health_check_interval=30,
        **kwargs,
    )
    return _checked_select(client, settings, min_version)


def describe(settings: Settings) -> str:
    """Where the store is, for messages: the URL with its passwords masked, and the Sentinel
    service name when there is one."""
    where = safe_url(settings.redis_url or "(no Redis URL)")
    master = settings.transport_options.get("master_name")
    return f"{where} (master {master})" if master and where.startswith("sentinel://") else where
