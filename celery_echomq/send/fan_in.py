"""How a flow's parent fans in, where it does not take every child's value once all are done:
a window, a quorum, a fold. Each is checked as ``flow()`` is given it, planned onto the
parent's stored job and its children's messages (pure), and what follows a release by it is
done here too.

A window on a flow's children (``flow(parent, children, max_active=N)``), planned: at most
N of them published or running at once. Pure.

The first N children start as any flow's do; the others are written ``waiting`` (kinds
``D``/``P`` beside the usual ``d``/``p``), their ids in order in their parent's ``:window``
list, and have no message. The script that finishes a child makes the next one pending and
hands it to its caller to publish (``store/lua/includes/window.lua``): publication follows
the children's order. A nested flow among them is one child: its own level is enqueued when
its turn comes, and it holds its slot until it finishes.

A flow released by a quorum of its children (``flow(parent, children, quorum=K)``).

Planned here: the parent's stored job keeps ``quorum`` (K) and the queues of its children on
other slots (``quorum_queues``), and every child's message the header :data:`H_QUORUM`
(``"K/N"``), which its worker passes to the script that settles it
(store/lua/includes/quorum.lua; a child of another slot is credited by credit.lua, passed the
same). That script releases the parent at the K-th success, in
order of success, and fails it at once when fewer than K can still succeed. What follows a
release or a failure is done here too: the parent gets the K values in the order they
succeeded (:func:`quorum_values`), and the children not yet started are cancelled
(:func:`cut_rest`); those running finish, recorded on their own rows, not counted.

A flow whose children's values are folded into one accumulator as they arrive
(``flow(parent, children, reduce=R)``): the parent gets that accumulator as its first
argument, one bounded value, rather than the list of every child's value.

Planned here: the parent's stored job keeps ``reduce`` (the reducer, as a JSON list), and every
child's message the header :data:`H_REDUCE` (the same, as JSON), which its worker passes to the
script that completes it (store/lua/includes/reduce.lua): that script folds the child's value
into the accumulator on the parent's row, in the step that credits it, so exactly once per
child. A value the reducer cannot fold fails that child under its policy, with the reason.
:func:`fold` is the same fold in Python, for eager mode.

The reducers: ``"count"``, ``"sum"``, ``"min"``, ``"max"``, ``"merge"`` (a dict union, a later
child's keys over earlier ones), ``("top", n, key)`` (the n values largest by ``value[key]``,
largest first, earlier first among equals) and ``("list", n)`` (the first n values).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery_echomq.send.jobs import mark_for_store
from celery_echomq.store.connection import text
from celery_echomq.store.headers import H_QUEUE, H_QUORUM, H_REDUCE
from celery_echomq.store.planned import Held, Node, Plan, PlannedChain, held_of
from celery_echomq.store.state import EchoMQ

MAX_ACTIVE_ALLOWED = (
    "an int >= 1 (the most children published or running at once), or None (no window)"
)


def check_max_active(value: object, where: str = "flow(max_active=...)") -> int | None:
    """``value`` if it is a window's size, else a ValueError saying what is allowed."""
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise ValueError(f"{where}: {value!r} is not allowed; allowed: {MAX_ACTIVE_ALLOWED}")
    return value


@dataclass(frozen=True)
class FlowSpec:
    """How a flow's parent fans in, as ``flow()`` was given it and checked it (canvas.py): its
    deadline (store/deadline_spec.py), window, quorum and reducer. The planner applies it as
    it builds the flow's level (send/plan.py), without checking it again."""

    deadline: dict[str, float] | None = None
    on_deadline: str = "fail"
    max_active: int | None = None
    quorum: int | None = None
    reduce: list[Any] | None = None
    batch: int | None = None  # children a broker message delivers (send/batches.py)

    @classmethod
    def of(cls, kwargs: Mapping[str, Any]) -> FlowSpec:
        """The spec a flow signature's ``kwargs`` keep (each checked by ``flow()``)."""
        return cls(
            deadline=kwargs.get("deadline") or None,
            on_deadline=str(kwargs.get("on_deadline", "fail")),
            max_active=kwargs.get("max_active"),
            quorum=kwargs.get("quorum"),
            reduce=kwargs.get("reduce"),
            batch=kwargs.get("batch"),
        )


