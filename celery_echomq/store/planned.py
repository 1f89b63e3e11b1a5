"""A flow, planned: its typed nodes.

A flow's level is a :class:`Plan` (its parent's message and its children); each child is a
:class:`PlannedJob` (one task's message), a :class:`Plan` of its own (a nested flow, its
``outer`` naming the flow it is a child of) or a :class:`PlannedChain` (a linked chain: one
child whose id is its last step's, its first step a job or a nested flow). Each node says
its id, its queue and which rows it writes; nothing needs to guess a node's kind from a
dict's keys. Beside Celery's message each node carries :class:`Held`, the engine's own facts
of it (a parent's children and fan-in, the errbacks a chain's steps ran): written into a
stored message by :func:`stored_message` alone, read back from one by :func:`held_of` alone.
What a row keeps of a node (:func:`stored_node`) and the one way to read it back
(:func:`node_of`) are at the end of this module: the planner's types are not the stored
format, and nothing else reads a stored node's keys. Pure.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any, TypedDict, TypeGuard, cast

from celery_echomq.store.headers import H_QUEUE


class JobMessage(TypedDict):
    """Celery's fields of one job's message, as the planner builds them (``job_dict``) and a
    publish sends them; the engine's own facts of the job are not among them (:class:`Held`)."""

    task: str
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    subtask_type: None
    immutable: bool


@dataclass(frozen=True)
class Held:
    """What the engine keeps of a job beside Celery's own fields (task, arguments, options):
    a held parent's children and how its flow fans in; a job's, the errbacks its chain's steps
    ran. The planner builds it once per node; :func:`stored_message` writes it into the
    stored message, and whoever releases, shows, cuts or grows the flow reads it back
    (:func:`held_of`)."""

    children: list[str] = field(default_factory=list)
    # Children whose values the parent does not get (a spread's).
    silent: list[str] = field(default_factory=list)
    single: bool = False  # a chain's step: the one value as is, not a list
    quorum: int = 0  # released once this many children succeeded; 0: by all of them
    quorum_queues: list[str] = field(default_factory=list)  # its children's other queues
    reduce: list[Any] | None = None  # the reducer its children's values are folded by
    max_active: int = 0  # its window; 0: none
    window_queue: str = ""  # the queue its window's children are on
    deadline: dict[str, float] | None = None
    on_deadline: str = "fail"
    fan_in: str = ""  # the job that holds the flow's children, where it is not the parent
    step_errbacks: list[Any] = field(default_factory=list)  # errbacks its chain's steps ran

    def valued(self) -> list[str]:
        """The children whose values the parent gets, in order."""
        if not self.silent:
            return list(self.children)
        silent = set(self.silent)
        return [cid for cid in self.children if cid not in silent]

    def kept(self, parent: bool) -> dict[str, Any]:
        """The fields a stored message keeps (``parent``: a held parent's, which lists its
        children even when there are none), in the order its bytes have always had them; a
        field at its default is not kept."""
        kept: dict[str, Any] = {}
        if self.step_errbacks:
            kept["step_errbacks"] = self.step_errbacks
        if parent:
            kept["children"] = self.children
        if self.single:
            kept["single"] = True
        if self.silent:
            kept["silent"] = self.silent
        if self.deadline:
            kept["deadline"] = self.deadline
            kept["on_deadline"] = self.on_deadline
        if self.max_active:
            kept["max_active"] = self.max_active
            kept["window_queue"] = self.window_queue
        if self.quorum:
            kept["quorum"] = self.quorum
        if self.quorum_queues:
            kept["quorum_queues"] = self.quorum_queues
        if self.reduce is not None:
            kept["reduce"] = self.reduce
        if self.fan_in:
            kept["fan_in"] = self.fan_in
        return kept


NOTHING_HELD = Held()
HELD_FIELDS = frozenset(f.name for f in fields(Held))


@dataclass(slots=True)
class PlannedJob:
    """One task's message in a flow: a child, or a step of a linked chain. ``message`` is
    the job dict its Celery message is built from (task, args, kwargs, options, ...);
    ``held``, what the engine keeps of it beside them."""

    message: JobMessage
    held: Held = NOTHING_HELD

    @property
    def id(self) -> str:
        return str(self.message["options"]["task_id"])

    @property
    def queue(self) -> str:
        return str(self.message["options"]["headers"][H_QUEUE])

    @property
    def head(self) -> PlannedJob:
        """The node published first when this child starts: itself."""
        return self

    def row_ids(self) -> list[str]:
        """The rows this child writes on its level: its own."""
        return [self.id]


