"""An id names one job in the whole store, on whichever queue its row lives.

A script refuses an id whose row exists on its own slot. The rows of every queue, with the
registry of queues that hold flows (``emq:queues``), are the index of ids, and a flow's ids
are checked against all of it with no window between the check and the rows' landing:

- On a store of one server, where a script may read every key, the enqueue script checks
  its ids itself (``includes/taken.lua``), in the same atomic step that writes them and
  registers their queues: nothing more is sent, and no command per child is run (a
  variadic EXISTS per 500 keys), on up to four other queues whatever the flow's size.
- Elsewhere (a Redis Cluster, whose scripts see one slot; a flow written in chunks; children
  added to a running flow; a check the script finds too wide, ``EMQWIDE``),
  :func:`claim_ids` first claims each id for its queue
  (``emq:id:{JOB...}``, SET NX, on the id's own slot) and then looks for its rows on every
  registered queue: two enqueues of one id on two queues cannot both pass, as one of them
  finds the other's claim, and a claim lives only until its enqueue has landed or been
  refused (:func:`release_claims`), its rows then standing for it.

And the ids a flow assigns before anything is sent: ``freeze`` gives every task of a canvas
one (``assign_ids``), and every id of a shaped tree, those its spreads will add included, is
gated and unique (``check_tree``).

A job in several flows of one canvas (``apply_async(on_exists="join")``): the same frozen
signature, one id, listed by two flows of the tree is one job, written by the first flow that
lists it and joined by the others (send/join.py), the plan alone deciding (``check_ids``).
Only a task can be shared; a job listed twice by one flow, a nested flow's parent or a chain's
step listed twice, and a job that would wait for itself (a cycle) are refused, with every
other id's rule (``check_unique``), before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from celery.canvas import Signature, _chain, _chord, group, maybe_signature

from celery_echomq.errors import DuplicateIdError, FlowExistsError
from celery_echomq.send.shape import SPREAD_TASK, is_linked
from celery_echomq.store.connection import text
from celery_echomq.store.keyspace import check_id, check_unique, new_job_id
from celery_echomq.store.planned import Plan, PlannedJob
from celery_echomq.store.replies import exists_error
from celery_echomq.store.state import EchoMQ

# A claim outlives any enqueue: a producer that dies holding one leaves it for this long.
CLAIM_TTL_MIN = 60


def claim_ids(state: EchoMQ, placed: Mapping[str, str]) -> list[str]:
    """Claim each id of ``placed`` (id -> the queue it will live on), then raise
    :class:`FlowExistsError` when one is claimed for, or has a row on, another queue.

    Returns the claim keys this call set, for :func:`release_claims` once the flow landed
    or was refused (a refusal here releases them itself)."""
    keys, chunk = state.keys, state.settings.chunk_size
    ttl = max(CLAIM_TTL_MIN, round(3 * state.settings.store_retry_timeout))
    items = list(placed.items())
    mine: list[str] = []
    try:
        for start in range(0, len(items), chunk):
            part = items[start : start + chunk]
            pipe = state.client.pipeline(transaction=False)
            for job_id, queue in part:
                pipe.set(keys.claim_key(job_id), queue, nx=True, ex=ttl)
                pipe.get(keys.claim_key(job_id))
            replies = pipe.execute()
            for (job_id, queue), was_set, held in zip(
                part, replies[0::2], replies[1::2], strict=True
            ):
                if was_set:
                    mine.append(keys.claim_key(job_id))
                elif held is not None and text(held) != queue:
                    raise exists_error(job_id, text(held))
        # Read after the claims: an enqueue whose claim is gone registered its queues first.
        queues = sorted(text(q) for q in state.client.smembers(keys.queues_key()))
        checks = [(job_id, q) for job_id, own in items for q in queues if q != own]
        for start in range(0, len(checks), chunk):
            part = checks[start : start + chunk]
            pipe = state.client.pipeline(transaction=False)
            for job_id, queue in part:
                pipe.exists(keys.job_key(queue, job_id))
            for (job_id, queue), there in zip(part, pipe.execute(), strict=True):
                if there:
                    raise exists_error(job_id, queue)
    except BaseException:
        release_claims(state, mine)
        raise
    return mine


def release_claims(state: EchoMQ, claims: Sequence[str]) -> None:
    """Delete the claims an enqueue set (one DEL per key: they span slots)."""
    if not claims:
        return
    pipe = state.client.pipeline(transaction=False)
    for key in claims:
        pipe.delete(key)
    pipe.execute()


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
    if is_linked(sig):
        for step in sig.tasks:  # its first may be a flow
            yield from _ids_of(step)
    elif getattr(sig, "subtask_type", None) == "flow":
        yield from ids(sig)
    elif "task_id" in sig.options:
        yield str(sig.options["task_id"])
    else:
        yield from _added(sig, sig._app)


def check_tree(node: Signature, shared: bool = False) -> None:
    """Every id a spread will add gated and unique with the rest, before anything reaches
    Redis (the ids planned now are gated by the plan). ``shared`` (on_exists="join"): one id
    listed twice is one job, which the plan checks (send/ids.py)."""
    found = [i for i in ids(node) if i != "None"]
    for job_id in found:
        check_id(job_id)
    check_unique(dict.fromkeys(found) if shared else found)


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
    tasks_of(sig, tasks)
    seen: dict[int, int] = {}
    for task in tasks:
        seen[id(task)] = seen.get(id(task), 0) + 1
    for task in tasks:
        if seen[id(task)] == 1:
            task.options.setdefault("task_id", new_job_id())


def tasks_of(sig: Any, out: list[Signature]) -> None:
    """Every task of the canvas ``sig``, in order, appended to ``out``."""
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
            tasks_of(part, out)


class CycleError(DuplicateIdError):
    """A job listed under itself: it would wait for its own value."""


def _call(job: PlannedJob) -> tuple[Any, ...]:
    message = job.message
    return (message.get("task"), message.get("args"), message.get("kwargs"), job.queue)


def check_ids(levels: Sequence[Plan], parent_id: str, shared: bool) -> dict[str, str]:
    """Every id of a tree names one row; with ``shared``, a task listed by several of its
    flows is one job. Returns each shared task's id -> the flow (its parent's id) that
    writes it, the first in ``levels``' order (outer first, as they are written)."""
    ids = [parent_id, *(cid for level in levels for cid in level.child_row_ids())]
    if not shared:
        check_unique(ids)
        return {}
    check_unique(dict.fromkeys(ids))  # a uuid and 'JOB' + it are still one row
    owners: dict[str, tuple[str, PlannedJob | None]] = {parent_id: ("", None)}
    under: dict[str, str] = {}  # a nested flow's parent id -> the flow that lists it
    writes: dict[str, str] = {}
    for level in levels:
        listed: set[str] = set()
        for entry in level.children:
            if isinstance(head := entry.head, Plan):
                under[head.parent_id] = level.parent_id
            plain = entry if isinstance(entry, PlannedJob) else None
            for cid in entry.row_ids():
                if cid in listed:
                    raise DuplicateIdError(
                        f"job id {cid!r} appears twice among the children of flow "
                        f"{level.parent_id!r}: a flow waits for a job once"
                    )
                listed.add(cid)
                _place(cid, level.parent_id, plain, owners, under, writes)
    return writes


def _place(
    cid: str,
    flow_id: str,
    job: PlannedJob | None,
    owners: dict[str, tuple[str, PlannedJob | None]],
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
