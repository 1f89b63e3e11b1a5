"""Bench-only prototype of the worker-side proposal in PROPOSALS.md: a pipelined claim.

Loaded by bench_app in a worker started with ``ECHOMQ_BENCH_WORKER_VARIANT=pipelined_claim``,
in that worker's processes only; celery_echomq is not edited. The library's receivers run
unchanged; only the step that talks to Redis behaves differently in each pool process:

- ``claim`` (task_prerun) is written to a connection of its own and its reply is not waited
  for: the script runs on the server while the task body runs;
- the next script of that process (``complete`` at task_success, ``fail``, ``retry``) is
  written behind it on the same connection, and both replies are read together: one round
  trip per child for claim + complete instead of two.

The semantics are those of the library's: a claim that did not take (already done, taken
over) leaves the job not active under this token, and the complete script then answers
``stale`` or the job's state and credits nothing, exactly as when the receiver skips it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import redis

from celery_echomq.store import scripts as echomq_scripts

VARIANT_ENV = "ECHOMQ_BENCH_WORKER_VARIANT"
PIPELINED_CLAIM = "pipelined_claim"
# The claim's reply the receiver sees: it stores its token, as after a real "claimed".
_ASSUMED_CLAIM = [b"claimed", 0]


class _Deferred:
    """One process's own connection and how many replies on it are still unread."""

    def __init__(self, client: Any) -> None:
        self.pid = os.getpid()
        self.conn = client.connection_pool.get_connection()
        self.unread = 0


_deferred: dict[int, _Deferred] = {}


def _for(scripts: Any) -> _Deferred:
    state = _deferred.get(id(scripts))
    if state is None or state.pid != os.getpid():
        client = next(iter(scripts._scripts.values())).registered_client
        # EVALSHA without redis-py's NOSCRIPT fallback: load every script once up front.
        for script in scripts._scripts.values():
            client.script_load(script.script)
        state = _deferred[id(scripts)] = _Deferred(client)
    return state


def _send(d: _Deferred, script: Any, keys: list[Any], args: list[Any]) -> None:
    d.conn.send_command("EVALSHA", script.sha, len(keys), *keys, *args)


def _read(d: _Deferred) -> Any:
    reply = d.conn.read_response()
    if isinstance(reply, redis.ResponseError):
        raise reply
    return reply


def install_pipelined_claim() -> None:
    original = echomq_scripts.Scripts._run

    def _run(self: Any, name: str, keys: Any, args: Any) -> Any:
        d = _for(self)
        script = self._scripts[name]
        if name == "claim":
            _send(d, script, list(keys), list(args))
            d.unread += 1
            return _ASSUMED_CLAIM
        if not d.unread:
            return original(self, name, keys, args)
        _send(d, script, list(keys), list(args))
        pending, d.unread = d.unread, 0
        for _ in range(pending):
            # A claim that failed on the server is what recovery repairs; the script behind
            # it still answers for itself below.
            with contextlib.suppress(redis.ResponseError):
                _read(d)
        try:
            return _read(d)
        except redis.ResponseError as exc:
            raised = echomq_scripts.server_error(exc)
            if raised is exc:
                raise
            raise raised from None

    echomq_scripts.Scripts._run = _run


def install_from_env() -> None:
    if os.environ.get(VARIANT_ENV) == PIPELINED_CLAIM:
        install_pipelined_claim()
