"""Tracing with OpenTelemetry, behind the ``[otel]`` extra (``opentelemetry-api`` only).

Without the package nothing here imports it and every hook is one module-level flag test.
With it and no SDK configured, OpenTelemetry's own no-op tracer answers (no header is
written: a no-op span has no context to carry). With an SDK:

- ``apply_async`` of a flow opens a PRODUCER span ``send <queue>`` (:data:`SPAN_SEND`) with
  OpenTelemetry's messaging attributes and ``echomq.flow.id`` / ``echomq.flow.children``; its
  context is written into the stored message of every job of the flow (children, nested flows,
  the parent), so every delivery, a parent released later by another worker and a recovery
  re-publish included, continues the flow's trace;
- each flow child's own span (opentelemetry-instrumentation-celery's ``run/<task>``) is kept
  on its parent's slot when it settles (``…:spans``), and the parent's ``run/<task>`` span
  links to them, up to the SDK's link limit (``echomq.links.dropped`` counts the rest), with
  ``echomq.released_by``;
- a release, a child's failure under its policy, a deadline, a cancel and a recovery
  re-publish are span events: on the span current where they happen (the child's run span on
  a worker) or, where none is, on a short INTERNAL span ``echomq <what>`` in the flow's trace.

Every name is listed in the README ("Tracing").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
except ImportError:  # the [otel] extra is not installed: every hook is a no-op
    ON = False
else:
    # ECHOMQ_OTEL=0 turns celery-echomq's own tracing off where the package is installed.
    ON = os.environ.get("ECHOMQ_OTEL", "1") != "0"

TRACER = "celery_echomq"
SPAN_SEND = "send {queue}"
SPAN_INTERNAL = "echomq {what}"
# Attributes
FLOW_ID = "echomq.flow.id"
FLOW_CHILDREN = "echomq.flow.children"
RELEASED_BY = "echomq.released_by"
LINKS_DROPPED = "echomq.links.dropped"
CHILD_ID = "echomq.child.id"
JOB_ID = "echomq.job.id"
POLICY = "echomq.policy"
ERROR = "echomq.error"
ON_DEADLINE = "echomq.on_deadline"
OUTSTANDING = "echomq.outstanding"
LATE_MS = "echomq.deadline.late_ms"
REASON = "echomq.reason"
QUEUE = "echomq.queue"
# Events
EV_RELEASED = "echomq.released"
EV_CHILD_FAILED = "echomq.child_failed"
EV_FLOW_FAILED = "echomq.flow_failed"
EV_DEADLINE = "echomq.deadline"
EV_CANCELLED = "echomq.cancelled"
EV_REPUBLISHED = "echomq.republished"

SPANS_SUFFIX = ":spans"  # the parent's hash: child id -> its span's context
DEFAULT_LINKS = 128  # the SDK's default (OTEL_SPAN_LINK_COUNT_LIMIT)

_tracer: Any = None


def tracer() -> Any:
    global _tracer
    if _tracer is None:
        from importlib import metadata

        # A proxy until a provider is set, then the provider's tracer.
        _tracer = trace.get_tracer(TRACER, metadata.version("celery-echomq"))
    return _tracer


def _system(app: Any) -> str:
    """``messaging.system``: the broker's kind, as OpenTelemetry names it."""
    scheme = str(app.conf.broker_url or "").partition("://")[0].partition("+")[0]
    if scheme in ("amqp", "amqps", "pyamqp", "librabbitmq"):
        return "rabbitmq"
    return "redis" if scheme == "rediss" else (scheme or "celery")


@contextlib.contextmanager
def flow_span(app: Any, plan: Any, fan_in: str = "") -> Iterator[None]:
    """The PRODUCER span of a flow's ``apply_async``; its context goes into every message."""
    if not ON:
        yield
        return
    levels = {level.parent_id: level for level in plan.levels()}
    own = levels.get(fan_in) or plan
    span = tracer().start_span(
        SPAN_SEND.format(queue=plan.queue),
        kind=trace.SpanKind.PRODUCER,
        attributes={
            "messaging.system": _system(app),
            "messaging.destination.name": plan.queue,
            "messaging.message.id": plan.parent_id,
            "messaging.operation.type": "send",
            FLOW_ID: plan.parent_id,
            FLOW_CHILDREN: len(own.children),
        },
    )
    with trace.use_span(span, end_on_exit=True):
        if span.is_recording():
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            if carrier:
                for job in plan.messages():
                    headers = job["options"].setdefault("headers", {})
                    headers.update(carrier)
        yield


@contextlib.contextmanager
def job_context(job: dict[str, Any] | None) -> Iterator[None]:
    """Make the flow's context (from ``job``'s stored headers) current while it is published,
    so a publishing span (the instrumentation's ``apply_async/<task>``) joins the flow's
    trace rather than that of whatever released it."""
    if not ON or not job:
        yield
        return
    headers = (job.get("options") or {}).get("headers") or {}
    if "traceparent" not in headers:
        yield
        return
    token = otel_context.attach(propagate.extract(headers))
    try:
        yield
    finally:
        otel_context.detach(token)


