"""A flow's fan-in with and without a reducer (``flow(..., reduce="sum")``), at N children:
what the parent's message weighs, what the store keeps per child, and the longest store
command of the release. The flow is built and credited by the scripts alone, as a worker
calls them (open/add/seal, then a claim and a completion per child): no worker runs, since
what is measured is the store's side and the parent's message, which a child's body does not
change.

    python3 dev.py bench reduce                    # 100,000 children
    python3 dev.py bench reduce --children 1000000
    python3 dev.py bench reduce --children 1000000 --only sum   # one mode

One private redis-server on loopback per mode. Reported per mode: the parent's first
argument as its message would carry it (JSON bytes: the list of N values, or the
accumulator), the store's used_memory growth per child from before the enqueue to the
released parent, and the longest commands (SLOWLOG, 1 ms and more) from the first
completion to the parent's values read (the plain flow's host reads them in chunks of 1000:
HSCAN).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import redis

from celery_echomq.embedded import RedisServer
from celery_echomq.store.keyspace import Keyspace, new_job_id
from celery_echomq.store.replies import Status
from celery_echomq.store.scripts import ParentRef, Scripts

QUEUE = "reduce"
CHUNK = 1000
VALUE = b"7"  # each child's value, as a JSON number


def measure(children: int, reducer: str) -> dict[str, Any]:
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url(0))
        scripts = Scripts(client, Keyspace("emq"))
        parent = new_job_id()
        kids = [new_job_id() for _ in range(children)]
        spec = json.dumps([reducer]) if reducer else ""
        ref = ParentRef(parent, QUEUE, "", spec)
        before = int(client.info("memory")["used_memory"])
        scripts.open_flow(QUEUE, parent, b'{"task": "parent", "args": []}', children, "fail")
        for start in range(0, children, CHUNK):
            part = kids[start : start + CHUNK]
            scripts.add_children(QUEUE, ref, [(k, b'{"task": "child"}', "") for k in part])
        assert scripts.seal_flow(QUEUE, parent) is Status.SEALED
        client.config_set("slowlog-log-slower-than", 1000)
        client.slowlog_reset()
        started = time.monotonic()
        handed = None
        for kid in kids:
            token = "t"
            scripts.claim(QUEUE, kid, token, 600_000)
            status, _, got, _ = scripts.complete_settling(
                QUEUE,
                kid,
                token,
                ttl=3600,
                is_parent=False,
                parent=ref,
                value=VALUE,
                inline_max=CHUNK,
            )
            if status is Status.RELEASED:
                handed = got
        credited = time.monotonic() - started
        assert handed is not None
        if reducer:
            acc = client.hget(scripts.keys.job_key(QUEUE, parent), "acc")
            argument = acc or b""
        else:
            values = [json.loads(v) for v in handed[1].values()]
            argument = json.dumps(values).encode()
        after = int(client.info("memory")["used_memory"])
        slow = sorted(
            (e["duration"] / 1000, e["command"].split(b" ")[0].decode())
            for e in client.slowlog_get(128)
        )
        return {
            "children": children,
            "reducer": reducer or "(the list of values)",
            "parent_argument_bytes": len(argument),
            "store_bytes_per_child": round((after - before) / children),
            "longest_ms": slow[-3:][::-1] if slow else "none of 1 ms or more",
            "credit_s": round(credited, 1),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--children", type=int, default=100_000)
    parser.add_argument(
        "--only", choices=("list", "sum"), help="one mode: the plain list of values, or sum"
    )
    args = parser.parse_args(argv)
    for reducer in ("", "sum"):
        if args.only and args.only != (reducer or "list"):
            continue
        print(json.dumps(measure(args.children, reducer)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
