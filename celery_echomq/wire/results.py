"""Results the store writes: a flow job's result in Celery's Redis backend, written by its
``complete`` script in the round trip that finishes the job.

Where the app's result backend is Celery's plain ``RedisBackend`` on the very server and
database of the flow store, a flow job whose options leave ``ignore_result`` unset is sent with
the ``echomq_r`` header (see send/plan.py), its message silent on ``ignore_result``. A worker
with the extension, once its claim holds the job, sets ``ignore_result`` on the running
request (:func:`hold_result`), which Celery's ``mark_as_done`` reads: its trace stores no
SUCCESS, and the worker hands ``complete.lua`` exactly what ``RedisBackend`` would have written
(key, encoded meta, expiry), which it SETs and PUBLISHes on the job's one active -> done
transition. The other outcomes (FAILURE, RETRY, STARTED, REVOKED) are rare and are stored here
through the backend, as Celery would have stored them for a request that did not ignore its
result.

A worker without the extension (a fleet half upgraded) reads a plain message and stores the
result as for any task: recovery finds the job still pending with a final state in the backend
and settles it from that result, never running it again (worker/recovery/lost.py). Had the
message said ``ignore_result``, such a worker would store nothing, and the job would be taken
for lost and run a second time.

A worker whose backend turns out not to be on the store's server (another configuration than
the producer's) stores the result through the backend before the job completes: a job sent
with the header always gets its result stored.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Mapping
from typing import Any

import redis
from celery import states
from celery.backends.base import KeyValueStoreBackend

from celery_echomq.store.connection import text
from celery_echomq.store.headers import H_RESULT
from celery_echomq.store.scripts import ResultWrite
from celery_echomq.store.state import EchoMQ

logger = logging.getLogger("celery_echomq")

# Celery's result keys, each also the channel its result is published on (result_write): the
# scripts write and publish them where the result backend is the store's own server, database
# and user (the fast path). Celery's own prefix, as its key-value backends name a result.
RESULT_PREFIX = KeyValueStoreBackend.task_keyprefix
RESULT_KEYS = f"{RESULT_PREFIX}*"

# backend -> whether it is fusable with its app's store (a backend object belongs to one app,
# and is made once per thread).
_fusable: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _where(kwargs: Mapping[str, Any], connection_class: Any) -> tuple[Any, ...]:
    """The server, database and identity a redis-py connection's arguments name."""
    unix = isinstance(connection_class, type) and issubclass(
        connection_class, redis.UnixDomainSocketConnection
    )
    tls = isinstance(connection_class, type) and issubclass(connection_class, redis.SSLConnection)
    address: tuple[Any, ...] = (
        ("unix", str(kwargs.get("path") or ""))
        if unix
        else ("tcp", str(kwargs.get("host") or "localhost"), int(kwargs.get("port") or 6379))
    )
    # TLS settings must be the same too: a connection the store makes must be one the backend
    # would make.
    ssl = sorted((k, repr(v)) for k, v in kwargs.items() if k.startswith("ssl_")) if tls else []
    return (
        *address,
        int(kwargs.get("db") or 0),
        kwargs.get("username") or None,
        kwargs.get("password") or None,
        tls,
        tuple(ssl),
    )


def _backend_where(backend: Any) -> tuple[Any, ...] | None:
    from celery.backends.redis import RedisBackend

    # Exactly the plain backend: Sentinel (a subclass) finds its primary on its own, and a
    # subclass may store differently.
    if type(backend) is not RedisBackend:
        return None
    params = dict(getattr(backend, "connparams", None) or {})
    connection_class = params.pop("connection_class", redis.Connection)
    return _where(params, connection_class)


def _store_where(state: EchoMQ) -> tuple[Any, ...] | None:
    url = state.settings.redis_url or ""
    if not url or url.startswith(("sentinel://", "redis+cluster://")):
        return None
    client = state.client
    if type(client) is not redis.Redis:
        return None
    pool = client.connection_pool
    return _where(pool.connection_kwargs, pool.connection_class)


