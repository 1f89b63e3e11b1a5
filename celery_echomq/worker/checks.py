"""What a worker checks of its deployment, and answers about it.

A worker starts whether or not its flow store answers: its background threads (recovery, the
deadline poller, the checks below) first wait for the store (:func:`wait_for_store`), and the
worker says once that it cannot reach it, and once that it has. Flow jobs it receives
meanwhile meet the store's error at their claim.

Once the store answers (after ``worker_ready``) it logs one WARNING when a primary of its flow
store has an evicting ``maxmemory-policy``: any policy but ``noeviction`` lets Redis delete
keys when its memory is full, a held parent's row among them, and that flow never finishes,
silently. The
``echomq_clock`` remote-control command answers how far this host's clock is from the store's
(``celery echomq doctor`` asks every worker; a worker whose app never called ``install`` says
so, which is how the doctor tells it from a worker with the extension).
"""

from __future__ import annotations

import logging
import socket
import threading
import weakref
from typing import Any

from celery.worker.control import inspect_command

from celery_echomq.store.connection import bounded, describe
from celery_echomq.store.server_info import clock_offset, evicting
from celery_echomq.store.state import EchoMQ, find_state

logger = logging.getLogger("celery_echomq")

CLOCK_COMMAND = "echomq_clock"
# What a worker whose app never called ``install`` answers (the command is registered in any
# process that imports this package, e.g. through the ``celery echomq`` CLI plugin).
NOT_INSTALLED = "celery-echomq is not installed on this worker's app"


# The states whose unreachable store was logged: once per process, whichever thread tries.
_told: weakref.WeakSet[EchoMQ] = weakref.WeakSet()
PAUSE = 1.0  # seconds between two attempts to reach a store that does not answer


def wait_for_store(state: EchoMQ, stop: threading.Event, pause: float = PAUSE) -> bool:
    """Return once the flow store answers a PING (True), or once ``stop`` is set (False).

    One thread of the process tries, once per ``pause``, each attempt a single one (no retry
    loop, none of its warnings): the first failure is logged once as a WARNING, the connect
    that follows once as INFO. A store that answers at once logs nothing.
    """
    while not state.reached.is_set():
        if not state.reaching.acquire(timeout=pause):
            if stop.is_set():
                return False
            continue
        try:
            return _reach(state, stop, pause)
        finally:
            state.reaching.release()
    return True


def _reach(state: EchoMQ, stop: threading.Event, pause: float) -> bool:
    while not state.reached.is_set():
        try:
            with bounded(0, "echomq_store_retry_timeout"):
                state.client.ping()
        except Exception as exc:
            if state not in _told:
                _told.add(state)
                logger.warning(
                    "echomq: the flow store %s cannot be reached (%s: %s). The worker runs and "
                    "keeps trying in the background; recovery and deadlines start once it "
                    "answers",
                    describe(state.settings),
                    type(exc).__name__,
                    exc,
                )
            if stop.wait(pause):
                return False
            continue
        if state in _told:
            logger.info("echomq: connected to the flow store %s", describe(state.settings))
        state.reached.set()
    return True


def on_worker_ready(sender: Any = None, **_: Any) -> None:
    """Check the store's eviction policy once it answers, in a thread of its own: the worker
    starts consuming at once, whether or not its store answers."""
    state = find_state(getattr(sender, "app", None))
    if state is None:
        return
    thread = threading.Thread(
        target=check_eviction, args=(state,), name="echomq-checks", daemon=True
    )
    thread.start()


def check_eviction(state: EchoMQ) -> None:
    """Warn once if the store's Redis may evict keys (a check that fails says why, in DEBUG)."""
    if not wait_for_store(state, threading.Event()):
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
