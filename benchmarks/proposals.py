"""Bench-only variants for the before/after figures of PROPOSALS.md.

Nothing in celery_echomq is edited: a producer variant replaces ``publish`` in
``celery_echomq.start`` and ``celery_echomq.settle`` in this process only, for one mode's sends
(``hook`` below); a worker variant is switched on by an environment variable in a worker of its
own (``worker_variants.py``).

Producer (``profile_flow.py`` runs them interleaved with the library's own publish, which since
P1 builds each message with ``app.amqp.create_task_message`` inside one kombu batch):

- ``flow, old publish``: the path before P1, one ``Signature.apply_async`` per child: a
  Signature, Task.apply_async, a result subscription and an LPUSH round trip for every child;
- ``flow, old publish batched``: the same per-child calls inside ``Producer.batch()`` (kombu
  >= 5.7), to show how much of P1 is the batch alone.

- ``flow+declare``: the library's publish, with the queue declared once per batch instead of
  once per message (P5): kombu's ``maybe_declare`` copies and binds the Queue entity for every
  message even when its cache says the queue is declared.

Worker (``bench.py --proposals``): ``flow+claim`` runs on a worker whose claim is pipelined
behind the task body (P2).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from celery.canvas import Signature

import celery_echomq.send.start as echomq_start
import celery_echomq.worker.settle as echomq_settle

Publish = Callable[[Any, Iterable[dict[str, Any]]], None]

# What bench.py --proposals adds to group/chord/flow, and the worker variant each one needs.
BENCH_MODES = ("flow+declare", "flow+claim")
WORKER_VARIANTS = {"flow+claim": "pipelined_claim"}


def _batch(producer: Any) -> contextlib.AbstractContextManager[Any]:
    batch = getattr(producer, "batch", None)
    return batch() if batch is not None else contextlib.nullcontext()


def _send_each(app: Any, producer: Any, jobs: Iterable[dict[str, Any]]) -> None:
    for job in jobs:
        sig = Signature(
            job["task"],
            job["args"],
            job["kwargs"],
            immutable=job.get("immutable", False),
            app=app,
        )
        sig.apply_async(producer=producer, **dict(job["options"]))


def publish_per_child(app: Any, jobs: Iterable[dict[str, Any]]) -> None:
    with app.producer_or_acquire(None) as producer:
        _send_each(app, producer, jobs)


def publish_per_child_batched(app: Any, jobs: Iterable[dict[str, Any]]) -> None:
    with app.producer_or_acquire(None) as producer, _batch(producer):
        _send_each(app, producer, jobs)


_library_publish: Publish = echomq_start.publish


@contextlib.contextmanager
def _declare_once(app: Any) -> Iterator[None]:
    amqp = app.amqp
    send = amqp.send_task_message
    declared: set[str] = set()

    def send_declaring_once(producer: Any, name: str, message: Any, **kwargs: Any) -> Any:
        queue = kwargs.get("queue")
        qname = str(getattr(queue, "name", queue))
        if kwargs.get("declare") is None and qname in declared:
            kwargs["declare"] = []
        declared.add(qname)
        return send(producer, name, message, **kwargs)

    # send_task_message is a cached property: an instance attribute shadows it until removed.
    amqp.send_task_message = send_declaring_once
    try:
        yield
    finally:
        del amqp.send_task_message


def publish_declare_once(app: Any, jobs: Iterable[dict[str, Any]]) -> None:
    with _declare_once(app):
        _library_publish(app, jobs)


PRODUCER_VARIANTS: dict[str, Publish] = {
    "flow, old publish": publish_per_child,
    "flow, old publish batched": publish_per_child_batched,
    "flow+declare": publish_declare_once,
}


@contextlib.contextmanager
def hook(mode: str) -> Iterator[None]:
    """Swap in the variant's publish for one mode's sends; the library's own otherwise."""
    variant = PRODUCER_VARIANTS.get(mode)
    if variant is None:
        yield
        return
    original = echomq_start.publish

    def publish(app: Any, jobs: Iterable[dict[str, Any]]) -> None:
        # A nested flow's entry is not a message: the library resumes it.
        jobs = list(jobs)
        variant(app, [job for job in jobs if "nested" not in job])
        nested = [job for job in jobs if "nested" in job]
        if nested:
            original(app, nested)

    # The producer's sends (start_flow) and the released parents' (dispatch_parent).
    echomq_start.publish = echomq_settle.publish = publish
    try:
        yield
    finally:
        echomq_start.publish = echomq_settle.publish = original
