"""The dashboard's pictures in docs/images/, taken from a real run: a private redis-server, a
real ``celery worker`` with the extension, real flows, the dashboard in this process, a
headless Chromium (Debian's ``chromium`` and ``chromium-driver``).

    .venv/bin/python docs/screenshots.py [--minutes 4] [--out docs/images]

For ``--minutes`` the script keeps starting flows (one with a failed child, a nested flow and
a chain; one with a window, ``max_active``; now and then one that fails), so that the worker's
recovery loop samples the queue once a minute as it would in production: the home page's
charts are those samples, nothing made up. Then it saves:

- ``timeline.png``: a finished flow's page: its failed child's traceback, the timeline of its
  children (a nested flow as one bar, a chain's steps), the parent's release;
- ``timeline-window.png``: a flow with a window while it runs: done, running and waiting bars;
- ``charts.png``: the home page's counts and its rates over time;
- ``workers.png``: the workers consuming the store's queues.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from celery import Celery, chain

import celery_echomq
from celery_echomq import flow

HERE = Path(__file__).resolve().parent
ENV_VAR = "ECHOMQ_SCREENSHOTS_REDIS"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"

app = Celery("screenshots")


def configure(url: str) -> None:
    """Broker, result backend and flow store on three databases of one Redis."""
    app.conf.update(
        broker_url=f"{url}/0",
        result_backend=f"{url}/1",
        echomq_redis_url=f"{url}/2",
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=1,
    )
    celery_echomq.install(app)


# The worker subprocess imports this module with the URL set by main().
if os.environ.get(ENV_VAR):
    configure(os.environ[ENV_VAR])


@app.task
def fetch(i: int, seconds: float) -> int:
    time.sleep(seconds)  # pretend to fetch page i
    return i


@app.task
def resize(i: int) -> int:
    return i + 1


@app.task
def upload(path: str) -> None:
    raise OSError(f"disk full writing {path}")


@app.task
def total(values: list[Any]) -> int:
    return sum(v for v in values if isinstance(v, int))


def report(n: int) -> Any:
    """A flow with a failed child (ignored: the flow goes on), a nested flow and a chain."""
    pages = [fetch.s(i, 0.3 + 0.25 * (i % 4)) for i in range(n)]
    broken = upload.s(f"/reports/{n}.pdf").set(parent_policy="ignore")
    inner = flow(total.s(), [fetch.s(i, 0.4) for i in range(3)])
    steps = chain(fetch.s(7, 0.3), resize.s())
    return flow(total.s(), [*pages, broken, inner, steps])


def windowed(n: int, width: int, seconds: float = 0.6) -> Any:
    return flow(total.s(), [fetch.s(i, seconds) for i in range(n)], max_active=width)


def browser() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


def shot(driver: Any, url: str, path: Path, width: int, until: str, most: int = 1100) -> None:
    """The page down to the bottom of the element ``until`` (a CSS selector), at most
    ``most`` pixels high."""
    driver.set_window_size(width, 800)
    driver.get(url)
    time.sleep(0.5)
    bottom = driver.execute_script(
        "const e = document.querySelector(arguments[0]);"
        "return Math.ceil(e.getBoundingClientRect().bottom + window.scrollY) + 12;",
        until,
    )
    chrome = driver.execute_script("return window.outerHeight - window.innerHeight;")
    driver.set_window_size(width, min(bottom, most) + chrome)
    time.sleep(0.3)
    assert driver.save_screenshot(str(path)), path
    print(f"  {path} ({path.stat().st_size // 1024} KB)")


def run(minutes: float, out: Path) -> None:
    from celery_echomq.embedded import RedisServer, WorkerProcess
    from celery_echomq.embedded.servers import free_port

    out.mkdir(parents=True, exist_ok=True)
    with RedisServer() as server:
        url = f"redis://127.0.0.1:{server.port}"
        env = {**os.environ, ENV_VAR: url, "PYTHONPATH": str(HERE)}
        log = Path(server.dir) / "worker.log"
        with WorkerProcess("screenshots", log=log, cwd=HERE, env=env, concurrency=4):
            configure(url)
            print(f"redis-server on {url}; a worker; flows for {minutes:g} minute(s)")
            until, i = time.time() + 60 * minutes, 0
            while time.time() < until:
                report(4 + i % 3).apply_async()
                windowed(8, 2).apply_async()
                if i % 4 == 3:
                    flow(total.s(), [fetch.s(0, 0.2), upload.s("/tmp/x")]).apply_async()
                i += 1
                time.sleep(8)
            # The flows the pictures show, started last: the windowed one pictured while it
            # runs (six done, three running, three waiting for a slot).
            shown = report(6).apply_async()
            shown.get(timeout=120)
            time.sleep(1)
            running = windowed(12, 3, seconds=2.0).apply_async()
            _pictures(free_port(), shown.id, running, out)
            running.get(timeout=120)


def _pictures(port: int, shown: str, running: Any, out: Path) -> None:
    import threading

    import uvicorn

    from celery_echomq.ops.dashboard import make_app

    server = uvicorn.Server(
        uvicorn.Config(make_app(app), host="127.0.0.1", port=port, log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    site = f"http://127.0.0.1:{port}"
    driver = browser()
    try:
        while running.dependencies().done < 6:
            time.sleep(0.1)
        shot(driver, f"{site}/flows/{running.id}", out / "timeline-window.png", 1200, "#timeline")
        shot(driver, f"{site}/flows/{shown}", out / "timeline.png", 1200, "#timeline")
        shot(driver, f"{site}/", out / "charts.png", 1400, ".release")
        shot(driver, f"{site}/workers", out / "workers.png", 1200, "table")
    finally:
        driver.quit()
        server.should_exit = True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=4.0, help="how long to run flows")
    parser.add_argument("--out", type=Path, default=HERE / "images", help="where the PNGs go")
    args = parser.parse_args()
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        print(f"needs {CHROMIUM} and {CHROMEDRIVER} (Debian: chromium chromium-driver)")
        return 2
    run(args.minutes, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