NO_SPEC = FlowSpec()


def window_of(plan: Plan, size: int | None) -> tuple[int, str]:
    """Give a planned level its window of ``size`` (None: none): ``(size, the queue its
    children are on)``, which its parent's stored job keeps (what ``add_children`` and
    ``show`` read), ``(0, "")`` for none; refuse a window the store cannot keep, before
    anything is written."""
    if size is None:
        return 0, ""
    for job in plan.children:
        if isinstance(job, PlannedChain):
            raise ValueError(
                f"flow {plan.parent_id}: max_active={size} takes tasks and flows as children, "
                "not a chain of tasks; allowed: wrap the chain in a flow of its own, or no "
                "max_active"
            )
    queues = sorted({job.queue for job in plan.children})
    if len(queues) > 1:
        raise ValueError(
            f"flow {plan.parent_id}: max_active={size} needs every child on one queue (the "
            f"window is kept on their queue's slot); these go to {', '.join(queues)}; allowed: "
            "children routed to one queue (it may differ from the parent's), or no max_active"
        )
    plan.max_active = size
    return size, queues[0] if queues else plan.queue


# A windowed level's first children, out at once, are marked as holding a slot (``e``, ``q``:
# the script that finishes one frees it); the others wait (``D``, ``P``). A child of a flow
# without a window keeps ``d`` or ``p``, and its completion never looks at a window.
_OUT_IN_WINDOW = str.maketrans("dp", "eq")


def waiting_kinds(kinds: str, size: int) -> str:
    """A level's row kinds for a window of ``size``: the first ``size`` children out at once,
    holding a slot (``d`` -> ``e``, ``p`` -> ``q``), each child after them waiting (``d`` ->
    ``D``, ``p`` -> ``P``); as they are with no window (a windowed level has no chain: one row
    per child)."""
    if not size:
        return kinds
    return kinds[:size].translate(_OUT_IN_WINDOW) + kinds[size:].upper()


def windowed(parent: dict[str, Any], queue: str, added: list[Node]) -> int:
    """The window of a running flow (``parent``: its stored job, on ``queue``) that
    ``added`` children join, 0 for none; refuses children its window cannot take, before
    anything is written: ``grow_flow`` keeps the window on the parent's slot, so they must
    be on the parent's queue, as the flow's own children must."""
    held = held_of(parent)
    size = held.max_active
    if not size:
        return 0
    where = held.window_queue or queue
    strays = sorted({job.queue for job in added} - {queue})
    if where != queue or strays:
        raise ValueError(
            f"flow {(parent.get('options') or {}).get('task_id')}: children added to a flow "
            f"with max_active={size} join its window on queue {queue!r}, its parent's; these "
            f"go to {', '.join(strays or [where])}; allowed: added children on {queue!r} (a "
            "flow whose children are on another queue than its parent takes none)"
        )
    return size


logger = logging.getLogger("celery_echomq")

QUORUM_ALLOWED = "an int >= 1 (the successes that release the parent), or None (every child)"


def check_quorum(value: object, where: str = "flow(quorum=...)") -> int | None:
    """``value`` if it is a quorum, else a ValueError saying what is allowed."""
    if value is None:
        return None
    if type(value) is not int or value < 1:
        raise ValueError(f"{where}: {value!r} is not allowed; allowed: {QUORUM_ALLOWED}")
    return value


def _headers(job: dict[str, Any]) -> dict[str, Any]:
    options = job.setdefault("options", {})
    headers: dict[str, Any] = options.setdefault("headers", {}) or {}
    options["headers"] = headers
    return headers


def quorum_of(plan: Plan, need: int | None) -> tuple[int, list[str]]:
    """Give a planned level its quorum of ``need`` (None: none) on every child's message:
    ``(need, the queues of its children on other slots)``, which its parent's stored job
    keeps, ``(0, [])`` for none; refuse one that cannot be met or that the store cannot
    count, before anything is written."""
    if need is None:
        return 0, []
    total = len(plan.children)
    if need > total:
        raise ValueError(
            f"flow {plan.parent_id}: quorum={need} of {total} children can never be met; "
            f"allowed: a quorum of at most {total}, or none"
        )
    for job in plan.children:
        if isinstance(job, PlannedChain):
            raise ValueError(
                f"flow {plan.parent_id}: quorum={need} takes tasks and flows as children, not "
                "a chain of tasks; allowed: wrap the chain in a flow of its own, or no quorum"
            )
    # The queues of its children on other slots than its own: where cut_rest cancels them.
    elsewhere = sorted({job.queue for job in plan.children} - {plan.queue})
    mark = f"{need}/{total}"
    for job in plan.children:
        if not isinstance(job, PlannedChain):  # refused above
            job.message["options"].setdefault("headers", {})[H_QUORUM] = mark
    return need, elsewhere


