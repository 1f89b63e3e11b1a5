"""What flow() refuses before it looks at its parent and children: a keyword it does not know
(a typo such as ``max_activ`` would otherwise travel silently as a message option), and a
chord's order of arguments."""

from __future__ import annotations

from typing import Any

from celery.canvas import Signature, group

# flow()'s own keywords, for the refusal of any other.
FLOW_KEYWORDS = (
    "policy",
    "single",
    "deadline",
    "on_deadline",
    "max_active",
    "quorum",
    "reduce",
    "args",
    "app",
    "task",
    "options",
    "immutable",
)
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
        raise TypeError(
            f"flow() got unknown keyword argument(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(FLOW_KEYWORDS)}, and Celery's message options "
            f"({', '.join(sorted(MESSAGE_OPTIONS))}); "
            "anything else a flow's messages carry goes in options={...} or .set(...)"
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
