"""``FlowResult``: the parent's result, with reads of the flow's state in Redis; and
``EagerFlowResult``, the same after an eager run, its reads in memory (:class:`FanIn`)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from celery import states
from celery.result import AsyncResult, EagerResult, GroupResult
from vine import promise

from celery_echomq.errors import FlowClosedError, FlowFailed, NoResultBackendError
from celery_echomq.ops.cancel import cancel_flow
from celery_echomq.send.flow_reads import add_children, reads_of
from celery_echomq.store import reads
from celery_echomq.store.connection import text
from celery_echomq.store.fan_in_rules import Decides, rule_of
from celery_echomq.store.reads import Dependencies, indexed_children, locate
from celery_echomq.store.state import get_state

# A parent row in one of these states runs again: its flow was retried since it failed.
RUNNING_AGAIN = frozenset({"awaiting_children", "pending", "active", "done"})


def children_id(job_id: str) -> str:
    """The id of the group of ``job_id``'s children's results: a group's result has one (a
    chord's header its group id); no task's, so that a result of it settles no task's."""
    return f"{job_id}:children"


class FlowChildren(GroupResult):  # type: ignore[misc]
    """A flow's children's results, in the children's order: ``FlowResult.parent``, as a
    chord's header ``GroupResult`` is its result's ``parent``.

    ``get()``, ``join()``, ``ready()`` and the rest read each child's result as a group's do.
    A child's failure reaches a reader of the flow through the flow's policy alone
    (``FlowFailed`` from the flow's ``get()``), so ``maybe_throw``, what ``AsyncResult.get``
    calls on the parents of a chain's result, leaves it to the flow: under ``ignore`` or
    ``continue`` a failed child is no error of the flow's.
    """

    def maybe_throw(self, callback: Any = None, propagate: bool = True) -> None:
        return None


