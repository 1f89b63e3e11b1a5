"""What the flow store's Redis servers say of themselves: the facts a worker checks at start
and ``celery echomq doctor`` reads (``ops/doctor.py`` judges them).

Reads only: INFO, CONFIG GET, TIME, CLUSTER INFO, the Sentinels' view of the primary, and the
store user's rights probed inside a transaction that is discarded, so that nothing runs.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis
from redis.cluster import RedisCluster

from celery_echomq.store.connection import pool_connection, text

# The commands celery-echomq sends from Python (the scripts' own are read from their files),
# with arguments of the right arity for a probe: K is a key of the store's, C a channel.
CLIENT_COMMANDS: dict[str, tuple[str, ...]] = {
    "EVALSHA": ("0" * 40, "1", "K"),
    "EVAL": ("return 0", "1", "K"),
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
    "SELECT": ("0",),
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


def node_facts(client: Any) -> list[NodeFacts]:
    facts = []
    for address, node in primaries(client):
        info = node.info()
        try:
            config = {k: text(v) for k, v in node.config_get("save").items()}
            config.update({k: text(v) for k, v in node.config_get("appendfsync").items()})
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
            connection.send_command(name, *args)
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
