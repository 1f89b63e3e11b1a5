"""The store's format on a real Redis, without Celery: every row a script creates carries it,
a row without it (written before formats were recorded) is read and finished, and every
writing script refuses a row of a newer format before any write (``EMQFORMAT``)."""

from __future__ import annotations

import uuid

import pytest
import redis

from celery_echomq import StoreFormatError
from celery_echomq.store.keyspace import JOB_SETS
from celery_echomq.store.loader import TRANSITIONS
from celery_echomq.store.replies import Status
from celery_echomq.store.script_values import packed
from celery_echomq.store.scripts import ParentRef, Scripts
from celery_echomq.store.store_format import STORE_FORMAT
from tests.helpers import KEYS, LEASE, TTL, enqueue, run_child

NEWER = str(STORE_FORMAT + 1)
NO_OPTIONS = packed({})  # the last ARGV of a script that takes options (lua/README.md)

# The scripts that write no row: a lease key, the queue's lease and hold sets, a parent's
# staging hash (what grow_flow, which checks the parent, staged), and add_children, which
# writes only rows that do not exist (a row it finds naming its parent is left as it is).
WRITES_NO_ROW = {"extend", "lease_release", "grow_done", "add_children"}


@pytest.fixture
def queue() -> str:
    return "q" + uuid.uuid4().hex[:8]


def everything(db: redis.Redis) -> dict[bytes, object]:
    """Every key, what it holds and its expiry: what "nothing was written" compares."""
    out: dict[bytes, object] = {}
    for key in db.keys("*"):
        held = db.hgetall(key) if db.type(key) == b"hash" else db.dump(key)
        out[key] = (held, db.pttl(key) > 0)
    return out


def calls(queue: str, parent: str, child: str) -> dict[str, tuple[list[str], list[str | bytes]]]:
    """Each writing script's KEYS and ARGV for a call about ``parent``'s row or ``child``'s
    (``child`` active under token 't'), with the queue's other keys where the script wants
    them: every row it would write is one the test has marked newer."""
    prow, crow = KEYS.job_key(queue, parent), KEYS.job_key(queue, child)
    other = [f"emq:{{{queue}}}:unused{i}" for i in range(16)]
    about_parent = [prow, *other]
    about_child = [crow, *other]
    return {
        "claim": (about_child, [child, "t2", str(LEASE), "0", "0", "0", NO_OPTIONS]),
        "complete": (about_child, [child, "t", "10", "0", parent, "1", "0", NO_OPTIONS]),
        "fail": (about_child, [child, "t", "E: x", "10", "0", parent, "0", "0", NO_OPTIONS]),
        "retry": (about_child, [child, "t", "0"]),
        "hand_over": (about_child, [child, "t"]),
        "take_handed": (about_child, [child, "t3", parent]),
        "requeue": (about_child, [child, "1000", "active", "t"]),
        "drop": (about_child, [child, "host|1|"]),
        "unhand": (about_child, [child, "1000"]),
        "cancel_shared": (about_child, [child, "10"]),
        "join_edge": (about_child, [child, parent, "fail", queue, "10"]),
        "retry_counted": ([crow, prow, *other], [child, parent, "10"]),
        "dispatch": (about_parent, [parent, "0"]),
        "cancel": (about_parent, [parent, "10"]),
        "credit": (about_parent, [parent, child, "done", "1", "", "10", NO_OPTIONS]),
        "deadline": (about_parent, [parent, "x", "fail", "10", "1000", "0"]),
        "deadline_done": (about_parent, [parent, "1"]),
        "deadline_arm": (about_child, [child, "in", "1000", parent]),
        "release": (about_parent, [parent, "10"]),
        "retry_deadline": (about_parent, [parent, "10"]),
        "retry_flow": (about_parent, [parent, "10"]),
        "retry_parent": (about_parent, [parent, "10"]),
        "seal_flow": (about_parent, [parent, "10"]),
        "abandon_flow": (about_parent, [parent, "10"]),
        "grow_flow": (about_parent, [parent, "x", "payload", "0", "0", NO_OPTIONS]),
        # A nested flow's enqueue and open take over its placeholder: here the child's row.
        "enqueue_flow": (
            [crow, *other],
            [child, "p", "0", packed([]), "10", "10", packed({"outer": parent})],
        ),
        "open_flow": ([crow, *other], [child, "p", "0", "fail", parent, "10", "10", NO_OPTIONS]),
        # The parent's row where it shares the slot: refused as newer there too.
        "cancel_elsewhere": ([*other[:3], other[3], crow], [parent, "10", "0", child]),
        "deadline_cut": ([*other[:2], other[2], crow], [parent, "10", "fail", child]),
        "credit_cut": ([prow, *other[:2]], [parent, child]),
        # the queue's counters and job sets, then the row
        "forget": ([*other[: 1 + len(JOB_SETS)], crow], ["1", child, "0"]),
        "retry_children": ([*other[:2], crow], [parent, child]),
    }


def test_the_rows_a_flow_is_written_with_carry_the_format(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, children = enqueue(scripts, queue, 2)
    for job in (parent, *children):
        assert db.hget(KEYS.job_key(queue, job), "format") == str(STORE_FORMAT).encode()


def test_a_row_without_a_format_is_read_and_finished(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    # Rows written before formats were recorded carry none: format 1, finished as they are.
    parent, children = enqueue(scripts, queue, 2)
    for job in (parent, *children):
        db.hdel(KEYS.job_key(queue, job), "format")
    assert run_child(scripts, queue, parent, children[0], b"1") == Status.CREDITED
    assert run_child(scripts, queue, parent, children[1], b"2") == Status.RELEASED
    assert db.hget(KEYS.job_key(queue, parent), "state") == b"pending"


def test_every_writing_script_refuses_a_row_of_a_newer_format_and_writes_nothing(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, (child, _) = enqueue(scripts, queue, 2)
    assert scripts.claim(queue, child, "t", LEASE)[0] == Status.CLAIMED
    for key in db.keys("*"):
        if db.type(key) == b"hash" and db.hexists(key, "state"):
            db.hset(key, "format", NEWER)
    table = calls(queue, parent, child)
    assert sorted(table) == sorted(set(TRANSITIONS) - WRITES_NO_ROW)
    before = everything(db)
    for name, (keys, argv) in table.items():
        with pytest.raises(StoreFormatError) as refused:
            scripts._run(name, keys, argv)
        assert (refused.value.found, refused.value.known) == (NEWER, STORE_FORMAT), name
        assert refused.value.row in keys, name
        assert everything(db) == before, name


def test_the_refusal_says_what_was_found_and_what_to_do(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, (child, _) = enqueue(scripts, queue, 2)
    db.hset(KEYS.job_key(queue, child), "format", NEWER)
    with pytest.raises(StoreFormatError) as refused:
        scripts.claim(queue, child, "t", LEASE)
    said = str(refused.value)
    assert f"store format {NEWER}" in said and f"format {STORE_FORMAT}" in said
    assert KEYS.job_key(queue, child) in said and "Upgrade celery-echomq" in said
    # The flow's other rows, of this release's format, go on as ever.
    assert scripts.claim(queue, _, "t", LEASE)[0] == Status.CLAIMED
    ref = ParentRef(parent, queue)
    assert scripts.complete(queue, _, "t", ttl=TTL, is_parent=False, parent=ref, value=b"1") == (
        Status.CREDITED
    )
