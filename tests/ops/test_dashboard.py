"""``celery echomq dashboard`` as a person uses it: pages in a real headless Chromium
(Selenium), the JSON and metrics routes over HTTP, the actions, and the real command.

The browser tests need Debian's ``chromium`` and ``chromium-driver`` (``/usr/bin/chromium``,
``/usr/bin/chromedriver``); they are skipped, saying so, when those are absent.
"""

from __future__ import annotations

import base64
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from celery.bin.celery import celery as celery_main
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from celery_echomq import flow
from tests.helpers import (
    KEYS,
    LOGDIR,
    REBOUND,
    ROOT,
    Env,
    Served,
    free_port,
    id_of,
    wait_for,
    with_id,
)

pytestmark = pytest.mark.e2e

CELERY = (sys.executable, "-m", "celery")
# Where the held-flow screenshot goes: the README's picture when asked for, else the logs.
SCREENSHOT = Path(os.environ.get("ECHOMQ_DASHBOARD_SCREENSHOT") or LOGDIR / "dashboard.png")


def state_of(store: redis.Redis, job_id: str, queue: str = "celery") -> str | None:
    value = store.hget(KEYS.job_key(queue, job_id), "state")
    return value.decode() if value is not None else None


@pytest.fixture
def gate(store: redis.Redis) -> Iterator[str]:
    """A gate key for `proj.gated`; always opened at the end so no worker stays blocked."""
    name = f"test:gate:{uuid.uuid4().hex}"
    yield name
    store.set(name, 1)


def node_state(driver: Any, job_id: str) -> str | None:
    """The state the page shows for ``job_id`` (None while it is not drawn)."""
    # Read in one script: the page refreshes itself, and an element found by one call may be
    # gone by the next (a stale element reference).
    state: str | None = driver.execute_script(
        "const e = document.getElementById(arguments[0]);"
        "return e ? e.getAttribute('data-state') : null;",
        f"job-{job_id}",
    )
    return state


def text_of(driver: Any, element_id: str) -> str | None:
    """The text of the element ``element_id`` (None while it is not on the page), read in one
    script for the same reason as ``node_state``."""
    text: str | None = driver.execute_script(
        "const e = document.getElementById(arguments[0]);return e ? e.textContent : null;",
        element_id,
    )
    return text


def line_of(driver: Any, job_id: str) -> str:
    """The text of ``job_id``'s own line in the tree (without its children's lines)."""
    script = (
        "const li = document.getElementById(arguments[0]);"
        "return Array.from(li.children).filter(c => c.tagName !== 'UL')"
        ".map(c => c.textContent).join(' ');"
    )
    return str(driver.execute_script(script, f"job-{job_id}"))


def held_flow(proj: Any, store: redis.Redis, gate: str) -> tuple[Any, str, str]:
    """A flow of two children: one done, one running until ``gate`` opens."""
    fast, slow = with_id(proj.add.s(2, 2)), with_id(proj.gated.s(5, gate))
    res = flow(proj.tsum.s(), [fast, slow]).apply_async()
    wait_for(lambda: state_of(store, id_of(slow)) == "active", timeout=60)
    wait_for(lambda: state_of(store, id_of(fast)) == "done", timeout=60)
    return res, id_of(fast), id_of(slow)


# --- the flow page, in a browser ----------------------------------------------------------------


