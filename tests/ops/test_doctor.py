"""The deployment checks itself: ``celery echomq doctor`` on real servers and a real worker,
and the WARNING a worker logs at start on a store that may evict keys.

A good deployment is a redis-server with AOF, the result backend on the store's database,
a worker answering for its clock. A fleet half upgraded has a worker whose app never calls
``install`` on a queue the store holds flows of. A bad one is a redis-server with
``allkeys-lru``, no persistence, an ACL user without EVALSHA, ``echomq_min_replicas=1`` and
no replica.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_echomq.config import Settings
from celery_echomq.embedded import RedisSentinelServer, RedisServer, wait_replicated
from celery_echomq.ops.doctor import CLOCK_TOLERANCE_MS, Facts, check_clock
from celery_echomq.ops.fleet import check_workers
from celery_echomq.store.server_info import required_commands, script_commands
from tests.helpers import ROOT, Env, Worker, logged

pytestmark = pytest.mark.e2e


def doctor(env: Env, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """``celery -A tests.proj echomq doctor ARGS`` as a subprocess, as an operator types it."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.proj", "echomq", "doctor", *args],
        cwd=ROOT,
        env=env.environ(**extra),
        capture_output=True,
        text=True,
        timeout=120,
    )


def statuses(out: subprocess.CompletedProcess[str]) -> dict[str, dict[str, str]]:
    report = json.loads(out.stdout)
    return {f["check"]: f for f in report["findings"]}


@pytest.fixture
def good() -> Iterator[dict[str, str]]:
    """A deployment that passes: AOF, noeviction, the backend on the store's database."""
    with RedisServer(None, "--appendonly", "yes") as server:
        yield {
            "ECHOMQ_T_BROKER": server.url(0),
            "ECHOMQ_T_BACKEND": server.url(1),
            "ECHOMQ_T_STORE": server.url(1),
        }


@pytest.fixture
def bad() -> Iterator[tuple[dict[str, str], Any]]:
    """A deployment that fails: allkeys-lru, no persistence, a user without EVALSHA, one
    replica required and none there, the result backend on another database."""
    with RedisServer(None, "--maxmemory-policy", "allkeys-lru") as server:
        server.client().execute_command(
            "ACL", "SETUSER", "flows", "on", ">pw", "~*", "&*", "+@all", "-evalsha"
        )
        yield (
            {
                "ECHOMQ_T_BROKER": server.url(0),
                "ECHOMQ_T_BACKEND": server.url(2),
                "ECHOMQ_T_STORE": f"redis://flows:pw@127.0.0.1:{server.port}/1",
                "ECHOMQ_T_MIN_REPLICAS": "1",
            },
            server,
        )


def _worker(env: Env, urls: dict[str, str]) -> Worker:
    return Worker(env, queues=f"doctor-{uuid.uuid4().hex[:8]}", concurrency=1, extra_env=urls)


def test_doctor_passes_a_good_deployment_and_asks_the_workers(
    env: Env, good: dict[str, str]
) -> None:
    worker = _worker(env, good)
    try:
        text = doctor(env, **good)
        as_json = doctor(env, "--json", **good)
    finally:
        worker.stop()
    print(f"$ celery echomq doctor\n{text.stdout}")  # what an operator reads (-s)
    assert text.returncode == 0, text.stdout + text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == f"flow store {good['ECHOMQ_T_STORE']}"
    # Every line ok but the Lua advisories' note: the suite's Redis 6.2.14 is open to them by
    # its version, which is a note to verify, not a failure.
    assert len(lines) == 13, text.stdout
    assert [line.split()[0] for line in lines[1:]].count("ok") == 11, text.stdout
    assert as_json.returncode == 0
    found = statuses(as_json)
    assert list(found) == [
        "memory policy", "persistence", "server version", "Lua advisories", "writes",
        "replicas", "ACL", "mode", "result backend", "clock", "workers", "store format",
    ]  # fmt: skip
    assert {n for n, f in found.items() if f["status"] != "ok"} == {"Lua advisories"}
    advisories = found["Lua advisories"]
    assert advisories["status"] == "note"
    assert advisories["detail"].startswith("Redis 6.2.14 is open by version to CVE-2025-49844")
    assert "fixed in Redis 6.2.20, 7.2.11, 7.4.6, 8.0.4, 8.2.2" in advisories["detail"]
    assert "back-ported" in advisories["detail"] and "changelog" in advisories["change"]
    assert found["writes"]["detail"].startswith("accepted")
    assert found["persistence"]["detail"].startswith("AOF")
    assert "fast path" in found["result backend"]["detail"]
    assert "1 worker(s) answered" in found["clock"]["detail"]
    assert found["workers"]["detail"].startswith("1 worker(s) with celery-echomq")
    # The worker found nothing to warn of at its start.
    assert "maxmemory-policy" not in worker.output()


