"""An id names one job in the whole store, on whichever queue its row lives.

A script refuses an id whose row exists on its own slot; a row of another queue lives on
another slot, where the script cannot look. So before a flow (or children added to one)
lands, the host looks for each of its ids on every other queue that holds flows: one
pipelined EXISTS per id and other queue, nothing at all on a store with one queue. The
queues are read at most once a second (``EchoMQ.known_queues``).

And the ids a flow assigns before anything is sent: ``freeze`` gives every task of a canvas
one (``assign_ids``), and every id of a shaped tree, those its spreads will add included, is
gated and unique (``check_tree``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from celery.canvas import Signature, _chain, _chord, group, maybe_signature

from celery_echomq.errors import FlowExistsError
from celery_echomq.send.shapes import SPREAD_TASK
from celery_echomq.store.keyspace import check_id, check_unique, new_job_id
from celery_echomq.store.state import EchoMQ


def refuse_taken(state: EchoMQ, placed: Mapping[str, str]) -> None:
    """Raise :class:`FlowExistsError` when an id of ``placed`` (id -> the queue it will live
    on) has a row on another queue."""
    queues = sorted(state.known_queues())
    if len(queues) < 2 and set(placed.values()) <= set(queues):
        return
    keys, chunk = state.keys, state.settings.chunk_size
    checks = [(job_id, q) for job_id, own in placed.items() for q in queues if q != own]
    for start in range(0, len(checks), chunk):
        part = checks[start : start + chunk]
        pipe = state.client.pipeline(transaction=False)
        for job_id, queue in part:
            pipe.exists(keys.job_key(queue, job_id))
        for (job_id, queue), there in zip(part, pipe.execute(), strict=True):
            if there:
                raise FlowExistsError(
                    f"job id {job_id!r} already exists in Redis, on queue {queue!r}; an id "
                    "names one job in the whole store, and a flow never overwrites a job "
                    "(nothing was written or published)"
                )


def ids(node: Signature) -> Iterator[str]:
    """Every job id of a normal tree, what its spreads will add included."""
    yield str(node.options.get("task_id"))
    yield from _added(node.parent, node._app)
    for child in node.children:
        yield from _ids_of(child)


def _added(parent: Signature, app: Any) -> Iterator[str]:
    if parent.task == SPREAD_TASK:
        for child in parent.kwargs["children"]:
            yield from _ids_of(maybe_signature(child, app=app))


def _ids_of(sig: Signature) -> Iterator[str]:
    if getattr(sig, "subtask_type", None) == "flow":
        yield from ids(sig)
    elif "task_id" in sig.options:
        yield str(sig.options["task_id"])
    else:
        yield from _added(sig, sig._app)


def check_tree(node: Signature) -> None:
    """Every id a spread will add gated and unique with the rest, before anything reaches
    Redis (the ids planned now are gated by the plan)."""
    found = [i for i in ids(node) if i != "None"]
    for job_id in found:
        check_id(job_id)
    check_unique(found)


def value_task(sig: Any) -> Signature | None:
    """The task whose value is a canvas's value (None for a group's: a list of values)."""
    sig = maybe_signature(sig)
    if isinstance(sig, _chain):
        return value_task(sig.tasks[-1]) if sig.tasks else None
    if isinstance(sig, _chord):
        return value_task(sig.body) if sig.body is not None else None
    if isinstance(sig, group):
        return None
    if getattr(sig, "subtask_type", None) == "flow":
        return value_task(sig.parent)
    return sig


def assign_ids(sig: Any) -> None:
    """Give every task of a canvas an id of its own, where it has none (``freeze``).

    A signature object that appears more than once (``(task.si(1),) * 3``) stands for as many
    jobs: it takes no id here, and each of its copies gets one when the flow is shaped."""
    tasks: list[Signature] = []
    _tasks_of(sig, tasks)
    seen: dict[int, int] = {}
    for task in tasks:
        seen[id(task)] = seen.get(id(task), 0) + 1
    for task in tasks:
        if seen[id(task)] == 1:
            task.options.setdefault("task_id", new_job_id())


def _tasks_of(sig: Any, out: list[Signature]) -> None:
    sig = maybe_signature(sig)
    if isinstance(sig, (_chain, group)):
        parts = list(sig.tasks)
    elif isinstance(sig, _chord):
        header = sig.tasks.tasks if isinstance(sig.tasks, group) else sig.tasks
        parts = [*header, *([sig.body] if sig.body is not None else [])]
    elif getattr(sig, "subtask_type", None) == "flow":
        parts = [sig.parent, *sig.children]
    else:
        out.append(sig)
        return
    for part in parts:
        if isinstance(part, Signature):
            _tasks_of(part, out)