def test_a_held_flow_shows_its_running_child_then_turns_done(
    proj: Any, worker: Any, store: redis.Redis, gate: str, serve: Any, browser: Any
) -> None:
    res, fast, slow = held_flow(proj, store, gate)
    site = serve()
    browser.get(f"{site.url}/flows/{res.id}")

    wait_for(lambda: node_state(browser, slow) == "active", timeout=30)
    assert node_state(browser, res.id) == "awaiting_children"
    assert node_state(browser, fast) == "done"
    assert "value=4" in line_of(browser, fast)
    assert "tests.proj.gated" in line_of(browser, slow) and "attempts=1" in line_of(browser, slow)
    # Names, arguments, start, end and runtime of each job.
    assert "tests.proj.add" in line_of(browser, fast) and "(2, 2)" in line_of(browser, fast)
    assert f"(5, '{gate}')" in line_of(browser, slow)
    assert re.search(r"start \d\d:\d\d:\d\d\.\d{3} · end \d\d:", line_of(browser, fast))
    assert re.search(r"runtime \d+\.\d\ds", line_of(browser, fast))
    assert "end - · runtime -" in line_of(browser, slow)  # still running
    root = line_of(browser, res.id)
    assert "tests.proj.tsum" in root and "done=1/2" in root and "outstanding=1" in root
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    browser.set_window_size(1500, 480)  # the tree, without the empty page below it
    try:
        assert browser.save_screenshot(str(SCREENSHOT))
    finally:
        browser.set_window_size(1280, 720)

    store.set(gate, 1)  # the running child finishes: the page follows without a reload
    wait_for(lambda: node_state(browser, res.id) == "done", timeout=60)
    assert node_state(browser, slow) == "done"
    assert "value=5" in line_of(browser, slow)
    assert "value=9" in line_of(browser, res.id)
    summary = browser.find_element("id", "summary")
    assert summary.text.startswith("parent done · 2/2 children finished")
    assert re.search(r"end \d\d:\d\d:\d\d\.\d{3} · runtime \d", line_of(browser, slow))
    browser.set_window_size(1500, 480)  # and done: every job with its start, end and runtime
    try:
        assert browser.save_screenshot(str(SCREENSHOT.with_name(SCREENSHOT.stem + "-done.png")))
    finally:
        browser.set_window_size(1280, 720)


