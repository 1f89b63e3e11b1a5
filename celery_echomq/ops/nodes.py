"""A flow tree's nodes as the views read them: a job, what a flow parent adds, a linked chain's
steps. Plain data, and its JSON form (what ``show --json`` prints and the dashboard serves)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# A job in one of these states will not change again (until its keys expire).
FINISHED = frozenset({"done", "failed", "cancelled"})
# What a job row's state reads as when the row is gone (expired, forgotten, never written).
MISSING = "missing"


@dataclass(frozen=True)
class FlowInfo:
    """What only a flow parent has: where its children stand (``Dependencies``'s counts)."""

    policy: str  # the default parent_policy of children that set none
    outstanding: int | None  # children not settled yet; None once the counter expired
    done: int  # children whose values count
    failed: int  # children failed under fail, fail_at_end, remove or continue
    ignored: int  # children failed under ignore
    cut: int  # children the flow ended without (cancelled; cut by a release, deadline, quorum)
    total: int  # children of the flow (those added while it ran included)
    failed_child: str | None  # the child whose failure under policy "fail" failed the flow
    max_active: int | None = None  # its window: the most children out at once (None: none)
    waiting: int = 0  # children waiting for a slot of that window
    quorum: int | None = None  # the successes that release its parent (None: every child)
    reduce: list[Any] | None = None  # its reducer (["sum"], ["top", 3, "score"]; None: none)
    acc: Any = None  # with a reducer: the children's values folded so far


@dataclass(frozen=True)
class ChildPage:
    """Which of a flow's children a node holds: one page of them, and where the next begins."""

    only: str | None  # the state filter ("failed", "pending", ...), None for every child
    cursor: str | None  # the cursor this page was read from (None: the first page)
    next_cursor: str | None  # the next page's; None after the last
    count: int  # the page size asked for


@dataclass(frozen=True)
class JobNode:
    """One job of a flow tree: a parent, a child, or a child that is itself a flow."""

    id: str
    queue: str
    state: str  # the row's state, or "missing" when the row is gone
    task: str | None
    attempts: int
    parent: str | None = None  # the parent's job id, for a child
    policy: str | None = None  # as a child: the parent_policy that applies to it
    policy_is_default: bool = False  # True when that policy is the flow's default
    outcome: str | None = None  # as a child: what its parent made of it (see _outcome)
    has_value: bool = False  # False means "no value yet", so that a None value still shows
    value: Any = None
    error: str | None = None  # "ExcType: message" for a failed job
    args: str | None = None  # its arguments as Celery shows them (argsrepr)
    kwargs: str | None = None  # and its keyword arguments (kwargsrepr)
    started_ms: int | None = None  # server time of its latest claim
    finished_ms: int | None = None  # when it finished (see timing.py), if known
    dispatched_ms: int | None = None  # a parent: when its release was published
    flow: FlowInfo | None = None  # set when this job is a flow parent
    children: tuple[JobNode, ...] = field(default=())
    # A linked chain's last step (the child its flow counts): every step, in order, itself
    # last; the chain's own state is :attr:`chain_state`.
    steps: tuple[JobNode, ...] = field(default=())
    page: ChildPage | None = None  # when ``children`` are one page of them (ops/pages.py)
    # How many parents wait for this job (on_exists="join", a DAG): 0 where not read, 1 for a
    # job of one flow; a page of children reads it (its row's parent and its ``:parents``).
    shared_by: int = 0
    # A job that replaced itself with a flow (Task.replace): that flow's parent, a flow of its
    # own that runs in the job's place (the job takes its outcome).
    replaced_by: str | None = None
    # The batch message that carried its latest delivery (flow(..., batch=N)); None: a
    # message of its own.
    batch: str | None = None

    @property
    def finished(self) -> bool:
        return self.state in FINISHED

    @property
    def running_step(self) -> int | None:
        """A linked chain: the 1-based number of the step that runs or is due to (pending or
        active), None when none is."""
        for number, step in enumerate(self.steps, 1):
            if step.state in ("pending", "active"):
                return number
        return None

    @property
    def chain_state(self) -> str:
        """A linked chain's state as a child: its failed or cancelled step's, else that of
        the step that runs, else its last step's."""
        for step in self.steps:
            if step.state in ("failed", "cancelled"):
                return step.state
        running = self.running_step
        return self.steps[running - 1].state if running else self.state

    @property
    def runtime_ms(self) -> int | None:
        """From its latest start to its end, when both are known."""
        if self.started_ms is None or self.finished_ms is None:
            return None
        return max(0, self.finished_ms - self.started_ms)


def json_default(value: Any) -> Any:
    """What ``json.dumps`` makes of a task value JSON cannot hold (sets, bytes, objects)."""
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return repr(value)


def node_dict(node: JobNode) -> dict[str, Any]:
    """A node as plain data, with ``finished`` spelled out: what ``show --json`` prints and the
    dashboard's ``/api/flows/<id>`` serves."""
    skip = ("children", "page")
    data = {f.name: getattr(node, f.name) for f in dataclasses.fields(node) if f.name not in skip}
    data["flow"] = dataclasses.asdict(node.flow) if node.flow else None
    if node.page is not None:
        data["page"] = dataclasses.asdict(node.page)
    data["finished"] = node.finished
    data["runtime_ms"] = node.runtime_ms
    data["children"] = [node_dict(child) for child in node.children]
    data["steps"] = [node_dict(step) for step in node.steps]
    if node.steps:
        data["chain_state"] = node.chain_state
        data["running_step"] = node.running_step
    return data


def shown_dict(node: JobNode, refusing: str) -> dict[str, Any]:
    """What ``show --json`` and the dashboard's ``/api/flows/<id>`` give: ``node`` and its
    children, and ``refusing``, why the store refuses writes now ("" while it takes them)."""
    return {**node_dict(node), "store_refuses_writes": refusing}
