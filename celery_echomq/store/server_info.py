"""What the flow store's Redis servers say of themselves: the facts a worker checks at start
and ``celery echomq doctor`` reads (``ops/doctor.py`` judges them), and whether the store
refuses writes now.

Reads only: INFO, CONFIG GET, TIME, CLUSTER INFO, the Sentinels' view of the primary, and the
store user's rights probed inside a transaction that is discarded, so that nothing runs.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis
from redis.cluster import RedisCluster

from celery_echomq.store.connection import pool_connection, text

logger = logging.getLogger("celery_echomq.store")

# The commands celery-echomq sends from Python (the scripts' own are read from their files),
# with arguments of the right arity for a probe: K is a key of the store's, C a channel. A
# subcommand is written as ACL names it, ``SCRIPT|LOAD``. redis-py runs a script by EVALSHA,
# loading it (SCRIPT LOAD; SCRIPT EXISTS first in a pipeline) where the server lacks it; a
# connection selects its database and, idle for 30 s, PINGs; INFO reads the version at first
# use and the memory policy at a worker's start.
CLIENT_COMMANDS: dict[str, tuple[str, ...]] = {
    "EVALSHA": ("0" * 40, "1", "K"),
    "SCRIPT|LOAD": ("return 0",),
    "SCRIPT|EXISTS": ("0" * 40,),
    "INFO": ("server",),
    "PING": (),
    "SELECT": ("0",),
    "WAIT": ("0", "0"),
    "TIME": (),
    "SCAN": ("0",),
    "DEL": ("K",),
    "EXISTS": ("K",),
    "EXPIRE": ("K", "1"),
    "GET": ("K",),
    "MGET": ("K",),
    "SET": ("K", "v"),
    "HGET": ("K", "f"),
    "HGETALL": ("K",),
    "HLEN": ("K",),
    "HMGET": ("K", "f"),
    "HSCAN": ("K", "0"),
    "HSET": ("K", "f", "v"),
    "HSETNX": ("K", "f", "v"),
    "HDEL": ("K", "f"),
    "LPUSH": ("K", "v"),
    "RPUSH": ("K", "v"),
    "LLEN": ("K",),
    "LRANGE": ("K", "0", "0"),
    "UNLINK": ("K",),
    "SADD": ("K", "m"),
    "SMEMBERS": ("K",),
    "ZADD": ("K", "0", "m"),
    "ZCARD": ("K",),
    "ZRANGE": ("K", "0", "0"),
    "ZRANGEBYSCORE": ("K", "0", "0"),
    "ZREM": ("K", "m"),
    "ZREVRANGE": ("K", "0", "0"),
    "ZREVRANGEBYSCORE": ("K", "0", "0"),
    "ZSCORE": ("K", "m"),
}
# Arguments for the commands only the scripts send.
SCRIPT_COMMANDS: dict[str, tuple[str, ...]] = {
    "DECR": ("K",),
    "HEXISTS": ("K", "f"),
    "HINCRBY": ("K", "f", "1"),
    "HSTRLEN": ("K", "f"),
    "INCR": ("K",),
    "INCRBY": ("K", "1"),
    "LPOP": ("K",),
    "PERSIST": ("K",),
    "PEXPIRE": ("K", "1000"),
    "PTTL": ("K",),
    "PUBLISH": ("C", "v"),
    "SCARD": ("K",),
    "ZREMRANGEBYRANK": ("K", "0", "0"),
    "ZREMRANGEBYSCORE": ("K", "0", "0"),
}
_CALL = re.compile(r"redis\.p?call\(\s*['\"]([A-Za-z]+)['\"]")


def script_commands() -> set[str]:
    """Every command the Lua scripts call (read from them: a new one is never forgotten)."""
    found: set[str] = set()
    lua = resources.files("celery_echomq.store") / "lua"
    for folder in (lua, lua / "includes"):
        for entry in folder.iterdir():
            if entry.name.endswith(".lua"):
                found.update(m.upper() for m in _CALL.findall(entry.read_text(encoding="utf-8")))
    return found


def required_commands() -> dict[str, tuple[str, ...]]:
    """The commands the store's user must be allowed, with a probe's arguments for each.
    A script's command without probe arguments here is a KeyError: the table is incomplete."""
    needed = dict(CLIENT_COMMANDS)
    for name in sorted(script_commands() - needed.keys()):
        needed[name] = SCRIPT_COMMANDS[name]
    return needed


