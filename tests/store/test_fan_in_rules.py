"""The fan-in's rules (``store/fan_in_rules.py``) checked against the scripts, row by row.

Every row of the table (each kind of fan-in, each outcome) is run after each of a set of
outcomes before it (so the parent still waits, was released or failed when it comes), and
the same children are settled twice: by the real scripts on a real Redis (complete.lua,
fail.lua and their ``settle_child``) and by the eager fan-in, ``result.py``'s ``FanIn``,
which executes the table. After each child both must say the same: the reply (released,
parent failed, credited), the parent's state, the counts ``dependencies()`` reads, the
values in their order, the errors kept and the failure's child and words.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis

from celery_echomq.result import FanIn
from celery_echomq.store.connection import text
from celery_echomq.store.fan_in_rules import QUORUM, RULES
from celery_echomq.store.keyspace import new_job_id
from celery_echomq.store.reads import CUT_FIELD, Dependencies, counts_of
from celery_echomq.store.replies import Status
from celery_echomq.store.scripts import ParentRef, Scripts
from tests.helpers import KEYS

TTL = 600
LEASE = 60_000
CHILDREN = 3
NEED = 2  # a quorum's K, of the three children

# What comes before the row's outcome: nothing, successes (the last of them releases a
# quorum), failures that fail the parent (at once, or a quorum's two), one that releases it
# at once, one that waits to fail it, and the failures that are only counted.
BEFORE = [
    (),
    ("done",),
    ("done", "done"),
    ("fail",),
    ("fail", "fail"),
    ("continue",),
    ("fail_at_end",),
    ("ignore",),
    ("remove",),
]

CASES = [
    pytest.param(kind, outcome, before, id=f"{kind}-{outcome}-after-{'+'.join(before) or 'none'}")
    for kind, outcome in RULES
    for before in BEFORE
]


class StoreFlow:
    """A flow of three children on one queue, settled by the scripts."""

    def __init__(
        self, db: redis.Redis, scripts: Scripts, parent: str, quorum: int, policy: str
    ) -> None:
        self.db, self.scripts = db, scripts
        self.queue = "q" + uuid.uuid4().hex[:8]
        self.kids = [new_job_id() for _ in range(CHILDREN)]
        self.ref = ParentRef(parent, self.queue, f"{quorum}/{CHILDREN}" if quorum else "")
        scripts.enqueue_flow(self.queue, parent, b"p", [(k, b"c") for k in self.kids])
        self.db.hset(self.row(), "policy", policy)

    def row(self, suffix: str = "") -> str:
        return KEYS.queue_key(self.queue, self.ref.id + suffix)

    def settle(self, i: int, ok: bool, data: str, policy: str) -> Status:
        kid, token = self.kids[i], "t-" + uuid.uuid4().hex
        assert self.scripts.claim(self.queue, kid, token, LEASE)[0] is Status.CLAIMED
        if ok:
            return self.scripts.complete(
                self.queue,
                kid,
                token,
                ttl=TTL,
                is_parent=False,
                parent=self.ref,
                value=data.encode(),
            )
        if policy:
            self.db.hset(KEYS.job_key(self.queue, kid), "parent_policy", policy)
        return self.scripts.fail(
            self.queue, kid, token, data, ttl=TTL, is_parent=False, parent=self.ref
        )[0]

    def dependencies(self) -> Dependencies:
        credited, recorded, cut = self.db.hmget(
            self.row(), "credited_failed", "failed_children", CUT_FIELD
        )
        return counts_of(
            self.db.get(self.row(":dependencies")),
            self.db.hlen(self.row(":processed")),
            self.db.hlen(self.row(":ignored")),
            credited,
            recorded,
            cut,
        )

    def seen(self) -> dict[str, Any]:
        """What the flow holds, in the eager fan-in's terms."""
        row = {text(k): text(v) for k, v in self.db.hgetall(self.row()).items()}
        state = row["state"]
        processed = {text(k): text(v) for k, v in self.db.hgetall(self.row(":processed")).items()}
        order = [text(k) for k in self.db.lrange(self.row(":quorum"), 0, -1)] or self.kids
        return {
            "state": state,
            "dependencies": repr(self.dependencies()),
            "values": [(k, processed[k]) for k in order if k in processed],
            "ignored": {text(k): text(v) for k, v in self.db.hgetall(self.row(":ignored")).items()},
            "failures": {k[len("failed:") :]: v for k, v in row.items() if k.startswith("failed:")},
            "failure": (row["failed_child"], row["error"]) if state == "failed" else None,
        }


def eager_seen(fanin: FanIn, kids: list[str]) -> dict[str, Any]:
    failure = fanin.failure
    return {
        "state": "awaiting_children" if fanin.waiting else "failed" if failure else "pending",
        "dependencies": repr(fanin.dependencies()),
        # In the children's order, or a quorum's order of success.
        "values": list(fanin.values.items())
        if fanin.quorum
        else [(k, fanin.values[k]) for k in kids if k in fanin.values],
        "ignored": fanin.ignored,
        "failures": fanin.failures,
        "failure": (failure.child_id, str(failure).removeprefix(f"flow {fanin.parent_id}: "))
        if failure
        else None,
    }


@pytest.mark.parametrize(("kind", "outcome", "before"), CASES)
def test_the_scripts_follow_each_rule_as_the_eager_fan_in_does(
    db: redis.Redis, scripts: Scripts, kind: str, outcome: str, before: tuple[str, ...]
) -> None:
    quorum = NEED if kind == QUORUM else 0
    # The row's own failure reads its policy from the flow (the flow's default); the ones
    # before it carry their own (a child's parent_policy).
    default = "fail" if outcome == "done" else outcome
    parent = new_job_id()
    store = StoreFlow(db, scripts, parent, quorum, default)
    fanin = FanIn(parent, CHILDREN, default, quorum=quorum, total=CHILDREN)
    outcomes = [*before, outcome, *["done"] * CHILDREN][:CHILDREN]
    for i, said in enumerate(outcomes):
        ok = said == "done"
        own = "" if ok or i == len(before) else said
        data = f"v{i}" if ok else f"ValueError: boom {i}"
        failed_before = fanin.failure is not None
        released = fanin.settle(store.kids[i], ok, data, own or None)
        eager = (
            Status.RELEASED
            if released
            else Status.PARENT_FAILED
            if fanin.failure is not None and not failed_before
            else Status.CREDITED
        )
        assert store.settle(i, ok, data, own) is eager, f"child {i} ({said})"
        assert store.seen() == eager_seen(fanin, store.kids), f"after child {i} ({said})"


def test_every_policy_has_its_row_in_each_kind_of_fan_in() -> None:
    from celery_echomq.send.jobs import POLICIES

    assert sorted(RULES) == sorted(
        (kind, outcome) for kind in ("count", QUORUM) for outcome in ("done", *POLICIES)
    )
