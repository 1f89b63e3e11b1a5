"""OpenTelemetry for a test worker (tests/proj.py, when ECHOMQ_T_OTEL_FILE is set): the SDK,
opentelemetry-instrumentation-celery, and an exporter that keeps each finished span as one
JSON line in that file (the SDK's own ``to_json``), so the test can read a prefork worker's
spans, from every pool process."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult


class LineExporter(SpanExporter):
    """Appends each span as a JSON line (one write per span: pool processes interleave whole
    lines)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(json.loads(s.to_json())) + "\n" for s in spans)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, lines.encode())
        finally:
            os.close(fd)
        return SpanExportResult.SUCCESS


class NullExporter(SpanExporter):
    """Drops every span: what making them costs, without any export."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def configure(path: str, service: str = "worker") -> Any:
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if path:
        provider.add_span_processor(SimpleSpanProcessor(LineExporter(path)))
    else:
        provider.add_span_processor(SimpleSpanProcessor(NullExporter()))
    trace.set_tracer_provider(provider)
    CeleryInstrumentor().instrument()
    return provider


def read_spans(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
