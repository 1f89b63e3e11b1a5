"""The one cursor of every paged read: where the next page starts (``children_values``,
``failed_children``, a flow's page of children, ``list_flows``), and the paging of a hash.

A page hands its cursor back as text, and the next call takes that text back as given:
``<phase><at>`` or ``<phase><at>:<after>``. ``phase`` says which of a read's sources the
page is in (a letter; none for a read of one source), ``at`` where in it (an HSCAN cursor,
a position in a flow's index, a score in a queue's index), and ``after`` the last member a
page returned inside the batch at ``at``, which the next page reads again and skips up to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from celery_echomq.errors import CursorError, InvalidIdError
from celery_echomq.store.connection import text
from celery_echomq.store.keyspace import check_id

__all__ = ["Cursor", "cursor_text", "hash_page"]

# Digits of a position: an HSCAN cursor is at most 2**64.
_AT_DIGITS = 20


@dataclass(frozen=True)
class Cursor:
    """Where the next page of a read starts (see the module's docstring)."""

    phase: str = ""
    at: int = 0
    after: str | None = None

    def __str__(self) -> str:
        head = f"{self.phase}{self.at}"
        return head if self.after is None else f"{head}:{self.after}"

    @classmethod
    def parse(
        cls,
        given: Any,
        what: str,
        phases: str = "",
        *,
        after: str = "any",
    ) -> Cursor:
        """The cursor a page gave, from its text; ``None``: the first page (of the first of
        ``phases``). ``after``: ``"any"`` (a hash's field), ``"id"`` (a job id) or ``"none"``
        (a read by position alone). Anything else is a :class:`CursorError` naming ``what``
        read it."""
        if given is None:
            return cls(phases[:1])
        raw = str(given)
        phase = raw[:1] if phases else ""
        head, colon, last = raw[len(phase) :].partition(":")
        fits = (
            (not phases or phase in phases)
            and head.isdigit()
            and len(head) <= _AT_DIGITS
            and (not colon or (last != "" and after != "none"))
            and (not colon or after != "id" or _is_id(last))
        )
        if not fits:
            raise CursorError(f"not a {what} cursor: {raw[:80]!r} (pass the one a page gave)")
        return cls(phase, int(head), last if colon else None)


def cursor_text(cursor: Cursor | None) -> str | None:
    """What a page hands back: the next page's cursor as text, None after the last page."""
    return None if cursor is None else str(cursor)


def _is_id(value: str) -> bool:
    try:
        check_id(value)
    except InvalidIdError:
        return False
    return True


def hash_page(
    client: Any,
    key: str,
    start: Cursor,
    count: int,
    match: str | None = None,
    scans: int | None = None,
    batch: int | None = None,
) -> tuple[dict[str, bytes], Cursor | None]:
    """At most ``count`` fields of the hash ``key`` from ``start``, and the next page's cursor
    (None: the hash is done), in ``start``'s phase.

    HSCAN's COUNT is a hint (a small hash comes whole), so each batch is sorted by field and a
    page may stop inside it: the cursor then names the batch and the last field returned, and
    the next page scans that batch again and skips up to that field. A field added meanwhile
    may sort before it (skipped) or after (returned): what SCAN promises for new fields. With
    ``scans``, a page makes at most that many HSCAN calls (a sparse ``match`` comes short);
    ``batch``: their COUNT, ``count`` unless given.
    """
    scan, after, made = start.at, start.after, 0
    page: dict[str, bytes] = {}
    while scans is None or made < scans:
        following, found = client.hscan(key, scan, match=match, count=batch or count)
        made += 1
        fields = sorted((text(k), v) for k, v in found.items())
        fresh = [(k, v) for k, v in fields if after is None or k > after]
        room = count - len(page)
        page.update(fresh[:room])
        if len(fresh) > room:
            return page, Cursor(start.phase, scan, fresh[room - 1][0])
        after, scan = None, int(following)
        if scan == 0:
            return page, None
        if len(page) >= count:
            break
    return page, Cursor(start.phase, scan)