class FlowResult(AsyncResult):  # type: ignore[misc]
    """The parent's result, with reads of the flow's state in Redis.

    ``parent`` is the flow's children's results (:class:`FlowChildren`), as a chord's result's
    is its header's: the ids the producer assigned, else read from the store's index of the
    flow's children at first use (None while the store has none). A result a canvas links
    to it (a chain's step before the flow) takes its place, as in Celery.
    """

    _linked: Any = None  # the parent a canvas (or the caller) set
    _child_ids: list[str] | None = None
    _children: FlowChildren | None = None

    def __init__(
        self,
        id: str,
        *args: Any,
        queue: str | None = None,
        fan_in: str | None = None,
        children: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        self._child_ids = list(children) if children is not None else None
        super().__init__(id, *args, **kwargs)
        self.flow_queue = queue
        # The job holding the flow's own children, where it is not the parent (a chain, a
        # group, a chord or a flow as the parent): the reads and add_children go there.
        self.fan_in = fan_in or id

    def _fan(self) -> tuple[str, str | None]:
        if self.fan_in == self.id:
            return self.id, self.flow_queue
        return self.fan_in, None

    @property
    def parent(self) -> Any:
        if self._linked is not None:
            return self._linked
        if self._children is None:
            results = self._child_results()
            if results is None:
                return None
            self._children = FlowChildren(children_id(self.id), results, app=self.app)
        return self._children

    @parent.setter
    def parent(self, value: Any) -> None:
        self._linked = value

    def _child_results(self) -> list[Any] | None:
        ids = self._child_ids if self._child_ids is not None else self._indexed()
        return None if ids is None else [AsyncResult(cid, app=self.app) for cid in ids]

    def _indexed(self) -> list[str] | None:
        # Read by Celery too (a chain's get() walks its steps' parents): a store that cannot
        # say (down, the flow not sent yet or expired) leaves it None, to be read again.
        try:
            state = get_state(self.app)
            job_id, queue = self._fan()
            return indexed_children(state, locate(state, job_id, queue), job_id)
        except Exception:
            return None

    def as_tuple(self) -> Any:
        # The children are the store's to say, not the tuple's (a task returning a flow's
        # result would store every child's id with its own).
        linked = self._linked
        return (self.id, linked and linked.as_tuple()), None

    def __reduce_args__(self) -> tuple[Any, ...]:
        return (self.id, self.backend, None, None, self._linked)

    def get(self, *args: Any, **kwargs: Any) -> Any:
        """The parent's value, as ``AsyncResult.get``; at once a clear error when the app has
        no result backend (the flow still runs).

        A result that already saw the flow fail or be cancelled looks at the store first:
        once the flow was retried (``echomq retry`` from anywhere), it waits for the new
        outcome instead of answering from its cache.
        """
        from celery.backends.base import DisabledBackend

        if isinstance(self.backend, DisabledBackend):
            raise NoResultBackendError(
                f"flow {self.id} runs, but its parent's value cannot be waited for: the app "
                "has no result backend. Set the result_backend setting (e.g. redis://, rpc://, "
                "a database), or read the children's values with children_values()"
            )
        self._recheck_cached()
        if self._linked is None:
            # The children's failures reach get() through the flow's policy (FlowFailed),
            # not from each child's result on every interval.
            kwargs.setdefault("follow_parents", False)
        return super().get(*args, **kwargs)

    def _get_task_meta(self) -> Any:
        # What .state, .ready() and .result read: the same look at the store as get().
        self._recheck_cached()
        return super()._get_task_meta()

    def _recheck_cached(self) -> None:
        cache = getattr(self, "_cache", None)
        if not cache or cache.get("status") not in (states.FAILURE, states.REVOKED):
            return
        try:
            state = get_state(self.app)
            queue = locate(state, self.id, self.flow_queue)
            now = text(state.client.hget(state.keys.job_key(queue, self.id), "state"))
        except Exception:
            return  # the store cannot say (down, or the flow expired): the cache stands
        if now in RUNNING_AGAIN:
            self._forget_cached()

    def children_values(self, cursor: str | None = None, count: int | None = None) -> Any:
        """``{child_job_id: value}`` for the children completed so far; with ``count``, one
        page and the next page's cursor: ``(values, next_cursor)`` (None after the last)."""
        job_id, queue = self._fan()
        return reads_of(job_id, app=self.app, queue=queue).children_values(cursor, count)

    def dependencies(self) -> Dependencies:
        """``Dependencies(outstanding, done, failed, ignored)``: where the children stand."""
        job_id, queue = self._fan()
        return reads_of(job_id, app=self.app, queue=queue).dependencies()

    def ignored_failures(self) -> dict[str, str]:
        """``{child_job_id: "ExcType: message"}`` for children failed under policy ``ignore``."""
        job_id, queue = self._fan()
        return reads_of(job_id, app=self.app, queue=queue).ignored_failures()

    def failed_children(self, cursor: str | None = None, count: int | None = None) -> Any:
        """``{child_job_id: "ExcType: message"}``: children failed under any policy, and those
        the flow's deadline cut (``FlowDeadlineExceeded: ...``); with ``count``, one page and
        the next page's cursor: ``(failures, next_cursor)`` (None after the last)."""
        job_id, queue = self._fan()
        return reads_of(job_id, app=self.app, queue=queue).failed_children(cursor, count)

    def add_children(self, children: Any) -> list[str]:
        """Add ``children`` to this flow while its parent is held: see
        :func:`celery_echomq.add_children`. Returns the ids added."""
        job_id, queue = self._fan()
        added = add_children(children, job_id, app=self.app, queue=queue)
        if self._child_ids is not None:
            self._child_ids += added
        if self._children is not None:
            for cid in added:
                self._children.add(AsyncResult(cid, app=self.app))
        return added

    def retry(self, child: str | None = None, deadline: Any = None) -> Any:
        """Run this flow again after it failed under policy ``fail`` (or by its deadline:
        then with a new ``deadline``): see :func:`celery_echomq.retry_flow`. ``get()`` then
        waits for the new outcome."""
        from celery_echomq.ops.repair import retry_flow

        outcome = retry_flow(get_state(self.app), self.id, child=child, deadline=deadline)
        self._forget_cached()
        return outcome

    def release(self, revoke: bool = False) -> Any:
        """Run the held parent now with the values so far: see
        :func:`celery_echomq.release_flow`."""
        from celery_echomq.ops.release import release_flow

        return release_flow(get_state(self.app), self._fan()[0], revoke=revoke)

    def __del__(self) -> None:
        # AsyncResult.__del__ unsubscribes from the backend's pending results. At interpreter
        # exit (a get() that timed out leaves the result subscribed) the app, its backend and
        # their connections are being torn down: there is nothing left to cancel, and the
        # attempt only prints "Exception ignored in AsyncResult.__del__" tracebacks.
        if sys.is_finalizing():
            return
        with contextlib.suppress(Exception):
            super().__del__()

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
        """Cancel the flow: revoke every outstanding job of its tree, on every queue; the
        parent will never run.

        ``get()`` then raises :class:`~celery_echomq.FlowCancelled`. A parent that already
        started is revoked like any task (and its children still outstanding, say under
        ``continue``, are cancelled).
        """
        state = get_state(self.app)
        queue = locate(state, self.id, self.flow_queue)
        cancel_flow(state, queue, self.id, terminate=terminate)
        parent_state = state.client.hget(state.keys.job_key(queue, self.id), "state")
        if parent_state != b"cancelled" and not self.ready():
            super().revoke(connection, terminate, signal, wait, timeout)


@dataclass
class FanIn:
    """A flow's counter, values and ignored errors, as the scripts keep them in Redis; a
    finished child settled by the fan-in's rules (``store/fan_in_rules.py``), as
    settle_child.lua settles it."""

    parent_id: str
    outstanding: int
    policy: str
    values: dict[str, Any] = field(default_factory=dict)
    ignored: dict[str, str] = field(default_factory=dict)
    # Children failed under fail, remove or continue (the row's 'failed:<id>' fields).
    failures: dict[str, str] = field(default_factory=dict)
    credited: int = 0
    waiting: bool = True
    failure: FlowFailed | None = None
    cut: list[str] = field(default_factory=list)  # children its deadline cut
    # Children it ended without otherwise: not started once its quorum was met, or finished
    # after it (cut, as the store's 'cut_children' counts them).
    ended_without: list[str] = field(default_factory=list)
    # The first child failed under fail_at_end (its id and error): the flow fails with it
    # once every child has settled.
    late: tuple[str, str] | None = None
    # The children's results, in the children's order, once the run is over (the result's
    # ``parent``).
    results: list[Any] = field(default_factory=list)
    # Released by its quorum-th success of ``total`` children (includes/quorum.lua), 0: none;
    # ``failed`` counts the failures that left one child fewer able to succeed.
    quorum: int = 0
    total: int = 0
    failed: int = 0

    def children_values(self, cursor: str | None, count: int | None) -> Any:
        return reads.eager_values(dict(self.values), cursor, count)

    def ignored_failures(self) -> dict[str, str]:
        return dict(self.ignored)

    def dependencies(self) -> Dependencies:
        under_fail = len(self.failures) - (self.credited - len(self.values) - len(self.ignored))
        cut = len(self.cut) + len(self.ended_without)
        return Dependencies(
            self.outstanding - under_fail - cut,
            len(self.values),
            len(self.failures),
            len(self.ignored),
            cut,
        )

    def failed_children(self, cursor: str | None = None, count: int | None = None) -> Any:
        return reads.eager_values(self.failures_by_child(), cursor, count)

    def failures_by_child(self) -> dict[str, str]:
        cut = "FlowDeadlineExceeded: flow {} passed its deadline before this child started"
        return {
            **self.ignored,
            **self.failures,
            **{cid: cut.format(self.parent_id) for cid in self.cut},
        }

    def settle(self, child_id: str, ok: bool, data: Any, policy: str | None) -> bool:
        """Count one finished child by its rule; whether this released the parent."""
        rule = rule_of(self.quorum, "done" if ok else policy or self.policy)
        if rule.cut_once_released and not self.waiting and self.failure is None:
            self.ended_without.append(child_id)  # finished after its flow was released
            return False
        kept = {"values": self.values, "ignored": self.ignored, "failures": self.failures}
        kept[rule.kept][child_id] = data
        if rule.counted:
            self.outstanding -= 1
            self.credited += 1
        return self.waiting and self._decide(rule.decides, child_id, data)

    def _decide(self, decides: Decides, child_id: str, data: Any) -> bool:
        """What the outcome decides while the parent waits (its rule's ``decides``);
        ``data`` a failure's error text."""
        if decides == "fail":
            return self._fail(f"child {child_id} failed: {data}", child_id, data)
        if decides == "at_quorum":
            return len(self.values) >= self.quorum and self._release()
        if decides == "short":
            self.failed += 1
            if self.total - self.failed >= self.quorum:
                return False
            return self._fail(
                f"quorum not met: {len(self.values)} of {self.total} children succeeded, "
                f"{self.quorum} needed ({self.failed} failed; the last, {child_id}: {data})",
                child_id,
                str(data),
                self.parent_id,
            )
        if decides == "late" and self.late is None:
            self.late = (child_id, data)
        return (decides == "at_once" or self.outstanding <= 0) and self._release()

    def _release(self) -> bool:
        """Released, unless a failure under fail_at_end waits to be given: then failed."""
        if self.late is not None:
            child_id, error = self.late
            return self._fail(f"child {child_id} failed: {error}", child_id, error)
        self.waiting = False
        return True

    def _fail(self, reason: str, child_id: str, error: str, *parent: str) -> bool:
        self.waiting = False
        self.failure = FlowFailed(f"flow {self.parent_id}: {reason}", child_id, error, *parent)
        return False

    def released_values(self, child_ids: Sequence[str]) -> list[Any]:
        """The parent's argument: the values so far, in the children's order (dispatch.lua);
        under a quorum, in the order they succeeded."""
        if self.quorum:
            return list(self.values.values())
        return [self.values[cid] for cid in child_ids if cid in self.values]


class EagerFlowResult(EagerResult, FlowResult):  # type: ignore[misc]
    """A flow's result after an eager run: the parent's outcome and the flow's reads, in
    memory. ``get()`` returns the parent's value, or raises what a worker's result would."""

    def __init__(
        self,
        id: str,
        ret_value: Any,
        state: str,
        traceback: Any = None,
        name: str | None = None,
        fanin: FanIn | None = None,
        app: Any = None,
    ) -> None:
        # Celery 5.3's EagerResult takes no name.
        EagerResult.__init__(self, id, ret_value, state, traceback)
        self._name = name
        self.app = app
        self.flow_queue = None
        self.fanin = fanin or FanIn(id, 0, "fail")

    def _child_results(self) -> list[Any]:
        # The run's, of the level that holds the flow's own children (apply_flow sets it).
        return list(self.fanin.results)

    def __reduce_args__(self) -> tuple[Any, ...]:
        return (self.id, self._result, self._state, self._traceback, self._name, self.fanin)

    def children_values(self, cursor: str | None = None, count: int | None = None) -> Any:
        return self.fanin.children_values(cursor, count)

    def dependencies(self) -> Dependencies:
        return self.fanin.dependencies()

    def failed_children(self, cursor: str | None = None, count: int | None = None) -> Any:
        return self.fanin.failed_children(cursor, count)

    def ignored_failures(self) -> dict[str, str]:
        return self.fanin.ignored_failures()

    def add_children(self, children: Any) -> list[str]:
        # The run is over: its parent no longer waits, whatever its outcome.
        raise FlowClosedError(
            f"flow {self.id} was run eagerly and has finished: children can only be added "
            "while it runs (add_children() inside a child's body)",
            self.id,
            self.state,
        )

    def revoke(self, *args: Any, **kwargs: Any) -> None:
        # Everything already ran: as for any eager result.
        EagerResult.revoke(self, *args, **kwargs)
