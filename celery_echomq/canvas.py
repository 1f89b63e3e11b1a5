"""``flow(parent, children)``: a Signature beside chord."""

from __future__ import annotations

from collections.abc import Iterable
from copy import deepcopy
from typing import Any

from celery import current_app
from celery.canvas import Signature, _chain, maybe_signature

from celery_echomq.result import FlowResult
from celery_echomq.send.accepts import (
    CHILD_OPTIONS,
    SEND_OPTIONS,
    check_keywords,
    check_order,
    check_spelling,
    child_signatures,
)
from celery_echomq.send.batches import check_batch
from celery_echomq.send.errbacks import give_errbacks
from celery_echomq.send.fan_in import check_max_active, check_quorum, check_reduce
from celery_echomq.send.ids import assign_ids, check_tree, value_task
from celery_echomq.send.jobs import check_policy
from celery_echomq.send.join import check_on_exists
from celery_echomq.send.plan import too_deep
from celery_echomq.send.producer import Sending, send_flow
from celery_echomq.send.shape import CALLBACKS, FLOW_TASK, merge_callbacks, normal_flow
from celery_echomq.store.connection import bounded
from celery_echomq.store.deadline_spec import check_on_deadline, deadline_spec
from celery_echomq.store.headers import CHORD_OPTIONS
from celery_echomq.store.keyspace import new_job_id
from celery_echomq.store.script_values import ParentRef
from celery_echomq.store.state import get_state
from celery_echomq.worker.settle import follow

__all__ = ["FLOW_TASK", "FlowResult", "flow"]


def _shaped(sig: Any, shared: bool = False) -> tuple[Any, str]:
    """``normal_flow(sig)``, its group parents' errbacks given to their tasks and every id of
    it gated (``shared``: a task listed twice is one job, see send/ids.py)."""
    made = normal_flow(sig)
    if made[0] is not sig:
        give_errbacks(made[0])
        check_tree(made[0], shared)
    return made