def refuse_growth(flow_id: str, held: Held) -> None:
    """Refuse children added to a flow released by a quorum (``held``: what its parent's
    stored job keeps): its children's messages carry the N of "K of N", fixed when it was
    sent."""
    if quorum := held.quorum:
        raise ValueError(
            f"flow {flow_id}: a flow with "
            f"quorum={quorum} takes no added children (its quorum counts the children "
            "it was sent with); allowed: add_children to a flow without a quorum"
        )


def quorum_values(state: EchoMQ, job: dict[str, Any], stored: dict[str, Any]) -> list[Any]:
    """The values a parent released by a quorum gets: those of the children credited while it
    waited, in the order they succeeded (its ``:quorum`` list), at most K (a retry of a flow
    failed by its deadline may find more counted meanwhile)."""
    queue = str(_headers(job).get(H_QUEUE) or "")
    key = state.keys.job_key(queue, str(job["options"]["task_id"])) + ":quorum"
    order = [text(cid) for cid in state.client.lrange(key, 0, held_of(job).quorum - 1)]
    return [state.loads(stored[cid]) for cid in order if cid in stored]


def cut_rest(state: EchoMQ, job: dict[str, Any]) -> list[str]:
    """Cancel the children of a flow released (or failed) by its quorum that have not
    started: they never run. Those running are left to finish. Idempotent: a repeat (the
    parent dispatched again by recovery) finds none outstanding. Returns the ids cancelled."""
    queue = str(_headers(job).get(H_QUEUE) or "")
    parent_id = str(job["options"]["task_id"])
    held = held_of(job)
    children = held.children
    chunk = state.settings.chunk_size
    cut: list[str] = []
    # On each slot its children live on, one script call per chunk (a row another slot holds
    # is not there: left alone).
    for where in (queue, *held.quorum_queues):
        for start in range(0, len(children), chunk):
            cut += state.scripts.cancel_elsewhere(
                where,
                parent_id,
                children[start : start + chunk],
                ttl=state.settings.result_ttl,
                started=False,
                parent_queue=queue,
            )
    for start in range(0, len(cut), chunk):  # Celery's result of each: REVOKED
        state.app.control.revoke(cut[start : start + chunk])
    if cut:
        logger.info("echomq: flow %s: quorum settled; %d children cancelled", parent_id, len(cut))
    return cut


NAMED = ("count", "sum", "min", "max", "merge")
REDUCE_ALLOWED = (
    '"count", "sum", "min", "max", "merge", ("top", n, key) or ("list", n) with n an int >= 1 '
    "and key a str, or None (the list of the children's values)"
)
EMPTY: dict[str, Any] = {"count": 0, "sum": 0, "min": None, "max": None, "merge": {}}


def check_reduce(value: object, where: str = "flow(reduce=...)") -> list[Any] | None:
    """The reducer ``value`` as a JSON-safe list (``["sum"]``, ``["top", 3, "score"]``), None
    for none; a ValueError saying what is allowed for anything else."""
    if value is None:
        return None
    if isinstance(value, str) and value in NAMED:
        return [value]
    spec = list(value) if isinstance(value, (list, tuple)) else None
    if spec and len(spec) == 1 and spec[0] in NAMED:
        return spec
    n_ok = spec is not None and len(spec) > 1 and type(spec[1]) is int and spec[1] >= 1
    if n_ok and spec and spec[0] == "list" and len(spec) == 2:
        return spec
    if n_ok and spec and spec[0] == "top" and len(spec) == 3 and isinstance(spec[2], str):
        return spec
    raise ValueError(f"{where}: {value!r} is not allowed; allowed: {REDUCE_ALLOWED}")


