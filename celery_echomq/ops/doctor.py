"""``celery echomq doctor``: the deployment checked, one finding per concern, each saying
what to change.

``read_facts`` reads what the store's servers, the Sentinels and the workers say (reads only,
see store/server_info.py); each ``check_*`` is pure: facts in, one :class:`Finding` out. A
finding is ``ok``, a ``note`` (works, and could be better) or ``wrong`` (a flow can be lost,
stall or fail): the command exits 1 when any is wrong.

A server open to a Lua advisory by its version is a note, not wrong: the version cannot tell a
build whose distribution back-ported the fixes (Debian's 7.0.15-1~deb12u10 has them), and a
check that fails on every such server would fail a large fleet's every run until its operators
stopped reading it. The note names what to verify; the exit status stays about flows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from celery_echomq.config import Settings, safe_url
from celery_echomq.ops.fleet import Finding, ask_workers, check_workers, has_extension
from celery_echomq.store import server_info, server_versions, store_format
from celery_echomq.store.connection import describe
from celery_echomq.store.reads import queues_of
from celery_echomq.store.server_info import NodeFacts, refusals_of
from celery_echomq.store.server_versions import MIN_SERVER, dotted, open_advisories, server_of
from celery_echomq.store.state import EchoMQ
from celery_echomq.wire.results import (
    RESULT_KEYS,
    RESULT_PREFIX,
    database_on_store_server,
    writes_results,
)

# A host clock further than this from the store's moves what is timed by host clocks (an
# aware-datetime deadline, a retry's countdown, Celery's eta and expires) by more than the
# deadline poller's own period (worker/deadline_poller.py). Leases and deadlines in seconds
# are timed by the store's clock alone.
CLOCK_TOLERANCE_MS = 250.0


@dataclass
class Facts:
    """What ``read_facts`` found; a part it could not read holds the reason instead."""

    settings: Settings
    where: str
    nodes: list[NodeFacts] = field(default_factory=list)
    user: str | None = None
    refused: dict[str, str] | None = None
    # Beside the store's keys, what its scripts write elsewhere: the key pattern the user
    # needs (Celery's results, a broker queue on the store's server) -> the commands refused.
    refused_elsewhere: dict[str, dict[str, str]] = field(default_factory=dict)
    cluster: dict[str, str] | None = None
    sentinels: tuple[str, list[tuple[str, dict[str, Any] | str]]] | None = None
    fast_path: bool = False
    backend: str = ""
    local_clock: tuple[float, float] | None = None
    workers: dict[str, dict[str, Any]] | str = field(default_factory=dict)
    # Every live worker's queues (Celery's own ``active_queues``, which a worker without the
    # extension answers too), and the queues the store holds flows of.
    consumers: dict[str, list[str]] = field(default_factory=dict)
    store_queues: list[str] | str = field(default_factory=list)
    # The newest flows of each store queue whose rows are of a newer format than this release's.
    newer: list[tuple[str, str, str]] | str = field(default_factory=list)


def read_facts(state: EchoMQ, workers_timeout: float = 1.0) -> Facts:
    """Everything the checks judge; a Redis error reaching the store itself is raised (the
    command turns it into one line)."""
    settings, client = state.settings, state.client
    facts = Facts(settings, describe(settings))
    facts.nodes = server_info.node_facts(client)
    facts.user = server_info.whoami(client)
    probe = state.keys.probe_key()
    facts.fast_path = writes_results(state)
    commands = server_info.required_commands()
    if not facts.fast_path:
        # The scripts publish only results, on the fast path: no channel is needed (and
        # probed, Redis would log the refusal of one).
        commands.pop("PUBLISH")
    facts.refused = server_info.refused_commands(client, commands, probe, f"{RESULT_PREFIX}doctor")
    if facts.refused is not None:
        facts.refused_elsewhere = _refused_elsewhere(state, facts.fast_path)
    if (settings.redis_url or "").startswith("redis+cluster://"):
        facts.cluster = server_info.cluster_state(client)
    facts.sentinels = server_info.sentinel_view(client)
    facts.backend = safe_url(str(state.app.conf.result_backend or "none"))
    facts.local_clock = server_info.clock_offset(client)
    try:
        facts.store_queues = queues_of(state, None)
    except Exception as exc:  # refused to this user, or a Cluster node's MOVED: said elsewhere
        facts.store_queues = f"{type(exc).__name__}: {exc}"
    try:
        queues = facts.store_queues if isinstance(facts.store_queues, list) else []
        facts.newer = store_format.newer_flows(client, state.keys, queues)
    except Exception as exc:  # refused to this user, or the queues unread: said elsewhere
        facts.newer = f"{type(exc).__name__}: {exc}"
    try:
        facts.workers, facts.consumers = ask_workers(state.app, workers_timeout)
    except Exception as exc:  # the broker unreachable: the workers cannot be asked
        facts.workers = f"{type(exc).__name__}: {exc}"
    return facts


def _refused_elsewhere(state: EchoMQ, fast_path: bool) -> dict[str, dict[str, str]]:
    """The user's rights on the keys the scripts write beside the store's: Celery's result
    keys (the fast path) and the broker's default queue where the broker is a Redis on the
    store's own server with the store's user (a small flow's enqueue pushes its children's
    messages there)."""
    probes: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {}
    if fast_path:
        probes[RESULT_KEYS] = (f"{RESULT_PREFIX}doctor", {"SET": ("K", "v")})
    broker = str(state.app.conf.broker_url or "")
    if broker.startswith(("redis://", "rediss://", "unix://")):
        try:
            on_store = database_on_store_server(state, redis.Redis.from_url(broker))
        except ValueError:  # a URL redis-py does not read (kombu's own options): not compared
            on_store = None
        queue = str(state.app.conf.task_default_queue or "celery")
        if on_store is not None:
            probes[queue] = (queue, {"LPUSH": ("K", "v")})
    found: dict[str, dict[str, str]] = {}
    for pattern, (key, commands) in probes.items():
        refused = server_info.refused_commands(state.client, commands, key, "")
        if refused:
            found[pattern] = refused
    return found


def _each(nodes: list[NodeFacts], bad: dict[str, str]) -> str:
    """``bad`` (address -> what) as text: the node named only where there are several, and
    nodes alike said once."""
    if len(nodes) == 1:
        return next(iter(bad.values()))
    alike: dict[str, list[str]] = {}
    for address, what in bad.items():
        alike.setdefault(what, []).append(address)
    if len(alike) == 1 and len(bad) == len(nodes):
        return f"{next(iter(alike))} (all {len(nodes)} masters)"
    return "; ".join(f"{what} on {', '.join(where)}" for what, where in alike.items())


def check_memory_policy(nodes: list[NodeFacts]) -> Finding:
    policies = {n.address: str(n.info.get("maxmemory_policy", "noeviction")) for n in nodes}
    bad = {a: p for a, p in policies.items() if p != "noeviction"}
    if not bad:
        return Finding("memory policy", "ok", "noeviction: a full Redis refuses writes, never "
                       "deletes a key")  # fmt: skip
    return Finding(
        "memory policy",
        "wrong",
        f"{_each(nodes, bad)}: when its memory is full, Redis deletes keys, held parents among "
        "them, and their flows never finish",
        "set maxmemory-policy noeviction (CONFIG SET maxmemory-policy noeviction, and in "
        "redis.conf or the provider's parameter group)",
    )


def _persistence(node: NodeFacts) -> tuple[bool | None, str]:
    """(persisted: True, False, or None where it cannot be told; what it is)."""
    if node.info.get("aof_enabled") in (1, "1"):
        fsync = (node.config or {}).get("appendfsync")
        return True, "AOF" + (f" (appendfsync {fsync})" if fsync else "")
    if node.config is None:
        return None, "AOF off; snapshots unknown (CONFIG GET refused)"
    save = (node.config.get("save") or "").strip()
    if save:
        return True, f"snapshots (save {save}; a crash loses the writes since the last one)"
    return False, "none (no AOF, no snapshots): a restart loses every flow"


def check_persistence(nodes: list[NodeFacts]) -> Finding:
    seen = {n.address: _persistence(n) for n in nodes}
    if all(ok for ok, _ in seen.values()):
        return Finding("persistence", "ok", _each(nodes, {a: w for a, (_, w) in seen.items()}))
    bad = {a: w for a, (ok, w) in seen.items() if not ok}
    change = "appendonly yes (or a save schedule, e.g. save 60 1000), in redis.conf"
    if all(ok is None for ok, _ in seen.values() if not ok):
        return Finding("persistence", "note", _each(nodes, bad), "check " + change)
    return Finding("persistence", "wrong", _each(nodes, bad), change)


def check_version(nodes: list[NodeFacts]) -> Finding:
    found = {n.address: server_of(n.info) for n in nodes}
    bad = {a: str(server) for a, server in found.items() if server.compat < MIN_SERVER}
    names = sorted({str(server) for server in found.values()})
    oldest = dotted(MIN_SERVER)
    if not bad:
        return Finding(
            "server version", "ok", f"{', '.join(names)} (Redis {oldest} or newer needed)"
        )
    return Finding(
        "server version",
        "wrong",
        f"{_each(nodes, bad)}: older than Redis {oldest}, the oldest this release runs on (a "
        "process's first use of the store refuses it)",
        f"upgrade to Redis {oldest} or newer (or any Valkey)",
    )


def check_advisories(nodes: list[NodeFacts]) -> Finding:
    """The published Lua advisories each server is open to by its version (a note: see the
    module's docstring)."""
    servers = {n.address: server_of(n.info) for n in nodes}
    open_to = {a: open_advisories(server) for a, server in servers.items()}
    if not any(open_to.values()):
        known = sorted({cve for a in server_versions.LUA_ADVISORIES for cve in a.cves})
        names = ", ".join(sorted({str(s) for s in servers.values()}))
        return Finding("Lua advisories", "ok", f"{names}: past {', '.join(known)} by version")
    said = {
        address: f"{servers[address]} is open by version to "
        + "; ".join(
            f"{', '.join(a.cves)} ({a.what}; fixed in {a.fixes(servers[address])})" for a in found
        )
        for address, found in open_to.items()
        if found
    }
    return Finding(
        "Lua advisories",
        "note",
        f"{_each(nodes, said)}. A distribution may have back-ported the fixes and kept the "
        "version (Debian's 7.0.15-1~deb12u10 has them): a warning to verify, not a proof",
        "upgrade to a fixed release, or confirm the package has the fixes (its changelog names "
        "the CVEs); every transition runs as Lua, so the store's user can reach them",
    )


def _config_of(node: NodeFacts) -> Callable[[str], str | None]:
    """``node``'s CONFIG as read (None for each setting where CONFIG GET was refused)."""
    return lambda name: (node.config or {}).get(name)


def check_writes(nodes: list[NodeFacts]) -> Finding:
    """Whether a primary refuses writes now (store/server_info.py's ``refusals_of``, the one
    judgement ``show`` and the dashboard also print)."""
    refusals = [r for n in nodes for r in refusals_of(n.address, n.info, _config_of(n))]
    if not refusals:
        return Finding("writes", "ok", "accepted (no OOM, replica, failed save or missing replica)")
    by_node: dict[str, list[str]] = {}
    for r in refusals:
        by_node.setdefault(r.address, []).append(r.why)
    return Finding(
        "writes",
        "wrong",
        f"{_each(nodes, {a: '; '.join(w) for a, w in by_node.items()})}: every transition is "
        "refused, so no flow starts or moves",
        "; ".join(dict.fromkeys(r.heals for r in refusals)),
    )


def _online(info: dict[str, Any]) -> int:
    return sum(
        1
        for key, value in info.items()
        if key.startswith("slave") and isinstance(value, dict) and value.get("state") == "online"
    )


def check_replicas(nodes: list[NodeFacts], wanted: int) -> Finding:
    roles = {n.address: str(n.info.get("role", "master")) for n in nodes}
    replica_of = {a: r for a, r in roles.items() if r != "master"}
    if replica_of:
        return Finding(
            "replicas",
            "wrong",
            f"{_each(nodes, {a: f'a {r}' for a, r in replica_of.items()})}: the store's URL "
            "names a replica, which refuses writes",
            "point echomq_redis_url at the primary (sentinel:// follows it through failovers)",
        )
    online = {n.address: _online(n.info) for n in nodes}
    fewest = min(online.values())
    counts = _each(nodes, {a: f"{c} online" for a, c in online.items()})
    if fewest < wanted:
        return Finding(
            "replicas",
            "wrong",
            f"{counts}, echomq_min_replicas={wanted}: every transition waits for {wanted} and "
            "fails with ReplicationError",
            f"add replicas (replicaof) until {wanted} are online, or lower echomq_min_replicas",
        )
    if wanted == 0 and fewest > 0:
        return Finding(
            "replicas",
            "note",
            f"{counts}, echomq_min_replicas=0: a failover may lose the last transitions",
            "echomq_min_replicas = 1 waits for one replica after each transition",
        )
    return Finding("replicas", "ok", f"{counts}, echomq_min_replicas={wanted}")


def check_acl(
    user: str | None,
    refused: dict[str, str] | None,
    prefix: str,
    elsewhere: dict[str, dict[str, str]] | None = None,
) -> Finding:
    who = f"user {user!r}" if user else "the store's user"
    if refused is None:
        return Finding(
            "ACL",
            "note",
            f"{who} may not run MULTI, so its rights could not be probed",
            f"check with ACL DRYRUN {user or '<user>'} EVALSHA ... as an administrator",
        )
    elsewhere = elsewhere or {}
    if not refused and not elsewhere:
        return Finding("ACL", "ok", f"{who} may run every command the store sends, on its keys")
    # Redis says which right is missing: to run the command, or to touch a key or a channel.
    commands = sorted(n for n, why in refused.items() if "command" in why)
    keys = sorted(n for n, why in refused.items() if "command" not in why and "key" in why)
    channels = sorted(n for n, why in refused.items() if "command" not in why and "channel" in why)
    said, grant = [], [f"+{name.lower()}" for name in commands]
    if commands:
        said.append(f"may not run {', '.join(commands)}")
    if keys:
        said.append(f"may not touch the keys {prefix}:* ({', '.join(keys)} refused)")
        grant.append(f"~{prefix}:*")
    if channels:
        said.append(f"may not publish on the channels {RESULT_KEYS}")
        grant.append(f"&{RESULT_KEYS}")
    for pattern, what in sorted(elsewhere.items()):
        whose = "Celery's results" if pattern == RESULT_KEYS else "the broker's queue"
        said.append(f"may not write {whose} {pattern} ({', '.join(sorted(what))} refused)")
        grant.append(f"~{pattern}")
    return Finding(
        "ACL",
        "wrong",
        f"{who} " + "; ".join(said),
        f"ACL SETUSER {user or '<user>'} {' '.join(grant)}",
    )


def check_mode(facts: Facts) -> Finding:
    url = facts.settings.redis_url or ""
    if url.startswith("redis+cluster://"):
        cluster = facts.cluster or {}
        state, size = cluster.get("cluster_state", "?"), cluster.get("cluster_size", "?")
        if state != "ok":
            return Finding(
                "mode",
                "wrong",
                f"Redis Cluster in state {state}",
                "bring every slot's master back (CLUSTER INFO names what fails)",
            )
        return Finding("mode", "ok", f"Redis Cluster, {size} masters, state ok")
    if facts.sentinels is not None:
        name, views = facts.sentinels
        answered = [v for _, v in views if isinstance(v, dict)]
        quorum = max((int(v.get("quorum", 1)) for v in answered), default=1)
        detail = f"Sentinel, master {name!r}: {len(answered)} of {len(views)} Sentinels answer"
        if len(answered) < quorum:
            silent = ", ".join(w for w, v in views if not isinstance(v, dict))
            return Finding("mode", "wrong", f"{detail}, quorum {quorum}: no failover can be "
                           f"agreed", f"bring back the Sentinels at {silent}")  # fmt: skip
        return Finding("mode", "ok", f"{detail}, quorum {quorum}")
    if any(n.info.get("cluster_enabled") in (1, "1") for n in facts.nodes):
        return Finding(
            "mode",
            "wrong",
            "the store's server is a Redis Cluster node reached as a single server: keys of "
            "other slots answer MOVED",
            "echomq_redis_url = 'redis+cluster://HOST:PORT'",
        )
    return Finding("mode", "ok", "a single server (no Sentinel, no Cluster)")


def check_backend(facts: Facts) -> Finding:
    if facts.fast_path:
        return Finding("result backend", "ok", f"{facts.backend}: fast path (the store writes "
                       "flow jobs' results in the script that completes them)")  # fmt: skip
    if not facts.settings.child_results:
        return Finding("result backend", "ok", "echomq_child_results=False: children store no "
                       "result; values reach the parent through the store")  # fmt: skip
    if facts.backend == "none":
        return Finding("result backend", "ok", "none: no result to write")
    if facts.cluster is not None or facts.sentinels is not None:
        return Finding(
            "result backend",
            "note",
            f"{facts.backend}: through Celery's backend (the fast path needs a store on a "
            "plain redis:// URL, not a Cluster or Sentinel)",
        )
    return Finding(
        "result backend",
        "note",
        f"{facts.backend}: not Celery's plain Redis backend on the store's server and database "
        "(a round trip and five commands more per job)",
        f"result_backend = {facts.where!r} (the store's own database) to take the fast path",
    )


def check_clock(facts: Facts) -> Finding:
    tolerance = CLOCK_TOLERANCE_MS
    offsets: dict[str, float] = {}
    if facts.local_clock is not None:
        offset, trip = facts.local_clock
        offsets["this host"] = abs(offset) - trip / 2
    asked = ""
    if isinstance(facts.workers, str):
        asked = f"; workers not asked ({facts.workers})"
    else:
        # A worker without the extension has no clock to measure: the workers check names it.
        workers = {n: a for n, a in facts.workers.items() if has_extension(a)}
        for name, answer in sorted(workers.items()):
            if "offset_ms" in answer:
                offsets[name] = abs(float(answer["offset_ms"])) - float(answer["rtt_ms"]) / 2
        failed = sorted(n for n, a in workers.items() if "offset_ms" not in a)
        answered = len(workers) - len(failed)
        asked = f"; {answered} worker(s) answered" + (
            f", {', '.join(failed)} could not read the store's clock" if failed else ""
        )
    if not offsets:
        return Finding("clock", "note", "no clock measured" + asked, "start a worker")
    worst_name = max(offsets, key=lambda n: offsets[n])
    worst = max(0.0, offsets[worst_name])
    detail = f"largest offset from the store's clock {worst:.0f} ms ({worst_name}){asked}"
    if worst <= tolerance:
        return Finding("clock", "ok", f"{detail}; within {tolerance:.0f} ms")
    return Finding(
        "clock",
        "wrong",
        f"{detail}: beyond {tolerance:.0f} ms, aware-datetime deadlines, countdowns and eta "
        "run that much early or late (leases use the store's clock)",
        f"synchronise {worst_name}'s clock (NTP: chrony or systemd-timesyncd)",
    )


def check_format(newer: list[tuple[str, str, str]] | str) -> Finding:
    """Whether a newer release wrote flows this one would leave untouched (its workers skip
    them): the newest flows of each queue, by their parent's format."""
    known = store_format.STORE_FORMAT
    if isinstance(newer, str):
        return Finding("store format", "note", f"format {known}; flows unread: {newer}")
    if not newer:
        return Finding("store format", "ok", f"format {known}; no newer flow among the newest")
    queues = sorted({queue for queue, _, _ in newer})
    queue, parent, found = newer[0]
    return Finding(
        "store format",
        "wrong",
        f"{len(newer)} of the newest flows (queues {', '.join(queues)}) are of store format "
        f"{found} (e.g. {parent} on {queue}), newer than format {known}, the newest this "
        "celery-echomq knows: a worker of this release leaves them untouched",
        "upgrade celery-echomq here and on every worker of those queues to the release that "
        "wrote them",
    )


def diagnose(facts: Facts) -> list[Finding]:
    """Every check, in the order the command prints them."""
    return [
        check_memory_policy(facts.nodes),
        check_persistence(facts.nodes),
        check_version(facts.nodes),
        check_advisories(facts.nodes),
        check_writes(facts.nodes),
        check_replicas(facts.nodes, facts.settings.min_replicas),
        check_acl(facts.user, facts.refused, facts.settings.key_prefix, facts.refused_elsewhere),
        check_mode(facts),
        check_backend(facts),
        check_clock(facts),
        check_workers(facts.workers, facts.consumers, facts.store_queues),
        check_format(facts.newer),
    ]


def as_json(where: str, findings: list[Finding]) -> dict[str, Any]:
    return {
        "store": where,
        "ok": not any(f.status == "wrong" for f in findings),
        "findings": [dataclasses.asdict(f) for f in findings],
    }
