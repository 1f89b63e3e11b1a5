"""A highly available flow store: Sentinel URLs, riding through a failover, min_replicas.

Every server here is a real redis-server from the bundled binary on a free loopback port: a
primary, replicas and three Sentinels (``RedisSentinelServer``), or a Redis Cluster with a
replica per master. The failover tests SIGKILL the primary (a master) while flows keep
arriving and real workers run them; the broker and the result backend stay on the suite's
Redis, only the flow store fails over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult
from redis.sentinel import SentinelManagedSSLConnection

import celery_echomq
from celery_echomq import StoreUnavailableError, flow
from celery_echomq.config import (
    Settings,
    parse_cluster_url,
    parse_sentinel_url,
    read_settings,
    safe_url,
)
from celery_echomq.embedded import (
    RedisClusterServer,
    RedisSentinelServer,
    RedisServer,
    wait_replicated,
)
from celery_echomq.errors import ConfigError, ReplicationError, StoreConnectionError
from celery_echomq.store.connection import make_client
from celery_echomq.store.keyspace import Keyspace, new_job_id
from celery_echomq.store.loader import load_source
from celery_echomq.store.scripts import ParentRef, Scripts
from tests.helpers import KEYS, LOGDIR, ROOT, Env, Worker, logged, runs_in_log, store_of

LEASE = 60_000
TTL = 600
# The failover tests' stall timeout: recovery repairs what a failover lost after this long;
# well above any wait of a message in the broker there, so nothing is re-run needlessly.
STALL = 15.0


def _text(raw: Any) -> str | None:
    return raw.decode() if isinstance(raw, bytes) else raw


def conf(**settings: Any) -> dict[str, Any]:
    """A Celery-like conf: ``read_settings`` only calls ``.get``."""
    return settings


# --- Settings: Celery's form of a Sentinel URL ----------------------------------------------


def test_sentinel_url_is_read_in_celerys_form() -> None:
    url = "sentinel://h1:26379;sentinel://h2:26380/2"
    settings = read_settings(
        conf(echomq_redis_url=url, echomq_transport_options={"master_name": "mymaster"})
    )
    assert settings.redis_url == url
    assert settings.transport_options["master_name"] == "mymaster"
    parsed = parse_sentinel_url(url)
    assert parsed.hosts == (("h1", 26379), ("h2", 26380))
    assert parsed.db == 2
    assert parsed.password is None
    with_password = parse_sentinel_url("sentinel://:s%40cret@h1:1/3;sentinel://:s%40cret@h2:2")
    assert with_password.password == "s@cret"
    assert with_password.db == 3
    # Defaults: no replicas waited for, a bounded retry.
    assert settings.min_replicas == 0
    assert settings.store_retry_timeout == 20.0


def test_sentinel_url_without_master_name_is_refused_naming_the_setting() -> None:
    url = "sentinel://h1:26379;sentinel://h2:26379/2"
    with pytest.raises(ConfigError, match=r'echomq_transport_options\["master_name"\]'):
        read_settings(conf(echomq_redis_url=url))
    app = Celery("nomaster", set_as_current=False)
    app.conf.echomq_redis_url = url
    state = celery_echomq.install(app)  # settings are read at first use, as Celery's are
    with pytest.raises(ConfigError, match="master_name"):
        _ = state.settings


def test_sentinel_broker_url_is_a_fallback_with_its_transport_options() -> None:
    url = "sentinel://:pw@h1:26379;sentinel://:pw@h2:26379/4"
    settings = read_settings(
        conf(
            broker_url=url,
            # kombu's own options sit beside master_name and are not the store's business
            broker_transport_options={"master_name": "cache", "visibility_timeout": 3600},
        )
    )
    assert settings.redis_url == url
    assert dict(settings.transport_options) == {"master_name": "cache"}
    with pytest.raises(ConfigError, match=r'broker_transport_options\["master_name"\]'):
        read_settings(conf(broker_url=url))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"echomq_transport_options": {"master_name": "m", "master-name": "m"}},
            r"unknown keys \['master-name'\].*allowed: master_name",
        ),
        ({"echomq_redis_url": "sentinel://h1:1/2;sentinel://h2:2/3"}, "different dbs"),
        ({"echomq_redis_url": "sentinel://h1:1;redis://h2:2"}, "every part"),
        ({"echomq_redis_url": "sentinel://h1:1/x"}, "database must be a number"),
        ({"echomq_redis_url": "sentinel://h1:1?ssl=1"}, "echomq_transport_options"),
        ({"echomq_min_replicas": -1}, "echomq_min_replicas"),
        ({"echomq_min_replicas": "1"}, "whole number"),
        ({"echomq_min_replicas_timeout": 0}, "echomq_min_replicas_timeout"),
        ({"echomq_store_retry_timeout": -1}, "echomq_store_retry_timeout"),
        ({"echomq_transport_options": {"master_name": "m", "ssl": "yes"}}, "ssl"),
        ({"echomq_redis_url": "redis+cluster://"}, "names no cluster node"),
        ({"echomq_redis_url": "redis+cluster://h1:1,h2:x"}, "port of 'h2:x' is not a number"),
    ],
    ids=[
        "unknown-option",
        "two-dbs",
        "mixed-schemes",
        "db-not-a-number",
        "query-options",
        "negative-replicas",
        "replicas-not-int",
        "zero-wait-timeout",
        "negative-retry",
        "bad-ssl",
        "cluster-no-node",
        "cluster-bad-port",
    ],
)
def test_bad_store_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    values: dict[str, Any] = {
        "echomq_redis_url": "sentinel://h1:26379/2",
        "echomq_transport_options": {"master_name": "m"},
    }
    values.update(settings)
    with pytest.raises(ConfigError, match=message):
        read_settings(values)


def test_cluster_url_names_several_seed_nodes() -> None:
    assert parse_cluster_url("redis+cluster://u:p@h1:7000,h2:7001,h3/?socket_timeout=3") == (
        "redis://u:p@h1:7000/?socket_timeout=3",
        [("h2", 7001), ("h3", 6379)],
    )
    assert parse_cluster_url("redis+cluster://h1:7000") == ("redis://h1:7000", [])


def test_safe_url_masks_every_sentinel_password() -> None:
    url = "sentinel://:one@h1:26379;sentinel://user:two@h2:26379/2"
    masked = safe_url(url)
    assert "one" not in masked and "two" not in masked
    assert masked == "sentinel://:***@h1:26379;sentinel://user:***@h2:26379/2"


def test_sentinel_client_carries_passwords_db_and_tls_to_its_connections() -> None:
    """What the connections would be made with (nothing is connected here)."""
    settings = Settings(
        redis_url="sentinel://:redispw@127.0.0.1:1;sentinel://:redispw@127.0.0.1:2/5",
        transport_options={
            "master_name": "mymaster",
            "sentinel_kwargs": {"password": "sentinelpw"},
            "ssl": {"ssl_cert_reqs": "none"},
        },
    )
    client = make_client(settings)
    pool = client.connection_pool
    assert pool.service_name == "mymaster"
    # redis-py's class, under the check of the database (a ConfigError naming the setting).
    assert issubclass(pool.connection_class, SentinelManagedSSLConnection)
    kwargs = pool.connection_kwargs
    assert (kwargs["password"], kwargs["db"], kwargs["ssl_cert_reqs"]) == ("redispw", 5, "none")
    sentinels = pool.sentinel_manager.sentinels
    assert [s.connection_pool.connection_kwargs["port"] for s in sentinels] == [1, 2]
    assert all(s.connection_pool.connection_kwargs["password"] == "sentinelpw" for s in sentinels)
    plain = make_client(
        Settings(redis_url="redis://127.0.0.1:1/0", transport_options={"ssl": True})
    )
    assert plain.connection_pool.connection_class.__name__ == "SSLConnection"


# --- A Sentinel-managed store, in this process ----------------------------------------------


@pytest.fixture
def ha() -> Iterator[RedisSentinelServer]:
    """A primary, one replica and three Sentinels, all fresh."""
    with RedisSentinelServer(replicas=1, sentinels=3) as servers:
        yield servers


def sentinel_settings(servers: RedisSentinelServer, db: int = 3, **extra: Any) -> dict[str, Any]:
    return {
        "echomq_redis_url": servers.url(db),
        "echomq_transport_options": {"master_name": servers.master_name},
        **extra,
    }


def scripts_for(settings: Settings) -> tuple[Any, Scripts]:
    client = make_client(settings)
    return client, Scripts(
        client,
        Keyspace("emq"),
        retry_timeout=settings.store_retry_timeout,
        min_replicas=settings.min_replicas,
        min_replicas_timeout=settings.min_replicas_timeout,
    )


def test_sentinel_store_with_passwords_runs_transitions() -> None:
    with RedisSentinelServer(password="redis-pw", sentinel_password="sentinel-pw") as servers:
        parts = [f"sentinel://:redis-pw@127.0.0.1:{port}" for port in servers.sentinel_ports]
        app = Celery("sentinelpw", set_as_current=False)
        app.conf.update(
            echomq_redis_url=";".join(parts) + "/4",
            echomq_transport_options={
                "master_name": servers.master_name,
                "sentinel_kwargs": {"password": "sentinel-pw"},
            },
        )
        state = celery_echomq.install(app)
        queue, parent, child = "q", new_job_id(), new_job_id()
        assert state.scripts.enqueue_flow(queue, parent, b"p", [(child, b"c")]) == 1
        assert state.scripts.claim(queue, child, "t1", LEASE)[0] == "claimed"
        # On the primary Sentinel names, in the URL's database.
        primary = servers.redis_client(servers.primary_port(), db=4)
        assert primary.hget(KEYS.job_key(queue, child), "state") == b"active"

        # A wrong Sentinel password: no Sentinel answers, so no primary is found, and the
        # bounded retry ends in StoreUnavailableError.
        wrong = Settings(
            redis_url=app.conf.echomq_redis_url,
            transport_options={
                "master_name": servers.master_name,
                "sentinel_kwargs": {"password": "wrong"},
            },
            store_retry_timeout=0.5,
        )
        _, bad = scripts_for(wrong)
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match=r"echomq_store_retry_timeout=0\.5"):
            bad.claim(queue, child, "t2", LEASE)
        assert time.monotonic() - started < 10

        # A wrong Redis password is no failover to wait out: it fails at once.
        wrong_redis = {
            "master_name": servers.master_name,
            "sentinel_kwargs": {"password": "sentinel-pw"},
            "password": "wrong",
        }
        _, bad = scripts_for(
            dataclasses.replace(wrong, transport_options=wrong_redis, store_retry_timeout=20.0)
        )
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="AuthenticationError"):
            bad.claim(queue, child, "t3", LEASE)
        assert time.monotonic() - started < 5


def test_sentinel_failover_transition_rides_through_and_scripts_reload(
    ha: RedisSentinelServer,
) -> None:
    settings = read_settings(sentinel_settings(ha))
    client, scripts = scripts_for(settings)
    queue, parent = "q", new_job_id()
    children = [new_job_id() for _ in range(3)]
    scripts.enqueue_flow(queue, parent, b"p", [(c, b"c") for c in children])
    tokens = {c: f"tok-{c}" for c in children}
    for c in children:
        assert scripts.claim(queue, c, tokens[c], LEASE)[0] == "claimed"
    wait_replicated(ha.redis_client(ha.primary_port()), 1)
    ref = ParentRef(parent, queue)

    def complete(child: str) -> str:
        return scripts.complete(
            queue, child, tokens[child], ttl=TTL, is_parent=False, parent=ref, value=b"1"
        )

    old = ha.kill_primary()
    started = time.monotonic()
    # Issued while no primary answers: it waits for the failover, then lands on the new one.
    first = complete(children[0])
    waited = time.monotonic() - started
    new = ha.wait_failover(old)
    assert new != old
    assert first == "credited", first
    assert waited > 0.5, "the old primary was dead: the call had to wait for a failover"
    new_primary = ha.redis_client(new, db=3)
    assert new_primary.get(f"{KEYS.job_key(queue, parent)}:dependencies") == b"2"

    # A new primary that never saw the scripts: redis-py's Script reloads on NOSCRIPT.
    new_primary.script_flush()
    assert complete(children[1]) == "credited"
    assert new_primary.script_exists(scripts.runner.registered["complete"].sha) == [True]
    # The same through the WAIT pipeline (min_replicas), once the old primary is back as a
    # replica: the pipeline loads what it runs.
    ha.restart(old)
    new_primary.script_flush()
    durable = dataclasses.replace(settings, min_replicas=1)
    _, replicated = scripts_for(durable)
    assert (
        replicated.complete(
            queue,
            children[2],
            tokens[children[2]],
            ttl=TTL,
            is_parent=False,
            parent=ref,
            value=b"1",
        )
        == "released"
    )
    assert new_primary.hget(KEYS.job_key(queue, parent), "state") == b"pending"
    assert new_primary.get(f"{KEYS.job_key(queue, parent)}:dependencies") == b"0"
    client.close()


def test_store_unavailable_after_the_retry_timeout() -> None:
    with RedisServer() as server:
        settings = Settings(redis_url=server.url(0), store_retry_timeout=1.0)
        client, scripts = scripts_for(settings)
        child = new_job_id()
        scripts.enqueue_flow("q", new_job_id(), b"p", [(child, b"c")])
        server.kill()
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError) as caught:
            scripts.claim("q", child, "t", LEASE)
        elapsed = time.monotonic() - started
        # Also a redis ConnectionError: code that treats one as "store down" still does.
        assert isinstance(caught.value, redis.ConnectionError)
        assert isinstance(caught.value, StoreConnectionError)
        assert "echomq_store_retry_timeout=1" in str(caught.value)
        assert elapsed < 5, elapsed  # bounded: it gave up, it did not hang
        client.close()


def test_a_plain_command_rides_through_a_restart_and_gives_up_after_the_retry_timeout() -> None:
    """A plain command (not a script) waits for a store that went away and comes back within
    echomq_store_retry_timeout, and fails after it when none answers: on every redis-py the
    package runs on (redis-py 5 and older end their own retry at the first error)."""
    from celery_echomq.embedded import free_port

    with RedisServer() as server:
        client = make_client(Settings(redis_url=server.url(0), store_retry_timeout=10.0))
        client.set("before", "1")
        server.kill()
        back = RedisServer(server.port)
        timer = threading.Timer(1.0, back.start)
        timer.start()
        try:
            started = time.monotonic()
            assert client.set("after", "2")
            assert 0.9 < time.monotonic() - started < 9
            assert client.get("after") == b"2"
        finally:
            timer.join()
            back.stop()
        client.close()

    down = make_client(
        Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0", store_retry_timeout=3.0)
    )
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError, match="Connection refused"):
        down.get("key")
    # Retried until its next try would pass the timeout (not refused at the first error).
    assert 1.0 < time.monotonic() - started < 7
    down.close()


def test_readonly_store_is_retried_until_it_takes_writes(
    primary_replica: tuple[RedisServer, RedisServer],
) -> None:
    """A plain redis:// URL that names a demoted primary (a replica): writes answer READONLY
    and are retried; once the server is promoted they land. A replica still, past the retry:
    the store refuses writes, and the error says so."""
    _, replica = primary_replica
    settings = Settings(redis_url=replica.url(0), store_retry_timeout=0.5)
    _, scripts = scripts_for(settings)
    with pytest.raises(StoreUnavailableError, match="refuses writes: it is a read-only replica"):
        scripts.enqueue_flow("q", new_job_id(), b"p", [(new_job_id(), b"c")])

    _, scripts = scripts_for(dataclasses.replace(settings, store_retry_timeout=20.0))
    parent = new_job_id()
    timer = threading.Timer(0.5, lambda: replica.client().replicaof("NO", "ONE"))
    timer.start()
    started = time.monotonic()
    assert scripts.enqueue_flow("q", parent, b"p", [(new_job_id(), b"c")]) == 1
    assert time.monotonic() - started >= 0.3
    timer.join()
    assert replica.client().exists(f"emq:{{q}}:{parent}") == 1


class LoseOneReply:
    """A TCP proxy on loopback in front of a real redis-server that loses one reply: on the
    first connection that sends ``trigger``, the server's answer to it is dropped and the
    connection closed, as when a primary dies right after running a command. Everything else
    passes through."""

    def __init__(self, port: int, trigger: bytes) -> None:
        self.target, self.trigger = port, trigger
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lost = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                server = socket.create_connection(("127.0.0.1", self.target))
                armed = threading.Event()
                threading.Thread(
                    target=self._pump, args=(client, server, armed, True), daemon=True
                ).start()
                threading.Thread(
                    target=self._pump, args=(server, client, armed, False), daemon=True
                ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, armed: Any, up: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if up and not self.lost.is_set() and self.trigger in data:
                    armed.set()
                if not up and armed.is_set() and not self.lost.is_set():
                    self.lost.set()  # the command ran; its reply goes nowhere
                    break
                dst.sendall(data)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


def test_a_lost_reply_is_retried_and_recognised_as_the_flows_own() -> None:
    """enqueue_flow refuses a row that exists. When its first attempt landed but its reply was
    lost, the resent call is refused by that very write; it is recognised by its payload and
    reported as the success it was."""
    with RedisServer() as server:
        direct = server.client()
        # Loaded up front, so that the first EVALSHA runs the script (no NOSCRIPT round).
        direct.script_load(load_source("enqueue_flow"))
        proxy = LoseOneReply(server.port, b"EVALSHA")
        try:
            settings = Settings(redis_url=f"redis://127.0.0.1:{proxy.port}/0")
            client, scripts = scripts_for(settings)
            parent = new_job_id()
            children = [(new_job_id(), b"c") for _ in range(3)]
            payload = b"payload-" + parent.encode()
            assert scripts.enqueue_flow("q", parent, payload, children) == 3
            assert proxy.lost.is_set(), "no reply was lost"
            assert direct.get(f"emq:{{q}}:{parent}:dependencies") == b"3"
            calls = direct.info("commandstats")["cmdstat_evalsha"]["calls"]
            assert calls == 2, "the call was sent once more, and refused by its own flow"
            # Another flow's parent with the same id is still refused.
            with pytest.raises(celery_echomq.FlowExistsError):
                scripts.enqueue_flow("q", parent, b"another payload", [(new_job_id(), b"c")])
            client.close()
        finally:
            proxy.close()


# --- min_replicas: WAIT after each transition -----------------------------------------------


@pytest.fixture
def primary_replica() -> Iterator[tuple[RedisServer, RedisServer]]:
    with (
        RedisServer() as primary,
        RedisServer(None, "--replicaof", "127.0.0.1", str(primary.port)) as replica,
    ):
        wait_replicated(primary.client(), 1)
        yield primary, replica


def test_min_replicas_transitions_are_on_the_replica_when_they_return(
    primary_replica: tuple[RedisServer, RedisServer],
) -> None:
    primary, replica = primary_replica
    settings = Settings(redis_url=primary.url(0), min_replicas=1, min_replicas_timeout=2.0)
    _, scripts = scripts_for(settings)
    on_replica = replica.client()
    for _ in range(20):
        parent, child = new_job_id(), new_job_id()
        scripts.enqueue_flow("q", parent, b"p", [(child, b"c")])
        # WAIT returned: the replica has it, with no pause in between.
        assert on_replica.hget(f"emq:{{q}}:{child}", "state") == b"pending"
        scripts.claim("q", child, "t", LEASE)
        assert on_replica.hget(f"emq:{{q}}:{child}", "state") == b"active"
        status = scripts.complete(
            "q", child, "t", ttl=TTL, is_parent=False, parent=ParentRef(parent, "q"), value=b"1"
        )
        assert status == "released"
        assert on_replica.hget(f"emq:{{q}}:{parent}", "state") == b"pending"


def test_min_replicas_fails_loudly_when_replicas_do_not_acknowledge(
    primary_replica: tuple[RedisServer, RedisServer],
) -> None:
    primary, replica = primary_replica
    settings = Settings(redis_url=primary.url(0), min_replicas=1, min_replicas_timeout=0.3)
    _, scripts = scripts_for(settings)
    child = new_job_id()
    scripts.enqueue_flow("q", new_job_id(), b"p", [(child, b"c")])
    assert replica.proc is not None
    os.kill(replica.proc.pid, signal.SIGSTOP)  # a replica that stopped acknowledging
    try:
        started = time.monotonic()
        with pytest.raises(ReplicationError) as caught:
            scripts.claim("q", child, "t", LEASE)
        assert 0.25 <= time.monotonic() - started < 5
        assert (caught.value.acked, caught.value.wanted) == (0, 1)
        assert "echomq_min_replicas=1" in str(caught.value)
    finally:
        os.kill(replica.proc.pid, signal.SIGCONT)
    # Applied on the primary, not taken back: loud, not silent.
    assert primary.client().hget(f"emq:{{q}}:{child}", "state") == b"active"
    # More replicas wanted than there are: every transition says so.
    _, greedy = scripts_for(dataclasses.replace(settings, min_replicas=2))
    with pytest.raises(ReplicationError, match="1 of echomq_min_replicas=2"):
        greedy.enqueue_flow("q", new_job_id(), b"p", [(new_job_id(), b"c")])


def test_min_replicas_a_completion_that_hands_out_its_parent_is_followed_unacknowledged(
    primary_replica: tuple[RedisServer, RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    """The completion of a flow's last child marks its parent handed out to this worker on
    the primary; a WAIT that comes back short (a new primary whose replica is not back yet)
    must not drop that reply, or the parent stays marked and is never published."""
    primary, replica = primary_replica
    settings = Settings(redis_url=primary.url(0), min_replicas=1, min_replicas_timeout=0.3)
    _, scripts = scripts_for(settings)
    parent, child = new_job_id(), new_job_id()
    scripts.enqueue_flow("q", parent, b"p", [(child, b"c")])
    scripts.claim("q", child, "t", LEASE)
    assert replica.proc is not None
    os.kill(replica.proc.pid, signal.SIGSTOP)
    try:
        with caplog.at_level("WARNING", logger="celery_echomq.store"):
            status, _, handed = scripts.complete_releasing(
                "q", child, "t", ttl=TTL, is_parent=False, parent=ParentRef(parent, "q"),
                value=b"1", inline_max=100,
            )  # fmt: skip
        # Still loud for the transitions that hand nothing out.
        with pytest.raises(ReplicationError):
            scripts.claim("q", new_job_id(), "t", LEASE)
    finally:
        os.kill(replica.proc.pid, signal.SIGCONT)
    assert status == "released"
    assert handed is not None and handed[0] == b"p"
    assert "0 of echomq_min_replicas=1" in caplog.text and "its reply is followed" in caplog.text
    assert primary.client().hget(f"emq:{{q}}:{parent}", "dispatched") is not None


@pytest.mark.e2e
def test_min_replicas_a_claim_not_replicated_defers_the_body_to_recovery(
    env: Env, proj: Any, primary_replica: tuple[RedisServer, RedisServer]
) -> None:
    """A claim on the primary alone may be lost by a failover, and with it what the body did
    (a parent run on a release only that primary had runs again once the new primary releases
    it): the body waits, and recovery re-publishes the job once its lease lapses."""
    primary, replica = primary_replica
    assert replica.proc is not None
    queue, child = f"defer-{uuid.uuid4().hex[:6]}", new_job_id()
    with store_of(proj.app, redis_url=primary.url(0), min_replicas=1):
        kid = proj.add.s(1, 2).set(task_id=child)
        res = flow(proj.tsum.s(), [kid]).apply_async(queue=queue)
        os.kill(replica.proc.pid, signal.SIGSTOP)  # the replica stops acknowledging
        worker = Worker(
            env,
            queues=queue,
            name=f"defer-{uuid.uuid4().hex[:6]}",
            extra_env={
                "ECHOMQ_T_STORE": primary.url(0),
                "ECHOMQ_T_MIN_REPLICAS": "1",
                "ECHOMQ_T_STALL": "2",
                "ECHOMQ_T_RECOVERY_INTERVAL": "0.5",
            },
        )
        try:
            try:
                logged(worker, f"the body of {child} is deferred to recovery, and runs once")
                assert "the primary has 1 replica(s) connected" in worker.output()
                assert runs_in_log(worker.log)[child] == 0
            finally:
                os.kill(replica.proc.pid, signal.SIGCONT)
            assert res.get(timeout=60) == 3
            assert runs_in_log(worker.log)[child] == 1
            assert f"re-published {child}" in worker.output()
        finally:
            worker.stop()


# --- Failover under load, with real workers -------------------------------------------------


class Traffic:
    """Flows of ``children`` children (each takes ``work`` seconds, so that flows are in
    flight at any moment) sent one after another, about ``rate`` a second, from a thread,
    until stopped; what each ``apply_async`` did is kept."""

    def __init__(
        self, proj: Any, queue: str, children: int = 3, rate: float = 2.5, work: float = 0.6
    ) -> None:
        self.proj, self.queue, self.children, self.rate = proj, queue, children, rate
        self.work = work
        self.sent: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            values = [n * 100 + j for j in range(self.children)]
            ids = [new_job_id() for _ in values]
            kids = [
                self.proj.sleep_then.s(v, self.work).set(task_id=i)
                for v, i in zip(values, ids, strict=True)
            ]
            record: dict[str, Any] = {"expected": sum(values), "children": ids}
            sig = flow(self.proj.tsum.s(), kids)
            record["id"] = sig.freeze().id
            record["sent_at"] = time.monotonic()
            try:
                sig.apply_async(queue=self.queue)
                record["error"] = None
            except Exception as exc:
                record["error"] = f"{type(exc).__name__}: {exc}"
            record["took"] = time.monotonic() - record["sent_at"]
            self.sent.append(record)
            self.stop.wait(1 / self.rate)

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)


def settle(proj: Any, sent: list[dict[str, Any]], timeout: float) -> None:
    """Wait (up to ``timeout`` for all) for each accepted flow's parent; record its outcome."""
    deadline = time.monotonic() + timeout
    for record in sent:
        if record["error"] is not None:
            continue
        result = AsyncResult(record["id"], app=proj.app)
        try:
            value = result.get(timeout=max(0.1, deadline - time.monotonic()), propagate=False)
            record["outcome"] = "ok" if value == record["expected"] else f"wrong:{value!r}"
        except Exception as exc:
            record["outcome"] = "unfinished" if "TimeoutError" in type(exc).__name__ else repr(exc)
            # No pending subscription left behind for a result that never comes.
            with contextlib.suppress(Exception):
                proj.app.backend.remove_pending_result(result)


