"""RQ's jobs for the peers bench, imported by ``rq_driver.py`` and by its ``rq worker``s."""

from __future__ import annotations

from rq import get_current_job


def add(x: int, y: int) -> int:
    return x + y


def tsum() -> int:
    """The dependent job: RQ hands it no values, so it reads each dependency's return value."""
    job = get_current_job()
    assert job is not None
    return sum(dep.return_value() for dep in job.fetch_dependencies())
