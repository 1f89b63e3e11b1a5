"""The dashboard's pictures in a real headless Chromium: a flow's timeline, the home page's
rates, a failed child's traceback and its retry, the workers. Real workers and Redis; each
picture is saved to ``/tmp/pictures`` (or ``ECHOMQ_PICTURES``) as a screenshot."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import chain

from celery_echomq import flow
from tests.helpers import KEYS, id_of, wait_for, with_id

pytestmark = pytest.mark.e2e
SHOTS = Path(os.environ.get("ECHOMQ_PICTURES") or "/tmp/pictures")


def state_of(store: redis.Redis, job_id: str) -> str | None:
    value = store.hget(KEYS.job_key("celery", job_id), "state")
    return value.decode() if value is not None else None


@pytest.fixture
def gate(store: redis.Redis) -> Iterator[str]:
    name = f"test:gate:{uuid.uuid4().hex}"
    yield name
    store.set(name, 1)


def shot(browser: Any, name: str, height: int = 700) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    browser.set_window_size(1400, height)
    try:
        assert browser.save_screenshot(str(SHOTS / name))
    finally:
        browser.set_window_size(1280, 720)


def bars(browser: Any) -> dict[str, str]:
    """Each bar of the timeline: its job id -> the kind its colour says."""
    found: dict[str, str] = browser.execute_script(
        "const out = {};"
        "document.querySelectorAll('#timeline rect.bar').forEach("
        "  r => { out[r.id.slice(4)] = r.dataset.kind; });"
        "return out;"
    )
    return found


def test_a_flows_timeline_draws_each_child_as_a_bar_of_its_state_then_the_parent(
    proj: Any, worker: Any, store: redis.Redis, gate: str, serve: Any, browser: Any
) -> None:
    done = with_id(proj.sleep_then.s(2, 0.3))
    bad = with_id(proj.boom.s("disk full").set(parent_policy="ignore"))
    slow = with_id(proj.gated.s(5, gate))
    inner = flow(proj.tsum.s(), [proj.add.s(1, 1), proj.add.s(2, 2)])
    inner.freeze()
    steps = chain(proj.add.s(1, 1), proj.add.s(1))
    sig = flow(proj.tsum.s(), [done, bad, slow, inner, steps])
    sig.freeze()
    first = str(steps.tasks[0].options["task_id"])
    res = sig.apply_async()
    wait_for(lambda: state_of(store, id_of(slow)) == "active", timeout=60)
    wait_for(lambda: state_of(store, id_of(bad)) == "failed", timeout=60)
    wait_for(lambda: state_of(store, id_of(done)) == "done", timeout=60)
    wait_for(lambda: state_of(store, inner.id) == "done", timeout=60)
    site = serve()
    browser.get(f"{site.url}/flows/{res.id}")
    wait_for(lambda: bars(browser).get(id_of(slow)) == "running", timeout=30)
    seen = bars(browser)
    assert seen[id_of(done)] == "done" and seen[id_of(bad)] == "failed"
    assert seen[inner.id] == "done" and seen[first] == "done"  # a chain's first step
    assert res.id not in seen  # the parent has not started
    legend = browser.find_element("css selector", "#timeline .legend").text
    for kind in ("waiting", "running", "done", "failed", "cancelled"):
        assert kind in legend
    # The nested flow's bar opens its own page.
    link = browser.execute_script(
        "return document.getElementById(arguments[0]).parentNode.getAttribute('href');",
        f"bar-{inner.id}",
    )
    assert link == f"/flows/{inner.id}"
    shot(browser, "timeline-running.png")

    store.set(gate, 1)
    wait_for(lambda: bars(browser).get(res.id) == "done", timeout=60)
    seen = bars(browser)
    assert seen[id_of(slow)] == "done"
    assert browser.find_elements("id", "release-mark")  # the parent's release
    # The running child's bar ends where the parent's release begins, or before.
    widths = browser.execute_script(
        "const b = id => document.getElementById('bar-' + id).getBBox();"
        "return [b(arguments[0]).x + b(arguments[0]).width, b(arguments[1]).x];",
        id_of(slow),
        res.id,
    )
    assert widths[0] <= widths[1] + 2
    shot(browser, "timeline-done.png")

    # The nested flow's one bar spans its whole run: from its enqueue, before its children
    # started, not from its own parent's run at its end.
    from celery_echomq import get_state
    from celery_echomq.ops.dashboard.timeline import build_timeline
    from celery_echomq.ops.pages import read_flow

    state = get_state(proj.app)
    line = build_timeline(state, read_flow(state, res.id, with_result=False))
    assert line is not None
    nested = next(bar for bar in line.bars if bar.id == inner.id)
    began = line.start_ms + nested.x * line.span_ms / 100
    inner_children = read_flow(state, inner.id, with_result=False).children
    assert began <= min(c.started_ms or 0 for c in inner_children) + 1


def test_a_failed_childs_traceback_and_its_retry_from_its_row_then_retry_all_failed(
    proj: Any, worker: Any, store: redis.Redis, serve: Any, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    flags = [f"test:flag:{uuid.uuid4().hex}" for _ in range(3)]
    bad = [
        with_id(proj.flaky.s(i, flag).set(parent_policy="ignore")) for i, flag in enumerate(flags)
    ]
    res = flow(proj.tsum.s(), [with_id(proj.add.s(1, 1)), *bad]).apply_async()
    assert res.get(timeout=60) == 2  # the failures ignored
    site = serve(allow_actions=True)
    browser.get(f"{site.url}/flows/{res.id}")
    first = id_of(bad[0])
    details = wait_for(lambda: browser.find_elements(By.ID, f"traceback-{first}"), timeout=30)
    details[0].find_element(By.TAG_NAME, "summary").click()
    text = details[0].text
    assert "Traceback (most recent call last)" in text and "ValueError" in text
    assert "flaky" in text  # Celery's own, as the result backend keeps it
    shot(browser, "failures.png", height=900)

    store.set(flags[0], 1)  # fixed: retry that one child from its row
    browser.find_element(By.ID, f"retry-child-{first}").click()
    note = wait_for(lambda: browser.find_elements(By.ID, "note"), timeout=30)[0].text
    assert f"child {first} retried: 1 published again" in note
    wait_for(lambda: state_of(store, first) == "done", timeout=60)
    assert state_of(store, id_of(bad[1])) == "failed"

    store.set(flags[1], 1)
    store.set(flags[2], 1)
    browser.get(f"{site.url}/flows/{res.id}")
    browser.find_element(By.ID, "retry-all").click()
    note = wait_for(lambda: browser.find_elements(By.ID, "note"), timeout=30)[0].text
    assert "2 failed child(ren) published again" in note
    for job in bad[1:]:
        wait_for(lambda job=job: state_of(store, id_of(job)) == "done", timeout=60)


def test_the_home_page_draws_rates_per_minute_from_the_workers_samples_and_metrics_agree(
    proj: Any, worker: Any, store: redis.Redis, serve: Any, browser: Any
) -> None:
    import time

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from celery_echomq import get_state
    from celery_echomq.store.pulse import note_done, sample

    ring = KEYS.queue_key("celery", "minutes")
    assert flow(proj.tsum.s(), [proj.add.s(1, 1)]).apply_async().get(timeout=60) == 2
    # The worker's recovery loop samples the queue's counters once a minute.
    wait_for(lambda: store.hlen(ring) > 0, timeout=30)
    store.delete(ring)
    # Three minutes gone by, each sampled with what the store counted by then: the same
    # writer as the worker's, given the minute (the test cannot wait three).
    state = get_state(proj.app)
    now = time.time()
    sample(state, ["celery"], now=now - 180)
    for i in range(2):
        assert flow(proj.tsum.s(), [proj.add.s(i, 1)]).apply_async().get(timeout=60) == i + 1
    failing = flow(proj.tsum.s(), [proj.boom.s("no")]).apply_async()
    wait_for(lambda: state_of(store, failing.id) == "failed", timeout=60)
    sample(state, ["celery"], now=now - 120)
    sample(state, ["celery"], now=now - 60)
    # Children done are tallied where they complete; a minute's tally goes to the ring at
    # that process's first completion of a later minute (here, this process's).
    for _ in range(7):
        note_done(state, "celery", now=now - 120)
    note_done(state, "celery", now=now - 60)
    assert int(store.hget(ring, f"{int((now - 120) // 60)}:done") or 0) >= 7

    site = serve()
    browser.get(site.url + "/")
    chart = "#chart-celery-{} figcaption b"

    def peak(name: str) -> str:
        found: str = browser.find_element("css selector", f"#chart-celery-{name} figcaption").text
        return found.split("peak ")[1]

    assert peak("flows_released") == "2"  # both flows released in that minute
    assert peak("flows_failed") == "1" and peak("children_failed") == "1"
    assert int(peak("children_done")) >= 7
    for name in ("flows_released", "flows_failed", "children_done", "children_failed", "held"):
        svg = browser.find_elements("css selector", f"#chart-celery-{name} svg polyline")
        assert len(svg) == 1
        assert browser.find_element("css selector", chart.format(name)).text != ""
    release = browser.find_element("id", "release-celery").text
    assert "recent flows released" in release and "p50" in release and "p99" in release
    # Each chart's time axis names its first and last sampled minute.
    axis = browser.find_element("css selector", "#chart-celery-held .axis-x").text.split()
    assert len(axis) == 3 and axis[2] == "UTC" and axis[0] != axis[1]
    shot(browser, "rates.png", height=560)

    metrics = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(httpx.get(site.url + "/metrics").text)
        for s in family.samples
    }
    assert (("echomq_per_minute", (("queue", "celery"), ("series", "held")))) in metrics
    p50 = metrics[("echomq_flow_release_seconds", (("quantile", "0.5"), ("queue", "celery")))]
    assert 0 <= p50 < 60


def test_the_workers_page_names_each_worker_its_extension_clock_offset_and_last_pass(
    env: Any, proj: Any, worker: Any, store: redis.Redis, serve: Any, browser: Any
) -> None:
    from tests.helpers import Worker

    assert flow(proj.tsum.s(), [proj.add.s(1, 1)]).apply_async().get(timeout=60) == 2
    # The recovery loop records each pass it runs.
    wait_for(lambda: store.hlen("emq:workers") > 0, timeout=30)
    plain = Worker(
        env, concurrency=1, name=f"old-{uuid.uuid4().hex[:6]}", extra_env={"ECHOMQ_T_PLAIN": "1"}
    )
    try:
        site = serve()
        browser.get(site.url + "/workers")
        rows = browser.execute_script(
            "return Array.from(document.querySelectorAll('#workers tr.worker')).map(r => ["
            "r.dataset.name, r.dataset.extension, r.className,"
            "r.querySelector('.offset').textContent,"
            "r.querySelector('.pass').textContent]);"
        )
        by_name = {row[0].split("@")[0]: row for row in rows}
        ours = by_name["session"]
        assert ours[1] == "yes" and "wrong" not in ours[2]
        assert " ms" in ours[3]  # its clock's offset from the store's
        assert "UTC" in ours[4] and "ago" in ours[4]  # its last recovery pass
        old = by_name[plain.name]
        assert old[1] == "no" and "wrong" in old[2]  # consumes celery without the extension
        assert old[3] == "-" and old[4] == "-"
        shot(browser, "workers.png", height=420)
    finally:
        plain.stop()


def test_the_timeline_tells_waiting_from_running_then_cancelled_and_draws_one_page(
    proj: Any, worker: Any, store: redis.Redis, gate: str, serve: Any, browser: Any
) -> None:
    slow = with_id(proj.gated.s(1, gate))
    rest = [with_id(proj.add.s(i, 1)) for i in range(3)]
    res = flow(proj.tsum.s(), [slow, *rest], max_active=1).apply_async()
    wait_for(lambda: state_of(store, id_of(slow)) == "active", timeout=60)
    site = serve(allow_actions=True)
    browser.get(f"{site.url}/flows/{res.id}")
    wait_for(lambda: bars(browser).get(id_of(slow)) == "running", timeout=30)
    seen = bars(browser)
    assert [seen[id_of(job)] for job in rest] == ["waiting"] * 3  # the window's waiting ones
    shot(browser, "timeline-waiting.png")

    browser.find_element("id", "action-cancel").click()
    wait_for(lambda: bars(browser).get(id_of(rest[0])) == "cancelled", timeout=30)
    assert [bars(browser)[id_of(job)] for job in rest] == ["cancelled"] * 3
    shot(browser, "timeline-cancelled.png")

    # A big flow draws the page of children in view, never the tree.
    big = flow(proj.tsum.s(), [proj.add.s(i, 0) for i in range(120)]).apply_async()
    assert big.get(timeout=120) == sum(range(120))
    browser.get(f"{site.url}/flows/{big.id}")
    drawn = wait_for(lambda: bars(browser), timeout=30)
    assert len(drawn) == 50 + 1 and drawn[big.id] == "done"  # a page of 50, and the parent
    assert set(drawn.values()) == {"done"}


def test_the_children_waiting_in_a_window_are_counted_sampled_and_drawn_beside_the_held(
    proj: Any,
    start_worker: Any,
    own_queue: Any,
    store: redis.Redis,
    gate: str,
    serve: Any,
    browser: Any,
) -> None:
    import time

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from celery_echomq import get_state
    from celery_echomq.store.pulse import read_minutes, sample

    name = own_queue("window")
    start_worker(queues=name, concurrency=2)
    site = serve()
    state = get_state(proj.app)

    def gauge() -> float:
        text = httpx.get(site.url + "/metrics").text
        found = {
            (s.name, s.labels.get("queue")): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        return found[("echomq_window_waiting", name)]

    kids = [with_id(proj.gated.s(i, gate)) for i in range(10)]
    res = flow(proj.tsum.s(), kids, max_active=2).apply_async(queue=name)
    wait_for(lambda: store.zcard(KEYS.queue_key(name, "active")) == 2, timeout=60)
    assert gauge() == 8  # two running, eight waiting for a slot
    now = time.time()
    sample(state, [name], now=now - 120)
    store.set(gate, 1)
    assert res.get(timeout=60) == sum(range(10))
    assert gauge() == 0
    sample(state, [name], now=now - 60)
    waiting = {m.minute: m.values["window_waiting"] for m in read_minutes(state, name)}
    assert waiting[int((now - 120) // 60)] == 8 and waiting[int((now - 60) // 60)] == 0

    browser.get(site.url + "/")
    figures = browser.execute_script(
        f"return Array.from(document.querySelectorAll('#charts-{name} figure.chart'))"
        ".map(f => f.id);"
    )
    held = figures.index(f"chart-{name}-held")
    assert figures[held + 1] == f"chart-{name}-window_waiting"  # drawn beside the held
    caption = browser.find_element("css selector", f"#chart-{name}-window_waiting figcaption").text
    assert caption.startswith("children waiting in windows") and "peak 8" in caption
    count = browser.find_element("css selector", f"#queue-{name} .count-window-waiting").text
    assert count == "0"
    shot(browser, "window-waiting.png", height=560)
