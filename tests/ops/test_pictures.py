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