def test_the_front_page_lists_a_flow_as_held_then_recent_and_a_failed_one_as_failed(
    proj: Any, worker: Any, store: redis.Redis, gate: str, serve: Any, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    res, _, _ = held_flow(proj, store, gate)
    failing = flow(proj.tsum.s(), [proj.boom.s("disk full")]).apply_async()
    wait_for(lambda: state_of(store, failing.id) == "failed", timeout=60)
    site = serve()

    def row(table: str, job_id: str) -> Any:
        found = browser.find_elements(By.CSS_SELECTOR, f"#{table}-celery tr[data-id='{job_id}']")
        return found[0] if found else None

    browser.get(site.url + "/")
    assert row("held", res.id).get_attribute("data-state") == "awaiting_children"
    assert row("recent", res.id) is not None
    assert row("held", failing.id) is None
    failed_row = row("failed", failing.id)
    assert failed_row is not None and "ValueError: disk full" in failed_row.text
    held_count = int(browser.find_element(By.CSS_SELECTOR, "#queue-celery .count-held").text)
    assert held_count >= 1
    # A list's count is the rows it shows: the failed flows beside the failed flows' table.
    for table in ("held", "failed", "recent"):
        shown = browser.find_elements(By.CSS_SELECTOR, f"#{table}-celery tr.flow-row")
        count = browser.find_element(By.CSS_SELECTOR, f"#{table}-celery .listed-count").text
        assert int(count) == len(shown)
    assert "tests.proj.tsum" in row("held", res.id).text  # the task, not only the id

    store.set(gate, 1)
    wait_for(lambda: state_of(store, res.id) == "done", timeout=60)
    browser.get(site.url + "/")
    assert row("held", res.id) is None
    assert row("recent", res.id).get_attribute("data-state") == "done"
    # A click on the row's id opens the flow's own page.
    row("recent", res.id).find_element(By.TAG_NAME, "a").click()
    wait_for(lambda: node_state(browser, res.id) == "done", timeout=30)


# --- actions ------------------------------------------------------------------------------------


def test_the_cancel_button_cancels_a_held_flow(
    proj: Any, worker: Any, store: redis.Redis, gate: str, serve: Any, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    res, _, slow = held_flow(proj, store, gate)
    site = serve(allow_actions=True)
    browser.get(f"{site.url}/flows/{res.id}")
    wait_for(lambda: node_state(browser, res.id) == "awaiting_children", timeout=30)

    browser.find_element(By.ID, "action-cancel").click()
    assert f"flow {res.id} cancelled" in wait_for(lambda: text_of(browser, "note"), timeout=30)
    wait_for(lambda: node_state(browser, res.id) == "cancelled", timeout=30)
    assert state_of(store, res.id) == "cancelled"
    assert state_of(store, slow) == "cancelled"
    assert "?note=" in browser.current_url  # POST, then a redirect: a reload repeats nothing

    # A cancelled flow offers no action; a POST sent all the same is refused with a reason.
    assert browser.find_elements(By.ID, "actions") == []
    again = httpx.post(f"{site.url}/flows/{res.id}/cancel", data={"token": site.token})
    assert (
        again.status_code == 303
        and "already%20finished%20%28cancelled%29" in again.headers["location"]
    )


def test_the_retry_button_runs_a_failed_flow_again(
    proj: Any, worker: Any, store: redis.Redis, serve: Any, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    flag = f"test:flag:{uuid.uuid4().hex}"
    bad = with_id(proj.flaky.s(5, flag))
    res = flow(proj.tsum.s(), [with_id(proj.add.s(1, 1)), bad]).apply_async()
    wait_for(lambda: state_of(store, res.id) == "failed", timeout=60)
    site = serve(allow_actions=True)
    browser.get(f"{site.url}/flows/{res.id}")
    wait_for(lambda: node_state(browser, res.id) == "failed", timeout=30)
    assert "ValueError: flag" in line_of(browser, id_of(bad))
    # The progress bar is full (every child settled) and says the flow failed: not green.
    bar = browser.find_element(By.ID, "bar")
    assert bar.get_attribute("class") == "failed"
    assert bar.value_of_css_property("accent-color") == "rgb(229, 57, 53)"

    store.set(flag, 1)  # what made the child fail is fixed: retry it from the page
    browser.find_element(By.ID, "action-retry").click()
    assert "1 child(ren) published again" in wait_for(lambda: text_of(browser, "note"), timeout=30)
    wait_for(lambda: node_state(browser, res.id) == "done", timeout=60)
    assert node_state(browser, id_of(bad)) == "done"
    assert browser.find_element(By.ID, "bar").get_attribute("class") == "done"
    assert "attempts=2" in line_of(browser, id_of(bad)) and "value=5" in line_of(
        browser, id_of(bad)
    )
    assert "value=7" in line_of(browser, res.id)


def test_the_release_button_runs_a_held_parent_with_the_values_so_far(
    proj: Any, worker: Any, store: redis.Redis, gate: str, serve: Any, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    res, _, slow = held_flow(proj, store, gate)
    site = serve(allow_actions=True)
    browser.get(f"{site.url}/flows/{res.id}")
    wait_for(lambda: node_state(browser, res.id) == "awaiting_children", timeout=30)

    browser.find_element(By.ID, "action-release").click()
    note = wait_for(lambda: text_of(browser, "note"), timeout=30)
    assert "released with 1 value(s); 1 child(ren) outstanding" in note
    assert res.get(timeout=60) == 4  # the parent ran with the done child's value alone
    wait_for(lambda: node_state(browser, res.id) == "done", timeout=60)
    assert node_state(browser, slow) == "active"  # still running: released, not revoked
    # Released: no second release is offered.
    assert browser.find_elements(By.ID, "action-release") == []


def test_without_allow_actions_there_are_no_buttons_and_a_post_is_refused(
    proj: Any, worker: Any, store: redis.Redis, gate: str, serve: Any, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    res, _, _ = held_flow(proj, store, gate)
    site = serve()
    browser.get(f"{site.url}/flows/{res.id}")
    wait_for(lambda: node_state(browser, res.id) == "awaiting_children", timeout=30)
    assert browser.find_elements(By.ID, "actions") == []
    assert browser.find_elements(By.TAG_NAME, "button") == []

    for action in ("cancel", "retry", "release"):
        refused = httpx.post(f"{site.url}/flows/{res.id}/{action}", data={"token": site.token})
        assert refused.status_code == 403
        assert "--allow-actions" in refused.text
    assert state_of(store, res.id) == "awaiting_children"


def test_a_cross_site_post_is_refused_and_changes_nothing(
    proj: Any, worker: Any, store: redis.Redis, gate: str, serve: Any
) -> None:
    res, _, _ = held_flow(proj, store, gate)
    site = serve(allow_actions=True)
    url = f"{site.url}/flows/{res.id}/cancel"

    no_token = httpx.post(url, data={})
    assert no_token.status_code == 403 and "action token" in no_token.text
    for guess in ("guessed", "géssed"):
        wrong = httpx.post(url, data={"token": guess})
        assert wrong.status_code == 403 and "action token" in wrong.text
    foreign = httpx.post(
        url, data={"token": site.token}, headers={"Origin": "https://evil.example"}
    )
    assert foreign.status_code == 403 and "cross-site" in foreign.text
    unknown = httpx.post(f"{site.url}/flows/{res.id}/explode", data={"token": site.token})
    assert unknown.status_code == 404 and "allowed: cancel, retry, release" in unknown.text
    assert state_of(store, res.id) == "awaiting_children"


# --- the JSON and metrics routes ----------------------------------------------------------------


def show_json(job_id: str) -> Any:
    out = CliRunner().invoke(
        celery_main,
        ["-A", "tests.proj", "echomq", "show", "--json", job_id],
        catch_exceptions=False,
    )
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


def test_api_flows_serves_the_json_of_show(
    proj: Any, worker: Any, store: redis.Redis, gate: str, serve: Any
) -> None:
    site = serve()
    res, _, _ = held_flow(proj, store, gate)
    held = httpx.get(f"{site.url}/api/flows/{res.id}")
    assert held.status_code == 200 and held.headers["content-type"] == "application/json"
    assert held.json() == show_json(res.id)
    assert held.json()["state"] == "awaiting_children"

    ok, bad = with_id(proj.add.s(1, 2)), with_id(proj.boom.s("404").set(parent_policy="ignore"))
    done = flow(proj.tsum.s(), [ok, bad]).apply_async()
    assert done.get(timeout=60) == 3
    wait_for(lambda: state_of(store, done.id) == "done", timeout=30)
    tree = httpx.get(f"{site.url}/api/flows/{done.id}").json()
    assert tree == show_json(done.id)
    assert tree["value"] == 3 and tree["children"][1]["outcome"] == "ignored"

    unknown = httpx.get(f"{site.url}/api/flows/JOBnosuchflow")
    assert unknown.status_code == 404
    assert unknown.json() == {
        "error": "no job 'JOBnosuchflow' in Redis (never started, or expired)"
    }
    ill = httpx.get(f"{site.url}/api/flows/task-42")
    assert ill.status_code == 400 and "must be JOB-namespaced" in ill.json()["error"]


def scrape(site: Served) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = httpx.get(f"{site.url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        assert family.name.startswith("echomq_")
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_metrics_parse_and_count_a_flows_transitions(
    proj: Any, start_worker: Any, own_queue: Any, store: redis.Redis, gate: str, serve: Any
) -> None:
    # A queue of the test's own, with a worker of its own: every count below is this test's.
    name = own_queue("metrics")
    start_worker(queues=name, concurrency=1)
    site = serve()
    q = (("queue", name),)

    def failures(policy: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return ("echomq_child_failures_total", (("policy", policy), ("queue", name)))

    # While a flow waits for its running child: held and active.
    slow = with_id(proj.gated.s(7, gate))
    waiting = flow(proj.tsum.s(), [slow]).apply_async(queue=name)
    wait_for(lambda: state_of(store, id_of(slow), name) == "active", timeout=60)
    samples = scrape(site)
    assert samples[("echomq_held", q)] == 1
    assert samples[("echomq_active", q)] == 1
    assert samples[("echomq_releases_total", q)] == 0
    store.set(gate, 1)
    assert waiting.get(timeout=60) == 7

    ok = flow(proj.tsum.s(), [proj.add.s(1, 1), proj.boom.s().set(parent_policy="ignore")])
    assert ok.apply_async(queue=name).get(timeout=60) == 2
    failed = flow(proj.tsum.s(), [proj.boom.s("no")]).apply_async(queue=name)
    wait_for(lambda: state_of(store, failed.id, name) == "failed", timeout=60)
    wait_for(lambda: state_of(store, waiting.id, name) == "done", timeout=30)
    samples = scrape(site)

    assert samples[("echomq_pending", q)] == 0
    assert samples[("echomq_active", q)] == 0
    assert samples[("echomq_held", q)] == 0
    # The failed set: two failed children and the parent the second one failed.
    assert samples[("echomq_failed", q)] == 3
    assert samples[("echomq_recent_flows", q)] == 3
    assert samples[("echomq_releases_total", q)] == 2  # the failed flow was never released
    assert samples[("echomq_dispatches_total", q)] == 2
    assert samples[failures("ignore")] == 1
    assert samples[failures("fail")] == 1
    assert samples[failures("remove")] == samples[failures("continue")] == 0
    assert samples[("echomq_republished_total", q)] == 0
    assert samples[("echomq_duplicates_skipped_total", q)] == 0


# --- the real command ---------------------------------------------------------------------------


def test_the_dashboard_command_serves_on_loopback_read_only(
    proj: Any, worker: Any, env: Env, store: redis.Redis, gate: str
) -> None:
    res, _, _ = held_flow(proj, store, gate)
    port = free_port()
    log = open(LOGDIR / f"dashboard-{port}.log", "w")  # noqa: SIM115 (closed below)
    process = subprocess.Popen(
        [*CELERY, "-A", "tests.proj", "echomq", "dashboard", "--port", str(port)],
        cwd=ROOT,
        env=env.environ(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert process.poll() is None, (LOGDIR / f"dashboard-{port}.log").read_text()
            try:
                return httpx.get(url + "/", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, timeout=60, interval=0.2)
        said = (LOGDIR / f"dashboard-{port}.log").read_text()
        assert f"echomq dashboard on http://127.0.0.1:{port}/ (read-only)" in said
        page = httpx.get(url + "/").text
        assert f'data-id="{res.id}" data-state="awaiting_children"' in page
        assert httpx.get(f"{url}/api/flows/{res.id}").json() == show_json(res.id)
        assert 'echomq_held{queue="celery"}' in httpx.get(url + "/metrics").text
        assert httpx.post(f"{url}/flows/{res.id}/cancel").status_code == 403
        assert state_of(store, res.id) == "awaiting_children"
        if shutil.which("ss"):
            # Bound to loopback only, by default: the one listening socket's local address.
            listening = subprocess.run(
                ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True
            ).stdout.splitlines()
            assert [line.split()[3] for line in listening] == [f"127.0.0.1:{port}"]
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def test_the_dashboard_refuses_actions_beyond_loopback_without_auth_and_warns(
    proj: Any, env: Env
) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CELERY, "-A", "tests.proj", "echomq", "dashboard", *args],
            cwd=ROOT, env=env.environ(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    refused = run("--host", "0.0.0.0", "--port", str(free_port()), "--allow-actions")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "needs --basic-auth USER:PASSWORD" in refused.stderr
    bad = run("--basic-auth", "nocolon", "--port", str(free_port()))
    assert bad.returncode == 1 and "--basic-auth must be USER:PASSWORD" in bad.stderr


# --- safe to expose -----------------------------------------------------------------------------


def test_every_response_refuses_framing(
    proj: Any, worker: Any, store: redis.Redis, gate: str, serve: Any, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    res, _, _ = held_flow(proj, store, gate)
    site = serve(allow_actions=True)
    for path in ("/", f"/flows/{res.id}", f"/api/flows/{res.id}", "/metrics"):
        headers = httpx.get(site.url + path).headers
        assert headers["x-frame-options"] == "DENY"
        assert "frame-ancestors 'none'" in headers["content-security-policy"]

    # An attacker's page (another origin) frames the flow page under a button of its own.
    attack = (
        f'<h1 id="bait">Win a prize</h1><iframe id="victim" src="{site.url}/flows/{res.id}" '
        'width="900" height="500"></iframe><iframe id="control" src="/own.html"></iframe>'
    )
    pages = {"/": attack, "/own.html": '<p id="own">framable</p>'}

    class Attacker(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.get(self.path, "").encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    evil = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Attacker)
    threading.Thread(target=evil.serve_forever, daemon=True).start()
    try:
        browser.get(f"http://localhost:{evil.server_address[1]}/")
        wait_for(lambda: browser.find_elements(By.ID, "bait"), timeout=30)
        browser.switch_to.frame("control")  # a page that allows framing loads in a frame
        wait_for(lambda: browser.find_elements(By.ID, "own"), timeout=30)
        browser.switch_to.default_content()
        browser.switch_to.frame("victim")
        assert browser.find_elements(By.ID, "action-cancel") == []  # nothing to click
        assert browser.find_elements(By.ID, f"job-{res.id}") == []  # nothing shown
        browser.switch_to.default_content()
    finally:
        browser.switch_to.default_content()
        evil.shutdown()
    assert state_of(store, res.id) == "awaiting_children"


def test_a_rebound_host_name_gets_neither_the_page_nor_the_action(
    proj: Any, worker: Any, store: redis.Redis, gate: str, serve: Any, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    res, _, _ = held_flow(proj, store, gate)
    site = serve(allow_actions=True)
    # The attacker's name resolves to this machine: the browser sends Host: REBOUND.
    browser.get(f"http://{REBOUND}:{site.port}/flows/{res.id}")
    body = browser.find_element(By.TAG_NAME, "body").text
    assert f"host '{REBOUND}' is not one this dashboard answers" in body
    assert site.token not in browser.page_source
    posted = httpx.post(
        f"{site.url}/flows/{res.id}/cancel",
        data={"token": site.token},
        headers={"Host": f"{REBOUND}:{site.port}"},
    )
    assert posted.status_code == 400
    assert state_of(store, res.id) == "awaiting_children"
    # The name it is really reached by is answered once allowed.
    from celery_echomq.ops.dashboard import Exposure

    named = serve(exposure=Exposure.of("127.0.0.1", [REBOUND]))
    browser.get(f"http://{REBOUND}:{named.port}/flows/{res.id}")
    wait_for(lambda: node_state(browser, res.id) == "awaiting_children", timeout=30)


def test_basic_auth_guards_every_route(
    proj: Any, worker: Any, store: redis.Redis, gate: str, serve: Any
) -> None:
    from celery_echomq.ops.dashboard import Exposure

    res, _, _ = held_flow(proj, store, gate)
    site = serve(allow_actions=True, exposure=Exposure.of("127.0.0.1", (), "ops:s3cret", True))
    for path in ("/", f"/flows/{res.id}", "/metrics"):
        anonymous = httpx.get(site.url + path)
        assert anonymous.status_code == 401
        assert anonymous.headers["www-authenticate"].startswith("Basic")
        assert httpx.get(site.url + path, auth=("ops", "wrong")).status_code == 401
        assert httpx.get(site.url + path, auth=("ops", "s3cret")).status_code == 200
    refused = httpx.post(f"{site.url}/flows/{res.id}/cancel", data={"token": site.token})
    assert refused.status_code == 401 and state_of(store, res.id) == "awaiting_children"
    token = base64.b64encode(b"ops:s3cret").decode()
    page = httpx.get(f"{site.url}/flows/{res.id}", headers={"Authorization": f"Basic {token}"})
    assert 'id="action-cancel"' in page.text


def test_bad_cursors_and_states_are_a_400(proj: Any, worker: Any, serve: Any) -> None:
    site = serve()
    for query in (
        "?before=²",
        "?state=recent&cursor=" + "9" * 5000,
        "?state=recent&cursor=r:1:notajob",
        "?state=everything",
        "?cursor=r:1:JOBabc",
    ):
        response = httpx.get(site.url + "/" + query)
        assert response.status_code == 400, query
        assert response.text.strip()


# --- what a page shows --------------------------------------------------------------------------


def test_the_flow_page_is_rendered_on_the_server_with_only_the_allowed_buttons(
    proj: Any, worker: Any, store: redis.Redis, gate: str, serve: Any
) -> None:
    site = serve(allow_actions=True)
    res, fast, slow = held_flow(proj, store, gate)

    def buttons(job_id: str) -> list[str]:
        page = httpx.get(f"{site.url}/flows/{job_id}")
        assert page.status_code == 200
        return re.findall(r'id="action-(\w+)"', page.text)

    # Without JavaScript (a plain GET) the tree, names and arguments are all there.
    page = httpx.get(f"{site.url}/flows/{res.id}").text
    assert f'id="job-{fast}" data-state="done"' in page and "tests.proj.add" in page
    assert f'id="job-{slow}" data-state="active"' in page and "(2, 2)" in page
    assert buttons(res.id) == ["cancel", "release"]  # held: nothing failed to retry
    failing = flow(proj.tsum.s(), [proj.boom.s("no")]).apply_async()
    wait_for(lambda: state_of(store, failing.id) == "failed", timeout=60)
    assert buttons(failing.id) == ["retry"]
    done = flow(proj.tsum.s(), [proj.add.s(1, 1)]).apply_async()
    assert done.get(timeout=60) == 2
    wait_for(lambda: state_of(store, done.id) == "done", timeout=30)
    assert buttons(done.id) == []
    unknown = httpx.get(f"{site.url}/flows/JOBnosuchflow")
    assert unknown.status_code == 404 and "never started, or expired" in unknown.text


def test_the_live_tree_lists_a_chain_childs_steps_and_the_one_that_runs(
    proj: Any, worker: Any, store: redis.Redis, gate: str, serve: Any
) -> None:
    from celery import chain

    site = serve()
    steps = chain(proj.add.s(1, 1), proj.gated.s(gate), proj.add.s(1))
    sig = flow(proj.tsum.s(), [steps])
    sig.freeze()
    first, running, last = (str(t.options["task_id"]) for t in steps.tasks)
    res = sig.apply_async()
    wait_for(lambda: state_of(store, running) == "active", timeout=30)
    page = httpx.get(f"{site.url}/flows/{res.id}/live")
    assert page.status_code == 200
    html = page.text
    assert "chain of 3 steps, step 2 runs" in html
    # The steps in order, each with its state.
    at = [html.index(f'id="job-{sid}"') for sid in (first, running)]
    assert at == sorted(at)
    for sid, step_state in ((first, "done"), (running, "active"), (last, "waiting")):
        assert f'id="job-{sid}" data-state="{step_state}"' in html
        assert html.count(f'id="job-{sid}"') == 1  # each step once, the last too
    store.set(gate, 1)
    assert res.get(timeout=60) == 3


def test_a_flows_page_says_why_it_waits_on_too_few_replicas_and_what_heals_it(
    proj: Any, env: Any, own_queue: Any, serve: Any
) -> None:
    from celery import Celery

    import celery_echomq
    from tests.helpers import Served

    queue = own_queue("replicas")
    res = flow(proj.tsum.s(), [proj.add.s(1, 1)]).apply_async(queue=queue)  # no worker: held
    # The same store, read by a deployment that asks each transition for one replica: this
    # private redis-server has none.
    strict = Celery("strict", set_as_current=False)
    strict.conf.update(
        broker_url=env.broker, result_backend=env.backend, echomq_redis_url=env.store
    )
    strict.conf.echomq_min_replicas = 1
    celery_echomq.install(strict)
    site = Served(strict, allow_actions=False)
    try:
        page = httpx.get(f"{site.url}/flows/{res.id}", timeout=30).text
    finally:
        site.stop()
    found = re.search(r'<p class="error" id="waiting">([^<]*)</p>', page)
    assert found, page[-2000:]
    assert "has 0 replica(s) connected, fewer than echomq_min_replicas=1" in found.group(1)
    assert "Heals once that primary has 1 replica(s) connected" in found.group(1)
    # The deployment that asks for none: nothing of the kind.
    plain = httpx.get(f"{serve().url}/flows/{res.id}", timeout=30).text
    assert 'id="waiting"' not in plain
