"""Each EchoMQ script on a real Redis, without Celery: the transitions and their guards."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from celery_echomq import KindError
from celery_echomq.errors import FlowExistsError
from celery_echomq.keyspace import Keyspace
from celery_echomq.scripts import ParentRef, Scripts

from .conftest import Env

TTL = 600
LEASE = 60_000


@pytest.fixture
def db(env: Env) -> Iterator[redis.Redis]:
    # A database of its own, so DBSIZE speaks of this test alone.
    client = redis.Redis.from_url(f"{env.base}/14")
    client.flushdb()
    yield client
    client.flushdb()


@pytest.fixture
def queue() -> str:
    return "q" + uuid.uuid4().hex[:8]


@pytest.fixture
def scripts(db: redis.Redis) -> Scripts:
    return Scripts(db, Keyspace("emq"))


def jid() -> str:
    return "JOB" + uuid.uuid4().hex


def enqueue(scripts: Scripts, queue: str, n: int) -> tuple[str, list[str]]:
    parent = jid()
    children = [jid() for _ in range(n)]
    scripts.enqueue_flow(queue, parent, b"parent", [(c, f"payload-{c}".encode()) for c in children])
    return parent, children


def run_child(scripts: Scripts, queue: str, parent: str, child: str, value: bytes) -> str:
    token = uuid.uuid4().hex
    assert scripts.claim(queue, child, token, LEASE)[0] == "claimed"
    return scripts.complete(
        queue, child, token, ttl=TTL, is_parent=False, parent=ParentRef(parent, queue), value=value
    )


def zmembers(db: redis.Redis, key: str) -> set[str]:
    return {m.decode() for m in db.zrange(key, 0, -1)}


def test_enqueue_flow_holds_the_parent_and_makes_children_claimable(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, children = enqueue(scripts, queue, 3)
    row = db.hgetall(f"emq:{{{queue}}}:{parent}")
    assert row[b"state"] == b"awaiting_children"
    assert row[b"payload"] == b"parent"
    assert db.get(f"emq:{{{queue}}}:{parent}:dependencies") == b"3"
    assert zmembers(db, f"emq:{{{queue}}}:pending") == set(children)  # parent in no set
    for child in children:
        crow = db.hgetall(f"emq:{{{queue}}}:{child}")
        assert crow[b"state"] == b"pending"
        assert crow[b"attempts"] == b"0"
        assert crow[b"parent"] == parent.encode()
        assert crow[b"payload"] == f"payload-{child}".encode()
    assert not any(parent.encode() in k for k in db.keys("*:active"))


@pytest.mark.parametrize("bad", ["parent", "child"])
def test_emqkind_refuses_before_any_write(
    db: redis.Redis, scripts: Scripts, queue: str, bad: str
) -> None:
    # Call the raw script (the host gate would refuse first) to show the second wall holds.
    keyspace = Keyspace("emq")
    parent = "XYZ1" if bad == "parent" else jid()
    children = [jid(), "NOTAJOB" if bad == "child" else jid()]
    keys = [
        f"emq:{{{queue}}}:{parent}",
        f"emq:{{{queue}}}:{parent}:dependencies",
        keyspace.queue_key(queue, "pending"),
        *(f"emq:{{{queue}}}:{c}" for c in children),
    ]
    argv = [parent, "p", "2", children[0], "a", children[1], "b"]
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
    ]:
        with pytest.raises(KindError):
            scripts._run(name, ["emq:{q}:x"] * 3, argv)
    assert db.dbsize() == 0


def test_existing_parent_is_refused_and_nothing_changes(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, _ = enqueue(scripts, queue, 2)
    before = {k: db.dump(k) for k in db.keys("*")}
    with pytest.raises(FlowExistsError, match=parent):
        scripts.enqueue_flow(queue, parent, b"other", [(jid(), b"x")])
    assert {k: db.dump(k) for k in db.keys("*")} == before


def test_existing_child_is_refused_and_nothing_changes(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    _, children = enqueue(scripts, queue, 2)
    before = {k: db.dump(k) for k in db.keys("*")}
    with pytest.raises(FlowExistsError, match=children[1]):
        scripts.enqueue_flow(queue, jid(), b"other", [(jid(), b"x"), (children[1], b"y")])
    assert {k: db.dump(k) for k in db.keys("*")} == before


def test_claim_moves_pending_to_active_with_a_new_token(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    _, (child,) = enqueue(scripts, queue, 1)
    assert scripts.claim(queue, child, "t1", LEASE) == ("claimed", 1, "")
    assert zmembers(db, f"emq:{{{queue}}}:pending") == set()
    assert zmembers(db, f"emq:{{{queue}}}:active") == {child}
    # A second delivery while t1's lease is live is a duplicate: nothing changes but the count.
    assert scripts.claim(queue, child, "t2", LEASE) == ("busy", 1, "t1")
    assert db.hget(f"emq:{{{queue}}}:{child}", "token") == b"t1"
    assert db.hget(f"emq:{{{queue}}}:counters", "duplicates_skipped") == b"1"
    # Once the holder is known dead, a redelivery takes over with a new token; the old token
    # is stale from now on.
    assert scripts.claim(queue, child, "t2", LEASE, force=True) == ("taken_over", 2, "t1")
    assert db.hget(f"emq:{{{queue}}}:{child}", "token") == b"t2"
    # So does one after the lease lapsed.
    db.zadd(f"emq:{{{queue}}}:active", {child: 1})
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
    assert db.get(f"emq:{{{queue}}}:{parent}:dependencies") == b"1"
    assert db.hgetall(f"emq:{{{queue}}}:{parent}:processed") == {child.encode(): b"1"}


def test_release_happens_exactly_at_zero(db: redis.Redis, scripts: Scripts, queue: str) -> None:
    parent, children = enqueue(scripts, queue, 3)
    pending = f"emq:{{{queue}}}:pending"
    statuses = []
    for i, child in enumerate(children):
        statuses.append(run_child(scripts, queue, parent, child, str(i).encode()))
        held = db.hget(f"emq:{{{queue}}}:{parent}", "state")
        assert (parent in zmembers(db, pending)) == (i == 2)
        assert held == (b"pending" if i == 2 else b"awaiting_children")
    assert statuses == ["credited", "credited", "released"]
    assert db.get(f"emq:{{{queue}}}:{parent}:dependencies") == b"0"


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
    assert db.hget(f"emq:{{{queue}}}:{child}", "state") == b"pending"
    assert zmembers(db, f"emq:{{{queue}}}:pending") == {child}
    assert zmembers(db, f"emq:{{{queue}}}:active") == set()
    assert scripts.claim(queue, child, "t2", LEASE) == ("claimed", 2, "")


def test_finished_rows_expire_and_sets_are_trimmed(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent, children = enqueue(scripts, queue, 2)
    for child in children:
        run_child(scripts, queue, parent, child, b"1")
    for child in children:
        assert 0 < db.ttl(f"emq:{{{queue}}}:{child}") <= TTL
    scripts.dispatch(queue, parent)
    scripts.claim(queue, parent, "p", LEASE)
    assert (
        scripts.complete(queue, parent, "p", ttl=TTL, is_parent=True, parent=None, value=b"2")
        == "done"
    )
    for suffix in ("", ":dependencies", ":processed"):
        assert 0 < db.ttl(f"emq:{{{queue}}}:{parent}{suffix}") <= TTL
    assert zmembers(db, f"emq:{{{queue}}}:pending") == set()
    assert zmembers(db, f"emq:{{{queue}}}:active") == set()


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
    assert db.zcard(f"emq:{{{queue}}}:pending") == 1000
    assert db.get(f"emq:{{{queue}}}:{parent}:dependencies") == b"1000"
    # A clash in the last slice is found, and nothing of the new flow is written.
    before = db.dbsize()
    clash = [(jid(), b"x") for _ in range(999)] + [(children[-1], b"y")]
    with pytest.raises(FlowExistsError, match=children[-1]):
        scripts.enqueue_flow(queue, jid(), b"p", clash)
    assert db.dbsize() == before


def test_chunked_path_open_add_seal_and_a_repeated_add_writes_nothing(
    db: redis.Redis, scripts: Scripts, queue: str
) -> None:
    parent = jid()
    children = [(jid(), b"c", "") for _ in range(3)]
    assert scripts.open_flow(queue, parent, b"p", 3, "fail") == 4  # N + 1 until sealed
    ref = ParentRef(parent, queue)
    assert scripts.add_children(queue, ref, children[:2]) == 2
    assert scripts.add_children(queue, ref, children) == 1  # the first two exist: skipped
    assert db.zcard(f"emq:{{{queue}}}:pending") == 3
    # Every child completes before the seal: the extra unit still holds the parent.
    for cid, _, _ in children:
        assert run_child(scripts, queue, parent, cid, b"1") == "credited"
    assert db.hget(f"emq:{{{queue}}}:{parent}", "state") == b"awaiting_children"
    assert scripts.seal_flow(queue, parent) == "released"
    assert scripts.seal_flow(queue, parent) == "noop"
    # Another flow cannot add a row that belongs to this one.
    with pytest.raises(FlowExistsError):
        scripts.add_children(queue, ParentRef(jid(), queue), children[:1])