@dataclass
class PlannedChain:
    """A linked chain as one child: its steps in order, the first a job or a nested flow
    (the step held on that flow's children), the others jobs written as waiting rows."""

    steps: list[PlannedJob | Plan]

    @property
    def id(self) -> str:
        """The chain's id as a child: its last step's (whose value the parent gets)."""
        return self.steps[-1].id

    @property
    def queue(self) -> str:
        return self.steps[0].queue

    @property
    def head(self) -> PlannedJob | Plan:
        """The node published first when the chain starts: its first step."""
        return self.steps[0]

    def row_ids(self) -> list[str]:
        """The rows the chain writes on its level: one per step."""
        return [step.id for step in self.steps]


@dataclass
class Plan:
    """A flow level with every id assigned and every message built, before anything is sent;
    as a child of another level, a nested flow (``outer``: the id of the flow it is a child
    of)."""

    queue: str
    parent_id: str
    parent: JobMessage
    children: list[Node] = field(default_factory=list)
    policy: str = "fail"
    child_policies: dict[str, str] = field(default_factory=dict)
    outer: str = ""
    # The parent takes its one child's value as is, not as a list (a chain's step).
    single: bool = False
    # Children whose values the parent does not get (a spread, see send/shape.py).
    silent: list[str] = field(default_factory=list)
    max_active: int = 0  # the most children out at once; 0: no window (send/fan_in.py)
    batch: int = 0  # children a broker message delivers; 0: one each (send/batches.py)
    # What its parent's stored message keeps beside Celery's fields (its children, fan-in).
    held: Held = NOTHING_HELD

    @classmethod
    def for_children(cls, queue: str, parent_id: str) -> Plan:
        """A level (its parent ``parent_id`` on ``queue``) to plan children on before its
        parent's message is built: a flow's, which ``plan_flow`` builds after them, or a
        running flow's that children are added to, whose parent's message is the stored one."""
        return cls(queue=queue, parent_id=parent_id, parent=cast(JobMessage, {}))

    @property
    def id(self) -> str:
        """A nested flow's id as a child: its parent's."""
        return self.parent_id

    @property
    def head(self) -> Plan:
        """The node published first when this nested flow starts: itself (its own level)."""
        return self

    @property
    def message(self) -> JobMessage:
        """The message that stands for this flow among its siblings: its parent's."""
        return self.parent

    def row_ids(self) -> list[str]:
        """The rows this nested flow writes on the level it is a child of: its parent's."""
        return [self.parent_id]

    def levels(self, whole: bool = False) -> Iterator[Plan]:
        """This flow, then every nested flow it starts with (``whole``: of the tree), outer
        before inner; one waiting for a slot of a window is enqueued when its turn comes."""
        yield self
        for child in self.children if whole else self.started():
            if isinstance(head := child.head, Plan):
                yield from head.levels(whole)

    def messages(self) -> Iterator[JobMessage]:
        """Every message this flow's start sends or holds: each started level's parent and
        each of its tasks (a nested flow's parent is its own level's)."""
        for level in self.levels():
            yield level.parent
            for child in level.children:
                steps = child.steps if isinstance(child, PlannedChain) else [child]
                yield from (step.message for step in steps if isinstance(step, PlannedJob))

    def started(self) -> list[Node]:
        """The children published at the start: the first ``max_active``, or all of them."""
        return self.children[: self.max_active or None]

    def child_ids(self) -> list[str]:
        return [child.id for child in self.children]

    def child_row_ids(self) -> list[str]:
        """The ids of every row this level writes for its children: each step of a chain."""
        return [cid for child in self.children for cid in child.row_ids()]

    def chunked(self, chunk_size: int) -> bool:
        """Whether this level takes open/add/seal instead of one enqueue_flow script."""
        return len(self.children) > chunk_size or any(
            child.queue != self.queue for child in self.children
        )


# A flow's child: a task, a nested flow or a linked chain.
Node = PlannedJob | Plan | PlannedChain


def stored_message(node: PlannedJob | Plan) -> dict[str, Any]:
    """The message a row keeps of ``node`` (a job's, or a nested flow's parent's): Celery's
    fields, then what the engine holds of it. The one place a message takes the engine's
    fields; Celery's are shared, not copied (a job that holds nothing: its message as is)."""
    held = node.held
    if held is NOTHING_HELD and isinstance(node, PlannedJob):
        return node.message  # type: ignore[return-value]  # a JobMessage is such a dict
    kept = held.kept(parent=isinstance(node, Plan))
    return {**node.message, **kept} if kept else node.message  # type: ignore[return-value]


def with_children(stored: dict[str, Any], children: list[str]) -> None:
    """List ``children`` on a held parent's stored message (decoded), in its place: what
    adding children to a running flow writes on its parent's row."""
    stored["children"] = children


