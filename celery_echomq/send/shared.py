"""One job in several flows of one canvas (``apply_async(on_exists="join")``): the same frozen
signature, one id, listed by two flows of the tree is one job, written by the first flow that
lists it and joined by the others (send/join.py). Pure: the plan alone decides.

Only a task can be shared; a job listed twice by one flow, a nested flow's parent or a chain's
step listed twice, and a job that would wait for itself (a cycle) are refused, with every
other id's rule (``check_unique``), before anything is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery_echomq.errors import DuplicateIdError, FlowExistsError
from celery_echomq.send.entries import Level, child_queue, first_job, row_ids
from celery_echomq.store.keyspace import check_unique


class CycleError(DuplicateIdError):
    """A job listed under itself: it would wait for its own value."""


def _call(job: dict[str, Any]) -> tuple[Any, ...]:
    return (job.get("task"), job.get("args"), job.get("kwargs"), child_queue(job))


def check_ids(levels: Sequence[Level], parent_id: str, shared: bool) -> dict[str, str]:
    """Every id of a tree names one row; with ``shared``, a task listed by several of its
    flows is one job. Returns each shared task's id -> the flow (its parent's id) that
    writes it, the first in ``levels``' order (outer first, as they are written)."""
    ids = [parent_id, *(cid for level in levels for e in level.children for cid in row_ids(e))]
    if not shared:
        check_unique(ids)
        return {}
    check_unique(dict.fromkeys(ids))  # a uuid and 'JOB' + it are still one row
    owners: dict[str, tuple[str, dict[str, Any] | None]] = {parent_id: ("", None)}
    under: dict[str, str] = {}  # a nested flow's parent id -> the flow that lists it
    writes: dict[str, str] = {}
    for level in levels:
        listed: set[str] = set()
        for entry in level.children:
            job = first_job(entry)
            if "nested" in job:
                under[str(job["nested"]["parent_id"])] = level.parent_id
            plain = "nested" not in job and "steps" not in entry
            for cid in row_ids(entry):
                if cid in listed:
                    raise DuplicateIdError(
                        f"job id {cid!r} appears twice among the children of flow "
                        f"{level.parent_id!r}: a flow waits for a job once"
                    )
                listed.add(cid)
                _place(cid, level.parent_id, job if plain else None, owners, under, writes)
    return writes


def _place(
    cid: str,
    flow_id: str,
    job: dict[str, Any] | None,
    owners: dict[str, tuple[str, dict[str, Any] | None]],
    under: dict[str, str],
    writes: dict[str, str],
) -> None:
    """Record ``cid`` listed by ``flow_id`` (``job``: its planned task, None for a nested
    flow's parent or a chain's step); a second listing must be the same task, and no flow."""
    if cid not in owners:
        owners[cid] = (flow_id, job)
        return
    first, first_job_ = owners[cid]
    ancestors, at = [], flow_id
    while at:
        ancestors.append(at)
        at = under.get(at, "")
    if cid in ancestors:
        raise CycleError(
            f"job id {cid!r} is listed under itself (in flow {flow_id!r}): it would wait for "
            "its own value; a cycle is refused (nothing was written or published)"
        )
    if job is None or first_job_ is None:
        raise DuplicateIdError(
            f"job id {cid!r} appears more than once in one flow, as a nested flow or a chain's "
            "step: only a task can be shared by several flows (on_exists='join')"
        )
    if _call(job) != _call(first_job_):
        raise FlowExistsError(
            f"job id {cid!r} is listed by flow {first!r} and by flow {flow_id!r} as two jobs "
            f"({_call(first_job_)[:3]!r} and {_call(job)[:3]!r}): one id names one job"
        )
    writes[cid] = first
