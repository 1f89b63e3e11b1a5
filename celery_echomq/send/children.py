"""What a flow's children may be: the signatures a list or a group gives, and the refusal,
naming the child's position, of anything else."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from celery.canvas import Signature, group, maybe_signature


def child_signatures(children: Any, app: Any) -> list[Signature]:
    """A flow's children as signatures: a list or a group of them (a dict is one, sent over
    the wire); anything else is refused, saying what was given and what is allowed."""
    if children is None:
        return []
    if isinstance(children, dict) and not isinstance(children, Signature):
        children = maybe_signature(children, app=app)
    if isinstance(children, group):
        children = children.tasks
    if isinstance(children, (str, bytes)) or not isinstance(children, Iterable):
        raise TypeError(
            "flow children must be a list or a group of signatures, got "
            f"{_a(children)} ({children!r:.60})"
        )
    if isinstance(children, Signature):
        raise TypeError(
            "flow children must be a list or a group of signatures, got one signature "
            f"({children.task!r}); wrap it in a list"
        )
    return [_child_signature(i, child, app) for i, child in enumerate(children, 1)]


def _a(value: Any) -> str:
    """``None``, or ``a str``/``an int``: what a refused value is, for the error."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _child_signature(position: int, child: Any, app: Any) -> Signature:
    """A child as a Signature; anything else is refused, naming its position (1-based)."""
    sig = maybe_signature(child, app=app) if isinstance(child, (Signature, dict)) else child
    if not isinstance(sig, Signature):
        raise TypeError(
            f"flow child {position} is {_a(child)}, not a Signature ({child!r:.60}); allowed: a "
            "task signature (task.s(...), task.si(...)), a chain, a group, a chord or a flow"
        )
    return sig