def _current() -> Any:
    span = trace.get_current_span()
    return span if span.is_recording() else None


def event(name: str, attributes: dict[str, Any], job: dict[str, Any] | None = None) -> None:
    """Add the event ``name`` to the current span; where none is recording, to a short
    INTERNAL span in the trace ``job``'s stored headers carry (none: nothing)."""
    if not ON:
        return
    span = _current()
    if span is not None:
        span.add_event(name, attributes)
        return
    headers = ((job or {}).get("options") or {}).get("headers") or {}
    if "traceparent" not in headers:
        return
    what = name.removeprefix("echomq.")
    with tracer().start_as_current_span(
        SPAN_INTERNAL.format(what=what),
        context=propagate.extract(headers),
        kind=trace.SpanKind.INTERNAL,
        attributes={k: v for k, v in attributes.items() if k == FLOW_ID},
    ) as internal:
        internal.add_event(name, attributes)


def released(child_id: str, parent_id: str) -> None:
    if ON:
        event(EV_RELEASED, {FLOW_ID: parent_id, RELEASED_BY: child_id})


def child_failed(child_id: str, parent_id: str, policy: str, error: str, failed: bool) -> None:
    if ON:
        attrs = {FLOW_ID: parent_id, CHILD_ID: child_id, POLICY: policy, ERROR: error[:500]}
        event(EV_CHILD_FAILED, attrs)
        if failed:
            event(EV_FLOW_FAILED, {FLOW_ID: parent_id, CHILD_ID: child_id})


def deadline_event(
    job: dict[str, Any] | None, flow_id: str, status: str, outstanding: int, late_ms: int
) -> None:
    if ON:
        attrs = {
            FLOW_ID: flow_id,
            ON_DEADLINE: "continue" if status == "released" else "fail",
            OUTSTANDING: outstanding,
            LATE_MS: late_ms,
        }
        event(EV_DEADLINE, attrs, job)


def cancelled(job: dict[str, Any] | None, flow_id: str, revoked: int) -> None:
    if ON:
        event(EV_CANCELLED, {FLOW_ID: flow_id, OUTSTANDING: revoked}, job)


def republished(job: dict[str, Any] | None, job_id: str, queue: str, reason: str) -> None:
    if ON:
        event(EV_REPUBLISHED, {JOB_ID: job_id, QUEUE: queue, REASON: reason}, job)


def spans_key(state: Any, queue: str, parent_id: str) -> str:
    return str(state.keys.job_key(queue, parent_id)) + SPANS_SUFFIX


def record_child(state: Any, child_id: str, parent: Any) -> None:
    """Keep a settling child's own span (the current one) on its parent's slot, for the
    parent's links: one round trip, only while a span is recording."""
    if not ON or parent is None:
        return
    span = _current()
    if span is None:
        return
    ctx = span.get_span_context()
    key = spans_key(state, parent.queue, parent.id)
    pipe = state.client.pipeline(transaction=False)
    pipe.hset(key, child_id, f"{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}")
    pipe.expire(key, state.settings.result_ttl)
    pipe.execute()


def _link_limit(span: Any) -> int:
    limits = getattr(span, "_limits", None)  # the SDK's SpanLimits
    found = getattr(limits, "max_links", None)
    if isinstance(found, int):
        return found
    try:
        return int(os.environ.get("OTEL_SPAN_LINK_COUNT_LIMIT", DEFAULT_LINKS))
    except ValueError:
        return DEFAULT_LINKS


def parent_started(state: Any, queue: str, parent_id: str, request: Any) -> None:
    """On a flow parent's own span (current when its body starts): a link to each child's
    span, ``echomq.released_by`` and ``echomq.flow.id``."""
    span = _current() if ON else None
    if span is None:
        return
    pipe = state.client.pipeline(transaction=False)
    pipe.hgetall(spans_key(state, queue, parent_id))
    pipe.hget(state.keys.job_key(queue, parent_id), "released_by")
    spans, by = pipe.execute()
    children = {k.decode() if isinstance(k, bytes) else str(k): v for k, v in spans.items()}
    released_by = str(getattr(request, "parent_id", None) or "")
    if released_by not in children:
        released_by = by.decode() if isinstance(by, bytes) else str(by or "")
    span.set_attribute(FLOW_ID, parent_id)
    span.set_attribute(RELEASED_BY, released_by)
    limit = _link_limit(span)
    added = 0
    for child_id, raw in children.items():
        if added >= limit or not hasattr(span, "add_link"):
            break
        trace_id, span_id, flags = (raw.decode() if isinstance(raw, bytes) else raw).split("-")
        context = trace.SpanContext(
            int(trace_id, 16), int(span_id, 16), True, trace.TraceFlags(int(flags, 16))
        )
        span.add_link(context, {CHILD_ID: child_id})
        added += 1
    span.set_attribute(FLOW_CHILDREN, len(children))
    span.set_attribute(LINKS_DROPPED, len(children) - added)
