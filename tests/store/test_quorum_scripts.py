"""The quorum's fan-in called script by script (store/lua/includes/quorum.lua): the K-th
success releases the parent once, whatever is delivered twice or stale; the order of success
is kept; a failure that leaves fewer than K possible fails the parent at once. A real Redis,
no worker."""

from __future__ import annotations

import uuid

import redis

from celery_echomq.store.keyspace import new_job_id
from celery_echomq.store.replies import Status
from celery_echomq.store.scripts import ParentRef, Scripts
from tests.helpers import KEYS

TTL = 600
LEASE = 60_000


def start(scripts: Scripts, n: int, need: int) -> tuple[ParentRef, list[str]]:
    queue = "q" + uuid.uuid4().hex[:8]
    parent, kids = new_job_id(), [new_job_id() for _ in range(n)]
    scripts.enqueue_flow(queue, parent, b"p", [(k, b"c") for k in kids])
    return ParentRef(parent, queue, f"{need}/{n}"), kids


def complete(scripts: Scripts, ref: ParentRef, kid: str, token: str, value: bytes) -> Status:
    return scripts.complete(
        ref.queue, kid, token, ttl=TTL, is_parent=False, parent=ref, value=value
    )


def order(db: redis.Redis, ref: ParentRef) -> list[bytes]:
    return list(db.lrange(KEYS.job_key(ref.queue, ref.id) + ":quorum", 0, -1))


def test_released_once_at_the_kth_success_under_redelivery(
    db: redis.Redis, scripts: Scripts
) -> None:
    ref, kids = start(scripts, 5, 2)
    tokens = {k: "t-" + uuid.uuid4().hex for k in kids}
    for k in kids:
        assert scripts.claim(ref.queue, k, tokens[k], LEASE)[0] is Status.CLAIMED
    assert complete(scripts, ref, kids[3], tokens[kids[3]], b"3") is Status.CREDITED
    # The same completion delivered again, and a stale one: neither is counted.
    assert complete(scripts, ref, kids[3], tokens[kids[3]], b"3") is not Status.RELEASED
    scripts.claim(ref.queue, kids[1], "t-new", LEASE, force=True)
    assert complete(scripts, ref, kids[1], tokens[kids[1]], b"1") is Status.STALE
    assert order(db, ref) == [kids[3].encode()]
    assert complete(scripts, ref, kids[1], "t-new", b"1") is Status.RELEASED
    row = KEYS.job_key(ref.queue, ref.id)
    assert db.hget(row, "state") == b"pending"
    assert order(db, ref) == [kids[3].encode(), kids[1].encode()]
    # A child running when the quorum was met finishes, uncounted.
    assert complete(scripts, ref, kids[0], tokens[kids[0]], b"0") is Status.CREDITED
    assert db.hget(row, "state") == b"pending"
    assert db.hgetall(KEYS.job_key(ref.queue, ref.id) + ":processed") == {
        kids[3].encode(): b"3",
        kids[1].encode(): b"1",
    }
    assert db.hget(KEYS.job_key(ref.queue, kids[0]), "state") == b"done"
    assert int(db.hget(KEYS.queue_key(ref.queue, "counters"), "released") or 0) == 1


def test_failed_at_once_when_the_quorum_cannot_be_met(db: redis.Redis, scripts: Scripts) -> None:
    ref, kids = start(scripts, 4, 3)
    db.hset(KEYS.job_key(ref.queue, ref.id), "policy", "remove")
    tokens = {k: "t-" + uuid.uuid4().hex for k in kids}
    for k in kids:
        scripts.claim(ref.queue, k, tokens[k], LEASE)
    assert complete(scripts, ref, kids[0], tokens[kids[0]], b"0") is Status.CREDITED

    def fail(kid: str) -> Status:
        return scripts.fail(
            ref.queue, kid, tokens[kid], "ValueError: no", ttl=TTL, is_parent=False, parent=ref
        )[0]

    assert fail(kids[1]) is Status.CREDITED  # 3 can still succeed
    assert fail(kids[1]) is not Status.PARENT_FAILED  # a repeat changes nothing
    assert fail(kids[2]) is Status.PARENT_FAILED  # 2 can: fewer than 3
    error = db.hget(KEYS.job_key(ref.queue, ref.id), "error")
    assert error is not None
    assert error.startswith(b"quorum not met: 1 of 4 children succeeded, 3 needed (2 failed")
    assert db.zscore(KEYS.queue_key(ref.queue, "failed"), ref.id) is not None
    assert complete(scripts, ref, kids[3], tokens[kids[3]], b"3") is Status.CREDITED
    assert db.hget(KEYS.job_key(ref.queue, ref.id), "state") == b"failed"


