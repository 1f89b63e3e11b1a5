"""A get() that timed out leaves nothing to print when its result goes away: not while the
program runs on, nor at interpreter exit, even once the result backend is gone."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from celery_echomq.embedded import RedisServer
from tests.helpers import ROOT

SCRIPT = """
    import gc
    import sys

    import redis
    from celery import Celery

    import celery_echomq
    from celery_echomq import flow

    url = sys.argv[1]
    app = Celery("quiet", broker=url + "/1", backend=url + "/2")
    app.conf.echomq_redis_url = url + "/3"
    celery_echomq.install(app)


    @app.task
    def add(x, y):
        return x + y


    @app.task
    def tsum(values):
        return sum(values)


    def main():
        res = flow(tsum.s(), [add.s(1, 2)]).apply_async()  # no worker: it never finishes
        try:
            res.get(timeout=0.5)
        except Exception as exc:
            print("timed out:", type(exc).__name__, flush=True)
        kept.append(flow(tsum.s(), [add.s(2, 2)]).apply_async())
        try:
            kept[-1].get(timeout=0.2)
        except Exception:
            pass
        # The result backend goes away while both results still wait for their outcome.
        redis.Redis.from_url(url).shutdown(nosave=True)


    kept = []
    main()
    gc.collect()  # the first result goes here; the second at interpreter exit
"""


def test_a_timed_out_get_leaves_no_noise_when_its_result_goes_away() -> None:
    server = RedisServer().start()
    try:
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(SCRIPT), server.url()[: -len("/0")]],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        server.stop()
    assert done.stdout.startswith("timed out: TimeoutError"), done.stderr
    assert "Exception ignored" not in done.stderr
    assert "Traceback" not in done.stderr
