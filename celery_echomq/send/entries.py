"""What a planned flow's child entry is (send/plan.py): a job, a nested flow's entry
(``{"nested": <its Plan as a dict>}``) or a linked chain's (``{"steps": [...]}``, its first
step a job or a nested flow's entry); its ids, its queue, and how deep a tree of them is.
Pure.
"""

from __future__ import annotations

from typing import Any, Protocol

from celery_echomq.errors import DepthError
from celery_echomq.store.headers import H_QUEUE


class Level(Protocol):
    """A flow level (send/plan.py's Plan): its parent's id and its children's entries."""

    parent_id: str
    children: list[dict[str, Any]]


def child_queue(job: dict[str, Any]) -> str:
    job = first_job(job)
    if "nested" in job:
        return str(job["nested"]["queue"])
    return str(job["options"]["headers"][H_QUEUE])


def child_id(job: dict[str, Any]) -> str:
    """A child's id: a nested flow's parent's, a linked chain's last step's."""
    if "nested" in job:
        return str(job["nested"]["parent_id"])
    if "steps" in job:
        job = job["steps"][-1]
    return str(job["options"]["task_id"])


def row_ids(job: dict[str, Any]) -> list[str]:
    """The rows a child entry writes on its level: one, or one per step of a chain."""
    if "steps" in job:
        return [child_id(step) for step in job["steps"]]
    return [child_id(job)]


def first_job(job: dict[str, Any]) -> dict[str, Any]:
    """The message a child entry publishes first: its own, or its chain's first step's."""
    return job["steps"][0] if "steps" in job else job


def check_depth(plan: Level, limit: int, above: int = 0) -> None:
    """Refuse a tree whose deepest path has more than ``limit`` flow levels (``above``: the
    levels over ``plan``'s parent, for children added to a nested flow)."""
    deepest, stack = 0, [(plan.children, above + 1)]
    while stack:
        children, depth = stack.pop()
        deepest = max(deepest, depth)
        nested = (first_job(job) for job in children)
        stack.extend((job["nested"]["children"], depth + 1) for job in nested if "nested" in job)
    if deepest > limit:
        raise DepthError(
            f"flow {plan.parent_id} is {deepest} levels deep (flows nested in flows: a group, "
            "chord or flow step of a chain counts as a level, a run of tasks as none); "
            f"allowed: at most {limit} (the echomq_max_depth setting); nothing was sent"
        )


def too_deep(limit: int) -> DepthError:
    """What a tree too deep for Python to plan raises (its depth was never counted)."""
    return DepthError(
        f"flow tree too deep to plan; allowed: at most {limit} levels (the echomq_max_depth "
        "setting); nothing was sent"
    )
