"""The store's format: the version of the rows' layout this release writes and knows.

A flow held in Redis outlives the code that wrote it, so every row a script creates carries
``format`` = :data:`STORE_FORMAT` (a row without the field was written before formats were
recorded: format 1, which this release reads and finishes). Every script that writes a row
reads its ``format`` first (``lua/includes/format.lua``, where :data:`STORE_FORMAT` is filled
in by ``loader.py``) and refuses a newer one with ``EMQFORMAT <found> <known> <row>``, before
any write: ``replies.server_error`` makes it a :class:`~celery_echomq.errors.StoreFormatError`.
"""

from __future__ import annotations

import logging

from celery_echomq.errors import StoreFormatError

# The format this release writes and the newest it reads. Raise it (and say what changed in
# docs/design.md's "The store's format") when a release changes what a row, or a key a script
# reads, holds in a way an older release would misread.
STORE_FORMAT = 2

# Where lua/includes/format.lua names the format; the loader writes STORE_FORMAT there.
FORMAT_SLOT = "@STORE_FORMAT@"

logger = logging.getLogger("celery_echomq")

# The rows this process has said it leaves alone: one line per row, however often it meets it.
_told: set[str] = set()
_TOLD_MAX = 10_000


def refused_format(message: str) -> StoreFormatError:
    """The error for a script's ``EMQFORMAT <found> <known> <row>`` reply."""
    parts = message.split(" ", 3)
    found = parts[1] if len(parts) > 1 else "?"
    known = int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else STORE_FORMAT
    return StoreFormatError(found, known, parts[3] if len(parts) > 3 else "?")


def newer_than_known(found: bytes | str | None, row: str) -> StoreFormatError | None:
    """The refusal a script would give of a row whose ``format`` field reads ``found``, for the
    host's own writes outside a script (recovery's evidence mark), else None."""
    if found is None:
        return None
    text = found.decode() if isinstance(found, bytes) else found
    if text.isdigit() and int(text) <= STORE_FORMAT:
        return None
    return StoreFormatError(text, STORE_FORMAT, row)


def tell_newer(exc: StoreFormatError, what: str) -> None:
    """Log ``exc`` once per row in this process: ``what`` is the step that left it alone."""
    if exc.row in _told:
        return
    if len(_told) >= _TOLD_MAX:
        _told.clear()
    _told.add(exc.row)
    logger.error("echomq: %s left alone: %s", what, exc)
