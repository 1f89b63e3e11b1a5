"""retry, release and failed_children of a flow with thousands of failed or outstanding
children, a page at a time: the right outcome, and every command each sends bounded (SLOWLOG,
logging every command, read after each).

Real workers run the flows: the session's, or one started on a queue of the test's own.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_echomq import flow, get_state
from celery_echomq.errors import CursorError, ListingError
from celery_echomq.ops.pages import read_flow
from tests.helpers import KEYS, id_of, run, wait_for, with_id

pytestmark = pytest.mark.e2e

CHUNK = 1000  # echomq_chunk_size's default: what tests/proj.py runs with
# The most arguments a chunk's script call takes: a key and an id per child, and its own.
MOST_ARGS = 2 * CHUNK + 20
WHOLE = {b"HGETALL", b"HKEYS", b"HVALS", b"SMEMBERS", b"SUNION", b"SINTER"}


def commands(store: redis.Redis, run: Callable[[], Any]) -> tuple[Any, list[list[bytes]]]:
    """What ``run()`` returns, and every command the store saw meanwhile (from any client),
    each as its words (SLOWLOG keeps 32: the rest counted as ``(N more arguments)``)."""
    before = store.config_get("slowlog-*")
    store.config_set("slowlog-log-slower-than", 0)
    store.config_set("slowlog-max-len", 200_000)
    store.slowlog_reset()
    try:
        out = run()
        entries = store.slowlog_get(200_000)
    finally:
        for name, value in before.items():
            store.config_set(name, value)
    seen = []
    for entry in entries:
        words = entry["command"].split(b" ")
        more = re.search(rb"\.\.\. \((\d+) more arguments\)", entry["command"])
        if more:
            words = words[:31] + [b"?"] * int(more.group(1))
        seen.append(words)
    return out, seen


def assert_bounded(seen: list[list[bytes]], marker: str, small: tuple[str, ...] = ()) -> None:
    """No command that names ``marker`` (a flow's id, or a queue of the test's own: a chunk's
    script call names its parent past the 32 words SLOWLOG keeps) reads a whole flow-sized
    key, and none takes more than a chunk: LRANGE spans, HSCAN counts, a script call's
    arguments. ``small``: keys known to hold at most a chunk (a released parent's values,
    which its dispatch hands out whole when there are no more than a chunk of them: see
    hand_out.lua)."""
    mine = [w for w in seen if any(marker.encode() in word for word in w)]
    assert mine, "no command of this flow was seen"
    for words in mine:
        name = words[0].upper()
        assert name not in WHOLE or words[1].decode() in small, words[:3]
        if name == b"LRANGE":
            start, stop = int(words[2]), int(words[3])
            assert stop >= 0 and stop - start + 1 <= CHUNK, words
        if name == b"HSCAN" and b"COUNT" in [w.upper() for w in words]:
            at = [w.upper() for w in words].index(b"COUNT")
            assert int(words[at + 1]) <= CHUNK, words
        if name in (b"EVALSHA", b"EVAL"):
            assert len(words) <= MOST_ARGS, (words[:3], len(words))


@pytest.fixture
def flag(store: redis.Redis) -> Iterator[str]:
    name = f"test:flag:{uuid.uuid4().hex}"
    yield name
    store.delete(name)


@pytest.mark.timeout(900)
def test_retry_of_2100_failed_children_reads_and_retries_them_a_chunk_at_a_time(
    proj: Any, worker: Any, store: redis.Redis, flag: str
) -> None:
    n, bad = 2500, 2100  # more failed children than two chunks
    sigs = [
        with_id(proj.flaky.s(i, flag)) if i % 25 < 21 else with_id(proj.add.s(i, 0))
        for i in range(n)
    ]
    failing = {id_of(s) for s in sigs if s.task == proj.flaky.name}
    assert len(failing) == bad
    res = flow(proj.tsum.s(), sigs).apply_async()
    row = KEYS.job_key("celery", res.id)
    # Every child runs (the flow failed at the first failure; the rest are recorded).
    wait_for(lambda: store.hlen(f"{row}:failures") == bad, timeout=600)
    wait_for(lambda: store.hlen(f"{row}:processed") == n - bad, timeout=120)
    assert store.hget(row, "state") == b"failed" and store.hexists(row, "head")

    # failed_children: a page at a time, every one once, each with its error.
    pages, cursor, calls = {}, None, 0
    while True:
        page, cursor = res.failed_children(cursor=cursor, count=400)
        calls += 1
        assert len(page) <= 400 and not set(page) & set(pages)
        pages.update(page)
        if cursor is None:
            break
    assert set(pages) == failing and calls >= bad // 400
    assert {e for e in pages.values()} == {f"ValueError: flag {flag} not set"}
    whole, seen = commands(store, res.failed_children)
    assert whole == pages
    assert_bounded(seen, res.id)
    assert not [w for w in seen if w[0].upper() == b"HGET" and w[-1] == b"payload"]

    store.set(flag, 1)
    outcome, seen = commands(store, res.retry)
    assert set(outcome.republished) == failing and len(outcome.republished) == bad
    assert outcome.held == (res.id,)
    assert_bounded(seen, res.id)
    calls = [w for w in seen if w[0].upper() == b"EVALSHA" and res.id.encode() in w]
    assert len(calls) >= 3  # three chunks of failed children, one script call each at least
    assert res.get(timeout=600) == sum(range(n))
    assert read_flow(get_state(proj.app), res.id, only="failed").children == ()
    assert res.failed_children() == {}


def test_failed_children_pages_the_same_failures_eagerly_and_on_a_worker(
    proj: Any,
    how: str,
) -> None:
    removed = [with_id(proj.boom.s(f"r{i}").set(parent_policy="remove")) for i in range(3)]
    ignored = [with_id(proj.boom.s(f"i{i}").set(parent_policy="ignore")) for i in range(2)]
    sigs = [with_id(proj.add.s(1, 1)), *removed, *ignored, with_id(proj.add.s(2, 2))]
    f = flow(proj.tsum.s(), sigs)
    f.freeze()
    res = run(f, how)
    assert res.get(timeout=60) == 6
    everything = res.failed_children()
    assert everything == {
        **{id_of(s): f"ValueError: r{i}" for i, s in enumerate(removed)},
        **{id_of(s): f"ValueError: i{i}" for i, s in enumerate(ignored)},
    }
    seen: dict[str, str] = {}
    cursor, pages = None, 0
    while True:
        page, cursor = res.failed_children(cursor=cursor, count=2)
        assert 1 <= len(page) <= 2 and not set(page) & set(seen)
        seen.update(page)
        pages += 1
        if cursor is None:
            break
    assert seen == everything and pages == 3
    with pytest.raises(CursorError):
        res.failed_children(cursor="nope", count=2)
    with pytest.raises(CursorError):
        res.failed_children(cursor="1")  # a cursor without a page size
    with pytest.raises(ListingError):
        res.failed_children(count=0)


def _held_flow(proj: Any, own_queue: Any, n: int) -> tuple[Any, str, list[Any]]:
    queue = own_queue("release")
    sigs = [with_id(proj.add.s(i, 1)) for i in range(n)]
    res = flow(proj.tsum.s(), sigs).apply_async(queue=queue)
    return res, queue, sigs


@pytest.mark.timeout(600)
def test_release_reads_the_counts_alone_and_revoke_stops_2500_children_a_chunk_at_a_time(
    proj: Any, own_queue: Any, start_worker: Any, store: redis.Redis
) -> None:
    # No worker on the flows' queue until each is released: every child stays pending.
    n = 2500
    plain, queue, _ = _held_flow(proj, own_queue, n)
    outcome, seen = commands(store, plain.release)
    assert (outcome.values, outcome.left, outcome.outstanding) == (0, n, ())
    assert outcome.state == "pending"
    assert_bounded(seen, "{" + queue + "}", small=(KEYS.flow_keys(queue, plain.id)[1],))
    # Nothing but the parent's row and counts read: no child's row, no page of the index.
    assert not [w for w in seen if w[0].upper() == b"LRANGE"]

    revoked, other, sigs = _held_flow(proj, own_queue, n)
    outcome, seen = commands(store, lambda: revoked.release(revoke=True))
    ids = [id_of(s) for s in sigs]
    assert outcome.left == n and sorted(outcome.revoked) == sorted(ids)
    assert sorted(outcome.outstanding) == sorted(ids)
    assert_bounded(seen, "{" + other + "}", small=(KEYS.flow_keys(other, revoked.id)[1],))
    mark = "{" + other + "}"
    scripts = [w for w in seen if w[0].upper() == b"EVALSHA" and any(mark in t.decode() for t in w)]
    assert len(scripts) >= 3  # the release with a chunk, then cancel_elsewhere per chunk
    pipe = store.pipeline(transaction=False)
    for cid in ids:
        pipe.hget(KEYS.job_key(other, cid), "state")
    assert set(pipe.execute()) == {b"cancelled"}
    # Each counted as cut, by the release's first chunk and each cancel_elsewhere after it.
    deps = revoked.dependencies()
    assert deps == (0, 0, 0, 0) and deps.cut == n

    start_worker(queues=f"{queue},{other}", concurrency=2)
    # Released with the values so far (none): each parent runs with an empty list.
    assert plain.get(timeout=300) == 0
    assert revoked.get(timeout=300) == 0