def database_on_store_server(state: EchoMQ, client: Any) -> int | None:
    """The database redis-py ``client`` uses when it talks to the store's own server (same
    address, identity and TLS; Sentinel and Cluster aside), else None."""
    mine = _store_where(state)
    if mine is None or type(client) is not redis.Redis:
        return None
    pool = client.connection_pool
    theirs = _where(pool.connection_kwargs, pool.connection_class)
    at = 2 if mine[0] == "unix" else 3  # the database's place in a _where tuple
    if theirs[:at] + theirs[at + 1 :] != mine[:at] + mine[at + 1 :]:
        return None
    return int(theirs[at])


def fusable(state: EchoMQ, backend: Any) -> bool:
    """Whether ``backend`` is Celery's plain Redis backend on the store's server and database
    (not Sentinel, not a Cluster): then the store's scripts can write its results."""
    try:
        return _fusable[backend]
    except (KeyError, TypeError):
        pass
    try:
        where = _backend_where(backend)
        same = where is not None and where == _store_where(state)
    except Exception as exc:  # an unusual backend or URL: write through Celery, as always
        logger.debug("echomq: result backend not comparable with the store: %r", exc)
        same = False
    with contextlib.suppress(TypeError):  # not weakly referable: compared again next time
        _fusable[backend] = same
    return same


def writes_results(state: EchoMQ) -> bool:
    """Whether flows this process starts mark their jobs for the store to write their results
    (``echomq_child_results`` on, and the app's backend fusable with the store)."""
    return state.settings.child_results and fusable(state, state.app.backend)


def marked(request: Any) -> bool:
    """Whether the job's message says the store writes its result (the ``echomq_r`` header)."""
    return request is not None and bool(getattr(request, H_RESULT, None))


def _request_ignores(task: Any, request: Any) -> bool:
    """Whether Celery's trace treats ``request`` as ignoring its result: the message's
    ``ignore_result`` where Celery reads it (``get_actual_ignore_result``), else (5.3) the
    task class's alone."""
    from celery.app import task as task_module

    actual = getattr(task_module, "get_actual_ignore_result", None)
    if actual is None:
        return bool(task.ignore_result)
    return bool(actual(task, request))


def _stored_by_celery(task: Any, request: Any) -> bool:
    """Whether Celery itself stores this job's errors (its ``store_errors``)."""
    return not _request_ignores(task, request) or bool(task.store_errors_even_if_ignored)


def _ours(task: Any, request: Any) -> bool:
    """A marked job whose task class keeps results (a class that ignores them stores none,
    as with Celery)."""
    return marked(request) and not task.ignore_result


def hold_result(request: Any) -> None:
    """For a marked job this delivery holds (its claim made, its STARTED stored): Celery's
    trace stores no SUCCESS for it from here on (``mark_as_done`` reads the request's
    ``ignore_result``), since its completion writes it; its errors are stored as for a
    message that said ``ignore_result`` (the ``store_*`` functions below). Nothing to send:
    the fast path stays one round trip per job."""
    if marked(request):
        request.ignore_result = True


def success_write(state: EchoMQ, task: Any, request: Any, result: Any) -> ResultWrite | None:
    """For a marked job that succeeded: what ``complete`` writes, computed as Celery's
    ``KeyValueStoreBackend._store_result`` would (``None``: nothing for the script to write;
    where the backend is not on the store's server, the result is stored here first)."""
    if not _ours(task, request) or not getattr(request, "ignore_result", False):
        # Not marked, or Celery's mark_as_done stored it already: a request that did not
        # ignore its result (not held: see hold_result).
        return None
    backend = task.backend
    if fusable(state, backend):
        value = backend.encode_result(result, states.SUCCESS)
        meta = backend._get_result_meta(
            result=value, state=states.SUCCESS, traceback=None, request=request
        )
        meta["task_id"] = text(request.id)
        encoded = backend.encode(meta)
        limit = getattr(backend, "_MAX_STR_VALUE_SIZE", None)
        if not (isinstance(encoded, str) and limit is not None and len(encoded) > limit):
            return result_write(backend, request.id, encoded)
    # Not fusable here, or too large for one value (Celery's own path raises its error).
    backend.store_result(request.id, result, states.SUCCESS, request=request)
    return None


