"""A primary, its replicas and three Sentinels watching it: a failover on one machine."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from celery_echomq.embedded.servers import (
    RedisServer,
    ServerBase,
    find_redis_server,
    free_port,
    wait_replicated,
)


class RedisSentinelServer(ServerBase):
    """``with RedisSentinelServer() as ha: ha.url(db)`` runs a Sentinel-managed Redis: a
    primary, ``replicas`` replicas and ``sentinels`` Sentinels (quorum: a majority), each a
    redis-server on a free loopback port.

    ``password`` is the Redis servers' (requirepass and masterauth), ``sentinel_password``
    the Sentinels' own. Detection is fast (``down_after_ms``) so a test's failover takes a
    few seconds: ``kill_primary()`` SIGKILLs whichever server is the primary now,
    ``wait_failover(port)`` returns the port of the replica the Sentinels promoted in its
    place, and ``restart(port)`` brings the killed one back as a replica of the new primary.
    """

    def __init__(
        self,
        replicas: int = 1,
        sentinels: int = 3,
        *,
        master_name: str = "mymaster",
        password: str | None = None,
        sentinel_password: str | None = None,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
        timeout: float = 30.0,
    ) -> None:
        if replicas < 1 or sentinels < 1:
            raise ValueError("a Sentinel setup needs at least one replica and one Sentinel")
        self.replica_count, self.sentinel_count = replicas, sentinels
        self.master_name = master_name
        self.password, self.sentinel_password = password, sentinel_password
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        self.timeout = timeout
        self.dir = tempfile.mkdtemp(prefix="echomq-sentinel-")
        self.servers: dict[int, RedisServer] = {}  # by port: the primary and the replicas
        self.sentinels: list[RedisServer] = []
        self.first_primary = 0

    def _auth(self) -> list[str]:
        if not self.password:
            return []
        return ["--requirepass", self.password, "--masterauth", self.password]

    def url(self, db: int = 0) -> str:
        """Celery's form of a Sentinel URL, every Sentinel named, with ``db`` on the last
        (the password, if any, is given separately: it is not in the URL)."""
        parts = [f"sentinel://127.0.0.1:{s.port}" for s in self.sentinels]
        return ";".join(parts) + f"/{db}"

    @property
    def sentinel_ports(self) -> list[int]:
        return [s.port for s in self.sentinels]

    def redis_client(self, port: int, **kwargs: Any) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=port, password=self.password, **kwargs)

    def sentinel_client(self, port: int) -> Any:
        import redis

        return redis.Redis(
            host="127.0.0.1", port=port, password=self.sentinel_password, socket_timeout=2
        )

    def start(self) -> RedisSentinelServer:
        try:
            primary = RedisServer(None, *self._auth())
            primary.start()
            self.servers[primary.port] = primary
            self.first_primary = primary.port
            for _ in range(self.replica_count):
                self._start_replica(None, primary.port)
            quorum = self.sentinel_count // 2 + 1
            for _ in range(self.sentinel_count):
                port = free_port()
                conf = Path(self.dir) / f"sentinel-{port}.conf"
                lines = [
                    f"port {port}",
                    "bind 127.0.0.1",
                    f"dir {self.dir}",
                    f"sentinel monitor {self.master_name} 127.0.0.1 {primary.port} {quorum}",
                    f"sentinel down-after-milliseconds {self.master_name} {self.down_after_ms}",
                    f"sentinel failover-timeout {self.master_name} {self.failover_timeout_ms}",
                    f"sentinel parallel-syncs {self.master_name} 1",
                ]
                if self.password:
                    lines.append(f"sentinel auth-pass {self.master_name} {self.password}")
                if self.sentinel_password:
                    lines += [
                        f"requirepass {self.sentinel_password}",
                        f"sentinel sentinel-pass {self.sentinel_password}",
                    ]
                conf.write_text("\n".join(lines) + "\n")
                sentinel = _SentinelProcess(port, str(conf), self.sentinel_password)
                self.sentinels.append(sentinel)
                sentinel.start()
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_replica(self, port: int | None, primary: int) -> RedisServer:
        replica = RedisServer(port, "--replicaof", "127.0.0.1", str(primary), *self._auth())
        replica.start()
        self.servers[replica.port] = replica
        return replica

    def _wait_ready(self) -> None:
        """Until every Sentinel sees the others and every replica, and the replicas are in
        sync: before that a failover could not gather its quorum."""
        deadline = time.monotonic() + self.timeout
        state: Any = None
        while time.monotonic() < deadline:
            try:
                states = [
                    self.sentinel_client(port).sentinel_master(self.master_name)
                    for port in self.sentinel_ports
                ]
            except Exception as exc:  # a Sentinel still starting
                state = exc
                time.sleep(0.1)
                continue
            state = states[0]
            if all(
                int(s.get("num-other-sentinels", 0)) == self.sentinel_count - 1
                and int(s.get("num-slaves", 0)) == self.replica_count
                for s in states
            ):
                wait_replicated(
                    self.redis_client(self.primary_port()), self.replica_count, self.timeout
                )
                return
            time.sleep(0.1)
        raise RuntimeError(f"Sentinels not ready in {self.timeout} s: {state}")

    def primary_port(self) -> int:
        """The port of the primary, as the first Sentinel that answers names it."""
        for port in self.sentinel_ports:
            try:
                address = self.sentinel_client(port).sentinel_get_master_addr_by_name(
                    self.master_name
                )
            except Exception:
                continue
            if address:
                return int(address[1])
        raise RuntimeError("no Sentinel names a primary")

    def kill_primary(self) -> int:
        """SIGKILL the current primary; its port."""
        port = self.primary_port()
        self.servers[port].kill()
        return port

    def wait_failover(self, old: int, timeout: float | None = None) -> int:
        """Until a majority of Sentinels name a primary other than ``old`` and it says it is
        one: its port."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while time.monotonic() < deadline:
            named = []
            for port in self.sentinel_ports:
                try:
                    address = self.sentinel_client(port).sentinel_get_master_addr_by_name(
                        self.master_name
                    )
                except Exception:
                    continue
                if address:
                    named.append(int(address[1]))
            new = [p for p in named if p != old]
            if len(new) > self.sentinel_count // 2 and len(set(new)) == 1:
                try:
                    if self.redis_client(new[0]).role()[0] in (b"master", "master"):
                        return new[0]
                except Exception:
                    pass
            time.sleep(0.1)
        raise RuntimeError(f"no failover from port {old} within {timeout or self.timeout} s")

    def restart(self, port: int, timeout: float | None = None) -> RedisServer:
        """Bring a killed server back on ``port``, as a replica of the current primary, and
        wait until it is in sync."""
        primary = self.primary_port()
        self.servers[port].stop()
        replica = self._start_replica(port, primary)
        # Wait on the server that says it is the primary now: a Sentinel that has not yet
        # caught up with a failover can still name the old one.
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            try:
                wait_replicated(
                    self.redis_client(self._serving_primary(primary)), self.replica_count, 1.0
                )
                return replica
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise

    def _serving_primary(self, named: int) -> int:
        """The port of the server whose role is master (``named`` when none answers so)."""
        for port in [named, *self.servers]:
            try:
                if self.redis_client(port).info("replication").get("role") == "master":
                    return port
            except Exception:
                continue
        return named

    def stop(self) -> None:
        for sentinel in self.sentinels:
            sentinel.stop()
        for server in self.servers.values():
            server.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class _SentinelProcess(RedisServer):
    """redis-server in Sentinel mode on ``port``, from a config file it may rewrite."""

    def __init__(self, port: int, conf: str, password: str | None) -> None:
        super().__init__(port)
        self.conf, self.password = conf, password

    def start(self) -> _SentinelProcess:
        args = [find_redis_server(), self.conf, "--sentinel"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server --sentinel exited with {self.proc.returncode}")
            try:
                self.client(password=self.password, socket_timeout=1).ping()
                return self
            except Exception:
                time.sleep(0.05)
        raise RuntimeError(f"Sentinel on port {self.port} did not answer PING in time")
