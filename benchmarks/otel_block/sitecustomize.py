"""On PYTHONPATH for benchmarks/tracing_cost.py's "absent" mode: opentelemetry cannot be
imported, as where the [otel] extra is not installed."""

import sys

sys.modules["opentelemetry"] = None  # type: ignore[assignment]
