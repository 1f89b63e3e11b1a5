"""What a flow takes from a signature: its callbacks, the options that are a canvas's own, and a
task copied with an id of its own. Pure."""

from __future__ import annotations

from typing import Any

from celery.canvas import Signature, _chain, _chord, group
from celery.utils.functional import maybe_list

from celery_echomq.store.keyspace import new_job_id

CALLBACKS = ("link", "link_error")
# The option that marks a linked chain (a chain of single tasks, each with its id): a child
# of a flow planned as steps (send/plan.py), not as nested flows.
LINKED = "echomq_linked"
# An option of a chain parent's steps after its first: the errbacks each step carries (the
# chain's own). A job held on the steps before it (its last step, a flow step) that one of
# them failed does not run these again (send/jobs.py stores them as its ``step_errbacks``).
STEP_ERRBACKS = "echomq_step_errbacks"


def merge_callbacks(own: Any, given: Any) -> list[Any]:
    """A signature's own callbacks, then those it was sent with, each once."""
    merged: list[Any] = []
    for callback in [*(maybe_list(own) or ()), *(maybe_list(given) or ())]:
        if callback not in merged:
            merged.append(callback)
    return merged


# Options of a chain, group or chord that are its own, not handed down to its tasks.
_OWN = frozenset(
    "task_id group_id group_index chord parent_policy subtask_type link link_error chain "  # noqa: SIM905
    "reply_to root_id parent_id echomq_silent echomq_linked echomq_step_errbacks".split()
)


def is_task(sig: Any) -> bool:
    """A single task's signature (not a chain, group, chord or flow)."""
    return type(sig) is Signature or (
        isinstance(sig, Signature)
        and not isinstance(sig, (_chain, _chord, group))
        and getattr(sig, "subtask_type", None) != "flow"
    )


def options_of(sig: Signature) -> dict[str, Any]:
    """A canvas's options that its tasks inherit (its own left out)."""
    return {k: v for k, v in sig.options.items() if k not in _OWN}


def task_copy(sig: Signature, inherited: dict[str, Any], task_id: Any = None) -> Signature:
    """A copy of a task with an id of its own and the options of the canvases around it."""
    copy = sig.clone()
    for key, value in inherited.items():
        copy.options.setdefault(key, value)
    if task_id is not None:
        copy.options.setdefault("task_id", task_id)
    copy.options.setdefault("task_id", new_job_id())
    return copy
