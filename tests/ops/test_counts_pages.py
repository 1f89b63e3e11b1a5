"""Every figure the dashboard shows says what it counts, and figures of the same thing agree:
a held-flows chart beside the counts table ends on the table's figure, whatever the age of
the workers' last sample; a flow's page, its JSON and /metrics show the children cut. Flows
written by the scripts themselves, on a queue of the test's own, served over HTTP."""

from __future__ import annotations

import html
import re
import time
from typing import Any

import httpx
import pytest

from celery_echomq import get_state
from celery_echomq.store import pulse
from celery_echomq.store.keyspace import new_job_id

TTL = 600


@pytest.fixture
def state(proj: Any) -> Any:
    return get_state(proj.app)


def held(state: Any, queue: str, n: int) -> tuple[str, list[str]]:
    """A held parent with ``n`` pending children (enqueue_flow), on a queue the store lists
    (as a producer's start registers it)."""
    state.client.sadd(state.keys.queues_key(), queue)
    parent, kids = new_job_id(), [new_job_id() for _ in range(n)]
    payload = state.dumps({"task": "tests.proj.tsum", "children": kids, "options": {}})
    state.scripts.enqueue_flow(queue, parent, payload, [(k, b"c") for k in kids])
    return parent, kids


def section(page: str, queue: str) -> str:
    start = page.index(f'id="queue-{queue}"')
    end = page.find('<section class="queue"', start)
    return page[start : end if end != -1 else len(page)]


def test_the_held_chart_ends_on_the_tables_figure_and_both_say_flows(
    state: Any, own_queue: Any, serve: Any
) -> None:
    queue = own_queue("pulse")
    held(state, queue, 1)
    # A worker's sample of three minutes ago: one flow held then.
    pulse.sample(state, [queue], now=time.time() - 180)
    held(state, queue, 2)
    held(state, queue, 2)
    site = serve()
    page = section(httpx.get(f"{site.url}/?queue={queue}").text, queue)
    table = re.search(r'<td class="count-held">(\d+)</td>', page)
    assert table is not None and table.group(1) == "3"
    chart = re.search(rf'id="chart-{queue}-held"[^>]*data-last="([^"]*)"', page)
    assert chart is not None and float(chart.group(1)) == 3.0
    # The older point is still drawn: the sample said one.
    points = re.search(rf'id="chart-{queue}-held" data-points="(\d+)"', page)
    assert points is not None and points.group(1) == "2"
    # What each figure counts is in its label.
    headers = re.findall(r"<th>([^<]+)</th>", page)
    assert "held flows" in headers and "failed jobs" in headers and "pending jobs" in headers
    assert "children done/total" in headers and "cut" in headers
    captions = [html.unescape(c) for c in re.findall(r"<figcaption>([^<]+)<b>", page)]
    assert "held flows (parents awaiting children) " in captions
    assert "children failed under fail / min " in captions
    assert not [c for c in captions if c.startswith("held parents")]
    # /metrics' per-minute value of the held series is the held gauge's.
    metrics = httpx.get(f"{site.url}/metrics").text
    assert f'echomq_held{{queue="{queue}"}} 3.0' in metrics
    assert f'echomq_per_minute{{queue="{queue}",series="held"}} 3.0' in metrics


def test_a_queue_no_worker_sampled_has_no_chart_beside_its_table(
    state: Any, own_queue: Any, serve: Any
) -> None:
    queue = own_queue("nopulse")
    held(state, queue, 1)
    site = serve()
    page = section(httpx.get(f"{site.url}/?queue={queue}").text, queue)
    assert f'id="no-samples-{queue}"' in page and f'id="chart-{queue}-held"' not in page


def test_a_cancelled_flows_page_and_json_show_its_children_cut(
    state: Any, own_queue: Any, serve: Any
) -> None:
    queue = own_queue("cutpage")
    parent, kids = held(state, queue, 3)
    state.scripts.cancel(queue, parent, kids, ttl=TTL)
    site = serve()
    page = httpx.get(f"{site.url}/flows/{parent}").text
    assert "outstanding=0 done=0/3 failed=0 ignored=0 cut=3" in page
    summary = re.search(r'<p id="summary"[^>]*>([^<]+)</p>', page)
    assert summary is not None
    assert html.unescape(summary.group(1)) == "parent cancelled · 0/3 children finished, 3 cut"
    flow = httpx.get(f"{site.url}/api/flows/{parent}").json()["flow"]
    assert (flow["outstanding"], flow["done"], flow["cut"], flow["total"]) == (0, 0, 3, 3)
    # /metrics counts the queue's children cut, as it counts their failures.
    metrics = httpx.get(f"{site.url}/metrics").text
    assert f'echomq_children_cut_total{{queue="{queue}"}} 3.0' in metrics
    listed = section(httpx.get(f"{site.url}/?queue={queue}").text, queue)
    row = re.search(rf'data-id="{parent}".*?</tr>', listed, re.S)
    assert row is not None
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", row.group(0))
    # task, done/total, failed, ignored, cut
    assert cells[:5] == ["tests.proj.tsum", "0/3", "0", "0", "3"]