# A transaction (redis-py's pipeline(transaction=True): a flow's start in phases, a retry with a
# new deadline) and the doctor's probe of the user's rights (MULTI ... DISCARD). Not probed
# inside the probe's own transaction: a user refused MULTI is told so.
TRANSACTION_COMMANDS = ("MULTI", "EXEC", "DISCARD")
# What ``celery echomq doctor`` sends besides, each optional: refused, its check says what it
# could not read (CONFIG GET could also read the server's passwords: left out of the user).
DOCTOR_COMMANDS = ("ACL|WHOAMI", "CONFIG|GET", "CLUSTER|INFO")


def acl_setuser(user: str = "flows", password: str = "PASSWORD", *, prefix: str = "emq") -> str:
    """The least-privilege ``ACL SETUSER`` line for a user of the store's own: the commands of
    :func:`required_commands` and a transaction's, on the store's keys, no channel."""
    # resetchannels: on Redis 6.2, ``reset`` leaves every channel allowed (acl-pubsub-default).
    commands = sorted({*required_commands(), *TRANSACTION_COMMANDS})
    rules = ["reset", "on", f">{password}", f"~{prefix}:*", "resetchannels"]
    return " ".join(["ACL SETUSER", user, *rules, *(f"+{name.lower()}" for name in commands)])


def primaries(client: Any) -> list[tuple[str, Any]]:
    """``(address, client)`` of each primary the store writes to: every master of a Redis
    Cluster, else the one server (through Sentinel: the primary it names now)."""
    if isinstance(client, RedisCluster):
        return [
            (f"{node.host}:{node.port}", client.get_redis_connection(node))
            for node in client.get_primaries()  # type: ignore[no-untyped-call]
        ]
    pool = client.connection_pool
    if hasattr(pool, "get_master_address"):
        host, port = pool.get_master_address()
        return [(f"{host}:{port}", client)]
    kwargs = pool.connection_kwargs
    where = kwargs.get("path") or f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
    return [(str(where), client)]


def evicting(client: Any) -> list[tuple[str, str]]:
    """``(address, policy)`` of each primary whose ``maxmemory-policy`` evicts keys (INFO's
    ``maxmemory_policy``: readable without CONFIG rights)."""
    found = []
    for address, node in primaries(client):
        policy = str(node.info("memory").get("maxmemory_policy", "noeviction"))
        if policy != "noeviction":
            found.append((address, policy))
    return found


@dataclass(frozen=True)
class NodeFacts:
    """One primary: its INFO, and its CONFIG (None where the user may not read it)."""

    address: str
    info: dict[str, Any]
    config: dict[str, str] | None


# The settings the doctor reads: persistence, and when the store refuses writes.
CONFIG_READ = ("save", "appendfsync", "stop-writes-on-bgsave-error", "min-replicas-to-write")


def node_facts(client: Any) -> list[NodeFacts]:
    facts = []
    for address, node in primaries(client):
        info = node.info()
        config: dict[str, str] | None = {}
        try:
            for name in CONFIG_READ:
                config = {
                    **(config or {}),
                    **{k: text(v) for k, v in node.config_get(name).items()},
                }
        except redis.ResponseError:  # NOPERM, or CONFIG renamed away (a managed Redis)
            config = None
        facts.append(NodeFacts(address, info, config))
    return facts


