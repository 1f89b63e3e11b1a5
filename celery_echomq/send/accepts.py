"""What ``flow()`` accepts before it shapes anything: the keywords it knows (a typo such as
``max_activ`` would otherwise travel silently as a message option), the options the extension
reads from a flow's send and a child's ``.set()`` (a close misspelling refused), a chord's
order of arguments refused; and its children (the signatures a list or a group gives,
anything else refused naming its position). Pure.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from typing import Any

from celery.canvas import Signature, group, maybe_signature

# flow()'s own keywords, for the refusal of any other.
FLOW_KEYWORDS = (
    "policy",
    "single",
    "deadline",
    "on_deadline",
    "max_active",
    "quorum",
    "reduce",
    "batch",
    "args",
    "app",
    "task",
    "options",
    "immutable",
)
# The options the extension reads from a flow's send (``apply_async``, ``apply``) and from a
# child's own (``.set()``): a close misspelling of one is refused (check_spelling).
SEND_OPTIONS = ("on_exists",)
CHILD_OPTIONS = ("parent_policy",)
# The options Celery sends a signature with (apply_async's, send_task's and the canvas's own
# lineage), also taken as keywords, as by chord(header, body, queue=...). Anything else a
# flow's messages should carry goes in ``options={...}`` or ``.set(...)``.
MESSAGE_OPTIONS = frozenset(
    {
        "add_to_parent",
        "chain",
        "chord",
        "chord_size",
        "compression",
        "connection",
        "correlation_id",
        "countdown",
        "delivery_mode",
        "eta",
        "exchange",
        "exchange_type",
        "expires",
        "group_id",
        "group_index",
        "headers",
        "ignore_result",
        "link",
        "link_error",
        "mandatory",
        "parent_id",
        "priority",
        "producer",
        "publisher",
        "queue",
        "replaced_task_nesting",
        "reply_to",
        "retries",
        "retry",
        "retry_policy",
        "root_id",
        "routing_key",
        "serializer",
        "shadow",
        "soft_time_limit",
        "stamped_headers",
        "stamps",
        "task_id",
        "time_limit",
    }
)

# What Celery's own copies of a signature hand its constructor (from_dict, clone).
INTERNAL_KEYWORDS = frozenset({"options", "immutable", "kwargs", "subtask_type"})


def check_keywords(options: dict[str, Any]) -> None:
    """Refuse a keyword neither flow() nor Celery's message options know (a typo such as
    ``max_activ`` would otherwise be carried silently as a message option)."""
    unknown = sorted(set(options) - MESSAGE_OPTIONS - INTERNAL_KEYWORDS)
    if unknown:
        meant = [
            f"{close[0]!r} for {name!r}"
            for name in unknown
            if (close := difflib.get_close_matches(name, FLOW_KEYWORDS, n=1, cutoff=0.8))
        ]
        hint = f"did you mean {', '.join(meant)}? " if meant else ""
        raise TypeError(
            f"flow() got unknown keyword argument(s) {', '.join(map(repr, unknown))}; {hint}"
            f"allowed: {', '.join(FLOW_KEYWORDS)}, and Celery's message options "
            f"({', '.join(sorted(MESSAGE_OPTIONS))}); "
            "anything else a flow's messages carry goes in options={...} or .set(...)"
        )


def check_spelling(given: Iterable[str], read: Sequence[str], where: str) -> None:
    """Refuse a name in ``given`` that the extension does not read but that is close to one it
    does (``on_exist``, ``parent_polciy``): Celery would carry it silently as a message
    option, and what was meant would not happen. Celery's own options and anything further
    from ``read`` pass through, as Celery passes them. ``where``: what the caller wrote."""
    for name in sorted(given):
        if name in read or name in MESSAGE_OPTIONS or name in INTERNAL_KEYWORDS:
            continue
        close = difflib.get_close_matches(name, read, n=1, cutoff=0.8)
        if close:
            raise TypeError(
                f"{where} got an unknown option {name!r}; did you mean {close[0]!r}? "
                f"the options it reads: {', '.join(read)}; nothing was sent"
            )


def check_order(parent: Any, children: Any) -> None:
    """Refuse a chord's order of arguments: ``flow(group_or_list, sig)`` reads as a flow whose
    parent is the group, held on one child, which is not what was meant."""
    header = isinstance(parent, (group, list, tuple))
    one = isinstance(children, Signature) and not isinstance(children, group)
    if header and one:
        raise TypeError(
            "flow(parent, children) takes the parent first, then its children: the reverse of "
            f"chord(header, body); got a {type(parent).__name__} then one signature "
            f"({getattr(children, 'task', children)!r}). Write flow(body, [children...]), "
            "e.g. flow(tsum.s(), [add.s(1, 1), add.s(2, 2)])"
        )


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
