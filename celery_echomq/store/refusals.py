"""A store that answers but refuses writes: which refusal a Redis error is, what it means,
what heals it, and the error of ours that says so.

Redis refuses a write, and a script's first write, when it is out of memory under a
``maxmemory-policy`` that frees nothing (``OOM``), a read-only replica (``READONLY``), after a
failed RDB save with ``stop-writes-on-bgsave-error yes`` (``MISCONF``), or with fewer replicas
than ``min-replicas-to-write`` (``NOREPLICAS``). A script is refused at its first write only
(once it has written, Redis lets it finish): a refused transition wrote nothing. Under OOM only
a write that may grow memory is refused (HSET, ZADD, SET, ...; not ZREM, HDEL, DEL), so a
script whose first write frees something runs whole: a transition either lands or writes
nothing. Reads still work: a worker can look at a lease while its writes are refused.

The worker (a claim deferred to recovery, an outcome retried while its lease holds) and the
producer (:class:`StoreWriteRefusedError`) read a refusal here and nowhere else.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import redis
from redis.exceptions import ReadOnlyError

from celery_echomq.errors import StoreWriteRefusedError


@dataclass(frozen=True)
class Refusal:
    """One kind of refusal: the reply's first word, the cause and its remedy in words."""

    code: str
    cause: str
    heal: str


REFUSALS = {
    r.code: r
    for r in (
        Refusal(
            "OOM",
            "it is out of memory (used_memory above maxmemory, and its maxmemory-policy "
            "evicts nothing it may, e.g. noeviction)",
            "memory is freed or maxmemory raised",
        ),
        Refusal(
            "READONLY",
            "it is a read-only replica",
            "the URL names the primary again, or this server is promoted (a failover, "
            "REPLICAOF NO ONE)",
        ),
        Refusal(
            "MISCONF",
            "its last RDB save failed and stop-writes-on-bgsave-error is yes",
            "a save succeeds (space and permissions in its dir) or "
            "stop-writes-on-bgsave-error is set to no",
        ),
        Refusal(
            "NOREPLICAS",
            "fewer replicas are connected than its min-replicas-to-write",
            "its replicas reconnect, or min-replicas-to-write is lowered",
        ),
    )
}


# Newer redis-py raises OOM as a class of its own, whose text has lost its code; an older one
# raises a plain ResponseError that keeps it ("OOM command not allowed ...").
_OUT_OF_MEMORY: tuple[type[Exception], ...] = tuple(
    getattr(redis.exceptions, name)
    for name in ("OutOfMemoryError",)
    if hasattr(redis.exceptions, name)
)

# A command's refusal starts with its code ("OOM command not allowed ..."); a script's is that
# reply inside Redis's own words: "OOM ... script: <sha>, on @user_script:12." (Redis 7),
# "Error running script (call to f_<sha>): @user_script:12: -OOM ..." (Redis 6).
# A pipeline's: "Command # 1 (HSET ...) of pipeline caused error: NOREPLICAS ...".
_CODE = re.compile(r"(?:^|-|error: )(OOM|READONLY|MISCONF|NOREPLICAS) ")


def refusal_of(exc: BaseException | None) -> Refusal | None:
    """The refusal ``exc`` is, or was raised from (a retry's last error); None for any other
    error."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, StoreWriteRefusedError):
            return REFUSALS.get(exc.code)
        if isinstance(exc, _OUT_OF_MEMORY):  # redis-py keeps the reply without its code
            return REFUSALS["OOM"]
        if isinstance(exc, ReadOnlyError):
            return REFUSALS["READONLY"]
        if isinstance(exc, redis.ResponseError):
            found = _CODE.search(str(exc))
            if found is not None:
                return REFUSALS[found.group(1)]
        exc = exc.__cause__ or exc.__context__
    return None


def refused(
    refusal: Refusal,
    store: str,
    outcome: str,
    exc: BaseException,
    server: str = "the flow store",
) -> StoreWriteRefusedError:
    """The error that tells what refused: the store at ``store`` (a URL without a password),
    the refusal, ``outcome`` (what was or was not written, in the caller's words) and what
    heals it; Redis's own reply last."""
    while isinstance(exc, StoreWriteRefusedError) and exc.__cause__ is not None:
        exc = exc.__cause__  # named already: Redis's own words are its cause's
    said = str(exc)
    found = _CODE.search(said)
    reply = said[found.start(1) :] if found is not None else f"{refusal.code} {said}"
    reply = reply.split(". ", 1)[0].split("\n", 1)[0].rstrip(".")
    return StoreWriteRefusedError(
        f"{server} {store} refuses writes: {refusal.cause}; {outcome}. It takes writes "
        f"again once {refusal.heal} (Redis: {reply})",
        store=store,
        code=refusal.code,
        cause=refusal.cause,
        heal=refusal.heal,
    )


@contextlib.contextmanager
def named_refusal(
    store: str, outcome: Callable[[], str], server: str = "the flow store"
) -> Iterator[None]:
    """Within the block, a refusal, however it is raised (a script's, already ours, or a plain
    command's from redis-py), becomes a :class:`StoreWriteRefusedError` naming ``store`` and
    ``outcome()``: what was and was not written when it came."""
    try:
        yield
    except Exception as exc:
        refusal = refusal_of(exc)
        if refusal is None:
            raise
        raise refused(refusal, store, outcome(), exc, server) from exc
