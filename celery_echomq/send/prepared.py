"""A template's message as JSON text in pieces, prepared once: a further job's message is the
pieces joined around its own values (body, id, root and parent ids, reprs, headers, delivery
tag, group id and index), instead of its whole dict copied and encoded again for every job.

The pieces come from encoding the template's message with a marker in each place a job's own
value goes; they are kept only when joining them around the template's own values gives back
exactly the JSON that was pushed for it, so a message built from them is the one kombu would
have written.
"""

from __future__ import annotations

import re
from json.encoder import encode_basestring_ascii as quoted
from typing import Any

from celery_echomq.send.pushes import REDIS_TRANSPORT

__all__ = ["Prepared", "quoted", "token"]


def _marker(slot: str) -> str:
    # A NUL cannot come out of JSON encoding unescaped, and no value kombu writes holds one.
    return f"\x00emq:{slot}\x00"


class Prepared:
    """The JSON of a message with its per-job values cut out: ``parts`` around ``slots``."""

    def __init__(self, parts: list[str], slots: list[str]) -> None:
        self.parts = parts
        self.slots = slots

    @classmethod
    def of(
        cls,
        message: dict[str, Any],
        own_reprs: bool,
        varying: tuple[str, ...],
        sent: Any,
    ) -> Prepared | None:
        """The pieces of ``message`` (a template's, as pushed: ``sent``), or None where they
        would not give ``sent`` back."""
        if REDIS_TRANSPORT is None or not isinstance(sent, str):
            return None
        headers, properties = dict(message["headers"]), dict(message["properties"])
        values: dict[str, str] = {}

        def cut(where: dict[str, Any], name: str, slot: str) -> None:
            values[slot] = token(where[name])
            where[name] = _marker(slot)

        marked = dict(message)
        cut(marked, "body", "body")
        cut(headers, "id", "id")
        cut(headers, "root_id", "root")
        cut(headers, "parent_id", "parent")
        cut(headers, "group", "group")
        cut(headers, "group_index", "group_index")
        if own_reprs:
            cut(headers, "argsrepr", "argsrepr")
            cut(headers, "kwargsrepr", "kwargsrepr")
        for name in varying:
            if type(headers.get(name)) not in (str, int):
                return None
            cut(headers, name, f"h:{name}")
        cut(properties, "correlation_id", "id")
        cut(properties, "delivery_tag", "tag")
        marked["headers"], marked["properties"] = headers, properties
        text = REDIS_TRANSPORT.dumps(marked)
        tokens = {quoted(_marker(slot)): slot for slot in values}
        pieces = re.split("(" + "|".join(re.escape(t) for t in tokens) + ")", text)
        prepared = cls(pieces[0::2], [tokens[t] for t in pieces[1::2]])
        return prepared if prepared.render(values) == sent else None

    def bind(self, values: dict[str, str]) -> Prepared:
        """These pieces with the slots ``values`` names filled in: what the messages of one
        flow's children share (their root, parent, group, headers) joined once, so that each
        message joins only its own values."""
        parts, slots = [self.parts[0]], []
        for slot, part in zip(self.slots, self.parts[1:], strict=True):
            if slot in values:
                parts[-1] += values[slot] + part
            else:
                slots.append(slot)
                parts.append(part)
        return Prepared(parts, slots)

    def render(self, values: dict[str, str]) -> str:
        """The message with ``values`` (slot -> JSON token) in their places."""
        parts = self.parts
        out = [parts[0]]
        for slot, part in zip(self.slots, parts[1:], strict=True):
            out.append(values[slot])
            out.append(part)
        return "".join(out)


def token(value: Any) -> str:
    """``value`` as JSON encodes it: a str quoted (ASCII), an int as its digits, None as
    null."""
    if type(value) is int:
        return str(value)
    if value is None:
        return "null"
    return quoted(value)