@Signature.register_type(name="flow")
class flow(Signature):  # type: ignore[misc]  # lower case, like chord and group
    """Run ``children``, then ``parent`` with the list of their values, exactly once.

    ``policy`` is what a child's final failure means for the parent unless the child sets its
    own with ``sig.set(parent_policy=...)``: ``fail``, ``ignore``, ``remove``, ``continue``
    or ``fail_at_end`` (the parent fails once every child has settled, as a chord's body does).
    ``max_active``: at most that many children published or running at once, the others
    published in order as earlier ones finish. ``quorum``: the parent runs at the K-th success;
    ``reduce``: it gets the values folded as they arrive; ``batch``: the children are
    delivered up to that many a broker message, each still a job of its own (see
    docs/flows.md).
    """

    def __init__(
        self,
        parent: Any = None,
        children: Iterable[Any] | None = None,
        *,
        policy: str = "fail",
        single: bool = False,
        deadline: Any = None,
        on_deadline: str = "fail",
        max_active: int | None = None,
        quorum: int | None = None,
        reduce: Any = None,
        batch: int | None = None,
        args: Iterable[Any] | None = None,
        app: Any = None,
        task: str = FLOW_TASK,
        **options: Any,
    ) -> None:
        check_keywords(options)
        check_order(parent, children)
        parent_sig = maybe_signature(parent, app=app)
        if not isinstance(parent_sig, Signature):
            raise TypeError(f"flow parent must be a signature, got {type(parent).__name__}")
        if app is None:
            # The parent's app, as a chord takes its body's: what chain and group ask a flow
            # for (``.app``) must be the app its tasks belong to, not the current one.
            app = parent_sig._app
        child_sigs = child_signatures(children, app)
        check_policy(policy, "flow(policy=...)")
        spec = deadline_spec(deadline)
        check_on_deadline(on_deadline)
        check_max_active(max_active)
        check_quorum(quorum)
        check_batch(batch)
        for child in child_sigs:
            check_spelling(child.options, CHILD_OPTIONS, f"flow child {child.task!r}: .set()")
            if "parent_policy" in child.options:
                check_policy(child.options["parent_policy"], f"child {child.task!r}")
        options.pop("subtask_type", None)
        options.pop("kwargs", None)
        immutable = options.pop("immutable", False)
        opts = options.pop("options", None) or {}
        own: dict[str, Any] = {"parent": parent_sig, "children": child_sigs, "policy": policy}
        if single:
            # A chain's step (see send/shape.py): the parent takes its one child's value as is.
            own["single"] = True
        if spec is not None:
            # Kept by the job that holds these children (see store/deadlines.py): JSON-safe.
            own["deadline"] = spec
            own["on_deadline"] = on_deadline
        # A window, a quorum, a reducer (send/fan_in.py).
        fan_in = {"max_active": max_active, "quorum": quorum, "reduce": check_reduce(reduce)}
        fan_in["batch"] = batch  # how the children are delivered (send/batches.py)
        own.update((k, v) for k, v in fan_in.items() if v is not None)
        super().__init__(
            task,
            tuple(args or ()),
            own,
            {**opts, **options},
            app=app,
            subtask_type="flow",
            immutable=immutable,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any], app: Any = None) -> flow:
        kwargs = d["kwargs"]
        return cls(
            kwargs["parent"],
            kwargs["children"],
            policy=kwargs.get("policy", "fail"),
            single=bool(kwargs.get("single", False)),
            deadline=kwargs.get("deadline"),
            on_deadline=kwargs.get("on_deadline", "fail"),
            max_active=kwargs.get("max_active"),
            quorum=kwargs.get("quorum"),
            reduce=kwargs.get("reduce"),
            batch=kwargs.get("batch"),
            args=d.get("args"),
            app=app,
            options=dict(d.get("options") or {}),
            immutable=d.get("immutable", False),
        )

    @property
    def parent(self) -> Signature:
        return self.kwargs["parent"]

    @property
    def children(self) -> list[Signature]:
        return self.kwargs["children"]  # type: ignore[no-any-return]

    @property
    def policy(self) -> str:
        return str(self.kwargs["policy"])

    @property
    def single(self) -> bool:
        return bool(self.kwargs.get("single", False))

    @property
    def deadline(self) -> dict[str, float] | None:
        """``{"in": seconds}`` or ``{"at": epoch seconds}``; None when it has none."""
        return self.kwargs.get("deadline")  # type: ignore[no-any-return]

    @property
    def on_deadline(self) -> str:
        return str(self.kwargs.get("on_deadline", "fail"))

    @property
    def max_active(self) -> int | None:
        """The most children published or running at once; None when it has no window."""
        return self.kwargs.get("max_active")  # type: ignore[no-any-return]

    def shape(self, shared: bool = False) -> tuple[flow, str]:
        """This flow as one whose parents are single tasks (see send/shape.py), and the id of the
        job that holds its own children ("" when that is its parent). What ``freeze`` made
        is kept, and what ``apply_async`` then sends; unfrozen, each send makes it anew
        (new ids, as a chord's)."""
        made = self.__dict__.get("_shape")
        if made is None:
            made = _shaped(self, shared)
        return made

    def _get_app(self) -> Any:
        app = self._app
        if app is None:
            app = self.parent._app or current_app
        return app

    def freeze(
        self,
        _id: str | None = None,
        group_id: str | None = None,
        chord: Any = None,
        root_id: str | None = None,
        parent_id: str | None = None,
        group_index: int | None = None,
    ) -> FlowResult:
        """Assign every job id (the parent's is the flow's) without sending anything.

        Like a chord inside a group or chain, the group, chord and lineage given here travel
        with the flow's options to its parent (and the lineage to the children).
        """
        for name, value in (
            ("group_id", group_id),
            ("chord", chord),
            ("root_id", root_id),
            ("parent_id", parent_id),
            ("group_index", group_index),
        ):
            if value is not None:
                self.options[name] = value
        # An id Celery hands ``freeze`` (a chord gives its body ``uuid()``) is kept as given:
        # the flow's id is the one Celery knows (its row is named by store/keyspace.row_id).
        given = self.options.get("task_id", _id)
        top, parent = value_task(self), self.parent
        composite = top is not parent
        if composite or self.__dict__.get("_shape") is not None:
            # A canvas among its parts: every task takes an id now, the one whose value is
            # the flow's takes the flow's, and the shape is made with those ids.
            if top is not None and given is not None:
                top.options.setdefault("task_id", given)
            if self.__dict__.get("_shape") is None:
                assign_ids(self)
            shape, fan = self.__dict__["_shape"] = self.shape()
            self.options["task_id"] = shape.options["task_id"]
            return FlowResult(self.options["task_id"], app=self._get_app(), fan_in=fan)
        parent_opts = parent.options
        if "task_id" not in parent_opts:
            parent_opts["task_id"] = new_job_id() if given is None else given
        self.options["task_id"] = parent_opts["task_id"]
        for child in self.children:
            if isinstance(child, flow):
                child.freeze()
            else:
                assign_ids(child)
        if not all(isinstance(c, flow) or value_task(c) is c for c in self.children):
            shape, fan = self.__dict__["_shape"] = self.shape()
            return FlowResult(self.options["task_id"], app=self._get_app(), fan_in=fan)
        ids = [child.options["task_id"] for child in self.children]
        return FlowResult(parent_opts["task_id"], app=self._get_app(), children=ids)

    def link_error(self, errback: Any) -> Any:
        """As ``chord.link_error`` (the parent's): a chain parent's step that fails runs it with
        its own id, as Celery's chain does; a child's failure once, with the flow's id."""
        if isinstance(self.parent, _chain) and "_shape" not in self.__dict__:
            self.parent.link_error(errback)
        return super().link_error(errback)

    def clone(self, args: Any = None, kwargs: Any = None, **opts: Any) -> flow:
        """A deep copy (parent and children too); ``args`` are prepended to the partial args."""
        return flow(
            self.parent.clone(),
            [child.clone() for child in self.children],
            policy=self.policy,
            single=self.single,
            deadline=self.deadline,
            on_deadline=self.on_deadline,
            max_active=self.max_active,
            quorum=self.kwargs.get("quorum"),
            reduce=self.kwargs.get("reduce"),
            batch=self.kwargs.get("batch"),
            args=(*tuple(args or ()), *self.args),
            app=self._app,
            options={**deepcopy(self.options), **opts},
            immutable=self.immutable,
        )

    def apply_async(
        self,
        args: Iterable[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        task_id: str | None = None,
        **options: Any,
    ) -> FlowResult:
        app = self._get_app()
        check_spelling(options, SEND_OPTIONS, "apply_async() of a flow")
        # What a flow whose ids name jobs in the store does (send/join.py): checked first.
        on_exists = check_on_exists(options.pop("on_exists", "raise"))
        if app.conf.task_always_eager:
            # As chord.apply_async does: run in this process, send nothing.
            return self.apply(args, kwargs, task_id=task_id, on_exists=on_exists, **options)
        state = get_state(app)
        settings = state.settings
        bound = settings.producer_timeout
        try:
            if bound is None:
                return self._send(app, state, args, kwargs, task_id, options, on_exists)
            with bounded(bound, "echomq_producer_timeout"):
                return self._send(app, state, args, kwargs, task_id, options, on_exists)
        except RecursionError:
            raise too_deep(state.settings.max_depth) from None

    def _send(
        self,
        app: Any,
        state: Any,
        args: Iterable[Any] | None,
        kwargs: dict[str, Any] | None,
        task_id: str | None,
        options: dict[str, Any],
        on_exists: str = "raise",
    ) -> FlowResult:
        chord = {name: options.pop(name) for name in CHORD_OPTIONS if name in options}
        shape, fan = self.shape(shared=on_exists == "join")
        if task_id is not None and shape is not self and "_shape" not in self.__dict__:
            shape, fan = _shaped(self.clone(task_id=task_id))
        # The callbacks it is sent with, and its own: a frozen shape was made before any
        # linked since (chord.link_error after freeze() still reaches the body).
        callbacks = {
            name: merge_callbacks(self.options.get(name), options.get(name))
            for name in CALLBACKS
            if name in self.options or name in options
        }
        sending = Sending(
            tuple(args or ()), kwargs, task_id, options, chord, callbacks, on_exists=on_exists
        )
        sent = send_flow(app, state, shape, fan, sending)
        for status, child, error in sent.settled:
            # A joined job that had failed, settled under the new parent's policy for it.
            follow(state, status, child, ParentRef(sent.parent_id, sent.queue), error)
        return FlowResult(sent.parent_id, app=app, queue=sent.queue, fan_in=fan)

    def apply(
        self,
        args: Iterable[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> FlowResult:
        """Run every child, then the parent, in this process (as ``chord(...).apply()``):
        no Redis, no broker. The result's ``get()`` is the parent's value; its reads
        (``children_values()`` and the rest) are held in memory."""
        from celery_echomq.eager import apply_flow

        check_spelling(options, SEND_OPTIONS, "apply() of a flow")
        return apply_flow(self, tuple(args or ()), kwargs, **options)

    def delay(self, *args: Any, **kwargs: Any) -> FlowResult:
        return self.apply_async(args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> FlowResult:
        return self.apply_async(args, kwargs)

    def __repr__(self) -> str:
        return f"flow({self.parent!r}, {self.children!r})"