def empty(spec: list[Any]) -> Any:
    """The accumulator before any child was folded."""
    return EMPTY.get(spec[0], [])


def reduce_of(plan: Plan, spec: list[Any] | None) -> list[Any] | None:
    """Give a planned level its reducer ``spec`` (None: none) on every child's message:
    returned for its parent's stored job to keep; refuse one the store cannot fold.

    Each child is sent for the store to write its result (:func:`mark_for_store`, unless its
    options decide ``ignore_result`` themselves): Celery's trace then stores no SUCCESS before
    its worker learns whether the value can be folded, and a value refused is stored as the
    child's FAILURE (a :class:`~celery_echomq.errors.ReduceError`), never after a SUCCESS."""
    if spec is None:
        return None
    for job in plan.children:
        if isinstance(job, PlannedChain) or job.queue != plan.queue:
            raise ValueError(
                f"flow {plan.parent_id}: reduce={spec!r} takes tasks and flows on "
                f"its parent's queue {plan.queue!r} as children (the values are folded on its "
                "slot), not a chain of tasks; allowed: wrap the chain in a flow of its own"
            )
    mark = json.dumps(spec)
    for job in plan.children:
        if isinstance(job, PlannedChain):  # refused above
            continue
        target = job.message
        target["options"].setdefault("headers", {})[H_REDUCE] = mark
        mark_for_store(target)
    return spec


def _shown(value: Any, raw: str | None) -> str:
    """A value as the reason for a refusal names it: its type and JSON (``raw``: as it was
    encoded), cut at 80 characters (what reduce.lua says of the same value)."""
    if raw is None:
        try:
            raw = json.dumps(value)
        except (TypeError, ValueError):
            raw = repr(value)
    return f"{type(value).__name__} {raw[:80]}"


def _number(value: Any, name: str, raw: str | None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} folds numbers, not {_shown(value, raw)}")
    return value


def fold(spec: list[Any], acc: Any, value: Any, raw: str | None = None) -> Any:
    """``acc`` with ``value`` folded in (what reduce.lua does); ValueError: the reason
    ``value`` (encoded as ``raw``, if given) cannot be folded."""
    name = spec[0]
    if name == "count":
        return acc + 1
    if name == "sum":
        return acc + _number(value, "sum", raw)
    if name in ("min", "max"):
        v = _number(value, name, raw)
        if acc is None:
            return v
        return min(acc, v) if name == "min" else max(acc, v)
    if name == "merge":
        if not isinstance(value, dict):
            raise ValueError(f"merge folds dicts, not {_shown(value, raw)}")
        return {**acc, **value}
    if name == "list":
        return acc if len(acc) >= spec[1] else [*acc, value]
    key = spec[2]
    score = value.get(key) if isinstance(value, dict) else None
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        raise ValueError(f"top folds dicts with the key {key!r}, not {_shown(value, raw)}")
    at = next((i for i, old in enumerate(acc) if score > old[key]), len(acc))
    return [*acc[:at], value, *acc[at:]][: spec[1]]


def refusal(spec: str, data: bytes) -> str | None:
    """Why the reducer ``spec`` (JSON, as a child's header carries it) cannot fold the value
    ``data`` (as the app's serializer encoded it), or None when it can: what reduce.lua
    decides, decided by the child's worker before any result of the child is stored."""
    reducer = json.loads(spec)
    if reducer[0] in ("count", "list"):
        return None
    raw = data.decode(errors="replace")
    try:
        value = json.loads(data)
    except ValueError:
        return f"{reducer[0]} folds JSON values, not {raw[:80]}"
    try:
        fold(reducer, empty(reducer), value, raw)
    except ValueError as exc:
        return str(exc)
    return None


def accumulated(state: EchoMQ, job: dict[str, Any]) -> Any:
    """The accumulator of a released parent (``job``: its stored job) whose children's values
    its reducer folded: its row's ``acc``, or the empty one when no child was folded."""
    headers = job["options"].get("headers") or {}
    row = state.keys.job_key(str(headers[H_QUEUE]), str(job["options"]["task_id"]))
    acc = state.client.hget(row, "acc")
    if acc is not None:
        return json.loads(acc)  # reduce.lua writes JSON
    spec = held_of(job).reduce
    return empty(spec) if spec else []