def report(
    name: str, sent: list[dict[str, Any]], runs: Counter[str], **extra: Any
) -> dict[str, Any]:
    accepted = [r for r in sent if r["error"] is None]
    refused = [r for r in sent if r["error"] is not None]
    summary = {
        "test": name,
        "flows_sent": len(sent),
        "accepted": len(accepted),
        "refused": len(refused),
        "refused_errors": sorted({r["error"].split(":")[0] for r in refused}),
        "completed": sum(1 for r in accepted if r["outcome"] == "ok"),
        "wrong_value": sum(1 for r in accepted if r["outcome"].startswith("wrong")),
        "lost": sum(1 for r in accepted if r["outcome"] == "unfinished"),
        "lost_ids": [r["id"] for r in accepted if r["outcome"] == "unfinished"][:5],
        "refused_but_ran": sum(1 for r in refused if runs[r["id"]] > 0),
        "parents_run_twice": sum(1 for r in sent if runs[r["id"]] > 1),
        "longest_apply_async_s": round(max((r["took"] for r in sent), default=0), 2),
        **extra,
    }
    line = json.dumps(summary, sort_keys=True)
    print(f"\nFAILOVER REPORT {line}")
    with open(LOGDIR / "failover-report.jsonl", "a") as out:
        out.write(line + "\n")
    return summary


