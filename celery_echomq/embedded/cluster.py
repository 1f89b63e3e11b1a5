"""A private Redis Cluster of a few ``redis-server`` processes."""

from __future__ import annotations

import os
import random
import shutil
import socket
import tempfile
import time
from typing import Any

from celery_echomq.embedded.servers import RedisServer, ServerBase, wait_replicated

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


class RedisClusterServer(ServerBase):
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
        """The ``echomq_redis_url`` for this cluster: every node a seed, so that a client
        finds it whichever node is down."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

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