def clock_offset(client: Any, samples: int = 3) -> tuple[float, float]:
    """``(offset, round trip)`` in ms of the store's clock (TIME) against this host's, from
    the sample with the shortest round trip: the offset is the server's time less the
    midpoint of the request, so it is known to within half the round trip."""
    node = primaries(client)[0][1]
    best: tuple[float, float] | None = None
    for _ in range(samples):
        before = time.time()
        seconds, micros = node.time()
        after = time.time()
        offset = (seconds + micros / 1e6 - (before + after) / 2) * 1000
        trip = (after - before) * 1000
        if best is None or trip < best[1]:
            best = (offset, trip)
    assert best is not None
    return best


def whoami(client: Any) -> str | None:
    node = primaries(client)[0][1]
    try:
        return str(text(node.execute_command("ACL", "WHOAMI")))
    except redis.ResponseError:  # before Redis 6, or ACL not allowed
        return None


def refused_commands(
    client: Any, commands: dict[str, tuple[str, ...]], key: str, channel: str
) -> dict[str, str] | None:
    """The commands (of ``commands``) the store's user may not run on ``key``/``channel``,
    with Redis's reason; None when the probe itself is refused (no MULTI).

    Every command is queued inside MULTI, where Redis checks the user's rights (command,
    keys, channels) as it queues, then the transaction is discarded: nothing runs.
    """
    node = primaries(client)[0][1]
    connection = pool_connection(node.connection_pool)
    refused: dict[str, str] = {}
    try:
        connection.send_command("MULTI")
        try:
            connection.read_response()
        except redis.ResponseError:
            return None
        names = list(commands)
        for name in names:
            args = [key if a == "K" else channel if a == "C" else a for a in commands[name]]
            connection.send_command(*name.split("|"), *args)
        for name in names:
            try:
                connection.read_response()
            except redis.ResponseError as exc:
                if "NOPERM" in str(exc) or "no permissions" in str(exc):
                    refused[name] = str(exc)
                # anything else (MOVED on a cluster node): not a refusal of the user's
        connection.send_command("DISCARD")
        connection.read_response()
    except BaseException:
        connection.disconnect()  # whatever was half read, this connection is not reused
        raise
    finally:
        node.connection_pool.release(connection)
    return refused


def cluster_state(client: Any) -> dict[str, str]:
    """CLUSTER INFO of one node, as ``field -> value``."""
    node = primaries(client)[0][1]
    raw = text(node.execute_command("CLUSTER", "INFO"))
    pairs = (line.split(":", 1) for line in raw.splitlines() if ":" in line)
    return {k.strip(): v.strip() for k, v in pairs}


def sentinel_view(client: Any) -> tuple[str, list[tuple[str, dict[str, Any] | str]]] | None:
    """``(service name, [(sentinel, its view of the primary, or why it did not answer)])``
    for a store reached through Sentinel, else None."""
    pool: Any = getattr(client, "connection_pool", None)  # a RedisCluster has none
    manager = getattr(pool, "sentinel_manager", None)
    if manager is None:
        return None
    name = str(pool.service_name)
    views: list[tuple[str, dict[str, Any] | str]] = []
    for sentinel in manager.sentinels:
        kwargs = sentinel.connection_pool.connection_kwargs
        where = f"{kwargs.get('host')}:{kwargs.get('port')}"
        try:
            views.append((where, dict(sentinel.sentinel_master(name))))
        except (redis.RedisError, OSError) as exc:
            views.append((where, f"{type(exc).__name__}: {exc}"))
    return name, views


def replicas_of(client: Any, key: str) -> tuple[str, int]:
    """``(address, replicas connected)`` of the primary that serves ``key`` (on a Cluster:
    the master of its slot), from INFO replication."""
    if isinstance(client, RedisCluster):
        node = client.get_node_from_key(key)  # type: ignore[no-untyped-call]
        info = client.get_redis_connection(node).info("replication")
        return f"{node.host}:{node.port}", int(info.get("connected_slaves", 0))
    (address, primary), *_ = primaries(client)
    return address, int(primary.info("replication").get("connected_slaves", 0))