class Crash:
    """How one kind of store fails over: the primary's and its replica's clients, the kill,
    the wait for a replacement, and bringing the killed server back as a replica."""

    name = ""

    def pair(self) -> tuple[Any, Any]:
        raise NotImplementedError

    def kill(self) -> int:
        raise NotImplementedError

    def wait_failover(self, old: int) -> int:
        raise NotImplementedError

    def restart(self, old: int) -> None:
        raise NotImplementedError


class SentinelCrash(Crash):
    name = "sentinel"

    def __init__(self, servers: RedisSentinelServer) -> None:
        self.servers = servers

    def pair(self) -> tuple[Any, Any]:
        port = self.servers.primary_port()
        (replica,) = [p for p in self.servers.servers if p != port]
        return self.servers.redis_client(port), self.servers.redis_client(replica)

    def kill(self) -> int:
        return self.servers.kill_primary()

    def wait_failover(self, old: int) -> int:
        return self.servers.wait_failover(old)

    def restart(self, old: int) -> None:
        self.servers.restart(old)


class ClusterCrash(Crash):
    name = "cluster"

    def __init__(self, cluster: RedisClusterServer, queue: str) -> None:
        self.cluster = cluster
        self.slot = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0]).keyslot(
            KEYS.queue_key(queue, "pending")
        )

    def pair(self) -> tuple[Any, Any]:
        master = self.cluster.master_of(self.slot)
        role = self.cluster.node(master).client().role()
        (replica,) = [int(port) for _, port, _ in role[2]]
        return self.cluster.node(master).client(), self.cluster.node(replica).client()

    def kill(self) -> int:
        master = self.cluster.master_of(self.slot)
        self.cluster.node(master).kill()
        return master

    def wait_failover(self, old: int) -> int:
        return self.cluster.wait_failover(old, self.slot)

    def restart(self, old: int) -> None:
        node = self.cluster.restart(old)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError):
                info = node.client().info("replication")
                if info.get("role") == "slave" and info.get("master_link_status") == "up":
                    return
            time.sleep(0.1)
        raise AssertionError(f"node {old} did not come back as a replica")


