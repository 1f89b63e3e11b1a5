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
from collections.abc import Iterable
from typing import Any

from celery_echomq.errors import StoreFormatError
from celery_echomq.store.keyspace import Keyspace, check_id

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


# The newest flows of each queue the doctor looks at: what a newer release wrote last.
DOCTOR_LOOKS = 20


def newer_flows(
    client: Any, keys: Keyspace, queues: Iterable[str], per_queue: int = DOCTOR_LOOKS
) -> list[tuple[str, str, str]]:
    """(queue, parent id, its format) for each of the newest ``per_queue`` flows of each queue
    (its recent-flow index) whose parent row is of a newer format than this release knows:
    one pipelined round trip for the indexes, one for the rows."""
    names = list(queues)
    pipe = client.pipeline(transaction=False)
    for queue in names:
        pipe.zrevrange(keys.queue_key(queue, "recent"), 0, per_queue - 1)
    flows = []
    for queue, ids in zip(names, pipe.execute(), strict=True):
        for raw in ids:
            flows.append((queue, check_id(raw.decode() if isinstance(raw, bytes) else raw)))
    pipe = client.pipeline(transaction=False)
    for queue, parent in flows:
        pipe.hget(keys.job_key(queue, parent), "format")
    found = []
    for (queue, parent), raw in zip(flows, pipe.execute(), strict=True):
        if newer_than_known(raw, keys.job_key(queue, parent)) is not None:
            found.append((queue, parent, raw.decode() if isinstance(raw, bytes) else str(raw)))
    return found
