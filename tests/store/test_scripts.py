"""Each EchoMQ script on a real Redis, without Celery: the transitions and their guards."""

from __future__ import annotations

import uuid

import pytest
import redis

from celery_echomq import KindError
from celery_echomq.errors import FlowExistsError
from celery_echomq.store.codec import Delta
from celery_echomq.store.keyspace import Keyspace, new_job_id
from celery_echomq.store.loader import TRANSITIONS, load_source
from celery_echomq.store.replies import WideCheck
from celery_echomq.store.script_values import packed
from celery_echomq.store.scripts import ParentRef, Scripts
from tests.helpers import KEYS, LEASE, TTL, enqueue, run_child


@pytest.fixture
def queue() -> str:
    return "q" + uuid.uuid4().hex[:8]


def zmembers(db: redis.Redis, key: str) -> set[str]:
    return {m.decode() for m in db.zrange(key, 0, -1)}


def test_enqueue_flow_holds_the_parent_and_makes_children_claimable(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, children = enqueue(scripts, queue, 3)
    row = db.hgetall(KEYS.job_key(queue, parent))
    assert row[b"state"] == b"awaiting_children"
    assert row[b"payload"] == b"parent"
    assert db.get(f"{KEYS.job_key(queue, parent)}:dependencies") == b"3"
    assert zmembers(db, KEYS.queue_key(queue, "pending")) == set(children)  # parent in no set
    for child in children:
        crow = db.hgetall(KEYS.job_key(queue, child))
        assert crow[b"state"] == b"pending"
        assert crow[b"attempts"] == b"0"
        assert crow[b"parent"] == parent.encode()
        assert crow[b"payload"] == f"payload-{child}".encode()
    assert not any(parent.encode() in k for k in db.keys("*:active"))


def test_enqueue_flow_stores_deltas_against_a_template_and_hands_them_out(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, (a, b) = new_job_id(), [new_job_id(), new_job_id()]
    scripts.enqueue_flow(
        queue, parent, b"parent", [(a, b"delta-a"), (b, b"whole-b")], template=b"tpl", kinds="dp"
    )
    assert db.hget(KEYS.job_key(queue, parent), "template") == b"tpl"
    row_a = db.hgetall(KEYS.job_key(queue, a))
    assert row_a[b"delta"] == b"delta-a" and b"payload" not in row_a
    # A small row keeps Redis's compact hash encoding.
    assert db.object("encoding", KEYS.job_key(queue, a)) in (b"listpack", b"ziplist")
    row_b = db.hgetall(KEYS.job_key(queue, b))
    assert row_b[b"payload"] == b"whole-b" and b"delta" not in row_b
    # What hands a stored job out says which form it is: a delta names the parent whose row
    # holds the template.
    db.zadd(KEYS.queue_key(queue, "pending"), {a: 0, b: 0})
    assert scripts.requeue(queue, a, 1, "pending") == ("requeued", Delta(b"delta-a", parent))
    assert scripts.requeue(queue, b, 1, "pending") == ("requeued", b"whole-b")
    scripts.claim(queue, a, "host|7|x", LEASE)
    assert scripts.claim(queue, a, "dup", LEASE)[0] == "busy"
    assert scripts.drop(queue, a, "host|7|") == ("requeued", Delta(b"delta-a", parent))


@pytest.mark.parametrize("bad", ["parent", "child"])
def test_emqkind_refuses_before_any_write(
    db: redis.Redis, scripts: Scripts, queue: str, bad: str
) -> None:
    # Call the raw script (the host gate would refuse first) to show the second wall holds.
    keyspace = Keyspace("emq")
    parent = "XYZ1" if bad == "parent" else new_job_id()
    children = [new_job_id(), "NOTAJOB" if bad == "child" else new_job_id()]
    # Keys the gate would refuse to build: spelled out here.
    keys = [
        f"emq:{{{queue}}}:{parent}",
        f"emq:{{{queue}}}:{parent}:dependencies",
        keyspace.queue_key(queue, "pending"),
        *(f"emq:{{{queue}}}:{c}" for c in children),
    ]
    argv = [parent, "p", "2", packed([children[0], "a", children[1], "b"]), "1000", "10"]
    before = db.dbsize()
    with pytest.raises(KindError, match="EMQKIND"):
        scripts._run("enqueue_flow", keys, argv)
    assert db.dbsize() == before


def test_every_script_repeats_the_kind_gate(scripts: Scripts, db: redis.Redis) -> None:
    for name, argv in [
        ("claim", ["BAD", "t", "1000"]),
        ("complete", ["BAD", "t", "10", "0", "", "v"]),
        ("fail", ["BAD", "", "E: x", "10", "0", ""]),
        ("retry", ["BAD", "t"]),
        ("dispatch", ["BAD", "0"]),
        ("requeue", ["BAD", "1000", "pending", ""]),
        ("extend", ["1000", "1", "JOBok", "BAD"]),
        ("drop", ["BAD", "host|1|"]),
        ("hand_over", ["BAD", "t"]),
        ("forget", ["1", "BAD", "0"]),
    ]:
        with pytest.raises(KindError):
            scripts._run(name, ["emq:{q}:x"] * 6, argv)
    assert db.dbsize() == 0


def test_forget_deletes_a_held_flow_and_takes_back_what_it_counted(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, children = enqueue(scripts, queue, 3)
    counters = KEYS.queue_key(queue, "counters")
    run_child(scripts, queue, parent, children[0], b"1")
    assert db.hget(counters, "held") == b"1"
    rows = [KEYS.job_key(queue, c) for c in children]
    assert scripts.forget(queue, children) == (rows, [])
    deleted, kept = scripts.forget(queue, [parent], [parent])
    own = KEYS.flow_own_keys(queue, parent)
    kinds = (own[0], own[1], KEYS.children_key(queue, parent))  # dependencies, processed
    assert (sorted(deleted), kept) == (sorted([KEYS.job_key(queue, parent), *kinds]), [])
    # Nothing of the flow is left, and the queue no longer counts its parent held.
    ids = [parent, *children]
    assert [k for k in db.keys(f"*{{{queue}}}*") if any(i.encode() in k for i in ids)] == []
    for name in ("pending", "active", "recent"):
        assert zmembers(db, KEYS.queue_key(queue, name)) == set()
    assert db.hget(counters, "held") == b"0"
    # Run again (a forget cut short and run anew): nothing more, nothing counted twice.
    assert scripts.forget(queue, [parent, *children], [parent]) == ([], [])
    assert db.hget(counters, "held") == b"0"


def test_forget_cuts_a_cancelled_childs_row_down_to_what_turns_its_message_away(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, children = enqueue(scripts, queue, 2)
    scripts.cancel(queue, parent, children, ttl=TTL)
    row = KEYS.job_key(queue, children[0])
    assert db.hget(row, "state") == b"cancelled" and db.pttl(row) > 0
    for _ in range(2):
        assert scripts.forget(queue, children, keep_cancelled_ms=60_000) == ([], children)
        assert db.hgetall(row) == {b"state": b"cancelled", b"parent": parent.encode()}
        assert 0 < db.pttl(row) <= TTL * 1000
    # The undo of a start keeps nothing: the rows it wrote go whatever their state.
    assert scripts.forget(queue, children) == ([row, KEYS.job_key(queue, children[1])], [])
    assert not db.exists(row)


def test_existing_parent_is_refused_and_nothing_changes(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, _ = enqueue(scripts, queue, 2)
    before = {k: db.dump(k) for k in db.keys("*")}
    with pytest.raises(FlowExistsError, match=parent):
        scripts.enqueue_flow(queue, parent, b"other", [(new_job_id(), b"x")])
    assert {k: db.dump(k) for k in db.keys("*")} == before


def test_existing_child_is_refused_and_nothing_changes(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    _, children = enqueue(scripts, queue, 2)
    before = {k: db.dump(k) for k in db.keys("*")}
    with pytest.raises(FlowExistsError, match=children[1]):
        scripts.enqueue_flow(
            queue, new_job_id(), b"other", [(new_job_id(), b"x"), (children[1], b"y")]
        )
    assert {k: db.dump(k) for k in db.keys("*")} == before


def test_claim_moves_pending_to_active_with_a_new_token(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    _, (child,) = enqueue(scripts, queue, 1)
    assert scripts.claim(queue, child, "t1", LEASE) == ("claimed", 1, "")
    assert zmembers(db, KEYS.queue_key(queue, "pending")) == set()
    assert zmembers(db, KEYS.queue_key(queue, "active")) == {child}
    # A second delivery while t1's lease is live is a duplicate: nothing changes but the count.
    assert scripts.claim(queue, child, "t2", LEASE) == ("busy", 1, "t1")
    assert db.hget(KEYS.job_key(queue, child), "token") == b"t1"
    assert db.hget(KEYS.queue_key(queue, "counters"), "duplicates_skipped") == b"1"
    # Once the holder is known dead, a redelivery takes over with a new token; the old token
    # is stale from now on.
    assert scripts.claim(queue, child, "t2", LEASE, force=True) == ("taken_over", 2, "t1")
    assert db.hget(KEYS.job_key(queue, child), "token") == b"t2"
    # So does one after the lease lapsed.
    db.zadd(KEYS.queue_key(queue, "active"), {child: 1})
    assert scripts.claim(queue, child, "t3", LEASE) == ("taken_over", 3, "t2")


def test_stale_token_changes_nothing(db: redis.Redis, scripts: Scripts, queue: str) -> None:
    parent, (child, _other) = enqueue(scripts, queue, 2)
    scripts.claim(queue, child, "old", LEASE)
    scripts.claim(queue, child, "new", LEASE, force=True)
    before = {k: db.dump(k) for k in db.keys("*")}
    ref = ParentRef(parent, queue)
    assert (
        scripts.complete(queue, child, "old", ttl=TTL, is_parent=False, parent=ref, value=b"1")
        == "stale"
    )
    assert scripts.retry(queue, child, "old") == "stale"
    assert scripts.fail(queue, child, "old", "E: x", ttl=TTL, is_parent=False, parent=ref) == (
        "stale",
        "",
    )
    assert {k: db.dump(k) for k in db.keys("*")} == before


@pytest.mark.parametrize("remote", [False, True], ids=["same slot", "other slot"])
def test_a_late_report_for_a_forgotten_flow_writes_nothing(
    db: redis.Redis, scripts: Scripts, queue: str, remote: bool
) -> None:
    """What reaches a flow once ``forget`` has deleted it: a worker's report of a revoked
    message it dropped (fail with any token), and the credit of a child of another slot that
    finished just before. Each answers ``missing`` and leaves no key: a row written back
    would stay for the result TTL, a :settled or :processed for ever."""
    parent, (child,) = enqueue(scripts, queue, 1)
    db.flushdb()  # what forget leaves of the flow: nothing
    ref = ParentRef(parent, queue + "b" if remote else queue)
    for policy in ("", "ignore"):
        assert scripts.fail(queue, child, "", "TaskRevokedError: revoked", ttl=TTL,
                            is_parent=False, parent=ref) == ("missing", "")  # fmt: skip
        assert scripts.credit(ref, child, "failed", "E: x", policy, ttl=TTL) == ("missing", "")
    assert scripts.credit(ref, child, "done", b"1", "", ttl=TTL) == ("missing", "")
    assert db.keys("*") == []


def test_second_complete_of_the_same_child_does_not_decrement(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, (child, _) = enqueue(scripts, queue, 2)
    token = "t"
    scripts.claim(queue, child, token, LEASE)
    ref = ParentRef(parent, queue)
    assert (
        scripts.complete(queue, child, token, ttl=TTL, is_parent=False, parent=ref, value=b"1")
        == "credited"
    )
    assert (
        scripts.complete(queue, child, token, ttl=TTL, is_parent=False, parent=ref, value=b"2")
        == "done"
    )
    # A redelivery after done cannot claim it again, so it cannot complete it again either.
    assert scripts.claim(queue, child, "t3", LEASE)[0] == "done"
    assert db.get(f"{KEYS.job_key(queue, parent)}:dependencies") == b"1"
    assert db.hgetall(f"{KEYS.job_key(queue, parent)}:processed") == {child.encode(): b"1"}


def test_release_happens_exactly_at_zero(db: redis.Redis, scripts: Scripts, queue: str) -> None:
    parent, children = enqueue(scripts, queue, 3)
    pending = KEYS.queue_key(queue, "pending")
    statuses = []
    for i, child in enumerate(children):
        statuses.append(run_child(scripts, queue, parent, child, str(i).encode()))
        held = db.hget(KEYS.job_key(queue, parent), "state")
        assert (parent in zmembers(db, pending)) == (i == 2)
        assert held == (b"pending" if i == 2 else b"awaiting_children")
    assert statuses == ["credited", "credited", "released"]
    assert db.get(f"{KEYS.job_key(queue, parent)}:dependencies") == b"0"


def test_dispatch_hands_out_the_parent_once(db: redis.Redis, scripts: Scripts, queue: str) -> None:
    parent, children = enqueue(scripts, queue, 2)
    assert scripts.dispatch(queue, parent) is None  # still held
    for child in children:
        run_child(scripts, queue, parent, child, child.encode())
    claimed = scripts.dispatch(queue, parent)
    assert claimed is not None
    payload, values = claimed
    assert payload == b"parent"
    assert values == {c: c.encode() for c in children}
    assert scripts.dispatch(queue, parent) is None
    # Recovery's form: only a dispatch older than the window is handed out again.
    assert scripts.dispatch(queue, parent, redispatch_after_ms=60_000) is None


def test_retry_moves_active_back_to_pending(db: redis.Redis, scripts: Scripts, queue: str) -> None:
    _, (child,) = enqueue(scripts, queue, 1)
    scripts.claim(queue, child, "t", LEASE)
    assert scripts.retry(queue, child, "t") == "retried"
    assert db.hget(KEYS.job_key(queue, child), "state") == b"pending"
    assert zmembers(db, KEYS.queue_key(queue, "pending")) == {child}
    assert zmembers(db, KEYS.queue_key(queue, "active")) == set()
    assert scripts.claim(queue, child, "t2", LEASE) == ("claimed", 2, "")


def test_finished_rows_expire_and_sets_are_trimmed(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, children = enqueue(scripts, queue, 2)
    for child in children:
        run_child(scripts, queue, parent, child, b"1")
    for child in children:
        assert 0 < db.ttl(KEYS.job_key(queue, child)) <= TTL
    scripts.dispatch(queue, parent)
    scripts.claim(queue, parent, "p", LEASE)
    assert (
        scripts.complete(queue, parent, "p", ttl=TTL, is_parent=True, parent=None, value=b"2")
        == "done"
    )
    for suffix in ("", ":dependencies", ":processed"):
        assert 0 < db.ttl(f"emq:{{{queue}}}:{parent}{suffix}") <= TTL
    assert not db.exists(f"{KEYS.job_key(queue, parent)}:ignored")
    assert zmembers(db, KEYS.queue_key(queue, "pending")) == set()
    assert zmembers(db, KEYS.queue_key(queue, "active")) == set()


def test_a_finished_parents_ignored_failures_expire_with_it(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, (good, bad) = enqueue(scripts, queue, 2)
    run_child(scripts, queue, parent, good, b"1")
    scripts.claim(queue, bad, "t", LEASE)
    ref = ParentRef(parent, queue)
    db.hset(KEYS.job_key(queue, parent), "policy", "ignore")  # the flow's default policy
    assert scripts.fail(queue, bad, "t", "E: x", ttl=TTL, is_parent=False, parent=ref) == (
        "released",
        "ignore",
    )
    scripts.dispatch(queue, parent)
    scripts.claim(queue, parent, "p", LEASE)
    scripts.complete(queue, parent, "p", ttl=TTL, is_parent=True, parent=None, value=b"2")
    for suffix in ("", ":dependencies", ":processed", ":ignored"):
        assert 0 < db.ttl(f"emq:{{{queue}}}:{parent}{suffix}") <= TTL


def test_noscript_falls_back_to_eval(db: redis.Redis, scripts: Scripts, queue: str) -> None:
    parent, (child,) = enqueue(scripts, queue, 1)
    db.script_flush()
    assert scripts.claim(queue, child, "t", LEASE) == ("claimed", 1, "")
    db.script_flush()
    ref = ParentRef(parent, queue)
    assert (
        scripts.complete(queue, child, "t", ttl=TTL, is_parent=False, parent=ref, value=b"v")
        == "released"
    )


def test_dispatch_of_many_values_reads_them_in_chunks(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, children = enqueue(scripts, queue, 5)
    for child in children:
        run_child(scripts, queue, parent, child, child.encode())
    # More values than inline_max: the script claims, the host reads :processed by HSCAN.
    claimed = scripts.dispatch(queue, parent, inline_max=2)
    assert claimed is not None
    assert claimed[1] == {c: c.encode() for c in children}
    assert scripts.dispatch(queue, parent, inline_max=2) is None


def test_enqueue_of_a_thousand_children_spans_every_slice(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, children = enqueue(scripts, queue, 1000)
    assert db.zcard(KEYS.queue_key(queue, "pending")) == 1000
    assert db.get(f"{KEYS.job_key(queue, parent)}:dependencies") == b"1000"
    # A clash in the last slice is found, and nothing of the new flow is written.
    before = db.dbsize()
    clash = [(new_job_id(), b"x") for _ in range(999)] + [(children[-1], b"y")]
    with pytest.raises(FlowExistsError, match=children[-1]):
        scripts.enqueue_flow(queue, new_job_id(), b"p", clash)
    assert db.dbsize() == before


def test_a_thousand_ids_are_checked_against_a_few_other_queues_in_the_script(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    """One id, one job, on a store of one server: a flow of 1,000 children checks its ids on
    up to four other queues in its own enqueue script (no claim, no round trip of its own);
    on more, with more than 1,000 keys to look up, it leaves the check to the host."""
    others = [queue + s for s in "bcd"]
    db.sadd(KEYS.queues_key(), queue, *others)
    taken = new_job_id()
    db.hset(KEYS.job_key(others[-1], taken), "state", "pending")
    children = [(new_job_id(), b"c") for _ in range(999)]
    before = db.dbsize()
    with pytest.raises(FlowExistsError, match=taken) as refused:
        scripts.enqueue_flow_at(queue, new_job_id(), b"p", [*children, (taken, b"c")], check=True)
    assert others[-1] in str(refused.value)
    assert db.dbsize() == before
    parent = new_job_id()
    scripts.enqueue_flow_at(queue, parent, b"p", children, check=True)
    assert db.get(f"{KEYS.job_key(queue, parent)}:dependencies") == b"999"
    assert db.keys("emq:id:*") == []
    db.sadd(KEYS.queues_key(), *(queue + s for s in "ef"))
    before = db.dbsize()
    with pytest.raises(WideCheck):
        wide = [(new_job_id(), b"c") for _ in range(300)]
        scripts.enqueue_flow_at(queue, new_job_id(), b"p", wide, check=True)
    assert db.dbsize() == before


def test_chunked_path_open_add_seal_and_a_repeated_add_writes_nothing(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent = new_job_id()
    children = [(new_job_id(), b"c", "") for _ in range(3)]
    assert scripts.open_flow(queue, parent, b"p", 3, "fail") == 4  # N + 1 until sealed
    ref = ParentRef(parent, queue)
    assert scripts.add_children(queue, ref, children[:2]) == 2
    assert scripts.add_children(queue, ref, children) == 1  # the first two exist: skipped
    assert db.zcard(KEYS.queue_key(queue, "pending")) == 3
    # Every child completes before the seal: the extra unit still holds the parent.
    for cid, _, _ in children:
        assert run_child(scripts, queue, parent, cid, b"1") == "credited"
    assert db.hget(KEYS.job_key(queue, parent), "state") == b"awaiting_children"
    assert scripts.seal_flow(queue, parent) == "released"
    assert scripts.seal_flow(queue, parent) == "noop"
    # Another flow cannot add a row that belongs to this one.
    with pytest.raises(FlowExistsError):
        scripts.add_children(queue, ParentRef(new_job_id(), queue), children[:1])


def test_chunked_path_stores_deltas_against_the_template_open_flow_kept(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, a, b = new_job_id(), new_job_id(), new_job_id()
    scripts.open_flow(queue, parent, b"p", 2, "fail", template=b"tpl")
    assert db.hget(KEYS.job_key(queue, parent), "template") == b"tpl"
    ref = ParentRef(parent, queue)
    assert scripts.add_children(queue, ref, [(a, b"da", ""), (b, b"wb", "")], "dp") == 2
    assert db.hget(KEYS.job_key(queue, a), "delta") == b"da"
    assert not db.hexists(KEYS.job_key(queue, a), "payload")
    assert db.object("encoding", KEYS.job_key(queue, a)) in (b"listpack", b"ziplist")
    assert db.hget(KEYS.job_key(queue, b), "payload") == b"wb"
    assert not db.hexists(KEYS.job_key(queue, b), "delta")


def test_grow_flow_adds_children_to_a_held_parent_and_refuses_a_closed_one(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    import hashlib

    parent, (first,) = enqueue(scripts, queue, 1)
    ref = ParentRef(parent, queue)
    row = KEYS.job_key(queue, parent)
    old = db.hget(row, "payload")
    assert old is not None
    sha = hashlib.sha1(old).hexdigest()
    local = [(new_job_id(), b"l1", ""), (new_job_id(), b"l2", "ignore")]
    remote = [(new_job_id(), b"r1", "remove")]
    # A payload read before another add landed is refused whole.
    assert scripts.grow_flow(ref, "0" * 40, b"p2", local, remote) == ("stale", 0)
    assert db.get(f"{row}:dependencies") == b"1" and db.hget(row, "payload") == old
    assert scripts.grow_flow(ref, sha, b"p2", local, remote) == ("added", 4)
    assert db.hget(row, "payload") == b"p2"
    for cid, payload, policy in local:
        child = db.hgetall(KEYS.job_key(queue, cid))
        assert child[b"state"] == b"pending" and child[b"payload"] == payload
        assert child[b"parent"] == parent.encode()
        assert child.get(b"parent_policy", b"") == policy.encode()
    assert db.zcard(KEYS.queue_key(queue, "pending")) == 3
    # The child of another slot is staged on the parent's slot, not written.
    (rid, _, _) = remote[0]
    assert db.hgetall(f"{row}:adding") == {rid.encode(): b"r1", f"{rid}:policy".encode(): b"remove"}
    assert db.zscore(KEYS.queue_key(queue, "adding"), parent) is not None
    # The same payload again (a resent script, or an add racing another): stale, no double count.
    assert scripts.grow_flow(ref, sha, b"p2", local, remote)[0] == "stale"
    assert db.get(f"{row}:dependencies") == b"4"
    # A row that exists on this slot is refused, nothing written.
    taken = [(first, b"x", "")]
    with pytest.raises(FlowExistsError):
        scripts.grow_flow(ref, hashlib.sha1(b"p2").hexdigest(), b"p3", taken, [])
    assert db.hget(row, "payload") == b"p2"
    # Written on its own slot: unstaged; the parent leaves the adding set with its last one.
    other = queue + "b"
    assert scripts.add_children(other, ref, remote) == 1
    assert scripts.grow_done(ref, [rid]) == 0
    assert not db.exists(f"{row}:adding")
    assert db.zcard(KEYS.queue_key(queue, "adding")) == 0
    # Every child completes: the last one releases the parent, after which nothing is added.
    for cid in (first, local[0][0], local[1][0]):
        run_child(scripts, queue, parent, cid, b"1")
    assert db.hget(row, "state") == b"awaiting_children"  # the remote child holds it
    assert scripts.credit(ref, rid, "done", b"1", "", ttl=TTL)[0] == "released"
    before = {key: db.dump(key) for key in db.keys("*")}
    sha = hashlib.sha1(db.hget(row, "payload") or b"").hexdigest()
    assert scripts.grow_flow(ref, sha, b"p4", [(new_job_id(), b"l3", "")], []) == ("pending", 0)
    assert scripts.grow_flow(ParentRef(new_job_id(), queue), sha, b"p4", [], []) == ("missing", 0)
    assert {key: db.dump(key) for key in db.keys("*")} == before
    with pytest.raises(KindError):
        scripts.grow_flow(ref, sha, b"p4", [("BAD", b"x", "")], [])
    with pytest.raises(KindError):
        scripts.grow_done(ref, ["BAD"])


# --- leases and evidence (recovery's scripts) -----------------------------------------------------


def now_ms(db: redis.Redis) -> int:
    seconds, micros = db.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_claim_marks_how_far_the_queue_has_delivered_per_priority(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    _, (first, second) = enqueue(scripts, queue, 2)
    since = db.zscore(KEYS.queue_key(queue, "pending"), first)
    scripts.claim(queue, first, "a", LEASE)
    scripts.claim(queue, second, "b", LEASE, priority=5)
    assert db.hgetall(KEYS.queue_key(queue, "marks")) == {
        b"0": str(int(since)).encode(),
        b"5": str(int(since)).encode(),
    }
    # A redelivery of a running job leaves the marks alone (it was not pending).
    scripts.claim(queue, first, "c", LEASE, force=True)
    assert db.hget(KEYS.queue_key(queue, "marks"), "0") == str(int(since)).encode()
    # A later job advances the mark past the one this client has seen; a job pending no later
    # than the mark it knows leaves the marks hash unread.
    _, (third,) = enqueue(scripts, queue, 1)
    later = db.zscore(KEYS.queue_key(queue, "pending"), third)
    scripts.claim(queue, third, "d", LEASE)
    assert db.hget(KEYS.queue_key(queue, "marks"), "0") == str(int(later)).encode()


def test_claim_takes_the_messages_pending_time_when_it_carries_one(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    # A child's first message carries the store's clock read before its flow was enqueued
    # (no later than its pending score): the mark advances to it without reading the score.
    _, (child,) = enqueue(scripts, queue, 1)
    score = int(db.zscore(KEYS.queue_key(queue, "pending"), child) or 0)
    assert scripts.claim(queue, child, "a", LEASE, since=score - 5)[0] == "claimed"
    assert db.hget(KEYS.queue_key(queue, "marks"), "0") == str(score - 5).encode()
    assert db.zscore(KEYS.queue_key(queue, "pending"), child) is None


def test_extend_renews_running_jobs_and_holds_received_ones(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    _, (running, waiting, done) = enqueue(scripts, queue, 3)
    scripts.claim(queue, running, "r", 1000)
    before = db.zscore(KEYS.queue_key(queue, "active"), running)
    assert scripts.extend(queue, [running, done], LEASE, [waiting]) == 2
    assert db.zscore(KEYS.queue_key(queue, "active"), running) >= before + LEASE - 1000
    assert db.zscore(KEYS.queue_key(queue, "active"), done) is None  # never makes a job active
    assert db.zscore(KEYS.queue_key(queue, "reserved"), waiting) >= now_ms(db) + LEASE - 1000
    # The claim that starts a held job leaves its hold to the worker that made it: its next
    # extend ends it.
    scripts.claim(queue, waiting, "w", LEASE)
    assert db.zscore(KEYS.queue_key(queue, "reserved"), waiting) is not None
    assert scripts.extend(queue, [], LEASE, [], [waiting]) == 0  # nothing renewed
    assert db.zscore(KEYS.queue_key(queue, "reserved"), waiting) is None


def test_requeue_refuses_a_held_job_and_backs_off(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    _, (child,) = enqueue(scripts, queue, 1)
    pending, stall = KEYS.queue_key(queue, "pending"), 10_000
    db.zadd(pending, {child: now_ms(db) - stall - 1})
    db.zadd(KEYS.queue_key(queue, "reserved"), {child: now_ms(db) + LEASE})
    assert scripts.requeue(queue, child, stall, "pending") == ("held", None)
    db.delete(KEYS.queue_key(queue, "reserved"))
    assert scripts.requeue(queue, child, stall, "pending") == (
        "requeued",
        f"payload-{child}".encode(),
    )
    assert db.hget(KEYS.queue_key(queue, "counters"), "republished") == b"1"
    assert scripts.requeue(queue, child, stall, "pending")[0] == "fresh"  # re-scored
    # Once re-published, the job must wait twice as long before the next re-publish.
    db.zadd(pending, {child: now_ms(db) - int(1.5 * stall)})
    assert scripts.requeue(queue, child, stall, "pending")[0] == "fresh"
    db.zadd(pending, {child: now_ms(db) - 2 * stall - 1})
    assert scripts.requeue(queue, child, stall, "pending")[0] == "requeued"
    assert db.hget(KEYS.job_key(queue, child), "requeued") == b"2"


def test_requeue_of_a_lapsed_active_job_makes_it_pending(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    _, (child,) = enqueue(scripts, queue, 1)
    scripts.claim(queue, child, "gone", LEASE)
    assert scripts.requeue(queue, child, LEASE, "active", "gone")[0] == "fresh"  # lease live
    db.zadd(KEYS.queue_key(queue, "active"), {child: 1})
    assert scripts.requeue(queue, child, LEASE, "active", "other")[0] == "stale"
    assert scripts.requeue(queue, child, LEASE, "active", "gone")[0] == "requeued"
    assert db.hget(KEYS.job_key(queue, child), "state") == b"pending"
    assert zmembers(db, KEYS.queue_key(queue, "active")) == set()
    # The re-published delivery claims it as a first one; the lapsed holder's token is stale.
    assert scripts.claim(queue, child, "new", LEASE) == ("claimed", 2, "")


def test_drop_ends_the_lease_of_a_holder_known_dead(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    _, (child, other) = enqueue(scripts, queue, 2)
    scripts.claim(queue, child, "host|42|x", LEASE)
    assert scripts.drop(queue, child, "host|41|") == ("noop", None)  # another holder's
    assert scripts.drop(queue, child, "host|42|") == ("lapsed", None)
    assert db.zscore(KEYS.queue_key(queue, "active"), child) <= now_ms(db)
    assert scripts.claim(queue, child, "new", LEASE) == ("taken_over", 2, "host|42|x")
    assert scripts.drop(queue, child, "host|42|") == ("noop", None)  # claimed anew since

    # A duplicate was skipped while the holder looked alive: no message is left, so the job is
    # pending again and its payload handed out to re-publish.
    scripts.claim(queue, other, "host|7|x", LEASE)
    assert scripts.claim(queue, other, "dup", LEASE)[0] == "busy"
    assert scripts.drop(queue, other, "host|7|") == ("requeued", f"payload-{other}".encode())
    assert db.hget(KEYS.job_key(queue, other), "state") == b"pending"
    assert other in zmembers(db, KEYS.queue_key(queue, "pending"))
    assert db.hget(KEYS.queue_key(queue, "counters"), "republished") == b"1"


def test_hand_over_keeps_a_replaced_job_for_its_replacements_outcome(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, (child,) = enqueue(scripts, queue, 1)
    scripts.claim(queue, child, "t", LEASE)
    assert scripts.hand_over(queue, child, "other") == "stale"
    assert scripts.hand_over(queue, child, "t") == "handed_over"
    db.zadd(KEYS.queue_key(queue, "active"), {child: 1})  # even past its lease
    assert scripts.claim(queue, child, "dup", LEASE)[0] == "busy"  # the replacement holds it
    ref = ParentRef(parent, queue)
    assert (
        scripts.complete(queue, child, "t", ttl=TTL, is_parent=False, parent=ref, value=b"9")
        == "released"
    )


def test_a_renewal_leaves_a_job_handed_over_due_for_recovery(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    # A worker may still list a replaced request as running a moment after its body handed
    # the job over: its renewal must not put recovery's look at the replacement a lease later.
    _, (child, other) = enqueue(scripts, queue, 2)
    for job in (child, other):
        scripts.claim(queue, job, "t", LEASE)
    assert scripts.hand_over(queue, child, "t") == "handed_over"
    due = db.zscore(KEYS.queue_key(queue, "active"), child)
    assert due is not None and due <= now_ms(db)
    assert scripts.extend(queue, [child, other], 10 * LEASE) == 1  # the other job's alone
    assert db.zscore(KEYS.queue_key(queue, "active"), child) == due


def test_a_retry_is_pending_from_when_it_is_due(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    _, (child,) = enqueue(scripts, queue, 1)
    scripts.claim(queue, child, "t", LEASE)
    assert scripts.retry(queue, child, "t", 30_000) == "retried"
    assert db.zscore(KEYS.queue_key(queue, "pending"), child) >= now_ms(db) + 29_000


def test_a_retrys_delivery_supersedes_the_delivery_that_sent_it(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    # Celery publishes a retry before the retrying delivery has finished: the retry's claim
    # must not be taken for a duplicate of it.
    _, (child,) = enqueue(scripts, queue, 1)
    scripts.claim(queue, child, "first", LEASE)
    assert scripts.claim(queue, child, "copy", LEASE)[0] == "busy"
    assert scripts.claim(queue, child, "retry", LEASE, retries=1) == ("taken_over", 2, "first")
    assert scripts.retry(queue, child, "first") == "stale"  # the retry signal comes late
    assert scripts.claim(queue, child, "copy", LEASE, retries=1)[0] == "busy"


def test_each_script_is_its_file_with_every_include_expanded_once() -> None:
    for name in TRANSITIONS:
        source = load_source(name)
        assert "--- @include" not in source
        for piece in ("now_ms", "gate_ids", "not_holder", "expire_keys", "release_parent"):
            assert source.count(f"local function {piece}(") <= 1, (name, piece)
        if name != "lease_release":  # the one script that takes no job id
            assert "EMQKIND" in source, name
    fan_in = load_source("credit")
    assert fan_in.count("local function settle_child(") == 1
    assert fan_in.count("local function now_ms(") == 1  # included twice, written once


def test_a_claim_riding_with_an_outcome_lands_in_its_round_trip_after_it(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    """A batch's next child is claimed with the running child's completion, after it."""
    parent, (first, second) = enqueue(scripts, queue, 2)
    heard: list[object] = []
    assert scripts.claim(queue, first, "t1", LEASE)[0] == "claimed"
    scripts.claim_riding(queue, second, "t2", LEASE, heard.append, parent=parent)
    # A script that records no outcome carries no rider: the lease loop's renewal.
    scripts.extend(queue, [first], LEASE)
    assert heard == [] and db.hget(KEYS.job_key(queue, second), "state") == b"pending"
    ref = ParentRef(parent, queue)
    status = scripts.complete(queue, first, "t1", ttl=TTL, is_parent=False, parent=ref, value=b"1")
    assert status == "credited"
    assert heard == [("claimed", 1, "")]
    assert db.hget(KEYS.job_key(queue, second), "token") == b"t2"
    assert scripts.runner.unride() is None  # sent once: nothing left waiting


def test_a_rider_whose_round_trip_failed_is_heard_as_unknown_and_claimed_again(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    """The server lost its scripts (a restart): the outcome is run again as any script is,
    the rider is heard as None, and the claim made again with its token takes the job, as it
    would had the rider landed unanswered."""
    parent, (first, second) = enqueue(scripts, queue, 2)
    heard: list[object] = []
    assert scripts.claim(queue, first, "t1", LEASE)[0] == "claimed"
    scripts.claim_riding(queue, second, "t2", LEASE, heard.append, parent=parent)
    db.script_flush()
    ref = ParentRef(parent, queue)
    status = scripts.complete(queue, first, "t1", ttl=TTL, is_parent=False, parent=ref, value=b"1")
    assert status == "credited" and heard == [None]
    assert db.hget(KEYS.job_key(queue, second), "state") == b"pending"
    assert scripts.claim(queue, second, "t2", LEASE, parent=parent)[0] == "claimed"
    # Had it landed, the same token finds its own claim: busy under itself, which the worker's
    # claim (worker/claims.py) reads as claimed.
    assert scripts.claim(queue, second, "t2", LEASE, parent=parent) == ("busy", 1, "t2")


def test_a_claim_riding_with_reads_lands_in_their_round_trip_after_them(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    """A batch's first child is claimed with the read of the batch's rows: the reads see the
    row as it was, the claim lands after them; a rider the server cannot run (its scripts
    lost) is heard as an error, and the reads still answer."""
    parent, (first, second) = enqueue(scripts, queue, 2)
    heard: list[object] = []
    scripts.claim_riding(queue, first, "t1", LEASE, heard.append)  # no parent: not compared
    pipe = db.pipeline(transaction=False)
    pipe.hget(KEYS.job_key(queue, first), "state")
    assert scripts.runner.read_carrying(pipe) == [b"pending"]
    assert heard == [("claimed", 1, "")]
    assert db.hget(KEYS.job_key(queue, first), "token") == b"t1"
    assert scripts.runner.unride() is None
    db.script_flush()
    scripts.claim_riding(queue, second, "t2", LEASE, heard.append, parent=parent)
    pipe = db.pipeline(transaction=False)
    pipe.hget(KEYS.job_key(queue, second), "state")
    assert scripts.runner.read_carrying(pipe) == [b"pending"]
    assert heard[-1] is None and db.hget(KEYS.job_key(queue, second), "state") == b"pending"
    # With no rider waiting, the reads alone.
    pipe = db.pipeline(transaction=False)
    pipe.hget(KEYS.job_key(queue, first), "state")
    assert scripts.runner.read_carrying(pipe) == [b"active"]


def test_a_failure_for_an_unstarted_job_fails_a_pending_one_and_leaves_a_started_one(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    """A revoke its worker learns of while a batch's child waits its turn (fail.lua's
    ``unstarted``): a pending child fails; one already claimed is left as it was."""
    parent, (waiting, running) = enqueue(scripts, queue, 2)
    ref = ParentRef(parent, queue)
    assert scripts.claim(queue, running, "t1", LEASE)[0] == "claimed"
    before = db.hgetall(KEYS.job_key(queue, running))
    revoked = "TaskRevokedError: revoked"
    kwargs = {"ttl": TTL, "is_parent": False, "parent": ref, "unstarted": True}
    assert scripts.fail(queue, running, "", revoked, **kwargs)[0] == "stale"
    assert db.hgetall(KEYS.job_key(queue, running)) == before
    assert scripts.fail(queue, waiting, "", revoked, **kwargs)[0] == "parent_failed"
    assert db.hget(KEYS.job_key(queue, waiting), "state") == b"failed"