@dataclass(frozen=True)
class Refusal:
    """A primary refusing writes now: where, why (as Redis would answer a write), and what
    heals it."""

    address: str
    why: str
    heals: str


def _number(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def refusals_of(
    address: str, info: Mapping[str, Any], config: Callable[[str], str | None]
) -> list[Refusal]:
    """Why the server whose INFO (memory, replication, persistence) is ``info`` refuses
    writes, from INFO alone where it says it; ``config(name)`` (None where CONFIG GET is
    refused) is asked only where the refusal also depends on a setting INFO does not show."""
    found: list[Refusal] = []
    if str(info.get("role", "master")) != "master" and _number(info.get("slave_read_only", 1)):
        primary = f"{info.get('master_host', '?')}:{info.get('master_port', '?')}"
        found.append(Refusal(
            address,
            f"a read-only replica of {primary} (READONLY)",
            "point echomq_redis_url at the primary (sentinel:// follows it), or REPLICAOF NO "
            "ONE on this server if it is to be the primary",
        ))  # fmt: skip
    maxmemory = _number(info.get("maxmemory"))
    used = _number(info.get("used_memory")) - _number(info.get("mem_not_counted_for_evict"))
    if maxmemory and used >= maxmemory and info.get("maxmemory_policy") == "noeviction":
        found.append(Refusal(
            address,
            f"out of memory (used_memory {info.get('used_memory_human', used)} >= maxmemory "
            f"{info.get('maxmemory_human', maxmemory)}, noeviction: OOM)",
            "raise maxmemory (CONFIG SET maxmemory, and in redis.conf), or free memory: forget "
            "finished flows (celery echomq forget), shorten echomq_result_ttl",
        ))  # fmt: skip
    if info.get("rdb_last_bgsave_status") == "err":
        stop, save = config("stop-writes-on-bgsave-error"), config("save")
        if stop != "no" and save != "":
            maybe = "" if stop else " (if stop-writes-on-bgsave-error is yes, the default)"
            found.append(Refusal(
                address,
                f"its last RDB snapshot failed{maybe} (MISCONF)",
                "fix what failed it (its log says: a full disk, a directory it cannot write), "
                "then BGSAVE: writes resume once a snapshot succeeds",
            ))  # fmt: skip
    if info.get("aof_last_write_status") == "err":
        found.append(Refusal(
            address,
            "its last write to the AOF failed (MISCONF)",
            "fix what failed it (its log says: a full disk, a directory it cannot write): "
            "writes resume once an AOF write succeeds",
        ))  # fmt: skip
    if "min_slaves_good_slaves" in info:
        good = _number(info.get("min_slaves_good_slaves"))
        wanted = _number(config("min-replicas-to-write")) or (1 if good == 0 else 0)
        if good < wanted:
            found.append(Refusal(
                address,
                f"{good} replica(s) in sync, fewer than min-replicas-to-write={wanted} "
                "(NOREPLICAS)",
                f"bring {wanted} replica(s) within min-replicas-max-lag (attach one: REPLICAOF "
                "on it), or lower min-replicas-to-write",
            ))  # fmt: skip
    return found


def refusing_writes(client: Any) -> list[Refusal]:
    """Why each primary of the store refuses writes now, if it does: one INFO per primary
    (and a CONFIG GET only where INFO shows a refusal that depends on a setting)."""
    found: list[Refusal] = []
    for address, node in primaries(client):
        try:
            info = node.info()
        except redis.ResponseError:  # INFO refused to this user: nothing to tell
            continue

        def config(name: str, node: Any = node) -> str | None:
            try:
                return str(text(node.config_get(name).get(name)))
            except redis.ResponseError:
                return None

        found.extend(refusals_of(address, info, config))
    return found


def refusal_text(refusals: list[Refusal]) -> str:
    """The refusals as one line for ``show`` and the dashboard; "" when there are none."""
    return "; ".join(
        f"the flow store refuses writes: {r.address} is {r.why}; heals: {r.heals}" for r in refusals
    )