def test_doctor_names_what_is_wrong_and_what_to_change_with_exit_1(
    env: Env, bad: tuple[dict[str, str], Any]
) -> None:
    urls, server = bad
    before = server.client().info("keyspace")
    text = doctor(env, **urls)
    as_json = doctor(env, "--json", **urls)
    print(f"$ celery echomq doctor\n{text.stdout}")  # what an operator reads (-s)
    assert text.returncode == 1 and as_json.returncode == 1, text.stdout + text.stderr
    assert "Traceback" not in text.stderr
    found = statuses(as_json)
    assert json.loads(as_json.stdout)["ok"] is False
    wrong = {name for name, f in found.items() if f["status"] == "wrong"}
    assert wrong == {"memory policy", "persistence", "replicas", "ACL"}
    assert found["result backend"]["status"] == "note"
    assert {
        found[n]["status"]
        for n in ("server version", "writes", "mode", "clock", "workers", "store format")
    } == {"ok"}
    assert "allkeys-lru" in found["memory policy"]["detail"]
    assert "noeviction" in found["memory policy"]["change"]
    assert "appendonly yes" in found["persistence"]["change"]
    assert "echomq_min_replicas=1" in found["replicas"]["detail"]
    assert found["ACL"]["detail"] == "user 'flows' may not run EVALSHA"
    assert found["ACL"]["change"] == "ACL SETUSER flows +evalsha"
    # One line per check, each wrong one with its change.
    lines = text.stdout.splitlines()[1:]
    assert len(lines) == 12
    assert sum(line.startswith("WRONG") for line in lines) == 4
    assert all("-> change: " in line for line in lines if line.startswith(("WRONG", "note")))
    # The doctor only read: the probe's transaction was discarded, nothing was written to the
    # store's database or the backend's (the broker's holds the control reply queue).
    after = server.client().info("keyspace")
    assert [after.get(f"db{n}") for n in (1, 2)] == [before.get(f"db{n}") for n in (1, 2)]


def test_doctor_names_the_keys_a_user_may_not_touch(env: Env, good: dict[str, str]) -> None:
    with RedisServer() as server:
        server.client().execute_command(
            "ACL", "SETUSER", "elsewhere", "on", ">pw", "~other:*", "&*", "+@all"
        )
        store = f"redis://elsewhere:pw@127.0.0.1:{server.port}/1"
        out = doctor(env, "--json", **{**good, "ECHOMQ_T_STORE": store})
    assert out.returncode == 1, out.stderr
    acl = statuses(out)["ACL"]
    assert acl["status"] == "wrong"
    assert acl["detail"].startswith("user 'elsewhere' may not touch the keys emq:* (")
    assert "EVALSHA" in acl["detail"] and "HSET" in acl["detail"]
    assert acl["change"] == "ACL SETUSER elsewhere ~emq:*"


