"""``echomq_unrevoke``: a worker remote-control command that forgets revocations.

A deadline revokes the messages of the children it cut (Celery's revoke: each worker keeps
the ids in memory and discards a message with one of them). A retry with a new deadline runs
those very children again, under the same ids, so it first asks every worker to forget them
(:func:`unrevoke`, a broadcast with replies) and publishes only then.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery.worker.control import control_command

COMMAND = "echomq_unrevoke"


@control_command(args=[("ids", list)], signature="<job id> ...")  # type: ignore[untyped-decorator]
def echomq_unrevoke(state: Any, ids: Sequence[str] = ()) -> dict[str, str]:
    """Forget the revocation of ``ids`` in this worker (a retry runs them again)."""
    from celery.worker import state as worker_state

    forgotten = 0
    for job_id in ids:
        if job_id in worker_state.revoked:
            worker_state.revoked.discard(job_id)
            forgotten += 1
    return {"ok": f"{forgotten} revocation(s) forgotten"}


def unrevoke(app: Any, ids: Sequence[str], timeout: float = 1.0) -> int:
    """Ask every worker to forget the revocation of ``ids``: how many workers answered."""
    if not ids:
        return 0
    replies = app.control.broadcast(
        COMMAND, arguments={"ids": list(ids)}, reply=True, timeout=timeout
    )
    return len(replies or [])
