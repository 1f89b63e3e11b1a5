"""Tracing (the [otel] extra) against real prefork workers: the SDK's in-memory exporter in
this process (the producer), and in each worker the SDK with
opentelemetry-instrumentation-celery, whose spans come back as JSON lines (tests/otel_setup)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

from celery_echomq import FlowDeadlineExceeded, flow, tracing
from tests.helpers import LOGDIR, ROOT, wait_for
from tests.otel_setup import read_spans


class Switch(Sampler):  # type: ignore[misc]
    """Records while on: the other test modules of the session see a non-recording tracer."""

    on = False

    def should_sample(
        self, parent: Any, trace_id: int, name: str, kind: Any = None, attributes: Any = None,
        *args: Any, **kwargs: Any,
    ) -> SamplingResult:  # fmt: skip
        if not self.on:
            return SamplingResult(Decision.DROP)
        return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes)

    def get_description(self) -> str:
        return "switch"


SWITCH = Switch()
EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module")
def producer() -> Iterator[InMemorySpanExporter]:
    """This process as an instrumented producer (our spans only: no Celery instrumentation
    here), recording while this module runs."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider(sampler=SWITCH)
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        trace.set_tracer_provider(provider)
    SWITCH.on = True
    yield EXPORTER
    SWITCH.on = False
    EXPORTER.clear()


def as_dicts(exporter: InMemorySpanExporter) -> list[dict[str, Any]]:
    return [json.loads(s.to_json()) for s in exporter.get_finished_spans()]


def traced_worker(start_worker: Any, queue: str, **env: str) -> tuple[Any, str]:
    path = str(LOGDIR / f"spans-{uuid.uuid4().hex[:8]}.jsonl")
    w = start_worker(queues=queue, concurrency=2, extra_env={"ECHOMQ_T_OTEL_FILE": path, **env})
    return w, path


