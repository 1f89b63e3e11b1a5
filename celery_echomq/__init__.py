"""celery-echomq: ``flow(parent, children)``, an exactly-once fan-in for Celery.

The parent is held in Redis by atomic Lua scripts and released once, when its last child
completes. See README.md, "How it works".
"""

from __future__ import annotations

from typing import Any

from celery_echomq.canvas import flow
from celery_echomq.errors import (
    ConfigError,
    CursorError,
    DeadlineError,
    DepthError,
    DuplicateIdError,
    EchoMQError,
    FlowCancelled,
    FlowClosedError,
    FlowDeadlineExceeded,
    FlowError,
    FlowExistsError,
    FlowFailed,
    InvalidIdError,
    KindError,
    ListingError,
    NoResultBackendError,
    NotRepairableError,
    OnExistsError,
    PolicyError,
    ReduceError,
    ReplicationError,
    StoreFormatError,
    StoreUnavailableError,
    StoreWriteRefusedError,
)
from celery_echomq.ops.listing import FlowRow, list_flows
from celery_echomq.ops.outcomes import ReleaseOutcome, RetryOutcome
from celery_echomq.ops.release import release_flow
from celery_echomq.ops.repair import retry_flow
from celery_echomq.result import FlowResult
from celery_echomq.send.flow_reads import (
    add_children,
    children_values,
    dependencies,
    failed_children,
    ignored_failures,
)
from celery_echomq.store.reads import Dependencies, UnknownFlowError
from celery_echomq.store.state import EchoMQ, get_state, install_state

__all__ = [
    "ConfigError",
    "CursorError",
    "DeadlineError",
    "Dependencies",
    "DepthError",
    "DuplicateIdError",
    "EchoMQError",
    "FlowCancelled",
    "FlowClosedError",
    "FlowDeadlineExceeded",
    "FlowError",
    "FlowExistsError",
    "FlowFailed",
    "FlowResult",
    "FlowRow",
    "InvalidIdError",
    "KindError",
    "ListingError",
    "NoResultBackendError",
    "NotRepairableError",
    "OnExistsError",
    "PolicyError",
    "ReduceError",
    "ReleaseOutcome",
    "ReplicationError",
    "RetryOutcome",
    "StoreFormatError",
    "StoreUnavailableError",
    "StoreWriteRefusedError",
    "UnknownFlowError",
    "add_children",
    "children_values",
    "dependencies",
    "failed_children",
    "flow",
    "get_state",
    "ignored_failures",
    "install",
    "list_flows",
    "release_flow",
    "retry_flow",
]

__version__ = "0.2.0"


def install(app: Any) -> EchoMQ:
    """Connect celery-echomq to ``app``: worker signals and the recovery step.

    The app's ``echomq_*`` settings are read when the app is finalized or first used (as
    Celery reads its own), so this may come before the app is configured.
    """
    from celery_echomq.chords import patch_celery
    from celery_echomq.send.tasks import register_tasks
    from celery_echomq.worker import (
        checks,  # noqa: F401 - registers the worker's echomq_clock
        signals,
        unrevoke,  # noqa: F401 - registers the worker's echomq_unrevoke
    )
    from celery_echomq.worker.batches import register_batch_task
    from celery_echomq.worker.deadline_poller import DeadlineStep
    from celery_echomq.worker.recovery import RecoveryStep

    state = install_state(app)
    # Inert unless the app sets echomq_chords (see chords.py).
    patch_celery()
    # What a flow whose parent is a group, a chord or a flow runs (see send/shape.py).
    register_tasks(app)
    register_batch_task(app)  # what a batch message runs (flow(..., batch=N))
    signals.connect()
    # A set: installing twice adds the step once.
    app.steps["worker"].add(RecoveryStep)
    app.steps["worker"].add(DeadlineStep)
    return state


def __dir__() -> list[str]:
    """What ``dir(celery_echomq)`` lists: the public names, not what this module imports for
    its own use (``annotations``, ``Any``, ``install_state``)."""
    return sorted([*__all__, "__version__"])
