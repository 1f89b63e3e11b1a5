"""The next child of a flow's window, published by the caller whose transition freed its
slot (see ``store/lua/includes/window.lua``): in the same step as the child that finished, as
a chain's next step is, with no poller and no round trip of its own. A caller that dies
before the publish leaves a pending row without a message, which recovery re-publishes.
"""

from __future__ import annotations

import logging
from typing import Any

from celery_echomq import tracing
from celery_echomq.config import safe_url
from celery_echomq.send.start import publish, with_since
from celery_echomq.store.codec import Delta, load_job
from celery_echomq.store.planned import is_nested_entry
from celery_echomq.store.script_values import Freed
from celery_echomq.store.state import EchoMQ

logger = logging.getLogger("celery_echomq")


def _job(state: EchoMQ, queue: str, freed: Freed) -> Any:
    stored = freed.stored
    if not isinstance(stored, Delta):
        return load_job(state, queue, freed.id, stored)
    # The flow's template, read from its row once per process (kept on the app's state).
    key, kept = (queue, stored.parent), state.templates
    templates: dict[str, bytes | None] = {}
    if key in kept:
        templates[stored.parent] = kept.get(key)
    job = load_job(state, queue, freed.id, stored, templates)
    if key not in kept:
        kept.put(key, templates[stored.parent])
    return job


def publish_freed(state: EchoMQ, queue: str, freed: list[Freed]) -> None:
    """Publish, in one batch, the children a transition on ``queue`` made pending for their
    flow's window: each one's stored job (a nested flow's entry starts that flow), with its
    pending time in its headers (its claim need not read it)."""
    store = safe_url(state.settings.redis_url or "")
    jobs = []
    for one in freed:
        try:
            job = _job(state, queue, one)
        except Exception as exc:  # left pending: recovery reports and re-publishes it
            logger.warning("echomq: window child %s on %s not published: %s", one.id, queue, exc)
            continue
        if isinstance(job, dict) and not is_nested_entry(job):
            job = with_since(job, one.since, store)
        jobs.append(job)
    if not jobs:
        return
    # Each stored job carries its own trace context; the first's is current while they go.
    with tracing.job_context(jobs[0]):
        publish(state.app, jobs)
    logger.debug("echomq: %d window children published on %s", len(jobs), queue)
