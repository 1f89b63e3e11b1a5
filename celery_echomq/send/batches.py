"""A flow's children delivered many to a broker message (``flow(parent, children, batch=N)``).

Each child stays a job of its own: its row, its id, its claim, its result, its place in the
parent's values. Only the delivery changes: instead of one Celery message per child, the
producer sends one message of the internal task :data:`BATCH_TASK` per N children of a queue
(and priority), which carries nothing but their ids. The worker that takes it
(worker/batches.py) reads each child's stored message from its row, as recovery does, and runs
it through Celery's own trace in that pool process, one after another: Celery's signals, the
claim that makes each body run once, the result, the completion, as for a message of its own.
So what a batch message says decides nothing: a copy, or a forged one, can only name jobs,
whose rows run their own bodies once.

A child whose batch message is lost (a worker killed mid-batch, a broker that dropped it) is a
pending row with no message, as after any lost message: recovery re-publishes it, on its own.

Planned here: which flows may batch (pure), and the batch messages of a level.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from celery.utils import uuid

from celery_echomq.store.headers import H_BATCH, H_SINCE, H_STORE, H_TEMPLATE
from celery_echomq.store.planned import Plan, PlannedChain, PlannedJob

BATCH_TASK = "celery_echomq.batch"
MAX_BATCH = 1000
BATCH_ALLOWED = f"an int from 1 to {MAX_BATCH} (children a broker message carries), or None"
# A child's options a batch message cannot keep for it: each is about its own message.
OWN_MESSAGE = ("countdown", "eta", "expires")


def check_batch(value: object, where: str = "flow(batch=...)") -> int | None:
    """``value`` if it is a batch's size, else a ValueError saying what is allowed."""
    if value is None:
        return None
    if type(value) is not int or not 1 <= value <= MAX_BATCH:
        raise ValueError(f"{where}: {value!r} is not allowed; allowed: {BATCH_ALLOWED}")
    return value


def batch_of(plan: Plan, size: int | None) -> int:
    """Give a planned level its batch of ``size`` (None: none); refuse, before anything is
    written, children a batch cannot carry."""
    if size is None:
        return 0
    where = f"flow {plan.parent_id}: batch={size}"
    if plan.max_active:
        raise ValueError(
            f"{where} and max_active={plan.max_active} both decide when a child is published; "
            "allowed: one of them"
        )
    for child in plan.children:
        if isinstance(child, PlannedChain):
            raise ValueError(
                f"{where} takes tasks as children, not a chain of tasks ({child.id}); allowed: "
                "wrap the chain in a flow of its own, or no batch"
            )
        if isinstance(child, Plan):
            raise ValueError(
                f"{where} takes tasks as children, not a nested flow ({child.id}); allowed: "
                "give the nested flow its own batch, or no batch"
            )
        options = child.message["options"]
        own = [name for name in OWN_MESSAGE if options.get(name) is not None]
        if own:
            raise ValueError(
                f"{where}: child {child.id} ({child.message['task']!r}) sets {', '.join(own)}, "
                "which only a message of its own can keep; allowed: children without "
                f"{', '.join(OWN_MESSAGE)}, or no batch"
            )
    plan.batch = size
    return size


def batch_jobs(
    app: Any, level: Plan, jobs: Iterable[PlannedJob], since: int | None, store: str
) -> list[dict[str, Any]]:
    """The batch messages that deliver ``jobs`` (children of ``level``, which batches them),
    as job dicts for a publish: up to ``level.batch`` of one queue and priority each, in the
    children's order, each with the time limits of its children added up."""
    runs: dict[tuple[str, Any], list[PlannedJob]] = {}
    for job in jobs:
        runs.setdefault((job.queue, job.message["options"].get("priority")), []).append(job)
    batches = []
    for (queue, priority), run in runs.items():
        for at in range(0, len(run), level.batch):
            batch = _batch_job(app, queue, priority, run[at : at + level.batch])
            if queue == level.queue:
                # Children on their parent's slot are stored against its template.
                batch["options"]["headers"][H_TEMPLATE] = level.parent_id
            batches.append(batch)
    for batch in batches:
        headers = batch["options"]["headers"]
        headers[H_STORE] = store
        if since is not None:
            headers[H_SINCE] = since
    return batches


def _batch_job(app: Any, queue: str, priority: Any, run: list[PlannedJob]) -> dict[str, Any]:
    first = run[0].message["options"]
    # Routed as its children are (they share a queue): what names their exchange and key.
    routing = {k: first[k] for k in ("exchange", "routing_key") if first.get(k) is not None}
    options: dict[str, Any] = {
        "task_id": uuid(),
        "queue": queue,
        **routing,
        "ignore_result": True,
        "headers": {H_BATCH: queue},
    }
    # Its children's lineage (the publish adds the sending task's where they have none): a
    # monitor draws the batch in their flow's tree, and each child keeps its own.
    options.update((k, first[k]) for k in ("root_id", "parent_id") if first.get(k))
    if priority is not None:
        options["priority"] = priority
    options.update(_time_limits(app, run))
    return {
        "task": BATCH_TASK,
        "args": [[job.id for job in run]],
        "kwargs": {},
        "options": options,
        "subtask_type": None,
        "immutable": True,
    }


def _time_limits(app: Any, run: list[PlannedJob]) -> dict[str, float]:
    """The batch message's time limits: Celery enforces a limit per message, so a batch's is
    the sum of its children's (each its own option, else its task's, else the app's), where
    every child has one; else none of that kind (a child without a limit may run for ever)."""
    limits: dict[str, float] = {}
    for name, setting in (
        ("time_limit", "task_time_limit"),
        ("soft_time_limit", "task_soft_time_limit"),
    ):
        each = [_limit_of(app, job, name, setting) for job in run]
        if each and all(limit is not None for limit in each):
            limits[name] = sum(limit for limit in each if limit is not None)
    return limits


def _limit_of(app: Any, job: PlannedJob, name: str, setting: str) -> float | None:
    given = job.message["options"].get(name)
    if given is None:
        task = app.tasks.get(job.message["task"])
        given = getattr(task, name, None) if task is not None else None
    if given is None:
        given = app.conf.get(setting)
    return float(given) if given else None
