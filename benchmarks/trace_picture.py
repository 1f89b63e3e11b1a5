"""One flow's trace, rendered from the OpenTelemetry SDK (no Jaeger: neither Debian nor PyPI
ships its all-in-one binary): a private redis-server, a real prefork worker with
opentelemetry-instrumentation-celery, this process as the producer with the SDK's
ConsoleSpanExporter. Writes docs/trace-console.txt (the console exporter's own output, every
span of the trace), docs/trace.txt (the spans as a tree on a time axis) and, with Pillow,
docs/trace.png.

    python3 dev.py bench trace-picture
"""

from __future__ import annotations

import argparse
import io
import json
import os
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DOCS = ROOT / "docs"


def _t(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def tree_lines(spans: list[dict[str, Any]], width: int = 48) -> list[str]:
    by_id = {s["context"]["span_id"]: s for s in spans}
    kids: dict[str | None, list[dict[str, Any]]] = {}
    for s in spans:
        parent = s["parent_id"] if s["parent_id"] in by_id else None
        kids.setdefault(parent, []).append(s)
    t0 = min(_t(s["start_time"]) for s in spans)
    t1 = max(_t(s["end_time"]) for s in spans)
    scale = width / max(t1 - t0, 1e-6)
    short = {
        sid: f"#{i}"
        for i, sid in enumerate(sorted(by_id, key=lambda k: _t(by_id[k]["start_time"])))
    }
    lines = [f"trace {spans[0]['context']['trace_id']}  ({(t1 - t0) * 1000:.0f} ms)", ""]

    def walk(span: dict[str, Any], depth: int) -> None:
        a, b = _t(span["start_time"]) - t0, _t(span["end_time"]) - t0
        bar = " " * int(a * scale) + "█" * max(1, int((b - a) * scale))
        kind = span["kind"].removeprefix("SpanKind.")
        name = f"{'  ' * depth}{short[span['context']['span_id']]} {span['name']} [{kind}]"
        lines.append(f"{name:<58}|{bar:<{width}}| {(b - a) * 1000:6.1f} ms")
        attrs = {
            k: v for k, v in span["attributes"].items() if k.startswith(("echomq.", "messaging."))
        }
        pad = "  " * depth + "     "
        for key, value in attrs.items():
            lines.append(f"{pad}{key} = {value}")
        for link in span["links"]:
            target = short.get(link["context"]["span_id"], link["context"]["span_id"])
            lines.append(f"{pad}link -> {target} {link['attributes']}")
        for event in span["events"]:
            shown = {k: v for k, v in event["attributes"].items() if k != "exception.stacktrace"}
            lines.append(f"{pad}event {event['name']} {shown}")
        for child in sorted(
            kids.get(span["context"]["span_id"], []), key=lambda s: _t(s["start_time"])
        ):
            walk(child, depth + 1)

    for root in kids.get(None, []):
        walk(root, 0)
    return lines


def png(lines: list[str], path: Path) -> bool:
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        return False
    font = ImageFont.truetype("/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf", 14)
    w = max(len(line) for line in lines) * 9 + 40
    image = Image.new("RGB", (w, len(lines) * 19 + 30), "white")
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        colour = "#1f4e9c" if "[" in line and "|" in line else "#333333"
        if "event " in line:
            colour = "#b3541e"
        if "link ->" in line:
            colour = "#2e7d32"
        draw.text((20, 15 + i * 19), line, fill=colour, font=font)
    image.save(path)
    return True


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    from celery_echomq.embedded import RedisServer, WorkerProcess
    from tests.otel_setup import read_spans

    console = io.StringIO()
    provider = TracerProvider(resource=Resource.create({"service.name": "producer"}))
    provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=console)))
    trace.set_tracer_provider(provider)
    tmp = Path(tempfile.mkdtemp(prefix="echomq-trace-"))
    worker_spans = tmp / "spans.jsonl"
    with RedisServer() as server:
        urls = {"ECHOMQ_T_BROKER": server.url(1), "ECHOMQ_T_BACKEND": server.url(2),
                "ECHOMQ_T_STORE": server.url(3)}  # fmt: skip
        os.environ.update(urls)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "ECHOMQ_T_OTEL_FILE": str(worker_spans)}
        from celery_echomq import flow
        from tests import proj

        worker = WorkerProcess("tests.proj", log=tmp / "w.log", cwd=ROOT, env=env,
                               concurrency=2, name="trace").start()  # fmt: skip
        try:
            kids = [proj.add.s(1, 1), proj.sleep_then.s(2, 0.2), proj.add.s(3, 3),
                    proj.boom.s("no page").set(parent_policy="ignore")]  # fmt: skip
            res = flow(proj.tsum.s(), kids, deadline=30).apply_async()
            assert res.get(timeout=30) == 10
            deadline = time.monotonic() + 20
            while not any(
                s["name"] == "run/tests.proj.tsum" for s in read_spans(str(worker_spans))
            ):
                if time.monotonic() > deadline:
                    raise TimeoutError("the parent's span never came")
                time.sleep(0.1)
        finally:
            worker.stop()
    ours = [json.loads(chunk) for chunk in _split(console.getvalue())]
    spans = ours + read_spans(str(worker_spans))
    trace_id = ours[0]["context"]["trace_id"]
    spans = [s for s in spans if s["context"]["trace_id"] == trace_id]
    for s in spans:
        s["service"] = s["resource"]["attributes"].get("service.name")
    (DOCS / "trace-console.txt").write_text(
        "\n".join(json.dumps(s, indent=4) for s in sorted(spans, key=lambda s: s["start_time"]))
        + "\n"
    )
    lines = tree_lines(spans)
    (DOCS / "trace.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("docs/trace.png" if png(lines, DOCS / "trace.png") else "(no Pillow: no PNG)")
    return 0


def _split(text: str) -> list[str]:
    """The console exporter's output: one indented JSON object per span."""
    out, depth, start = [], 0, None
    for i, ch in enumerate(text):
        if ch == "{":
            depth += 1
            start = i if depth == 1 else start
        elif ch == "}":
            depth -= 1
            if depth == 0 and start is not None:
                out.append(text[start : i + 1])
    return out


if __name__ == "__main__":
    raise SystemExit(main())
