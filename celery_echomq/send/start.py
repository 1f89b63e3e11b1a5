"""Starting a flow: enqueue every level, then publish its leaves.

Each step is one script call; what follows it (a publish) is repeated by recovery if the
process dies in between.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any, NamedTuple

import redis
from kombu.exceptions import EncodeError
from redis.cluster import RedisCluster

from celery_echomq.config import safe_url
from celery_echomq.errors import EchoMQError, FlowExistsError, StoreUnavailableError
from celery_echomq.send.dispatch import dispatch_parent
from celery_echomq.send.fused import SINCE_MARK, prepare
from celery_echomq.send.ids import refuse_taken
from celery_echomq.send.plan import Plan, child_id, child_queue
from celery_echomq.send.publish import send_jobs
from celery_echomq.store.codec import child_template, job_delta
from celery_echomq.store.deadlines import arm_levels, disarm
from celery_echomq.store.headers import H_SINCE, H_STORE
from celery_echomq.store.script_base import BrokerPushes
from celery_echomq.store.scripts import ParentRef
from celery_echomq.store.state import EchoMQ, get_state

logger = logging.getLogger("celery_echomq")


class Encoded(NamedTuple):
    """A level's stored messages, encoded before anything is written.

    A level's children on its parent's slot are stored compactly: ``template`` (kept on the
    parent's row) and, per child, a delta against it where ``kinds`` has a ``d``; a whole
    payload where it has a ``p`` (a nested flow's entry, a child routed to another queue).
    See :mod:`~celery_echomq.store.codec`. ``kinds`` empty: every child's is a whole payload.
    """

    parent: bytes
    children: list[tuple[str, bytes]]
    template: bytes = b""
    kinds: str = ""


def _encode(state: EchoMQ, job: dict[str, Any], where: str) -> bytes:
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


def encode_plan(state: EchoMQ, plan: Plan) -> dict[str, Encoded]:
    """Every level's messages, by parent id; refuses (``EncodeError``) an argument the
    serializer cannot encode, naming its job, before any Redis command or publish."""
    encoded: dict[str, Encoded] = {}
    # Inner levels first: a bad argument is named where it is, not by the nested flow's
    # entry that carries it.
    for level in reversed(list(plan.levels())):
        # The template lives on the parent's row: only a child on the same slot (routed to
        # the parent's queue) can be stored against it.
        template = child_template(j for j in level.children if child_queue(j) == level.queue)
        children = []
        kinds = []
        dumps = state.dumps
        for position, job in enumerate(level.children, 1):
            cid = child_id(job)
            delta = None
            if template is not None and child_queue(job) == level.queue:
                delta = job_delta(template, job)
            kinds.append("p" if delta is None else "d")
            try:
                children.append((cid, dumps(job if delta is None else delta)))
            except Exception as exc:
                # Named only when it fails: a flow encodes thousands of children.
                what = "a nested flow" if "nested" in job else job["task"]
                where = f"flow {level.parent_id}: child {position} ({what}, {cid})"
                raise _refused(state, where, exc) from exc
        where = f"flow {level.parent_id}: the parent ({level.parent['task']})"
        parent = _encode(state, level.parent, where)
        if template is None:
            encoded[level.parent_id] = Encoded(parent, children)
            continue
        where = f"flow {level.parent_id}: its children's template ({template['task']})"
        encoded[level.parent_id] = Encoded(
            parent, children, _encode(state, template, where), "".join(kinds)
        )
    return encoded


def declare_reply_queue(app: Any, parent_id: str) -> None:
    """Declare the queue an ``rpc://`` result backend replies to, as ``send_task`` does before
    it publishes: the parent's result may come back before the caller asks for it."""
    from celery.backends.rpc import RPCBackend

    backend = app.backend
    if isinstance(backend, RPCBackend):
        with app.producer_or_acquire(None) as producer:
            backend.on_task_call(producer, parent_id)


def start_flow(state: EchoMQ, plan: Plan, encoded: dict[str, Encoded] | None = None) -> None:
    """Enqueue the flow (each level of a tree, outer first), then publish its leaves.

    A level whose children all live on its parent's slot, and are no more than
    ``echomq_chunk_size``, is one enqueue_flow script. Any other level takes the
    chunked path: open_flow holds the parent with one extra unit on its counter,
    add_children writes the children per queue and chunk, seal_flow removes the extra unit.

    A nested flow's parent is first written by its outer flow as a pending child whose
    payload is the nested plan, then held by its own level: a crash between the two leaves a
    pending child that recovery re-publishes, which resumes the nested flow (``publish``).
    """
    if encoded is None:
        encoded = encode_plan(state, plan)
    if not plan.outer:
        declare_reply_queue(state.app, plan.parent_id)
    scripts = state.scripts
    keys = state.keys
    chunk = state.settings.chunk_size
    levels = list(plan.levels())
    written: list[tuple[str, str, list[str]]] = []
    # On one Redis (not a Cluster, whose slots these keys span), each level's script also
    # writes its locator, and the first one registers the tree's queues: a small flow is one
    # round trip before its publish.
    cluster = isinstance(state.client, RedisCluster)
    chunked = [level.chunked(chunk) for level in levels]
    # When each level's children became pending (the store's clock, no later than their
    # pending score): their messages carry it, sparing each claim a read (see H_SINCE).
    since: dict[str, int | None] = {}
    store = safe_url(state.settings.redis_url or "")
    fused: BrokerPushes | None = None
    try:
        # Before the flow lands, not after: a producer killed right after the EVAL must still
        # leave its queues where recovery looks (SADD is idempotent).
        queues = {level.queue for level in levels}
        queues.update(child_queue(job) for level in levels for job in level.children)
        register: list[str] = sorted(queues)
        refuse_taken(
            state,
            {
                **{lv.parent_id: lv.queue for lv in levels if not lv.outer},
                **{child_id(j): child_queue(j) for lv in levels for j in lv.children},
            },
        )
        clock = None
        if cluster:
            state.client.sadd(keys.queues_key(), *register)
            register = []
        elif any(chunked):
            # The store's clock before the enqueue, for the chunked levels' children (their
            # scripts do not return the time they read). Not on a cluster, where TIME would
            # come from any node's clock, not the queue's master's.
            first = state.client.pipeline(transaction=False)
            first.sadd(keys.queues_key(), *register)
            first.time()
            _, (seconds, micros) = first.execute()
            clock = int(seconds) * 1000 + int(micros) // 1000
            register = []
        whole = []
        # A small flow of one level, on a broker that shares the store's server: its
        # children's messages go with its enqueue script (send/fused.py).
        fused = None
        one = levels[0]
        if len(levels) == 1 and one.children and not (cluster or chunked[0] or one.child_policies):
            fused = prepare(state, [_with_since(j, SINCE_MARK, store) for j in one.children])
        armed = arm_levels(state, levels)  # first: a flow that lands has its deadline
        try:
            for level, is_chunked in zip(levels, chunked, strict=True):
                if is_chunked:
                    _enqueue_chunked(state, level, encoded[level.parent_id], chunk, written)
                    since[level.parent_id] = clock
                    continue
                step = encoded[level.parent_id]
                _, since[level.parent_id] = scripts.enqueue_flow_at(
                    level.queue,
                    level.parent_id,
                    step.parent,
                    step.children,
                    outer=level.outer,
                    recent_ttl_ms=state.settings.result_ttl * 1000,
                    recent_max=state.settings.recent_flows,
                    template=step.template,
                    kinds=step.kinds,
                    # A missing policy reads as "fail" (settle_child, views): the default
                    # costs nothing.
                    policy="" if level.policy == "fail" else level.policy,
                    locator_ttl=0 if cluster else state.locator_ttl,
                    register=register,
                    publish=fused,
                )
                register = []
                written.append((level.queue, level.parent_id, level.child_ids()))
                whole.append(level)
        except EchoMQError:
            # A refusal after an earlier level or chunk landed: take back exactly what this
            # call wrote, so bad input leaves nothing behind.
            _rollback(state, written)
            disarm(state, armed)
            logger.info(
                "echomq: flow %s refused; %d steps taken back", plan.parent_id, len(written)
            )
            raise
        # After the atomic land: each child's own policy, on the same slot (one MULTI per
        # slot, as Redis Cluster requires), before any child can run (none is published yet).
        for level in whole:
            if level.child_policies:
                pipe = state.client.pipeline(transaction=True)
                for cid, child_policy in level.child_policies.items():
                    pipe.hset(keys.job_key(level.queue, cid), "parent_policy", child_policy)
                pipe.execute()
        # Outside the flow's slot: where a bare id lives (written by the script where it can).
        located = [
            level
            for level, is_chunked in zip(levels, chunked, strict=True)
            if cluster or is_chunked
        ]
        if located:
            side = state.client.pipeline(transaction=False)
            for level in located:
                side.set(keys.locator_key(level.parent_id), level.queue, ex=state.locator_ttl)
            side.execute()
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        where = f"Redis at {safe_url(state.settings.redis_url or '')!r}"
        if not written:
            raise StoreUnavailableError(
                f"{where} is unavailable ({exc}); the flow was not started and nothing was "
                "published"
            ) from exc
        raise StoreUnavailableError(
            f"{where} became unavailable ({exc}) after flow {plan.parent_id} was enqueued; "
            "nothing was published: recovery publishes its children once Redis is back"
        ) from exc
    if logger.isEnabledFor(logging.INFO):
        logger.info(
            "echomq: flow %s enqueued on %s with %d children%s",
            plan.parent_id,
            plan.queue,
            len(plan.children),
            f" ({len(levels) - 1} nested flows)" if len(levels) > 1 else "",
        )
    if fused is not None:
        return  # its children's messages were pushed by its enqueue
    leaves = [
        _with_since(job, since[level.parent_id], store)
        for level in levels
        for job in level.children
        if "nested" not in job
    ]
    if leaves:
        publish(state.app, leaves)
    for level in levels:
        if not level.children:
            dispatch_parent(state, level.queue, level.parent_id)


def _with_since(job: dict[str, Any], since: int | None, store: str) -> dict[str, Any]:
    """``job`` with :data:`H_SINCE` and :data:`H_STORE` in its message headers (its stored
    payload keeps neither)."""
    first: dict[str, Any] = {H_STORE: store}
    if since is not None:
        first[H_SINCE] = since
    options = dict(job["options"])
    options["headers"] = {**(options.get("headers") or {}), **first}
    return {**job, "options": options}


def _rollback(state: EchoMQ, written: list[tuple[str, str, list[str]]]) -> None:
    """Delete what a refused start wrote: ``(queue, parent id or '', child ids)`` per step."""
    keys = state.keys
    for queue, parent_id, child_ids in reversed(written):
        # A parent the step held was counted in the queue's 'held' counter: uncount it.
        held = (
            bool(parent_id)
            and state.client.hget(keys.job_key(queue, parent_id), "state") == b"awaiting_children"
        )
        pipe = state.client.pipeline(transaction=False)
        for cid in child_ids:
            pipe.delete(keys.job_key(queue, cid))
        if child_ids:
            pipe.zrem(keys.queue_key(queue, "pending"), *child_ids)
        if parent_id:
            pipe.delete(keys.job_key(queue, parent_id), keys.flow_keys(queue, parent_id)[0])
            # Its locator, where its script wrote one (a key of another slot: on its own).
            pipe.delete(keys.locator_key(parent_id))
            pipe.zrem(keys.queue_key(queue, "open"), parent_id)
            pipe.zrem(keys.queue_key(queue, "pending"), parent_id)
            # Undo what open_flow/enqueue_flow counted: the flow never existed.
            pipe.zrem(keys.queue_key(queue, "recent"), parent_id)
            if held:
                pipe.hincrby(keys.queue_key(queue, "counters"), "held", -1)
        pipe.execute()


def _enqueue_chunked(
    state: EchoMQ,
    level: Plan,
    encoded: Encoded,
    chunk: int,
    written: list[tuple[str, str, list[str]]],
) -> None:
    scripts = state.scripts
    scripts.open_flow(
        level.queue,
        level.parent_id,
        encoded.parent,
        len(level.children),
        level.policy,
        outer=level.outer,
        recent_ttl_ms=state.settings.result_ttl * 1000,
        recent_max=state.settings.recent_flows,
        template=encoded.template,
    )
    written.append((level.queue, level.parent_id, []))
    by_queue: dict[str, list[tuple[str, bytes, str]]] = {}
    kinds_by_queue: dict[str, list[str]] = {}  # a kind per row: a delta or a whole payload
    kinds = encoded.kinds or "p" * len(level.children)
    for job, (cid, payload), kind in zip(level.children, encoded.children, kinds, strict=True):
        by_queue.setdefault(child_queue(job), []).append(
            (cid, payload, level.child_policies.get(cid, ""))
        )
        kinds_by_queue.setdefault(child_queue(job), []).append(kind)
    parent = ParentRef(level.parent_id, level.queue)
    open_key = state.keys.queue_key(level.queue, "open")
    for queue, rows in by_queue.items():
        for start in range(0, len(rows), chunk):
            rows_chunk = rows[start : start + chunk]
            rows_kinds = "".join(kinds_by_queue[queue][start : start + chunk])
            scripts.add_children(
                queue, parent, rows_chunk, "" if "d" not in rows_kinds else rows_kinds
            )
            written.append((queue, "", [cid for cid, _, _ in rows_chunk]))
            # A producer still writing is alive: recovery takes an open flow for abandoned a
            # stall timeout after its last chunk, not after its first, however large it is.
            seconds, micros = state.client.time()
            state.client.zadd(open_key, {level.parent_id: seconds * 1000 + micros // 1000}, xx=True)
    scripts.seal_flow(level.queue, level.parent_id)
    logger.info(
        "echomq: flow %s opened, %d children added on %d queue(s), sealed",
        level.parent_id,
        len(level.children),
        len(by_queue),
    )


def resume_nested(state: EchoMQ, plan: Plan) -> None:
    """Finish starting a nested flow whose outer flow landed but which did not (recovery)."""
    # FlowExistsError: it landed after all; its own children are pending rows that recovery
    # re-publishes.
    with contextlib.suppress(FlowExistsError):
        start_flow(state, plan)


def publish(app: Any, jobs: Iterable[dict[str, Any]]) -> None:
    """Publish stored job dicts in one batch; a nested flow's entry resumes that flow (its
    outer flow landed, it did not: starting it is what is left to do)."""
    jobs = list(jobs)
    send_jobs(app, [job for job in jobs if "nested" not in job])
    for job in jobs:
        if "nested" in job:
            resume_nested(get_state(app), Plan.from_dict(job["nested"]))
