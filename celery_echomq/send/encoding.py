"""A flow's messages encoded before anything is written: each level's parent and children,
a child against its level's template where it can be (a delta), a linked chain as its
steps' rows. Refuses what the serializer cannot encode, naming the job. Pure.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kombu.exceptions import EncodeError

from celery_echomq.send.fan_in import waiting_kinds
from celery_echomq.send.plan import Plan
from celery_echomq.store.codec import PLACE, child_template, job_delta
from celery_echomq.store.planned import PlannedChain, PlannedJob, stored_message, stored_node
from celery_echomq.store.state import EchoMQ

# A chain's steps, by their kind (enqueue_flow.lua, add_children.lua): its first step, pending;
# a middle step, waiting; its last, waiting, and the one its parent counts.
STEP_FIRST, STEP_WAITING, STEP_LAST = "s", "w", "l"


class Encoded(NamedTuple):
    """A level's stored messages, encoded before anything is written.

    A level's children on its parent's slot are stored compactly: ``template`` (kept on the
    parent's row) and, per child, a delta against it where ``kinds`` has a ``d``; a whole
    payload where it has a ``p`` (a nested flow's entry, a child routed to another queue).
    See :mod:`~celery_echomq.store.codec`. ``kinds`` empty: every child's is a whole payload.
    ``alike``: per child, whether its job is the template's task with the template's options
    (its id aside): the messages of such children differ only in id and arguments, which
    their publish need not compare again (wire/publish.py).
    """

    parent: bytes
    children: list[tuple[str, bytes]]
    template: bytes = b""
    kinds: str = ""
    alike: tuple[bool, ...] = ()


def _encode(state: EchoMQ, job: dict[str, Any], where: str) -> bytes:
    """``job`` (a message or a node's stored form) encoded, or refused naming ``where``."""
    try:
        return state.dumps(job)
    except Exception as exc:
        raise _refused(state, where, exc) from exc


def _refused(state: EchoMQ, where: str, exc: Exception) -> EncodeError:
    name = state.settings.serializer
    return EncodeError(
        f"{where} cannot be encoded with the {name!r} serializer (task_serializer): "
        f"{type(exc).__name__}: {exc}; the flow was not started: nothing was written or "
        "published"
    )


# A delta naming any of these is of a job whose message differs from the template's in more
# than its arguments (its task, its options, its place in its group): its message is not
# built from the template's.
_NOT_ALIKE = frozenset({"task", "options", PLACE})


def encode_plan(state: EchoMQ, plan: Plan) -> dict[str, Encoded]:
    """Every level's messages, by parent id; refuses (``EncodeError``) an argument the
    serializer cannot encode, naming its job, before any Redis command or publish."""
    encoded: dict[str, Encoded] = {}
    # Inner levels first: a bad argument is named where it is, not by the nested flow's
    # entry that carries it.
    for level in reversed(list(plan.levels())):
        # The template lives on the parent's row: only a child on the same slot (routed to
        # the parent's queue) can be stored against it.
        template = child_template(
            stored_message(j)
            for j in level.children
            if isinstance(j, PlannedJob) and j.queue == level.queue
        )
        children = []
        kinds = []
        alike = []
        dumps = state.dumps
        for position, job in enumerate(level.children, 1):
            if isinstance(job, PlannedChain):
                steps = job.steps
                for i, step in enumerate(steps):
                    where = f"flow {level.parent_id}: child {position}, step {i + 1}"
                    children.append((step.id, _encode(state, stored_node(step), where)))
                kinds.append(STEP_FIRST + STEP_WAITING * (len(steps) - 2) + STEP_LAST)
                alike.append(False)
                continue
            cid = job.id
            delta = None
            if template is not None and isinstance(job, PlannedJob) and job.queue == level.queue:
                delta = job_delta(template, stored_message(job))
            kinds.append("p" if delta is None else "d")
            alike.append(delta is not None and _NOT_ALIKE.isdisjoint(delta))
            try:
                children.append((cid, dumps(stored_node(job) if delta is None else delta)))
            except Exception as exc:
                # Named only when it fails: a flow encodes thousands of children.
                what = "a nested flow" if isinstance(job, Plan) else job.message["task"]
                where = f"flow {level.parent_id}: child {position} ({what}, {cid})"
                raise _refused(state, where, exc) from exc
        where = f"flow {level.parent_id}: the parent ({level.parent['task']})"
        parent = _encode(state, stored_message(level), where)
        kinds = list(waiting_kinds("".join(kinds), level.max_active))
        if template is None:
            told = any(isinstance(j, PlannedChain) for j in level.children) or level.max_active > 0
            encoded[level.parent_id] = Encoded(parent, children, kinds="".join(kinds) * told)
            continue
        where = f"flow {level.parent_id}: its children's template ({template['task']})"
        encoded[level.parent_id] = Encoded(
            parent, children, _encode(state, template, where), "".join(kinds), tuple(alike)
        )
    return encoded