def test_doctor_names_each_worker_without_the_extension_on_a_queue_of_the_store(
    env: Env, good: dict[str, str]
) -> None:
    tag = uuid.uuid4().hex[:8]
    queue, elsewhere = f"fleet-{tag}", f"elsewhere-{tag}"
    # A queue the store holds flows of (enqueue_flow adds each flow's queue to this set).
    redis.Redis.from_url(good["ECHOMQ_T_STORE"]).sadd("emq:queues", queue)
    plain = {**good, "ECHOMQ_T_PLAIN": "1"}
    started: list[Worker] = []
    try:
        for name, queues, urls in (
            (f"new-{tag}", queue, good),  # upgraded
            (f"old-{tag}", queue, plain),  # not yet: runs the store's flows as plain tasks
            (f"aside-{tag}", elsewhere, plain),  # not yet, but no flow goes where it listens
        ):
            started.append(Worker(env, queues=queues, concurrency=1, name=name, extra_env=urls))
        text = doctor(env, **good)
        as_json = doctor(env, "--json", **good)
    finally:
        for worker in started:
            worker.stop()
    print(f"$ celery echomq doctor\n{text.stdout}")  # what an operator reads (-s)
    assert text.returncode == 1 and as_json.returncode == 1, text.stdout + text.stderr
    wrong = [line for line in text.stdout.splitlines() if line.startswith("WRONG")]
    assert len(wrong) == 1 and wrong[0].startswith("WRONG  workers: without celery-echomq")
    assert f"old-{tag}@{socket.gethostname()} (queues {queue})" in wrong[0]
    assert f"new-{tag}" not in wrong[0] and f"aside-{tag}" not in wrong[0]
    assert "celery_echomq.install(app)" in wrong[0]
    found = statuses(as_json)
    # Only the worker with the extension has a clock to measure; the others are not "failed".
    assert found["clock"]["status"] == "ok"
    assert "; 1 worker(s) answered;" in found["clock"]["detail"]
    assert "could not read" not in found["clock"]["detail"]


def test_a_worker_warns_once_at_start_of_a_store_that_evicts(
    env: Env, bad: tuple[dict[str, str], Any]
) -> None:
    urls, _ = bad
    worker = _worker(env, {**urls, "ECHOMQ_T_MIN_REPLICAS": "0"})
    try:
        logged(worker, "maxmemory-policy")  # checked beside the started worker, not before
        time.sleep(1)
        log = worker.output()
    finally:
        worker.stop()
    warned = [line for line in log.splitlines() if "maxmemory-policy" in line]
    assert len(warned) == 1, log
    assert "WARNING" in warned[0] and "allkeys-lru" in warned[0] and "noeviction" in warned[0]


def test_doctor_tells_a_cluster_from_a_cluster_node_reached_as_one_server(
    env: Env, redis_cluster: str
) -> None:
    # The first of the URL's seed nodes, reached as a plain server.
    host = redis_cluster.split("//", 1)[1].split("/", 1)[0].split(",", 1)[0]
    as_cluster = statuses(doctor(env, "--json", ECHOMQ_T_STORE=redis_cluster))
    assert as_cluster["mode"]["status"] == "ok"
    assert as_cluster["mode"]["detail"] == "Redis Cluster, 3 masters, state ok"
    # Every master is read: three nodes' policies.
    assert as_cluster["memory policy"]["status"] == "ok"
    as_node = doctor(env, "--json", ECHOMQ_T_STORE=f"redis://{host}/0")
    assert as_node.returncode == 1
    mode = statuses(as_node)["mode"]
    assert mode["status"] == "wrong" and "redis+cluster://" in mode["change"]


def test_doctor_counts_the_sentinels_and_replicas_of_a_sentinel_store(env: Env) -> None:
    with RedisSentinelServer(replicas=1, sentinels=3) as servers:
        urls = {
            "ECHOMQ_T_STORE": servers.url(1),
            "ECHOMQ_T_MASTER_NAME": servers.master_name,
            "ECHOMQ_T_MIN_REPLICAS": "1",
        }
        wait_replicated(servers.redis_client(servers.primary_port()), 1)
        found = statuses(doctor(env, "--json", **urls))
        assert found["mode"] == {
            "check": "mode",
            "status": "ok",
            "detail": "Sentinel, master 'mymaster': 3 of 3 Sentinels answer, quorum 2",
            "change": "",
        }
        assert found["replicas"]["status"] == "ok"
        assert found["replicas"]["detail"] == "1 online, echomq_min_replicas=1"
        # Two Sentinels gone: the one left cannot agree a failover alone.
        gone = servers.sentinels[:2]
        for sentinel in gone:
            sentinel.stop()
        out = doctor(env, "--json", **urls)
        assert out.returncode == 1
        mode = statuses(out)["mode"]
        assert mode["status"] == "wrong"
        assert mode["detail"].startswith("Sentinel, master 'mymaster': 1 of 3 Sentinels answer")
        assert all(f"127.0.0.1:{s.port}" in mode["change"] for s in gone)


# --- The pure checks -------------------------------------------------------------------------


