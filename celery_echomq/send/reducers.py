"""A flow whose children's values are folded into one accumulator as they arrive
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
from typing import Any

from celery_echomq.send.entries import child_queue
from celery_echomq.send.jobs import mark_for_store
from celery_echomq.store.headers import H_QUEUE, H_REDUCE
from celery_echomq.store.state import EchoMQ

NAMED = ("count", "sum", "min", "max", "merge")
ALLOWED = (
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
    raise ValueError(f"{where}: {value!r} is not allowed; allowed: {ALLOWED}")


def empty(spec: list[Any]) -> Any:
    """The accumulator before any child was folded."""
    return EMPTY.get(spec[0], [])


def reduce_of(plan: Any, kwargs: dict[str, Any]) -> None:
    """Give a planned level its reducer (from its flow signature's ``kwargs``): kept on its
    parent's stored job and on every child's message; refuse one the store cannot fold.

    Each child is sent for the store to write its result (:func:`mark_for_store`, unless its
    options decide ``ignore_result`` themselves): Celery's trace then stores no SUCCESS before
    its worker learns whether the value can be folded, and a value refused is stored as the
    child's FAILURE (a :class:`~celery_echomq.errors.ReduceError`), never after a SUCCESS."""
    spec = check_reduce(kwargs.get("reduce"))
    if spec is None:
        return
    for job in plan.children:
        if "steps" in job or child_queue(job) != plan.queue:
            raise ValueError(
                f"flow {plan.parent_id}: reduce={kwargs['reduce']!r} takes tasks and flows on "
                f"its parent's queue {plan.queue!r} as children (the values are folded on its "
                "slot), not a chain of tasks; allowed: wrap the chain in a flow of its own"
            )
    plan.parent["reduce"] = spec
    mark = json.dumps(spec)
    for job in plan.children:
        target = job["nested"]["parent"] if "nested" in job else job
        target["options"].setdefault("headers", {})[H_REDUCE] = mark
        mark_for_store(target)


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
    return empty(job["reduce"]) if acc is None else json.loads(acc)  # reduce.lua writes JSON
