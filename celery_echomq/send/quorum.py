"""A flow released by a quorum of its children (``flow(parent, children, quorum=K)``).

Planned here: the parent's stored job keeps ``quorum`` (K) and the queues of its children on
other slots (``quorum_queues``), and every child's message the header :data:`H_QUORUM`
(``"K/N"``), which its worker passes to the script that settles it
(store/lua/includes/quorum.lua; a child of another slot is credited by credit.lua, passed the
same). That script releases the parent at the K-th success, in
order of success, and fails it at once when fewer than K can still succeed. What follows a
release or a failure is done here too: the parent gets the K values in the order they
succeeded (:func:`quorum_values`), and the children not yet started are cancelled
(:func:`cut_rest`); those running finish, recorded on their own rows, not counted.
"""

from __future__ import annotations

import logging
from typing import Any

from celery_echomq.send.entries import child_queue
from celery_echomq.send.reducers import check_reduce as check_reduce  # for canvas.py
from celery_echomq.send.reducers import reduce_of
from celery_echomq.store.connection import text
from celery_echomq.store.headers import H_QUEUE, H_QUORUM
from celery_echomq.store.state import EchoMQ

logger = logging.getLogger("celery_echomq")

ALLOWED = "an int >= 1 (the successes that release the parent), or None (every child)"


def check_quorum(value: object, where: str = "flow(quorum=...)") -> int | None:
    """``value`` if it is a quorum, else a ValueError saying what is allowed."""
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise ValueError(f"{where}: {value!r} is not allowed; allowed: {ALLOWED}")
    return value


def _headers(job: dict[str, Any]) -> dict[str, Any]:
    options = job.setdefault("options", {})
    headers: dict[str, Any] = options.setdefault("headers", {}) or {}
    options["headers"] = headers
    return headers


def quorum_of(plan: Any, kwargs: dict[str, Any]) -> None:
    """Give a planned level its quorum (from its flow signature's ``kwargs``): kept on its
    parent's stored job, and on every child's message; refuse one that cannot be met or that
    the store cannot count, before anything is written."""
    need = check_quorum(kwargs.get("quorum"))
    if need is None:
        return
    total = len(plan.children)
    if need > total:
        raise ValueError(
            f"flow {plan.parent_id}: quorum={need} of {total} children can never be met; "
            f"allowed: a quorum of at most {total}, or none"
        )
    for job in plan.children:
        if "steps" in job:
            raise ValueError(
                f"flow {plan.parent_id}: quorum={need} takes tasks and flows as children, not "
                "a chain of tasks; allowed: wrap the chain in a flow of its own, or no quorum"
            )
    plan.parent["quorum"] = need
    # The queues of its children on other slots than its own: where cut_rest cancels them.
    elsewhere = sorted({child_queue(job) for job in plan.children} - {plan.queue})
    if elsewhere:
        plan.parent["quorum_queues"] = elsewhere
    mark = f"{need}/{total}"
    for job in plan.children:
        _headers(job["nested"]["parent"] if "nested" in job else job)[H_QUORUM] = mark


def refuse_growth(job: dict[str, Any]) -> None:
    """Refuse children added to a flow released by a quorum (``job``: its parent's stored
    job): its children's messages carry the N of "K of N", fixed when it was sent."""
    if job.get("quorum"):
        raise ValueError(
            f"flow {(job.get('options') or {}).get('task_id')}: a flow with "
            f"quorum={job['quorum']} takes no added children (its quorum counts the children "
            "it was sent with); allowed: add_children to a flow without a quorum"
        )


def fan_in_of(plan: Any, kwargs: dict[str, Any]) -> None:
    """A planned level's quorum and reducer (send/reducers.py), from its flow's ``kwargs``."""
    quorum_of(plan, kwargs)
    reduce_of(plan, kwargs)


def quorum_values(state: EchoMQ, job: dict[str, Any], stored: dict[str, Any]) -> list[Any]:
    """The values a parent released by a quorum gets: those of the children credited while it
    waited, in the order they succeeded (its ``:quorum`` list), at most K (a retry of a flow
    failed by its deadline may find more counted meanwhile)."""
    queue = str(_headers(job).get(H_QUEUE) or "")
    key = state.keys.job_key(queue, str(job["options"]["task_id"])) + ":quorum"
    order = [text(cid) for cid in state.client.lrange(key, 0, int(job["quorum"]) - 1)]
    return [state.loads(stored[cid]) for cid in order if cid in stored]


def cut_rest(state: EchoMQ, job: dict[str, Any]) -> list[str]:
    """Cancel the children of a flow released (or failed) by its quorum that have not
    started: they never run. Those running are left to finish. Idempotent: a repeat (the
    parent dispatched again by recovery) finds none outstanding. Returns the ids cancelled."""
    queue = str(_headers(job).get(H_QUEUE) or "")
    parent_id = str(job["options"]["task_id"])
    children = [str(cid) for cid in job.get("children") or ()]
    chunk = state.settings.chunk_size
    cut: list[str] = []
    # On each slot its children live on, one script call per chunk (a row another slot holds
    # is not there: left alone).
    for where in (queue, *(str(q) for q in job.get("quorum_queues") or ())):
        for start in range(0, len(children), chunk):
            cut += state.scripts.cancel_elsewhere(
                where,
                parent_id,
                children[start : start + chunk],
                ttl=state.settings.result_ttl,
                started=False,
            )
    for start in range(0, len(cut), chunk):  # Celery's result of each: REVOKED
        state.app.control.revoke(cut[start : start + chunk])
    if cut:
        logger.info("echomq: flow %s: quorum settled; %d children cancelled", parent_id, len(cut))
    return cut