def test_a_retried_child_counted_as_resolved_counts_toward_the_quorum_again(
    db: redis.Redis, scripts: Scripts
) -> None:
    # 2 of 3 under remove: a failure leaves 2 that can succeed, and a retry of that child
    # takes its failure back, so its second failure still leaves 2 (not 1: failed at once).
    ref, kids = start(scripts, 3, 2)
    row = KEYS.job_key(ref.queue, ref.id)
    db.hset(row, "policy", "remove")

    def fail(kid: str) -> Status:
        token = "t-" + uuid.uuid4().hex
        scripts.claim(ref.queue, kid, token, LEASE)
        return scripts.fail(
            ref.queue, kid, token, "ValueError: no", ttl=TTL, is_parent=False, parent=ref
        )[0]

    assert fail(kids[0]) is Status.CREDITED
    assert scripts.retry_counted(ref.queue, ref.id, kids[0])[0] is Status.RETRIED
    assert db.hget(row, "quorum_failed") == b"0"
    assert fail(kids[0]) is Status.CREDITED
    assert db.hget(row, "state") == b"awaiting_children"
    for kid, value in ((kids[1], b"1"), (kids[2], b"2")):
        token = "t-" + uuid.uuid4().hex
        scripts.claim(ref.queue, kid, token, LEASE)
        complete(scripts, ref, kid, token, value)
    assert db.hget(row, "state") == b"pending"
    assert order(db, ref) == [kids[1].encode(), kids[2].encode()]


def test_a_reducer_folds_each_child_once(db: redis.Redis, scripts: Scripts) -> None:
    queue = "q" + uuid.uuid4().hex[:8]
    parent, kids = new_job_id(), [new_job_id() for _ in range(3)]
    scripts.enqueue_flow(queue, parent, b"p", [(k, b"c") for k in kids])
    ref = ParentRef(parent, queue, "", '["sum"]')
    tokens = {k: "t-" + uuid.uuid4().hex for k in kids}
    for k in kids:
        scripts.claim(queue, k, tokens[k], LEASE)
    row = KEYS.job_key(queue, parent)
    assert complete(scripts, ref, kids[0], tokens[kids[0]], b"5") is Status.CREDITED
    complete(scripts, ref, kids[0], tokens[kids[0]], b"5")  # delivered again: not folded
    assert db.hget(row, "acc") == b"5"
    # A value it cannot fold: refused before any write; the child is still active.
    before = {k: db.dump(k) for k in db.keys("*")}
    assert complete(scripts, ref, kids[1], tokens[kids[1]], b'"x"') is Status.UNFOLDABLE
    assert {k: db.dump(k) for k in db.keys("*")} == before
    assert db.hget(KEYS.job_key(queue, kids[1]), "state") == b"active"
    assert complete(scripts, ref, kids[2], tokens[kids[2]], b"2.5") is Status.CREDITED
    assert db.hget(row, "acc") == b"7.5"


# The values each reducer is given below: JSON as a child's worker encodes its return value.
VALUES = [b"3", b"-2.5", b"1e3", b'"x"', b"true", b"null", b"[]", b"{}", b"[1, 2]",
          b'{"s": 4}', b'{"s": "high"}', b'{"t": 1}', b'{"s": true}']  # fmt: skip
REDUCERS = ['["count"]', '["sum"]', '["min"]', '["max"]', '["merge"]', '["top", 2, "s"]',
            '["list", 2]']  # fmt: skip


def test_the_workers_check_and_the_script_agree(db: redis.Redis, scripts: Scripts) -> None:
    """A child's worker decides whether its value can be folded before any result is stored
    (send/reducers.py's refusal); the script that credits it decides again: the same answer,
    with the same reason, for every reducer and kind of value."""
    from celery_echomq.send.fan_in import refusal

    for spec in REDUCERS:
        queue = "q" + uuid.uuid4().hex[:8]
        parent, kids = new_job_id(), [new_job_id() for _ in VALUES]
        scripts.enqueue_flow(queue, parent, b"p", [(k, b"c") for k in kids])
        ref = ParentRef(parent, queue, "", spec)
        for kid, value in zip(kids, VALUES, strict=True):
            scripts.claim(queue, kid, "t-" + kid, LEASE)
            status, _, handed, _ = scripts.complete_settling(
                queue, kid, "t-" + kid, ttl=TTL, is_parent=False, parent=ref, value=value
            )
            said = None if handed is None else handed[1]["reason"]
            reason = said.decode() if isinstance(said, bytes) else said
            assert (spec, value, reason) == (spec, value, refusal(spec, value))
            assert (status is Status.UNFOLDABLE) == (reason is not None)
    assert refusal('["sum"]', b'"x"') == 'sum folds numbers, not str "x"'
    assert refusal('["merge"]', b"[]") == "merge folds dicts, not list []"


def test_a_quorum_folds_the_successes_it_counts(db: redis.Redis, scripts: Scripts) -> None:
    """quorum=2 with reduce="sum": the parent's accumulator is the fold of the two successes
    that met it; a child that finishes after is recorded and not folded."""
    ref, kids = start(scripts, 3, 2)
    ref = ParentRef(ref.id, ref.queue, ref.quorum, '["sum"]')
    tokens = {k: "t-" + uuid.uuid4().hex for k in kids}
    for k in kids:
        scripts.claim(ref.queue, k, tokens[k], LEASE)
    assert complete(scripts, ref, kids[2], tokens[kids[2]], b"10") is Status.CREDITED
    assert complete(scripts, ref, kids[0], tokens[kids[0]], b"5") is Status.RELEASED
    assert complete(scripts, ref, kids[1], tokens[kids[1]], b"100") is Status.CREDITED
    assert db.hget(KEYS.job_key(ref.queue, ref.id), "acc") == b"15"
