"""A flow's deadline as given (seconds, a ``timedelta`` or an aware ``datetime``), checked and
turned into the one JSON-safe form a signature, a plan and a payload carry.

Pure: nothing here touches Redis. The spec is ``{"in": seconds}`` (counted from when the
flow's children are enqueued, on the store's clock) or ``{"at": epoch seconds}``.
"""

from __future__ import annotations

import math
import time
from datetime import datetime, timedelta
from typing import Any

from celery_echomq.errors import DeadlineError
from celery_echomq.store.planned import Plan

ON_DEADLINE = ("fail", "continue")
# A deadline further away than this is almost certainly a unit mistake (ms for s).
MAX_SECONDS = 366 * 86400


def check_on_deadline(value: object, where: str = "flow(on_deadline=...)") -> str:
    if value not in ON_DEADLINE:
        raise DeadlineError(f"{where}: unknown value {value!r}; allowed: " + ", ".join(ON_DEADLINE))
    return str(value)


def deadline_spec(value: Any, where: str = "flow(deadline=...)") -> dict[str, float] | None:
    """``value`` as ``{"in": s}`` / ``{"at": epoch s}``, or None; a clear error for bad input,
    which starts with ``where`` (what the caller wrote)."""
    if value is None:
        return None
    if isinstance(value, dict) and set(value) in ({"in"}, {"at"}):
        ((kind, number),) = value.items()
        return {kind: _number(number, kind, where)}
    if isinstance(value, timedelta):
        return {"in": _seconds(value.total_seconds(), where)}
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise DeadlineError(
                f"{where}: {value.isoformat()} is a naive datetime; give an aware one "
                "(datetime.now(timezone.utc) + ...) or a number of seconds"
            )
        at = value.timestamp()
        if at <= time.time():
            raise DeadlineError(
                f"{where}: {value.isoformat()} has already passed; give a time in "
                "the future or a number of seconds"
            )
        return {"at": at}
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DeadlineError(
            f"{where}: {value!r} is a {type(value).__name__}; allowed: seconds (an "
            "int or float > 0), a timedelta, or an aware datetime"
        )
    return {"in": _seconds(float(value), where)}


def _number(value: Any, kind: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DeadlineError(f"{where}: {value!r} is not a number of seconds")
    return _seconds(float(value), where) if kind == "in" else float(value)


def _seconds(seconds: float, where: str) -> float:
    if not math.isfinite(seconds) or seconds <= 0:
        raise DeadlineError(
            f"{where}: {seconds!r} seconds; a deadline must be more than 0 seconds away"
        )
    if seconds > MAX_SECONDS:
        raise DeadlineError(
            f"{where}: {seconds:g} seconds is more than a year; give seconds, not ms"
        )
    return seconds


def spec_ms(spec: dict[str, float]) -> tuple[str, int]:
    """``("in", ms from now)`` or ``("at", epoch ms)``: what the arm script takes."""
    if "in" in spec:
        return "in", max(1, round(spec["in"] * 1000))
    return "at", round(spec["at"] * 1000)


def describe(spec: dict[str, float] | None) -> str:
    if not spec:
        return "none"
    if "in" in spec:
        return f"{spec['in']:g}s"
    return datetime.fromtimestamp(spec["at"]).astimezone().isoformat(timespec="milliseconds")


def level_deadline(level: Plan) -> tuple[dict[str, float], str] | None:
    """A planned level's deadline spec and on_deadline (kept by the job that holds its
    children, which the store arms and fires), or None when it has none."""
    held = level.held
    return (held.deadline, held.on_deadline) if held.deadline else None


NAMED = 10  # ids a message names (the error's ``outstanding`` holds up to NAMED_MAX)
NAMED_MAX = 1000


def exceeded(
    flow_id: str, outstanding: list[str], due: float | None, count: int | None = None
) -> Any:
    """The error of a flow failed by its deadline, naming ``outstanding`` (in the children's
    order) of the ``count`` children it still waited for (all of them when None): the same on
    a worker as in eager mode."""
    from celery_echomq.errors import FlowDeadlineExceeded

    count = max(len(outstanding), count or 0)
    named = ", ".join(outstanding[:NAMED])
    more = f" and {count - NAMED} more" if count > NAMED else ""
    message = f"flow {flow_id} passed its deadline with {count} children outstanding" + (
        f": {named}{more}" if named else ""
    )
    return FlowDeadlineExceeded(message, flow_id, outstanding[:NAMED_MAX], count, due)
