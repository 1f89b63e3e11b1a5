"""Dramatiq's actors for the peers bench: the broker, its results and its group callbacks on
the database ``$PEERS_REDIS_URL`` names. Imported by ``dramatiq_driver.py`` and by the
``dramatiq`` worker processes it starts."""

from __future__ import annotations

import os

import dramatiq
from dramatiq import Message
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import GroupCallbacks
from dramatiq.rate_limits.backends import RedisBackend as BarrierBackend
from dramatiq.results import Results
from dramatiq.results.backends import RedisBackend as ResultBackend

URL = os.environ["PEERS_REDIS_URL"]
QUEUE = "peers"

broker = RedisBroker(url=URL)
results = ResultBackend(url=URL)
broker.add_middleware(Results(backend=results))
# The group's counter: each child's completion decrements it, the last enqueues the callback.
broker.add_middleware(GroupCallbacks(BarrierBackend(url=URL)))
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name=QUEUE, store_results=True)
def add(x: int, y: int) -> int:
    return x + y


@dramatiq.actor(queue_name=QUEUE, store_results=True)
def tsum(child_ids: list[str]) -> int:
    """The completion callback: a Dramatiq callback is not handed its group's values, so it
    reads each child's result from the results backend, as a fan-in has to."""
    total = 0
    for message_id in child_ids:
        child = Message(
            queue_name=QUEUE,
            actor_name="add",
            args=(),
            kwargs={},
            options={},
            message_id=message_id,
            message_timestamp=0,
        )
        total += results.get_result(child)
    return total