def by_name(spans: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [s for s in spans if s["name"] == name]


def test_without_the_extra_nothing_is_imported_and_flows_run() -> None:
    """No opentelemetry package: celery_echomq imports none of it, and a flow runs as ever."""
    code = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "import celery_echomq, celery_echomq.tracing as t\n"
        "from celery import Celery\n"
        "app = Celery('x'); app.conf.task_always_eager = True; celery_echomq.install(app)\n"
        "@app.task\n"
        "def one(): return 1\n"
        "@app.task\n"
        "def total(v): return sum(v)\n"
        "f = celery_echomq.flow(total.s(), [one.si(), one.si()], deadline=5)\n"
        "assert f.apply().get() == 2\n"
        "assert t.ON is False\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry') and sys.modules[m]]\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == "ok", out.stderr


def test_a_flow_is_one_trace_from_its_producer_to_its_parent(
    proj: Any, producer: InMemorySpanExporter, start_worker: Any, own_queue: Any
) -> None:
    queue = own_queue("otel")
    _, path = traced_worker(start_worker, queue, OTEL_SPAN_LINK_COUNT_LIMIT="3")
    bad = proj.boom.s("no page").set(parent_policy="ignore")
    kids = [proj.add.s(i, i) for i in range(4)] + [bad]
    f = flow(proj.tsum.s(), kids)
    f.freeze()
    ids = [k.options["task_id"] for k in kids]
    res = f.apply_async(queue=queue)
    assert res.get(timeout=30) == 12

    (send,) = by_name(as_dicts(producer), f"send {queue}")
    assert send["kind"] == "SpanKind.PRODUCER"
    assert send["attributes"] == {
        "messaging.system": "redis",
        "messaging.destination.name": queue,
        "messaging.message.id": res.id,
        "messaging.operation.type": "send",
        "echomq.flow.id": res.id,
        "echomq.flow.children": 5,
    }
    trace_id = send["context"]["trace_id"]
    spans = wait_for(lambda: by_name(read_spans(path), "run/tests.proj.tsum") and read_spans(path))
    children = [s for s in spans if s["name"] in ("run/tests.proj.add", "run/tests.proj.boom")]
    assert len(children) == 5
    # Every child's run span is a child of the flow's PRODUCER span: one trace.
    for span in children:
        assert span["context"]["trace_id"] == trace_id
        assert span["parent_id"] == send["context"]["span_id"]
    # The parent, published later by the worker that released it, is in the same trace,
    # under the flow's span (through the instrumentation's own publish span).
    (parent,) = by_name(spans, "run/tests.proj.tsum")
    assert parent["context"]["trace_id"] == trace_id
    (publish,) = [s for s in spans if s["context"]["span_id"] == parent["parent_id"]]
    assert publish["name"] == "apply_async/tests.proj.tsum"
    assert publish["parent_id"] == send["context"]["span_id"]
    # Links to its children's spans, up to the SDK's limit (3 here); the rest counted.
    child_spans = {s["context"]["span_id"] for s in children}
    assert len(parent["links"]) == 3
    assert {link["context"]["span_id"] for link in parent["links"]} <= child_spans
    attrs = parent["attributes"]
    assert attrs["echomq.flow.id"] == res.id
    assert attrs["echomq.flow.children"] == 5 and attrs["echomq.links.dropped"] == 2
    assert attrs["echomq.released_by"] in ids
    # Events: the failure under its policy on the failed child's span; the release on the
    # releasing child's span.
    (boom,) = by_name(spans, "run/tests.proj.boom")
    (failed,) = [e for e in boom["events"] if e["name"] == "echomq.child_failed"]
    assert failed["attributes"]["echomq.policy"] == "ignore"
    assert failed["attributes"]["echomq.error"] == "ValueError: no page"
    releaser = next(s for s in children if any(e["name"] == "echomq.released" for e in s["events"]))
    (event,) = [e for e in releaser["events"] if e["name"] == "echomq.released"]
    assert event["attributes"] == {
        "echomq.flow.id": res.id,
        "echomq.released_by": attrs["echomq.released_by"],
    }


def test_a_deadline_and_a_cancel_are_events_in_the_flows_trace(
    proj: Any,
    producer: InMemorySpanExporter,
    start_worker: Any,
    own_queue: Any,
    store: redis.Redis,
) -> None:
    queue = own_queue("otel-dl")
    _, path = traced_worker(start_worker, queue)
    gate = f"gate:{uuid.uuid4().hex}"
    res = flow(proj.tsum.s(), [proj.gated.s(1, gate)], deadline=0.5).apply_async(queue=queue)
    with pytest.raises(FlowDeadlineExceeded):
        res.get(timeout=30)
    (send,) = [
        s for s in by_name(as_dicts(producer), f"send {queue}")
        if s["attributes"]["echomq.flow.id"] == res.id
    ]  # fmt: skip
    spans = wait_for(lambda: by_name(read_spans(path), "echomq deadline"))
    (span,) = spans
    assert span["context"]["trace_id"] == send["context"]["trace_id"]
    assert span["parent_id"] == send["context"]["span_id"]
    (event,) = span["events"]
    assert event["name"] == "echomq.deadline"
    assert event["attributes"]["echomq.flow.id"] == res.id
    assert event["attributes"]["echomq.on_deadline"] == "fail"
    assert event["attributes"]["echomq.outstanding"] == 1
    assert 0 <= event["attributes"]["echomq.deadline.late_ms"] < 1000
    store.set(gate, 1)

    # A cancel from a process with no span of its own: a short span in the flow's trace.
    held = flow(proj.tsum.s(), [proj.gated.s(2, gate + "x")]).apply_async(queue=queue + "-none")
    held.revoke()
    (cancel,) = [
        s for s in by_name(as_dicts(producer), "echomq cancelled")
        if s["attributes"]["echomq.flow.id"] == held.id
    ]  # fmt: skip
    assert [e["name"] for e in cancel["events"]] == ["echomq.cancelled"]
    store.delete(f"emq:{{{queue}-none}}:pending")


def test_a_recovery_republish_is_an_event_in_the_jobs_trace(producer: InMemorySpanExporter) -> None:
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("send q") as span:
        carrier: dict[str, str] = {}
        from opentelemetry import propagate

        propagate.inject(carrier)
    job = {"options": {"headers": carrier}}
    tracing.republished(job, "JOB" + "a" * 32, "q", "message gone")
    (internal,) = by_name(as_dicts(producer), "echomq republished")
    assert internal["parent_id"] == f"0x{span.get_span_context().span_id:016x}"
    (event,) = internal["events"]
    assert event["name"] == "echomq.republished"
    assert event["attributes"]["echomq.reason"] == "message gone"


def test_no_header_is_written_without_a_recording_span(proj: Any) -> None:
    """The API without an SDK (or a sampler that drops): no traceparent in the messages."""
    from celery_echomq.send.plan import plan_flow

    plan = plan_flow(proj.app, proj.tsum.s(), [proj.add.s(1, 1)], policy="fail", args=(),
                     kwargs=None, options={})  # fmt: skip
    was, SWITCH.on = SWITCH.on, False
    try:
        with tracing.flow_span(proj.app, plan):
            pass
    finally:
        SWITCH.on = was
    assert all("traceparent" not in job["options"]["headers"] for job in plan.messages())