def failover_under_load(
    env: Env,
    proj: Any,
    crash: Crash,
    queue: str,
    store: dict[str, Any],
    *,
    min_replicas: int,
    settle_for: float,
    rejoin_after: float = 0.0,
    cut_for: float = 0.5,
    traffic_shape: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Flows arrive and real workers run them while the store's primary is SIGKILLed; then
    every flow is waited for and counted: completed, lost, parents run twice."""
    options = store.get("transport_options") or {}
    worker = Worker(
        env,
        queues=queue,
        # Children mostly sleep: eight at once cost little CPU, and keep the worker at about
        # half its capacity, so no message waits anywhere near the stall timeout.
        concurrency=8,
        name=f"fo-{crash.name}{min_replicas}-{uuid.uuid4().hex[:6]}",
        extra_env={
            "ECHOMQ_T_STORE": store["redis_url"],
            "ECHOMQ_T_MASTER_NAME": options.get("master_name", ""),
            "ECHOMQ_T_MIN_REPLICAS": str(min_replicas),
            "ECHOMQ_T_STALL": str(STALL),
            "ECHOMQ_T_RECOVERY_INTERVAL": "1",
        },
    )
    try:
        with store_of(proj.app, **store, min_replicas=min_replicas, stall_timeout=STALL) as state:
            with Traffic(proj, queue, **(traffic_shape or {})) as traffic:
                wreck = crash_under(proj, crash, traffic, rejoin_after, cut_for)
            settle(proj, traffic.sent, settle_for)
            runs = runs_in_log(worker.log)
            # What became of each lost flow: is its parent row still in the store (on the
            # new primary), did its children run?
            lost = [
                {
                    "id": r["id"],
                    "parent_row": _text(
                        state.client.hget(state.keys.job_key(queue, r["id"]), "state")
                    ),
                    "children_ran": sum(1 for c in r["children"] if runs[c]),
                }
                for r in traffic.sent
                if r["error"] is None and r["outcome"] == "unfinished"
            ]
    finally:
        worker.stop()
    return report(
        f"{crash.name} min_replicas={min_replicas}",
        traffic.sent,
        runs,
        lost_detail=lost[:5],
        **wreck,
    )


def crash_under(
    proj: Any, crash: Crash, traffic: Traffic, rejoin_after: float = 0.0, cut_for: float = 0.5
) -> dict[str, Any]:
    """Cut replication, SIGKILL the primary ``cut_for`` s later, wait for its replacement,
    bring it back ``rejoin_after`` s later (meanwhile the new primary has no replica)."""
    time.sleep(2.5)

    def in_flight_now() -> int:
        return sum(
            1
            for r in list(traffic.sent)
            if r["error"] is None and not AsyncResult(r["id"], app=proj.app).ready()
        )

    # The fault must meet flows in flight: their completions are what the cut and the kill
    # put at risk. On a loaded machine the traffic may lag, so the cut waits (up to 5 s more)
    # until one is.
    waited_until = time.monotonic() + 5.0
    in_flight = in_flight_now()
    while not in_flight and time.monotonic() < waited_until:
        time.sleep(0.05)
        in_flight = in_flight_now()
    primary, replica = crash.pair()
    # The replication link breaks just before the crash, as in a network partition
    # (the replica cannot authenticate to reconnect): what the primary acknowledges
    # from now on is on it alone.
    replica.config_set("masterauth", "partitioned")
    # (sent as it is: client_kill_filter of redis-py 5 and older refuses the type replica)
    primary.execute_command("CLIENT", "KILL", "TYPE", "replica")
    time.sleep(cut_for)
    at_kill = len(traffic.sent)
    behind = int(primary.info("replication")["master_repl_offset"]) - int(
        replica.info("replication")["slave_repl_offset"]
    )
    old = crash.kill()
    killed_at = time.monotonic()
    new = crash.wait_failover(old)
    failover_s = time.monotonic() - killed_at
    replica.config_set("masterauth", "")
    time.sleep(rejoin_after)
    crash.restart(old)
    time.sleep(2.0)
    return {
        "sent_before_kill": at_kill,
        "in_flight_at_cut": in_flight,
        "replica_behind_bytes_at_kill": behind,
        "failover_s": round(failover_s, 1),
        "new_primary_differs": new != old,
    }


def sentinel_failover_under_load(
    env: Env, proj: Any, servers: RedisSentinelServer, *, min_replicas: int, settle_for: float
) -> dict[str, Any]:
    store = {
        "redis_url": servers.url(3),
        "transport_options": {"master_name": servers.master_name},
    }
    queue = f"fo-{uuid.uuid4().hex[:10]}"
    return failover_under_load(
        env,
        proj,
        SentinelCrash(servers),
        queue,
        store,
        min_replicas=min_replicas,
        settle_for=settle_for,
    )


@pytest.mark.e2e
def test_failover_sentinel_with_min_replicas_loses_nothing(
    env: Env, proj: Any, ha: RedisSentinelServer
) -> None:
    summary = sentinel_failover_under_load(env, proj, ha, min_replicas=1, settle_for=60)
    assert summary["new_primary_differs"]
    assert summary["in_flight_at_cut"] > 0, summary
    assert summary["accepted"] > summary["sent_before_kill"] > 0, summary
    # Every accepted flow completed, with every child counted once (the parent's sum).
    assert summary["lost"] == 0, summary
    assert summary["wrong_value"] == 0, summary
    assert summary["completed"] == summary["accepted"], summary
    # Each parent ran once, accepted or not.
    assert summary["parents_run_twice"] == 0, summary


@pytest.mark.e2e
def test_failover_sentinel_without_min_replicas_reports_what_was_lost(
    env: Env, proj: Any, ha: RedisSentinelServer
) -> None:
    summary = sentinel_failover_under_load(env, proj, ha, min_replicas=0, settle_for=30)
    assert summary["new_primary_differs"]
    assert summary["in_flight_at_cut"] > 0, summary
    # The report adds up: every flow sent is accepted or refused, every accepted one
    # completed, ended with a wrong value or is counted lost.
    assert summary["accepted"] + summary["refused"] == summary["flows_sent"]
    assert summary["completed"] + summary["wrong_value"] + summary["lost"] == summary["accepted"], (
        summary
    )


@pytest.mark.e2e
@pytest.mark.parametrize("min_replicas", [1, 0], ids=["min_replicas=1", "min_replicas=0"])
def test_failover_cluster_master_killed_mid_flow(env: Env, proj: Any, min_replicas: int) -> None:
    """The same on a Redis Cluster of three masters with a replica each, as an operator meets
    it: the master that owns the flows' queue, the first seed of the cluster URL, is killed
    0.7 s after its replica stopped following it; its replica takes its slots and runs
    without a replica of its own for 5 s (transitions meanwhile come back short of
    echomq_min_replicas) before the old master rejoins; flows of 3 children of 0.4 s, two a
    second."""
    with RedisClusterServer(masters=3, replicas=1, node_timeout_ms=2000) as cluster:
        first = redis.Redis(host="127.0.0.1", port=cluster.ports[0])
        queue = next(
            q
            for q in (f"fo-{uuid.uuid4().hex[:10]}" for _ in range(5000))
            if cluster.master_of(int(first.cluster("KEYSLOT", KEYS.queue_key(q, "pending"))))
            == cluster.ports[0]
        )
        summary = failover_under_load(
            env,
            proj,
            ClusterCrash(cluster, queue),
            queue,
            {"redis_url": cluster.url()},
            min_replicas=min_replicas,
            settle_for=60 if min_replicas else 30,
            rejoin_after=5.0,
            cut_for=0.7,
            traffic_shape={"children": 3, "rate": 2.0, "work": 0.4},
        )
    assert summary["new_primary_differs"]
    assert summary["in_flight_at_cut"] > 0, summary
    assert summary["accepted"] > summary["sent_before_kill"] > 0, summary
    assert summary["completed"] + summary["wrong_value"] + summary["lost"] == summary["accepted"], (
        summary
    )
    if min_replicas:
        assert summary["lost"] == 0, summary
        assert summary["wrong_value"] == 0, summary
        assert summary["parents_run_twice"] == 0, summary
        # What the new master took while it had no replica was refused to its producers.
        assert summary["refused_errors"] in ([], ["ReplicationError"]), summary


@pytest.mark.e2e
def test_cli_reaches_a_cluster_whose_first_seed_node_died(env: Env, proj: Any) -> None:
    """A cluster URL names several seed nodes: with the first one SIGKILLed (a master, its
    slots failed over to its replica), `celery echomq show` still finds the cluster and the
    flow, where a URL naming that node alone cannot connect."""
    with RedisClusterServer(masters=3, replicas=1, node_timeout_ms=2000) as cluster:
        seed = cluster.ports[0]
        first = redis.Redis(host="127.0.0.1", port=seed)
        assert first.role()[0] == b"master"
        # A queue whose slot the first seed serves: its failover is what the read rides over.
        queue = next(
            q
            for q in (f"seed-{uuid.uuid4().hex[:8]}" for _ in range(2000))
            if cluster.master_of(int(first.cluster("KEYSLOT", KEYS.queue_key(q, "pending"))))
            == seed
        )
        slot = int(first.cluster("KEYSLOT", KEYS.queue_key(queue, "pending")))
        with store_of(proj.app, redis_url=cluster.url()):
            res = flow(proj.tsum.s(), [proj.add.s(1, 2)]).apply_async(queue=queue)
        cluster.node(seed).kill()
        cluster.wait_failover(seed, slot)

        def show(url: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "celery", "-A", "tests.proj", "echomq", "show", res.id,
                 "--json"],
                cwd=ROOT, env=env.environ(ECHOMQ_T_STORE=url, ECHOMQ_T_STORE_RETRY="2"),
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip

        done = show(cluster.url())
        assert done.returncode == 0, done.stderr
        tree = json.loads(done.stdout)
        assert (tree["state"], tree["queue"]) == ("awaiting_children", queue)
        assert [c["state"] for c in tree["children"]] == ["pending"]
        alone = show(f"redis+cluster://127.0.0.1:{seed}")
        assert alone.returncode != 0
