"""Starting a flow: enqueue every level, then publish its leaves.

Each step is one script call; what follows it (a publish) is repeated by recovery if the
process dies in between.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster

from celery_echomq.config import safe_url
from celery_echomq.errors import (
    EchoMQError,
    FlowExistsError,
    StoreUnavailableError,
    StoreWriteRefusedError,
)
from celery_echomq.send.batches import batch_jobs
from celery_echomq.send.chunked import Written, enqueue_chunked, takes_chunked_path
from celery_echomq.send.dispatch import declare_reply_queue, dispatch_parent
from celery_echomq.send.encoding import Encoded, encode_plan
from celery_echomq.send.ids import claim_ids, release_claims
from celery_echomq.send.join import Joined, joins_by_level
from celery_echomq.send.plan import Plan
from celery_echomq.store.connection import describe
from celery_echomq.store.deadlines import Armed, arm_levels, disarm, rearm
from celery_echomq.store.headers import H_SINCE, H_STORE
from celery_echomq.store.planned import PlannedJob, nested_plan, stored_message
from celery_echomq.store.refusals import named_refusal, refusal_of
from celery_echomq.store.replies import Status, WideCheck
from celery_echomq.store.script_values import BrokerPushes
from celery_echomq.store.state import EchoMQ, get_state
from celery_echomq.wire.publish import SINCE_MARK, prepare, send_jobs

logger = logging.getLogger("celery_echomq")


def start_flow(
    state: EchoMQ,
    plan: Plan,
    encoded: dict[str, Encoded] | None = None,
    joined: dict[str, Joined] | None = None,
) -> list[tuple[Status, str, str]]:
    """Enqueue the flow (each level of a tree, outer first), then publish its leaves.

    A level whose children all live on its parent's slot, and are no more than
    ``echomq_chunk_size``, is one enqueue_flow script. Any other level takes the
    chunked path: open_flow holds the parent with one extra unit on its counter,
    add_children writes the children per queue and chunk, seal_flow removes the extra unit.

    A nested flow's parent is first written by its outer flow as a pending child whose
    payload is the nested plan, then held by its own level: a crash between the two leaves a
    pending child that recovery re-publishes, which resumes the nested flow (``publish``).

    ``joined``: children that name jobs in the store, or that several flows of the tree list
    (``on_exists="join"``, send/join.py): a level that joins one takes the chunked path, the
    job gains an edge instead of a row, and what crediting finished ones made of the parent is
    returned for the caller to follow.

    In three phases: prepare (what the levels need, nothing written), land (every write,
    taken back on a refusal), publish (the leaves' messages, the parents with no children).
    """
    if encoded is None:
        encoded = encode_plan(state, plan)
    if not plan.outer:
        declare_reply_queue(state.app, plan.parent_id)
    start = _prepare(state, plan, joined or {})
    since, fused, settled = _land(state, plan, start, encoded)
    if logger.isEnabledFor(logging.INFO):
        logger.info(
            "echomq: flow %s enqueued on %s with %d children%s",
            plan.parent_id,
            plan.queue,
            len(plan.children),
            f" ({len(start.levels) - 1} nested flows)" if len(start.levels) > 1 else "",
        )
    if fused is None:  # else its children's messages were pushed by its enqueue
        with _publish_refused(state, plan):
            _publish_levels(state, start, since)
    return settled


@dataclass(frozen=True)
class _Start:
    """What a flow's start decides before it writes anything."""

    levels: list[Plan]
    # Per level: whether it takes the chunked path (open, add per chunk, seal).
    chunked: list[bool]
    # On one Redis (not a Cluster, whose slots these keys span), each level's script also
    # writes its locator, and the first one registers the tree's queues: a small flow is one
    # round trip before its publish.
    cluster: bool
    # Every queue of the tree, for the registry of queues that hold flows.
    queues: list[str]
    # An id names one job in the whole store (send/ids.py): on one server, each level's
    # enqueue script checks its ids across queues itself; else they are claimed first.
    in_script: bool
    store: str  # the store's URL as a message names it (no password)
    # Per level (its parent's id): the children it joins instead of writing (on_exists="join").
    joins: dict[str, dict[str, Joined]]
    # The joined ids whose jobs are in the store already: never claimed.
    in_store: frozenset[str]


def _prepare(state: EchoMQ, plan: Plan, joined: dict[str, Joined]) -> _Start:
    """The levels and their paths, from the plan and the settings alone."""
    levels = list(plan.levels())
    cluster = isinstance(state.client, RedisCluster)
    joins = joins_by_level(plan, joined)
    chunk = state.settings.chunk_size
    chunked = [takes_chunked_path(level, chunk, joins[level.parent_id]) for level in levels]
    queues = {level.queue for level in levels}
    queues.update(child.queue for level in levels for child in level.children)
    return _Start(
        levels,
        chunked,
        cluster,
        sorted(queues),
        in_script=not (cluster or any(chunked)),
        store=safe_url(state.settings.redis_url or ""),
        joins=joins,
        in_store=frozenset(i for i, j in joined.items() if not j.owner),
    )


def _land(
    state: EchoMQ, plan: Plan, start: _Start, encoded: dict[str, Encoded]
) -> tuple[dict[str, int | None], BrokerPushes | None, list[tuple[Status, str, str]]]:
    """Write the flow, every level; on a refusal take back what was written. Returns when
    each level's children became pending (the store's clock, no later than their pending
    score: their messages carry it, sparing each claim a read, see H_SINCE), the messages
    its enqueue pushed itself (wire/publish.py), if it did, and what crediting the joined jobs
    that had finished made of their new parents."""
    written: Written = []
    since: dict[str, int | None] = {}
    claims: list[str] = []
    with _store_errors(state, plan, written), _claims_released(state, claims):
        if not start.in_script:
            unclaimed = placed(start.levels).items()
            claims += claim_ids(state, {i: q for i, q in unclaimed if i not in start.in_store})
        clock, register = _register_queues(state, start)
        fused = _fused(state, start, encoded)
        armed = arm_levels(state, start.levels)  # first: a flow that lands has its deadline
        with _taken_back_on_refusal(state, plan, written, armed):
            whole, settled = _enqueue_levels(
                state, start, encoded, register, fused, clock, written, since, claims
            )
        rearm(state, armed)  # a poller that met an entry before its flow landed dropped it
        _write_child_policies(state, whole)
        _write_locators(state, start)
    return since, fused, settled


@contextlib.contextmanager
def _publish_refused(state: EchoMQ, plan: Plan) -> Iterator[None]:
    """The flow landed; a refusal now is the broker's (a Redis broker out of memory, say) or,
    for a parent with no children, the store's dispatch: StoreWriteRefusedError, naming it."""
    try:
        yield
    except Exception as exc:
        if refusal_of(exc) is None:
            raise
        store = isinstance(exc, StoreWriteRefusedError)
        where = describe(state.settings) if store else safe_url(str(state.app.conf.broker_url))
        outcome = (
            f"flow {plan.parent_id} was written to the store, but not every message of it was "
            "published: recovery publishes what is missing once it takes writes"
        )
        with named_refusal(where, lambda: outcome, "the flow store" if store else "the broker"):
            raise


@contextlib.contextmanager
def _store_errors(state: EchoMQ, plan: Plan, written: Written) -> Iterator[None]:
    """A store that goes away mid-start raises StoreUnavailableError, saying what landed; one
    that refuses writes, StoreWriteRefusedError."""
    try:
        with named_refusal(describe(state.settings), lambda: _refused_outcome(plan, written)):
            yield
    except StoreWriteRefusedError:
        raise
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


def _refused_outcome(plan: Plan, written: Written) -> str:
    """What a start refused by the store left: its first write is refused whole (a script
    refused at its first write wrote nothing), and one refused later is taken back."""
    if not written:
        return f"flow {plan.parent_id} was not started: nothing of it was written or published"
    return (
        f"flow {plan.parent_id} was written in part ({len(written)} steps), not taken "
        "back; nothing was published: recovery publishes what landed, or fails a level "
        "left open as abandoned, once the store takes writes"
    )


@contextlib.contextmanager
def _claims_released(state: EchoMQ, claims: list[str]) -> Iterator[None]:
    try:
        yield
    finally:
        # Landed or refused: its rows, or nothing, stand for its ids from now on.
        with contextlib.suppress(redis.RedisError):
            release_claims(state, claims)


@contextlib.contextmanager
def _taken_back_on_refusal(
    state: EchoMQ, plan: Plan, written: Written, armed: list[Armed]
) -> Iterator[None]:
    """A refusal after an earlier level or chunk landed: take back exactly what this call
    wrote, so bad input leaves nothing behind."""
    try:
        yield
    except StoreUnavailableError:
        # Not bad input: the store refused a write, or went away. What landed is taken back
        # if the store lets it (under OOM it does: a deletion is not refused); else it stays
        # for recovery, as after a producer that died there, and the error says so.
        try:
            _rollback(state, written)
            disarm(state, armed)
        except Exception as exc:
            logger.warning("echomq: flow %s not taken back: %s", plan.parent_id, exc)
        else:
            written.clear()
        raise
    except EchoMQError:
        _rollback(state, written)
        disarm(state, armed)
        logger.info("echomq: flow %s refused; %d steps taken back", plan.parent_id, len(written))
        raise


def _register_queues(state: EchoMQ, start: _Start) -> tuple[int | None, list[str]]:
    """Register the tree's queues before the flow lands, not after: a producer killed right
    after the EVAL must still leave its queues where recovery looks (SADD is idempotent).
    Returns the store's clock where it was read, and the queues left for the first enqueue
    script to register."""
    keys = state.keys
    if start.cluster:
        state.client.sadd(keys.queues_key(), *start.queues)
        return None, []
    if any(start.chunked):
        # The store's clock before the enqueue, for the chunked levels' children (their
        # scripts do not return the time they read). Not on a cluster, where TIME would
        # come from any node's clock, not the queue's master's.
        first = state.client.pipeline(transaction=False)
        first.sadd(keys.queues_key(), *start.queues)
        first.time()
        _, (seconds, micros) = first.execute()
        return int(seconds) * 1000 + int(micros) // 1000, []
    return None, list(start.queues)


def _fused(state: EchoMQ, start: _Start, encoded: dict[str, Encoded]) -> BrokerPushes | None:
    """A small flow of one level, on a broker that shares the store's server: its children's
    messages go with its enqueue script (wire/publish.py)."""
    levels, one = start.levels, start.levels[0]
    plain = not (start.cluster or start.chunked[0] or one.child_policies or one.batch)
    if len(levels) != 1 or not one.children or not plain:
        return None
    heads, store = [child.head for child in one.started()], start.store
    jobs = [
        with_since(stored_message(h), SINCE_MARK, store) for h in heads if isinstance(h, PlannedJob)
    ]
    return prepare(state, jobs, encoded[one.parent_id].alike)


def _enqueue_levels(
    state: EchoMQ,
    start: _Start,
    encoded: dict[str, Encoded],
    register: list[str],
    fused: BrokerPushes | None,
    clock: int | None,
    written: Written,
    since: dict[str, int | None],
    claims: list[str],
) -> tuple[list[Plan], list[tuple[Status, str, str]]]:
    """Each level, outer first: one enqueue_flow script, or the chunked path. Returns the
    levels written whole, and what the chunked levels' joined jobs made of their parents."""
    chunk = state.settings.chunk_size
    cluster = start.cluster
    whole: list[Plan] = []
    settled: list[tuple[Status, str, str]] = []
    for level, is_chunked in zip(start.levels, start.chunked, strict=True):
        if is_chunked:
            joins = start.joins[level.parent_id]
            settled += enqueue_chunked(
                state, level, encoded[level.parent_id], chunk, written, joins
            )
            since[level.parent_id] = clock
            continue
        step = encoded[level.parent_id]
        enqueue = functools.partial(
            state.scripts.enqueue_flow_at,
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
        try:
            _, since[level.parent_id] = enqueue(check=start.in_script)
        except WideCheck:
            # Too many ids and queues for one script to check: claimed here instead.
            claims += claim_ids(state, placed([level]))
            _, since[level.parent_id] = enqueue(check=False)
        register = []
        written.append((level.queue, level.parent_id, level.child_row_ids()))
        whole.append(level)
    return whole, settled


def _write_child_policies(state: EchoMQ, whole: list[Plan]) -> None:
    """After the atomic land: each child's own policy, on the same slot (one MULTI per
    slot, as Redis Cluster requires), before any child can run (none is published yet)."""
    for level in whole:
        if level.child_policies:
            pipe = state.client.pipeline(transaction=True)
            for cid, child_policy in level.child_policies.items():
                pipe.hset(state.keys.job_key(level.queue, cid), "parent_policy", child_policy)
            pipe.execute()


def _write_locators(state: EchoMQ, start: _Start) -> None:
    """Outside the flow's slot: where a bare id lives (written by the script where it can)."""
    located = [
        level
        for level, is_chunked in zip(start.levels, start.chunked, strict=True)
        if start.cluster or is_chunked
    ]
    if located:
        side = state.client.pipeline(transaction=False)
        for level in located:
            side.set(state.keys.locator_key(level.parent_id), level.queue, ex=state.locator_ttl)
        side.execute()


def _publish_levels(state: EchoMQ, start: _Start, since: dict[str, int | None]) -> None:
    """The leaves' messages (a nested flow's parent is no leaf: its own level holds it; a
    level that batches its children sends a message per batch), and the parents with no
    children, which run at once."""
    leaves: list[dict[str, Any]] = []
    for level in start.levels:
        heads = [
            head
            for child in level.started()
            if isinstance(head := child.head, PlannedJob)
            and child.id not in start.joins[level.parent_id]
        ]
        at = since[level.parent_id]
        if level.batch:
            leaves += batch_jobs(state.app, level, heads, at, start.store)
        else:
            leaves += [with_since(stored_message(head), at, start.store) for head in heads]
    if leaves:
        publish(state.app, leaves)
    for level in start.levels:
        if not level.children:
            dispatch_parent(state, level.queue, level.parent_id)


def placed(levels: list[Plan]) -> dict[str, str]:
    """Every id these levels write (a nested level's parent is its outer level's child) ->
    the queue its row lives on."""
    return {
        **{lv.parent_id: lv.queue for lv in levels if not lv.outer},
        **{cid: c.queue for lv in levels for c in lv.children for cid in c.row_ids()},
    }


def with_since(job: dict[str, Any], since: int | None, store: str) -> dict[str, Any]:
    """``job`` with :data:`H_SINCE` and :data:`H_STORE` in its message headers (its stored
    payload keeps neither)."""
    first: dict[str, Any] = {H_STORE: store}
    if since is not None:
        first[H_SINCE] = since
    options = dict(job["options"])
    options["headers"] = {**(options.get("headers") or {}), **first}
    return {**job, "options": options}


def _rollback(state: EchoMQ, written: Written) -> None:
    """Delete what a refused start wrote: ``(queue, parent id or '', child ids)`` per step,
    a chunk of rows at a time, each chunk and the parent's own keys one script (forget.lua,
    which also takes back what the start counted: the parent held, children in a window)."""
    keys, size = state.keys, state.settings.chunk_size
    for queue, parent_id, child_ids in reversed(written):
        for at in range(0, len(child_ids), size):
            state.scripts.forget(queue, child_ids[at : at + size])
        if parent_id:
            state.scripts.forget(queue, [parent_id], [parent_id])
            # Its locator, where its script wrote one (a key of another slot: on its own).
            state.client.delete(keys.locator_key(parent_id))


def resume_nested(state: EchoMQ, plan: Plan) -> None:
    """Finish starting a nested flow whose outer flow landed but which did not (recovery)."""
    # FlowExistsError: it landed after all; its own children are pending rows that recovery
    # re-publishes.
    with contextlib.suppress(FlowExistsError):
        start_flow(state, plan)


def publish(app: Any, jobs: Iterable[dict[str, Any]]) -> None:
    """Publish stored jobs (decoded) in one batch; a nested flow's entry resumes that flow
    (its outer flow landed, it did not: starting it is what is left to do)."""
    messages = []
    for job in jobs:
        if (nested := nested_plan(job)) is not None:
            resume_nested(get_state(app), nested)
        else:
            messages.append(job)
    send_jobs(app, messages)
