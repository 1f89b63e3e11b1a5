"""Redis Cluster as the flow store: real workers, a real three-master cluster.

The broker and the result backend stay on the test Redis; only the flow store
(``echomq_redis_url``) is the cluster, in the workers and in this process. Each test routes
its flows to queues of this module alone, chosen so that the three queues' hash tags sit on
three different masters: what one queue's keys share is a slot, and a flow across queues
really crosses nodes.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import pytest
import redis
from redis.cluster import RedisCluster as _RedisCluster

from celery_echomq import FlowFailed, flow, get_state
from celery_echomq.store.state import _ATTR, EchoMQ, make_client
from tests.helpers import KEYS, ROOT, Env, Worker, worker_pair

TIMEOUT = 90
# redis-py's cluster client, as make_client returns it for a redis+cluster:// URL (generic
# for the type checker only).
if TYPE_CHECKING:
    RedisCluster = _RedisCluster[bytes]
else:
    RedisCluster = _RedisCluster


class Queues(NamedTuple):
    parent: str  # where the flows' parents (and same-queue children) go
    a: str
    b: str


def node_of(client: RedisCluster, key: str) -> int:
    """The port of the one master that holds ``key``, asked of every master directly.

    CLUSTER KEYSLOT gives the key's slot; CLUSTER GETKEYSINSLOT on each master lists the keys
    that master really stores in that slot (a master that does not own the slot lists none).
    """
    primaries = client.get_primaries()
    holders = []
    for node in primaries:
        direct = redis.Redis(host=node.host, port=node.port)
        try:
            slot = int(direct.execute_command("CLUSTER", "KEYSLOT", key))
            if key.encode() in direct.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10_000):
                holders.append(int(node.port))
        finally:
            direct.close()
    assert len(holders) == 1, f"{key} is held by {holders} of {len(primaries)} masters"
    return holders[0]


def tag_node(client: RedisCluster, queue: str) -> int:
    """The master that owns the slot of ``queue``'s hash tag (where its keys must go)."""
    node = client.get_node_from_key(KEYS.queue_key(queue, "pending"))
    assert node is not None
    return int(node.port)


@pytest.fixture(scope="module")
def cluster(redis_cluster: str) -> Iterator[RedisCluster]:
    client = make_client(redis_cluster)
    assert isinstance(client, _RedisCluster)
    yield client
    client.close()


@pytest.fixture(scope="module")
def queues(cluster: RedisCluster) -> Queues:
    """Three fresh queue names whose hash tags map to three different masters."""
    chosen: dict[int, str] = {}
    for _ in range(500):
        name = "cl" + uuid.uuid4().hex[:8]
        chosen.setdefault(tag_node(cluster, name), name)
        if len(chosen) == 3:
            return Queues(*chosen.values())
    raise AssertionError(f"no queue names on three masters: {chosen}")


@pytest.fixture(scope="module")
def cluster_workers(
    env: Env, proj: Any, redis_cluster: str, queues: Queues
) -> Iterator[tuple[Worker, Worker]]:
    """A worker on the parents' queue and one on the two others, both storing in the cluster."""
    first, second = worker_pair(
        env,
        queues.parent,
        f"{queues.a},{queues.b}",
        queues.parent,
        {"ECHOMQ_T_STORE": redis_cluster},
    )
    yield first, second
    second.stop()
    first.stop()


@pytest.fixture
def on_cluster(proj: Any, redis_cluster: str, cluster_workers: Any) -> Iterator[EchoMQ]:
    """This process's app stores its flows in the cluster for one test, then goes back."""
    app = proj.app
    saved = get_state(app)
    state = EchoMQ(app, dataclasses.replace(saved.settings, redis_url=redis_cluster))
    setattr(app, _ATTR, state)
    try:
        yield state
    finally:
        setattr(app, _ATTR, saved)
        if state._client is not None:
            state._client.close()


def test_cluster_queues_sit_on_three_different_masters(
    cluster: RedisCluster, queues: Queues
) -> None:
    nodes = {tag_node(cluster, q) for q in queues}
    assert len(nodes) == 3
    assert len(cluster.get_primaries()) == 3


def test_same_queue_flow_on_cluster(
    proj: Any, on_cluster: EchoMQ, cluster: RedisCluster, queues: Queues
) -> None:
    res = flow(proj.tsum.s(), [proj.add.s(i, i) for i in range(10)]).apply_async(
        queue=queues.parent
    )
    assert res.get(timeout=TIMEOUT) == 90
    assert res.dependencies() == (0, 10, 0, 0)
    assert sorted(res.children_values().values()) == [2 * i for i in range(10)]
    # Every key of the flow is on its queue's master.
    keys = [KEYS.job_key(queues.parent, res.id), f"{KEYS.job_key(queues.parent, res.id)}:processed"]
    keys += [KEYS.job_key(queues.parent, cid) for cid in res.children_values()]
    assert {node_of(cluster, key) for key in keys} == {tag_node(cluster, queues.parent)}


