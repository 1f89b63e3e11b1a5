"""The doctor's view of the fleet: which live workers have the extension, and which consume a
queue of the store without it.

A worker without the extension takes a flow's jobs from their queue and runs them as plain
tasks: their outcome never reaches the flow, which stays held. It is found from this process
alone, by two broadcasts: Celery's own ``active_queues``, which every worker answers, and the
extension's ``echomq_clock``, which only a worker whose app called ``install`` answers with a
measure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from celery_echomq.worker.checks import CLOCK_COMMAND, NOT_INSTALLED


@dataclass(frozen=True)
class Finding:
    check: str
    status: str  # "ok", "note" or "wrong"
    detail: str
    change: str = ""

    def line(self) -> str:
        mark = {"ok": "ok   ", "note": "note ", "wrong": "WRONG"}[self.status]
        return f"{mark}  {self.check}: {self.detail}" + (
            f" -> change: {self.change}" if self.change else ""
        )


def ask_workers(app: Any, timeout: float) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]]]:
    """Every live worker's answer to ``echomq_clock``, and the queues each consumes (Celery's
    ``active_queues``), by worker name. Two broadcasts from this process: a worker without the
    extension answers the second and not the first (or with an error), and nothing else
    needs to run for the doctor to find it."""
    with app.connection_for_write() as connection:
        # An unreachable broker: one try, not Celery's connection retries.
        connection.ensure_connection(max_retries=1, interval_start=0, interval_step=0)
        clocks = app.control.broadcast(
            CLOCK_COMMAND, reply=True, timeout=timeout, connection=connection
        )
        queues = app.control.broadcast(
            "active_queues", reply=True, timeout=timeout, connection=connection
        )
    consumers = {
        name: sorted(str(q.get("name")) for q in answer if isinstance(q, dict))
        for reply in queues or []
        for name, answer in reply.items()
        if isinstance(answer, list)
    }
    return {name: answer for reply in clocks or [] for name, answer in reply.items()}, consumers


def has_extension(answer: dict[str, Any] | None) -> bool:
    """Whether a worker's ``echomq_clock`` answer comes from an app that called ``install``:
    no answer, the "not installed" one, or an unknown command (a host without the package:
    kombu answers ``KeyError('echomq_clock')``) say it does not."""
    if not isinstance(answer, dict):
        return False
    error = str(answer.get("error", ""))
    return (
        answer.get("installed") is not False
        and NOT_INSTALLED not in error
        and (CLOCK_COMMAND not in error)
    )


def check_workers(
    workers: dict[str, dict[str, Any]] | str,
    consumers: dict[str, list[str]],
    store_queues: list[str] | str,
) -> Finding:
    """Every worker that consumes a queue the store holds flows of has the extension: one
    without it runs a flow's jobs as plain tasks, whose outcome never reaches the flow.
    ``store_queues``: the reason, where they could not be read (then every worker without
    the extension is named, as a note: it may or may not take a flow's jobs)."""
    if isinstance(workers, str):
        return Finding("workers", "note", f"not asked ({workers})")
    if isinstance(store_queues, str):
        unknown = sorted(n for n in consumers if not has_extension(workers.get(n)))
        if not unknown:
            return Finding(
                "workers", "ok", f"{len(workers)} worker(s) with celery-echomq, none without it"
            )
        return Finding(
            "workers",
            "note",
            f"without celery-echomq: {', '.join(unknown)}; the store's queues could not be "
            f"read ({store_queues}) to tell whether they take a flow's jobs",
            "install celery-echomq on each and call celery_echomq.install(app)",
        )
    ours = set(store_queues)
    lacking = {
        name: sorted(ours.intersection(queues))
        for name, queues in sorted(consumers.items())
        if ours.intersection(queues) and not has_extension(workers.get(name))
    }
    if lacking:
        names = "; ".join(f"{n} (queues {', '.join(q)})" for n, q in lacking.items())
        return Finding(
            "workers",
            "wrong",
            f"without celery-echomq, consuming the store's queues: {names}; such a worker runs "
            "a flow's jobs as plain tasks, and their flows stay held until a worker with it "
            "takes the queue",
            "install celery-echomq on it and call celery_echomq.install(app), then restart it "
            "(upgrade workers first, then producers)",
        )
    with_it = sum(1 for answer in workers.values() if has_extension(answer))
    return Finding(
        "workers",
        "ok",
        f"{with_it} worker(s) with celery-echomq, none without it on a queue the store holds "
        "flows of",
    )
