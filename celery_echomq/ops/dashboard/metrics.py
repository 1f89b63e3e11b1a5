"""``/metrics``: Prometheus text, read from Redis at scrape time by a custom collector.

Nothing is kept in the dashboard process: gauges are the queues' state-set sizes and the
count of held parents, counters are the fields the scripts increment in each queue's
``emq:{q}:counters`` hash (monotonic: only the scripts write them, and only upwards). One
pipelined round trip per scrape, five commands per queue; then, per queue, the ring of
per-minute samples (store/pulse.py) and one page of recent flows for the release times.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from celery_echomq.ops.dashboard.charts import live_gauges, percentiles, read_series, release_times
from celery_echomq.ops.dashboard.overview import PAGE, queue_names, read_counts
from celery_echomq.ops.listing import read_flows
from celery_echomq.send.jobs import POLICIES
from celery_echomq.store.state import EchoMQ


class EchoMQCollector(Collector):
    """Every metric is named ``echomq_*`` and labelled with its queue."""

    def __init__(self, state: EchoMQ) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        gauges = {
            name: GaugeMetricFamily(f"echomq_{name}", doc, labels=["queue"])
            for name, doc in (
                ("pending", "Jobs claimable now (children, and released parents not started)"),
                ("active", "Jobs claimed and running (or lost, until recovery notices)"),
                ("held", "Flow parents awaiting their children"),
                (
                    "window_waiting",
                    "Children waiting for a slot of their flow's window (max_active)",
                ),
                ("failed", "Jobs failed for good within the result TTL"),
                ("recent_flows", "Flows in the queue's recent-flow index"),
            )
        }
        counters = {
            field: CounterMetricFamily(f"echomq_{name}", doc, labels=["queue"])
            for field, name, doc in (
                ("released", "releases", "Held parents released (their children settled)"),
                ("dispatched", "dispatches", "Released parents handed out for publishing"),
                ("republished", "republished", "Messages recovery published again"),
                ("duplicates_skipped", "duplicates_skipped", "Duplicate deliveries skipped"),
                (
                    "forged_refused",
                    "forged_refused",
                    "Deliveries refused: their message named another parent than the job's row",
                ),
                (
                    "children_cut",
                    "children_cut",
                    "Children their flow ended without (cancelled, revoked by a release, cut by a "
                    "deadline or a quorum): dependencies()' cut, over the queue's flows",
                ),
            )
        }
        failures = CounterMetricFamily(
            "echomq_child_failures",
            "Children that failed for good, by the parent_policy applied to them",
            labels=["queue", "policy"],
        )
        names = queue_names(self.state)
        live: dict[str, dict[str, int]] = {}
        for name, cards, values in read_counts(self.state, names):
            live[name] = live_gauges(cards, values)
            pending, active, failed, indexed = cards
            for key, value in (
                ("pending", pending),
                ("active", active),
                ("held", values["held"]),
                ("window_waiting", values["window_waiting"]),
                ("failed", failed),
                ("recent_flows", indexed),
            ):
                gauges[key].add_metric([name], value)
            for field, family in counters.items():
                family.add_metric([name], values[field])
            for policy in POLICIES:
                failures.add_metric([name, policy], values[f"failed_{policy}"])
        yield from gauges.values()
        yield from counters.values()
        yield failures
        yield from self._over_time(names, live)

    def _over_time(self, names: list[str], live: dict[str, dict[str, int]]) -> Iterator[Metric]:
        """What the home page's charts draw: each series' latest per-minute value (from the
        workers' samples), and the release times of the newest page of recent flows."""
        minute = GaugeMetricFamily(
            "echomq_per_minute",
            "The latest minute's value of each of the dashboard's series over time (rates "
            "per minute between the workers' samples; held, window_waiting, pending, active "
            "as read now, the echomq_held, ... gauges' values)",
            labels=["queue", "series"],
        )
        release = GaugeMetricFamily(
            "echomq_flow_release_seconds",
            "From a flow's enqueue to its parent's release, over the newest recent flows "
            "released (nearest-rank quantiles)",
            labels=["queue", "quantile"],
        )
        for name in names:
            for series in read_series(self.state, name, live[name]):
                if series.last is not None:
                    minute.add_metric([name, series.name], series.last)
            rows, _ = read_flows(self.state, "recent", name, None, PAGE, None)
            for quantile, ms in percentiles(release_times(self.state, rows)).items():
                release.add_metric([name, str(quantile)], ms / 1000)
        yield minute
        yield release


def registry_for(state: EchoMQ) -> CollectorRegistry:
    """A registry of its own (not the process-wide default): only the flow store's metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EchoMQCollector(state))
    return registry