def split_held(stored: dict[str, Any]) -> tuple[JobMessage, Held]:
    """A stored message (decoded) as Celery's fields and what the engine holds of it."""
    if HELD_FIELDS.isdisjoint(stored):
        return stored, NOTHING_HELD  # type: ignore[return-value]  # as stored_message wrote it
    message = {k: v for k, v in stored.items() if k not in HELD_FIELDS}
    return message, held_of(stored)  # type: ignore[return-value]


def held_of(message: Any) -> Held:
    """What a parent's stored message (decoded) keeps of its flow; all defaults for anything
    else (a task's message, content that is no job)."""
    if not isinstance(message, dict):
        return Held()
    get = message.get
    # The ids as kept (str each), not copied: a large flow's parent lists many.
    return Held(
        children=get("children") or [],
        silent=get("silent") or [],
        single=bool(get("single")),
        quorum=int(get("quorum") or 0),
        quorum_queues=[str(q) for q in get("quorum_queues") or ()],
        reduce=list(reduce) if (reduce := get("reduce")) else None,
        max_active=int(get("max_active") or 0),
        window_queue=str(get("window_queue") or ""),
        deadline=get("deadline") or None,
        on_deadline=str(get("on_deadline") or "fail"),
        fan_in=str(get("fan_in") or ""),
        step_errbacks=list(get("step_errbacks") or ()),
    )


# What a row keeps of a planned node (the row's ``format`` field says which release's form):
# a job, its message dict as it is; a nested flow, ``{"nested": {<its level's fields>,
# "children": [<each child, so kept>]}}``; a linked chain (inside a nested flow's children),
# ``{"steps": [<each step, so kept>]}``. Rows of formats 1 and 2 keep the same form.
NESTED, STEPS = "nested", "steps"


def stored_node(node: Node) -> dict[str, Any]:
    """What a row keeps of ``node`` (its messages are shared, not copied)."""
    if isinstance(node, PlannedJob):
        return stored_message(node)
    if isinstance(node, PlannedChain):
        return {STEPS: [stored_node(step) for step in node.steps]}
    return {
        NESTED: {
            "queue": node.queue,
            "parent_id": node.parent_id,
            "parent": stored_message(node),
            "children": [stored_node(child) for child in node.children],
            "policy": node.policy,
            "child_policies": node.child_policies,
            "outer": node.outer,
            "single": node.single,
            "silent": node.silent,
            "max_active": node.max_active,
            "batch": node.batch,
        }
    }


def node_of(stored: Any) -> Node:
    """The planned node a row keeps (decoded); ``ValueError`` when it keeps none: neither a
    job (a dict with its options) nor a nested flow's or a chain's entry."""
    if isinstance(stored, dict):
        if isinstance(level := stored.get(NESTED), dict):
            return _plan_of(level)
        if isinstance(steps := stored.get(STEPS), list) and steps:
            return PlannedChain([_step_of(step) for step in steps])
        if isinstance(stored.get("options"), dict):
            return PlannedJob(*split_held(stored))
    raise ValueError(f"not a stored job: {type(stored).__name__}")


def is_row_job(stored: Any) -> TypeGuard[dict[str, Any]]:
    """Whether a row's stored job (decoded) is one a row can keep and a publish can send: a
    task's message, or a nested flow's entry (publishing it starts that flow)."""
    return isinstance(stored, dict) and (
        isinstance(stored.get("options"), dict) or is_nested_entry(stored)
    )


def is_nested_entry(stored: Any) -> bool:
    """Whether a stored job is a nested flow's entry, not a task's own message."""
    return isinstance(stored, dict) and isinstance(stored.get(NESTED), dict)


def nested_plan(stored: Any) -> Plan | None:
    """The nested flow a stored job is the entry of (publishing it starts that flow), or
    None for a task's own message."""
    level = stored.get(NESTED) if isinstance(stored, dict) else None
    return _plan_of(level) if isinstance(level, dict) else None


def _plan_of(level: dict[str, Any]) -> Plan:
    parent, held = split_held(level["parent"])
    return Plan(
        queue=str(level["queue"]),
        parent_id=str(level["parent_id"]),
        parent=parent,
        held=held,
        children=[node_of(child) for child in level.get("children") or ()],
        policy=str(level.get("policy") or "fail"),
        child_policies=dict(level.get("child_policies") or {}),
        outer=str(level.get("outer") or ""),
        single=bool(level.get("single")),
        silent=list(level.get("silent") or ()),
        max_active=int(level.get("max_active") or 0),
        batch=int(level.get("batch") or 0),
    )


def _step_of(stored: Any) -> PlannedJob | Plan:
    node = node_of(stored)
    if isinstance(node, PlannedChain):
        raise ValueError("a chain's step is a job or a nested flow, not a chain")
    return node
