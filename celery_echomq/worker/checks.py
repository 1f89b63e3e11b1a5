"""What a worker checks of its deployment, and answers about it.

At start (``worker_ready``) it logs one WARNING when a primary of its flow store has an
evicting ``maxmemory-policy``: any policy but ``noeviction`` lets Redis delete keys when its
memory is full, a held parent's row among them, and that flow never finishes, silently. The
``echomq_clock`` remote-control command answers how far this host's clock is from the store's
(``celery echomq doctor`` asks every worker; a worker whose app never called ``install`` says
so, which is how the doctor tells it from a worker with the extension).
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from celery.worker.control import inspect_command

from celery_echomq.store.connection import describe
from celery_echomq.store.server_info import clock_offset, evicting
from celery_echomq.store.state import find_state

logger = logging.getLogger("celery_echomq")

CLOCK_COMMAND = "echomq_clock"
# What a worker whose app never called ``install`` answers (the command is registered in any
# process that imports this package, e.g. through the ``celery echomq`` CLI plugin).
NOT_INSTALLED = "celery-echomq is not installed on this worker's app"


def on_worker_ready(sender: Any = None, **_: Any) -> None:
    """Warn once if the store's Redis may evict keys (a check that fails says why, in DEBUG:
    the worker's recovery reports an unreachable store on its own)."""
    state = find_state(getattr(sender, "app", None))
    if state is None:
        return
    try:
        found = evicting(state.client)
    except Exception as exc:
        logger.debug("echomq: could not read the flow store's maxmemory-policy: %r", exc)
        return
    if found:
        logger.warning(
            "echomq: the flow store %s has maxmemory-policy %s: when its memory is full, Redis "
            "deletes keys, held parents among them, and their flows never finish. Set "
            "maxmemory-policy noeviction ('celery echomq doctor' checks the whole deployment)",
            describe(state.settings),
            ", ".join(f"{policy} on {address}" for address, policy in found),
        )


@inspect_command()  # type: ignore[untyped-decorator]
def echomq_clock(state: Any) -> dict[str, Any]:
    """This host's clock against the flow store's: ``offset_ms`` (the store's time less this
    host's) and the ``rtt_ms`` of the measure (the offset is known to within half of it)."""
    store = find_state(state.consumer.app)
    if store is None:
        return {"error": NOT_INSTALLED, "installed": False}
    try:
        offset, trip = clock_offset(store.client)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"host": socket.gethostname(), "offset_ms": offset, "rtt_ms": trip}