def test_a_deadline_fires_on_cluster(
    proj: Any, on_cluster: EchoMQ, cluster: RedisCluster, queues: Queues
) -> None:
    """The workers' deadline poller reads the cluster (TIME, then every queue's index): the
    flow is released at its deadline with the values so far, long before its slow child."""
    kids = [proj.add.s(1, 1), proj.sleep_then.s(5, 30)]
    res = flow(proj.tsum.s(), kids, deadline=1.5, on_deadline="continue").apply_async(
        queue=queues.parent
    )
    assert res.get(timeout=20) == 2
    row = cluster.hgetall(KEYS.job_key(queues.parent, res.id))
    assert row[b"released_by"] == b"deadline"


def test_cross_queue_flow_on_cluster_credits_across_nodes(
    proj: Any, on_cluster: EchoMQ, cluster: RedisCluster, queues: Queues
) -> None:
    a = proj.add.s(1, 1).set(queue=queues.a)
    b = proj.add.s(2, 2).set(queue=queues.b)
    c = proj.add.s(3, 3)  # the parent's queue, from apply_async
    f = flow(proj.tsum.s(), [a, b, c])
    res = f.freeze()
    f.apply_async(queue=queues.parent)
    assert res.get(timeout=TIMEOUT) == 12
    assert res.dependencies() == (0, 3, 0, 0)
    ida, idb, idc = (sig.options["task_id"] for sig in (a, b, c))
    assert res.children_values() == {ida: 2, idb: 4, idc: 6}
    rows = {
        queues.a: KEYS.job_key(queues.a, ida),
        queues.b: KEYS.job_key(queues.b, idb),
        queues.parent: KEYS.job_key(queues.parent, idc),
    }
    held = {queue: node_of(cluster, key) for queue, key in rows.items()}
    assert held == {queue: tag_node(cluster, queue) for queue in rows}
    assert len(set(held.values())) == 3
    assert node_of(cluster, KEYS.job_key(queues.parent, res.id)) == held[queues.parent]
    # The two children of other nodes were credited once each on the parent's node.
    assert cluster.hgetall(KEYS.settled_key(queues.parent, res.id)) == {
        ida.encode(): b"done",
        idb.encode(): b"done",
    }
    assert cluster.zcard(KEYS.queue_key(queues.a, "outbox")) == 0
    assert cluster.zcard(KEYS.queue_key(queues.b, "outbox")) == 0
    assert cluster.zscore(KEYS.queue_key(queues.parent, "open"), res.id) is None


def test_chunked_flow_on_cluster(
    proj: Any, on_cluster: EchoMQ, cluster: RedisCluster, queues: Queues
) -> None:
    on_cluster.settings = dataclasses.replace(on_cluster.settings, chunk_size=7)
    n = 3 * 7 + 2
    children = [proj.add.s(i, 0).set(queue=(queues.a, queues.b)[i % 2]) for i in range(n)]
    res = flow(proj.tsum.s(), children).apply_async(queue=queues.parent)
    assert res.get(timeout=TIMEOUT) == sum(range(n))
    assert res.dependencies() == (0, n, 0, 0)
    assert len(cluster.hgetall(KEYS.settled_key(queues.parent, res.id))) == n


def test_nested_flow_on_cluster(
    proj: Any, on_cluster: EchoMQ, cluster: RedisCluster, queues: Queues
) -> None:
    # The inner flow's parent lives on queue a; its children on b and on the outer's queue.
    inner = flow(
        proj.tsum.s().set(queue=queues.a),
        [proj.add.s(1, 1).set(queue=queues.b), proj.add.s(2, 2).set(queue=queues.parent)],
    )
    last = proj.add.s(5, 5)
    f = flow(proj.tsum.s(), [inner, last])
    res = f.freeze()
    f.apply_async(queue=queues.parent)
    inner_id = inner.parent.options["task_id"]
    assert res.get(timeout=TIMEOUT) == 16
    assert res.children_values() == {inner_id: 6, last.options["task_id"]: 10}
    assert res.dependencies() == (0, 2, 0, 0)
    assert get_state(proj.app).client is on_cluster.client
    inner_res = proj.app.AsyncResult(inner_id)
    assert inner_res.get(timeout=TIMEOUT) == 6
    assert node_of(cluster, f"{KEYS.job_key(queues.a, inner_id)}:processed") == tag_node(
        cluster, queues.a
    )


def test_ignore_policy_on_cluster(proj: Any, on_cluster: EchoMQ, queues: Queues) -> None:
    far = proj.boom.s("far").set(queue=queues.a, parent_policy="ignore")
    near = proj.boom.s("near").set(parent_policy="ignore")
    f = flow(proj.tsum.s(), [far, near, proj.add.s(2, 2).set(queue=queues.b)])
    res = f.freeze()
    f.apply_async(queue=queues.parent)
    assert res.get(timeout=TIMEOUT) == 4
    assert res.ignored_failures() == {
        far.options["task_id"]: "ValueError: far",
        near.options["task_id"]: "ValueError: near",
    }
    assert res.dependencies() == (0, 1, 0, 2)
    assert res.failed_children() == res.ignored_failures()


