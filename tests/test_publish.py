"""A flow's messages carry the argsrepr/kwargsrepr Celery would give them."""

from __future__ import annotations

import itertools
from typing import Any

from celery.utils.saferepr import saferepr

from celery_echomq.publish import _fast_repr

VALUES: list[Any] = [
    0, -5, 2**40, 10**30, 1.5, -0.0, float("inf"), float("nan"), True, None,
    "", "a", 'a"b', "x y", "é", "a\\b", "a'b", "\t", "x" * 41, [1, 2], {"a": 1}, b"ab",
]  # fmt: skip


def test_plain_arguments_get_exactly_saferepr_and_others_are_left_to_celery() -> None:
    fast = 0
    for a, b in itertools.product(VALUES, repeat=2):
        args, kwargs = (a, b), {"k": a, "z": b}
        got = _fast_repr(args, kwargs)
        if got is None:
            continue
        fast += 1
        assert got == (saferepr(args, 1024), saferepr(kwargs, 1024)), (args, kwargs)
    assert fast > 100  # the common case (numbers, short plain strings) takes the fast path
    # Quotes, backslashes, non-ASCII, long strings, huge ints, containers: Celery's saferepr.
    for odd in ("a'b", "a\\b", "é", "x" * 41, 10**30, [1], {"a": 1}, b"ab"):
        assert _fast_repr((odd,), {}) is None
    assert _fast_repr(tuple(range(17)), {}) is None