def result_write(backend: Any, task_id: str, encoded: Any) -> ResultWrite:
    """Celery's result record for ``task_id`` with its ``encoded`` meta, every piece as
    ``RedisBackend`` names it: the key, the backend's expiry (None: kept), and the channel
    ``_set`` publishes it on, the key's own name, which a waiting ``AsyncResult.get``
    subscribes to."""
    key = text(backend.get_key_for_task(task_id))
    expires = backend.expires
    return ResultWrite(key, encoded, int(expires) if expires else None, channel=key)


def store_success(task: Any, request: Any, result: Any) -> None:
    """SUCCESS through the backend, for a marked job whose completion wrote none (it was not
    the job's transition: another delivery holds it, or it was cancelled while running).
    Celery's chord child would store it: its ``_store_result`` never overwrites a SUCCESS."""
    _guarded(
        "SUCCESS",
        request.id,
        task.backend.store_result,
        request.id,
        result,
        states.SUCCESS,
        request=request,
    )


def store_refused(task: Any, request: Any, reason: str) -> None:
    """FAILURE for a child whose value its flow's reducer cannot fold (``reason``, from
    send/fan_in.py), as Celery stores a task that raised: a
    :class:`~celery_echomq.errors.ReduceError`, its ``link_error`` callbacks run. Only for a
    job whose result the store writes (its message said ``ignore_result``, so Celery's trace
    stored no SUCCESS before the value was looked at)."""
    from celery_echomq.errors import ReduceError

    if _ours(task, request):
        _guarded(
            "FAILURE",
            request.id,
            task.backend.mark_as_failure,
            request.id,
            ReduceError(reason),
            request=request,
        )


def _guarded(what: str, task_id: str, store: Any, *args: Any, **kwargs: Any) -> None:
    """Store a rare outcome; an error is logged, never raised: the receiver's transition
    (fail, retry, revoke) must still run whatever Celery's backend answers."""
    try:
        store(*args, **kwargs)
    except Exception as exc:
        logger.warning("echomq: could not store %s for %s: %r", what, task_id, exc)


def store_failure(
    task: Any, request: Any, task_id: str, exc: BaseException, traceback: Any
) -> None:
    """FAILURE for a marked job, where Celery's trace stored none (the message said
    ``ignore_result``); Celery has already run the errbacks."""
    if _ours(task, request) and not _stored_by_celery(task, request):
        _guarded(
            "FAILURE",
            task_id,
            task.backend.store_result,
            task_id,
            exc,
            states.FAILURE,
            traceback=traceback,
            request=request,
        )


def store_retry(task: Any, request: Any, exc: BaseException | None, traceback: Any) -> None:
    if _ours(task, request) and not _stored_by_celery(task, request):
        _guarded(
            "RETRY",
            request.id,
            task.backend.store_result,
            request.id,
            exc,
            states.RETRY,
            traceback=traceback,
            request=request,
        )


def store_revoked(task: Any, request: Any, reason: str) -> None:
    from celery.exceptions import TaskRevokedError

    if _ours(task, request) and not _stored_by_celery(task, request):
        _guarded(
            "REVOKED",
            request.id,
            task.backend.store_result,
            request.id,
            TaskRevokedError(reason),
            states.REVOKED,
            traceback=None,
            request=request,
        )


def store_started(task: Any, request: Any) -> None:
    """STARTED for a marked job of a ``track_started`` task (Celery's trace skips it when the
    message says ``ignore_result``)."""
    if not _ours(task, request) or not task.track_started or getattr(request, "is_eager", False):
        return
    if not _request_ignores(task, request):
        return  # Celery's trace stores it (Celery 5.3 reads the task class alone)
    _guarded(
        "STARTED",
        request.id,
        task.backend.store_result,
        request.id,
        {"pid": os.getpid(), "hostname": getattr(request, "hostname", None)},
        states.STARTED,
        request=request,
    )


def backend_readable(app: Any) -> bool:
    """Whether any process can read a task's result from the app's result backend: not with
    none, nor with ``rpc://``, which sends each result to its caller's own reply queue."""
    from celery.backends.base import DisabledBackend
    from celery.backends.rpc import RPCBackend

    return not isinstance(app.backend, (DisabledBackend, RPCBackend))
