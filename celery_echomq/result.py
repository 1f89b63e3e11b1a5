"""``FlowResult``: the parent's result, with reads of the flow's state in Redis."""

from __future__ import annotations

from typing import Any

from celery.result import AsyncResult
from vine import promise

from . import reads
from .errors import NoResultBackendError
from .reads import locate
from .start import cancel_flow
from .state import get_state


class FlowResult(AsyncResult):  # type: ignore[misc]
    """The parent's result, with reads of the flow's state in Redis."""

    def __init__(
        self,
        id: str,
        *args: Any,
        queue: str | None = None,
        fan_in: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(id, *args, **kwargs)
        self.flow_queue = queue
        # The job holding the flow's own children, where it is not the parent (a chain, a
        # group, a chord or a flow as the parent): the reads and add_children go there.
        self.fan_in = fan_in or id

    def _fan(self) -> tuple[str, str | None]:
        if self.fan_in == self.id:
            return self.id, self.flow_queue
        return self.fan_in, None

    def get(self, *args: Any, **kwargs: Any) -> Any:
        """The parent's value, as ``AsyncResult.get``; at once a clear error when the app has
        no result backend (the flow still runs)."""
        from celery.backends.base import DisabledBackend

        if isinstance(self.backend, DisabledBackend):
            raise NoResultBackendError(
                f"flow {self.id} runs, but its parent's value cannot be waited for: the app "
                "has no result backend. Set the result_backend setting (e.g. redis://, rpc://, "
                "a database), or read the children's values with children_values()"
            )
        return super().get(*args, **kwargs)

    def children_values(self) -> dict[str, Any]:
        """``{child_job_id: value}`` for the children completed so far."""
        job_id, queue = self._fan()
        return reads.children_values(job_id, app=self.app, queue=queue)

    def dependencies(self) -> reads.Dependencies:
        """``.outstanding`` (the counter) and ``.processed`` (children credited)."""
        job_id, queue = self._fan()
        return reads.dependencies(job_id, app=self.app, queue=queue)

    def ignored_failures(self) -> dict[str, str]:
        """``{child_job_id: "ExcType: message"}`` for children failed under policy ``ignore``."""
        job_id, queue = self._fan()
        return reads.ignored_failures(job_id, app=self.app, queue=queue)

    def failed_children(self) -> dict[str, str]:
        """``{child_job_id: "ExcType: message"}``: children failed under any policy, and those
        the flow's deadline cut (``FlowDeadlineExceeded: ...``)."""
        job_id, queue = self._fan()
        return reads.failed_children(job_id, app=self.app, queue=queue)

    def add_children(self, children: Any) -> list[str]:
        """Add ``children`` to this flow while its parent is held: see
        :func:`celery_echomq.add_children`. Returns the ids added."""
        from .grow import add_children

        job_id, queue = self._fan()
        return add_children(children, job_id, app=self.app, queue=queue)

    def retry(self, child: str | None = None, deadline: Any = None) -> Any:
        """Run this flow again after it failed under policy ``fail`` (or by its deadline:
        then with a new ``deadline``): see :func:`celery_echomq.retry_flow`. ``get()`` then
        waits for the new outcome."""
        from .repair import retry_flow

        outcome = retry_flow(get_state(self.app), self.id, child=child, deadline=deadline)
        self._forget_cached()
        return outcome

    def release(self, revoke: bool = False) -> Any:
        """Run the held parent now with the values so far: see
        :func:`celery_echomq.release_flow`."""
        from .repair import release_flow

        return release_flow(get_state(self.app), self._fan()[0], revoke=revoke)

    def _forget_cached(self) -> None:
        # A result that already read the failure keeps it cached, and its readiness promise
        # is fulfilled (get() would return at once): both start afresh, as on a new result.
        self._cache = None
        self.on_ready = promise(self._on_fulfilled, weak=True)

    def revoke(
        self,
        connection: Any = None,
        terminate: bool = False,
        signal: Any = None,
        wait: bool = False,
        timeout: float | None = None,
    ) -> None:
        """Cancel the flow: revoke every outstanding child; the parent will never run.

        ``get()`` then raises :class:`~celery_echomq.FlowCancelled`. A parent that already
        started is revoked like any task.
        """
        state = get_state(self.app)
        queue = locate(state, self.id, self.flow_queue)
        if not cancel_flow(state, queue, self.id, terminate=terminate) and not self.ready():
            super().revoke(connection, terminate, signal, wait, timeout)