def test_the_clock_check_names_the_worker_furthest_off() -> None:
    facts = Facts(Settings(redis_url="redis://x"), "redis://x", local_clock=(2.0, 1.0))
    facts.workers = {
        "celery@a": {"offset_ms": -30.0, "rtt_ms": 2.0},
        "celery@b": {"offset_ms": CLOCK_TOLERANCE_MS + 200, "rtt_ms": 4.0},
    }
    finding = check_clock(facts)
    assert finding.status == "wrong"
    assert "(celery@b)" in finding.detail and "celery@b" in finding.change
    # Within the tolerance, once the measure's own uncertainty (half its round trip) is taken.
    facts.workers = {"celery@b": {"offset_ms": CLOCK_TOLERANCE_MS + 1, "rtt_ms": 4.0}}
    assert check_clock(facts).status == "ok"
    facts.workers = "OperationalError: broker down"
    finding = check_clock(facts)
    assert finding.status == "ok" and "workers not asked (OperationalError" in finding.detail


def test_the_workers_check_knows_a_host_without_the_package() -> None:
    workers: dict[str, dict[str, Any]] = {
        "new@a": {"offset_ms": 0.0, "rtt_ms": 1.0},
        "old@b": {"error": "KeyError('echomq_clock')"},  # kombu's answer: no such command
        "store-down@c": {"error": "ConnectionError: refused"},  # has it; cannot read the store
    }
    consumers = {
        "new@a": ["flows"],
        "old@b": ["flows", "mail"],
        "store-down@c": ["flows"],
        "silent@d": ["flows"],  # answers Celery's own inspect, not the extension's command
        "mailer@e": ["mail"],
    }
    finding = check_workers(workers, consumers, ["flows"])
    assert finding.status == "wrong"
    assert "old@b (queues flows); silent@d (queues flows)" in finding.detail
    assert "new@a" not in finding.detail and "store-down@c" not in finding.detail
    assert "mailer@e" not in finding.detail
    assert (
        check_workers(workers, {"new@a": ["flows"], "mailer@e": ["mail"]}, ["flows"]).status == "ok"
    )
    assert check_workers("OperationalError: broker down", consumers, ["flows"]).status == "note"


def test_every_command_of_the_scripts_is_probed() -> None:
    needed = required_commands()
    assert script_commands() <= needed.keys()
    assert {"EVALSHA", "SCRIPT|LOAD", "HSET", "ZADD", "TIME", "PUBLISH"} <= needed.keys()
    assert "EVAL" not in needed  # redis-py loads a missing script (SCRIPT LOAD), never EVALs


def test_doctor_names_flows_a_newer_release_wrote_as_wrong(env: Env, good: dict[str, str]) -> None:
    from celery_echomq.store.store_format import STORE_FORMAT
    from tests.helpers import KEYS

    store, queue = redis.Redis.from_url(good["ECHOMQ_T_STORE"]), f"newer-{uuid.uuid4().hex[:8]}"
    parent = f"JOB{uuid.uuid4().hex}"
    # What a newer release's enqueue leaves: its queue registered, its flow in the queue's
    # recent index, the parent's row of its format.
    store.sadd("emq:queues", queue)
    store.zadd(KEYS.queue_key(queue, "recent"), {parent: 1})
    store.hset(KEYS.job_key(queue, parent), mapping={"state": "awaiting_children"})
    assert statuses(doctor(env, "--json", **good))["store format"]["status"] == "ok"
    store.hset(KEYS.job_key(queue, parent), "format", str(STORE_FORMAT + 1))
    text = doctor(env, **good)
    print(f"$ celery echomq doctor\n{text.stdout}")  # what an operator reads (-s)
    assert text.returncode == 1, text.stdout + text.stderr
    wrong = [line for line in text.stdout.splitlines() if line.startswith("WRONG")]
    assert len(wrong) == 1 and wrong[0].startswith("WRONG  store format: 1 of the newest flows")
    assert f"store format {STORE_FORMAT + 1} (e.g. {parent} on {queue})" in wrong[0]
    assert f"newer than format {STORE_FORMAT}" in wrong[0]
    assert "-> change: upgrade celery-echomq" in wrong[0]


# --- The least-privilege user of docs/production.md, on a real server and a real worker ---------

