"""Why an unfinished flow waits on its store's replicas, and why no flow moves while the store
refuses writes, in words an operator acts on: what ``show`` prints last and the dashboard
shows."""

from __future__ import annotations

from celery_echomq.ops.views import FINISHED
from celery_echomq.store.server_info import refusal_text, refusing_writes, replicas_of
from celery_echomq.store.state import EchoMQ


def replication_wait(state: EchoMQ, queue: str, job_id: str, job_state: str) -> str:
    """Why an unfinished flow waits when its slot's primary has fewer replicas than
    ``echomq_min_replicas`` (every transition's WAIT falls short: a claimed body is deferred
    to recovery, again and again), and what heals it; "" when it does not."""
    wanted = state.settings.min_replicas
    if not wanted or job_state in FINISHED:
        return ""
    address, replicas = replicas_of(state.client, state.keys.job_key(queue, job_id))
    if replicas >= wanted:
        return ""
    return (
        f"waiting: the primary of this flow's slot ({address}) has {replicas} replica(s) "
        f"connected, fewer than echomq_min_replicas={wanted}: each transition's WAIT falls "
        "short, so every claimed job's body is deferred to recovery and its attempts grow. "
        f"Heals once that primary has {wanted} replica(s) connected (attach one, e.g. to a "
        "master left without its replica by a failover), or with echomq_min_replicas lowered"
    )


def store_refusal(state: EchoMQ) -> str:
    """Why the store refuses writes now (out of memory, a replica, a failed save, too few
    replicas for min-replicas-to-write) and what heals it; "" when it accepts them. One INFO
    per primary: ``show`` calls it once, the dashboard once per page."""
    return refusal_text(refusing_writes(state.client))
