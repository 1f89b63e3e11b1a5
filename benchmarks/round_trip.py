"""What one round trip costs redis-server's CPU, apart from the command it carries.

    python3 dev.py bench round-trip              # 3 rounds of 3,000 calls each way

On a private redis-server, the same calls sent one at a time (a reply awaited before the next
is sent, as a worker's claim or completion is) and then pipelined (all written, then every
reply read), reading the server's CPU (``INFO cpu``: used_cpu_user + used_cpu_sys) around
each. Two calls: a PING, and an EVALSHA of a script running five commands on a job-sized row
(about what the claim script does). The difference between the two ways is the cost of the
round trip itself: the server waking in epoll_wait, reading one request, writing one reply
(the loopback's TCP work on both ends is charged to the writer), and going back to sleep.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import redis
from measure import redis_cpu

from celery_echomq.embedded import RedisServer

FIVE_COMMANDS = """
redis.call('HMGET', KEYS[1], 'state', 'attempts', 'token', 'retries', 'parent', 'format')
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[1], 'state', 'active', 'token', ARGV[2], 'attempts', '1')
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
return redis.call('TIME')
"""


def rows(client: Any, n: int) -> None:
    client.flushdb()
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        pipe.hset(f"JOB{i}", mapping={"state": "pending", "payload": "x" * 800, "format": "2"})
        pipe.zadd("pending", {f"JOB{i}": i})
    pipe.execute()


def per_call_us(client: Any, n: int, send: Callable[[Any, int], None], batched: bool) -> float:
    """Server CPU per call, in microseconds, of ``n`` calls of ``send``."""
    rows(client, n)
    before = redis_cpu(client)
    if batched:
        pipe = client.pipeline(transaction=False)
        for i in range(n):
            send(pipe, i)
        pipe.execute()
    else:
        for i in range(n):
            send(client, i)
    return (redis_cpu(client) - before) * 1e6 / n


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url())
        sha = client.script_load(FIVE_COMMANDS)
        calls: dict[str, Callable[[Any, int], None]] = {
            "PING": lambda c, i: c.ping(),
            "EVALSHA of five commands": lambda c, i: c.evalsha(
                sha, 3, f"JOB{i}", "pending", "active", f"JOB{i}", "token", str(i)
            ),
        }
        print(f"server CPU per call, µs, median of {args.rounds} rounds of {args.calls} calls")
        print(f"{'call':<28}{'one at a time':>15}{'pipelined':>12}{'round trip':>12}")
        for name, send in calls.items():
            alone = [per_call_us(client, args.calls, send, False) for _ in range(args.rounds)]
            batch = [per_call_us(client, args.calls, send, True) for _ in range(args.rounds)]
            a, b = statistics.median(alone), statistics.median(batch)
            print(f"{name:<28}{a:>15.1f}{b:>12.1f}{a - b:>12.1f}")


if __name__ == "__main__":
    main()