PRODUCE = """
from celery_echomq import flow
from tests import proj
print([flow(proj.tsum.s(), [proj.add.s(i, i) for i in range(8)]).apply_async().get(timeout=90)
       for _ in range(2)])
"""


def _documented_user(server: Any, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """The ACL user of docs/production.md on ``server`` (less ``drop``), and the URLs of a
    deployment whose store it is (the broker and the backend keep the default user)."""
    (line,) = [
        line
        for line in (ROOT / "docs" / "production.md").read_text().splitlines()
        if line.startswith("ACL SETUSER ")
    ]
    words = [w for w in line.replace(">PASSWORD", ">pw").split() if w not in drop]
    server.client().execute_command(*words)
    return {
        "ECHOMQ_T_BROKER": server.url(0),
        "ECHOMQ_T_BACKEND": server.url(1),
        "ECHOMQ_T_STORE": f"redis://flows:pw@127.0.0.1:{server.port}/1",
    }


def test_a_user_with_exactly_the_documented_rights_runs_flows_and_doctor_finds_none_missing(
    env: Env,
) -> None:
    with RedisServer(None, "--appendonly", "yes") as server:
        urls = _documented_user(server)
        worker = Worker(env, queues="celery", concurrency=2, name="acl", extra_env=urls)
        try:
            produced = subprocess.run(
                [sys.executable, "-c", PRODUCE],
                cwd=ROOT,
                env=env.environ(**urls),
                capture_output=True,
                text=True,
                timeout=180,
            )
            text = doctor(env, **urls)
            as_json = doctor(env, "--json", **urls)
        finally:
            worker.stop()
        denied = server.client().execute_command("ACL", "LOG")
    print(f"$ celery echomq doctor\n{text.stdout}")  # what an operator reads (-s)
    assert produced.returncode == 0, produced.stdout + produced.stderr
    assert produced.stdout.strip() == "[56, 56]"
    # Nothing the worker or the producer needs was denied: only what the doctor goes without
    # (CONFIG GET, ACL WHOAMI: it says what it could not read), and what redis-py asks of a
    # new connection and goes on without (CLIENT SETINFO and the like).
    refused = {(e[b"reason"], e[b"object"]) for e in denied}
    assert refused <= {(b"command", b"config"), (b"command", b"acl"), (b"command", b"client")}
    assert text.returncode == 0, text.stdout + text.stderr
    found = statuses(as_json)
    assert found["ACL"] == {
        "check": "ACL",
        "status": "ok",
        "detail": "the store's user may run every command the store sends, on its keys",
        "change": "",
    }
    assert found["workers"]["detail"].startswith("1 worker(s) with celery-echomq")


def test_a_user_missing_a_documented_right_gets_a_doctor_line_naming_it(env: Env) -> None:
    with RedisServer(None, "--appendonly", "yes") as server:
        urls = _documented_user(server, drop=("+hincrby", "+script|load"))
        text = doctor(env, **urls)
        as_json = doctor(env, "--json", **urls)
        # The user shared with the result backend (the fast path): the results' keys and
        # channels, which the store's own line leaves out, are missing.
        shared = {**urls, "ECHOMQ_T_BACKEND": urls["ECHOMQ_T_STORE"]}
        _documented_user(server)
        fast = statuses(doctor(env, "--json", **shared))
    print(f"$ celery echomq doctor\n{text.stdout}")  # what an operator reads (-s)
    assert text.returncode == 1, text.stdout + text.stderr
    acl = statuses(as_json)["ACL"]
    assert acl["status"] == "wrong"
    assert acl["detail"] == "the store's user may not run HINCRBY, SCRIPT|LOAD"
    assert acl["change"] == "ACL SETUSER <user> +hincrby +script|load"
    wrong = [line for line in text.stdout.splitlines() if line.startswith("WRONG")]
    assert wrong == [f"WRONG  ACL: {acl['detail']} -> change: {acl['change']}"]
    assert "fast path" in fast["result backend"]["detail"]
    assert fast["ACL"]["detail"] == (
        "the store's user may not publish on the channels celery-task-meta-*; may not write "
        "Celery's results celery-task-meta-* (SET refused)"
    )
    assert fast["ACL"]["change"] == ("ACL SETUSER <user> &celery-task-meta-* ~celery-task-meta-*")