def test_fail_policy_on_cluster(proj: Any, on_cluster: EchoMQ, queues: Queues) -> None:
    failing = proj.boom.s("far").set(queue=queues.b)
    f = flow(proj.tsum.s(), [failing, proj.add.s(2, 2)], policy="fail")
    res = f.freeze()
    f.apply_async(queue=queues.parent)
    with pytest.raises(FlowFailed) as info:
        res.get(timeout=TIMEOUT)
    assert info.value.child_id == failing.options["task_id"]
    assert info.value.error == "ValueError: far"

    # The same on one slot: the one-script path (enqueue_flow).
    same = proj.boom.s("near")
    f2 = flow(proj.tsum.s(), [proj.add.s(1, 1), same])
    res2 = f2.freeze()
    f2.apply_async(queue=queues.parent)
    with pytest.raises(FlowFailed) as info2:
        res2.get(timeout=TIMEOUT)
    assert info2.value.child_id == same.options["task_id"]


def test_cli_show_stats_and_forget_on_cluster(
    proj: Any,
    env: Env,
    redis_cluster: str,
    on_cluster: EchoMQ,
    cluster: RedisCluster,
    queues: Queues,
) -> None:
    """`celery -A proj echomq ...` with the cluster as the store, as a user runs it."""
    a = proj.add.s(1, 1).set(queue=queues.a)
    f = flow(proj.tsum.s(), [a, proj.add.s(2, 2)])
    res = f.freeze()
    f.apply_async(queue=queues.parent)
    assert res.get(timeout=TIMEOUT) == 6

    def run(*args: str) -> Any:
        done = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.proj", "echomq", *args, "--json"],
            cwd=ROOT, env=env.environ(ECHOMQ_T_STORE=redis_cluster),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    tree = run("show", res.id)
    assert (tree["state"], tree["queue"], tree["value"]) == ("done", queues.parent, 6)
    assert {(c["queue"], c["state"], c["value"]) for c in tree["children"]} == {
        (queues.a, "done", 2),
        (queues.parent, "done", 4),
    }
    # A recovery pass reads the cluster (TIME on its own, not in a pipeline): nothing is due.
    assert run("recover") == {"repairs": []}
    listed = {row["queue"] for row in run("stats")["queues"]}
    assert {queues.parent, queues.a} <= listed
    forgotten = run("forget", res.id)
    assert f"emq:{{{queues.a}}}:{a.options['task_id']}" in forgotten["keys"]
    gone = [KEYS.job_key(queues.parent, res.id), f"emq:{{{queues.a}}}:{a.options['task_id']}"]
    assert [cluster.hgetall(key) for key in gone] == [{}, {}]


def test_children_added_across_masters_while_the_flow_runs(
    proj: Any, on_cluster: EchoMQ, cluster: RedisCluster, queues: Queues
) -> None:
    # The sleeping child keeps the parent held while this process adds a child (the workers'
    # store is the cluster, where the tests' gates do not live).
    children = [proj.spawner.s(1, [2, 3], queue=queues.a), proj.sleep_then.s(9, 3)]
    res = flow(proj.tsum.s(), children).apply_async(queue=queues.parent)
    outside = res.add_children([proj.add.s(4, 0).set(queue=queues.b)])
    assert res.get(timeout=TIMEOUT) == 1 + 9 + 2 + 3 + 4
    assert res.dependencies() == (0, 5, 0, 0)
    assert sorted(res.children_values().values()) == [1, 2, 3, 4, 9]
    (bid,) = outside
    assert node_of(cluster, KEYS.job_key(queues.b, bid)) == tag_node(cluster, queues.b)
    settled = cluster.hgetall(KEYS.settled_key(queues.parent, res.id))
    assert len(settled) == 3 and settled[bid.encode()] == b"done"
    assert cluster.zcard(KEYS.queue_key(queues.parent, "adding")) == 0


def test_a_job_shared_by_parents_on_three_masters_is_credited_to_each_once(
    proj: Any, on_cluster: EchoMQ, cluster: RedisCluster, queues: Queues
) -> None:
    """on_exists="join" on a cluster: the shared job on one master, its parents on the two
    others, one joined while it may still run and one once it is done."""
    shared = proj.add.s(4, 4).set(queue=queues.a)
    sid = shared.freeze().id
    first = flow(proj.tsum.s(), [shared]).apply_async(queue=queues.parent)
    again = proj.add.s(4, 4).set(task_id=sid, queue=queues.a)
    second = flow(proj.tsum.s(), [again, proj.add.s(1, 1)]).apply_async(
        queue=queues.b, on_exists="join"
    )
    assert first.get(timeout=TIMEOUT) == 8
    assert second.get(timeout=TIMEOUT) == 10
    third = flow(proj.tsum.s(), [again.clone()]).apply_async(queue=queues.parent, on_exists="join")
    assert third.get(timeout=TIMEOUT) == 8
    edges = cluster.hgetall(on_cluster.keys.parents_key(queues.a, sid))
    assert set(edges) == {second.id.encode(), third.id.encode()}
    assert second.children_values()[sid] == 8 and third.dependencies() == (0, 1, 0, 0)
