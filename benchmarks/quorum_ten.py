"""A quorum's run as it happens: 10 children, ``quorum=3``, on a real prefork worker.

    python3 dev.py bench quorum-ten            # 10 replicas, the first 3 answers
    python3 dev.py bench quorum-ten --concurrency 4

Ten "replicas" answer after different delays (child i sleeps ``DELAYS[i]`` seconds); the
worker runs ``--concurrency`` of them at once (prefetch 1, acks late: a process holds one
message at a time). Printed per child: its delay, whether its body started and finished
(each body marks both in Redis), its row's state in the store, its Celery result's state, and
whether its value was counted (one of the values the parent got); then what the parent got,
in the order the children succeeded, and the three kinds of children counted: ran and
counted, ran (running when the quorum was met) and finished but not counted, cancelled
before starting. A private redis-server, broker, backend and store on three of its databases.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from celery.result import AsyncResult

import celery_echomq
from celery_echomq import flow

ROOT = Path(__file__).resolve().parent.parent

ENV_VAR = "ECHOMQ_QUORUM_TEN_REDIS"
# Seconds each replica takes: three fast ones among slower ones, none in the children's order.
DELAYS = [2.0, 0.4, 3.0, 0.2, 2.5, 0.6, 4.0, 1.5, 3.5, 5.0]
NEED = 3

app = Celery("quorum_ten")


def configure(url: str) -> None:
    app.conf.update(
        broker_url=f"{url}/0",
        result_backend=f"{url}/1",
        echomq_redis_url=f"{url}/2",
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=1,
        task_acks_late=True,
    )
    celery_echomq.install(app)


if os.environ.get(ENV_VAR):
    configure(os.environ[ENV_VAR])


def _marks() -> redis.Redis:
    return redis.Redis.from_url(f"{os.environ[ENV_VAR]}/3")


@app.task
def replica(i: int, delay: float) -> int:
    """One replica's answer: marks its start, sleeps, marks its end, returns i."""
    _marks().set(f"started:{i}", time.time())
    time.sleep(delay)
    _marks().set(f"finished:{i}", time.time())
    return i


@app.task
def first_answers(values: list[int]) -> list[int]:
    return values


def run(url: str, concurrency: int) -> None:
    from celery_echomq.embedded import WorkerProcess

    marks = redis.Redis.from_url(f"{url}/3")
    store = redis.Redis.from_url(f"{url}/2")
    keys = celery_echomq.get_state(app).keys
    log = Path(tempfile.mkdtemp(prefix="quorum_ten-")) / "worker.log"
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), str(ROOT)]))
    env = {**os.environ, ENV_VAR: url, "PYTHONPATH": path}
    with WorkerProcess("quorum_ten", log=log, cwd=Path(__file__).parent, env=env,
                       concurrency=concurrency, ready_timeout=90):  # fmt: skip
        kids = [replica.s(i, d) for i, d in enumerate(DELAYS)]
        ids = [kid.freeze().id for kid in kids]
        started = time.monotonic()
        res = flow(first_answers.s(), kids, quorum=NEED).apply_async()
        got = res.get(timeout=60)
        took = time.monotonic() - started
        counted = set(res.children_values())
        time.sleep(max(DELAYS) + 1)  # the children still running finish meanwhile
        rows = []
        for i, cid in enumerate(ids):
            row = store.hget(keys.job_key("celery", cid), "state")
            rows.append(
                (
                    i,
                    DELAYS[i],
                    marks.exists(f"started:{i}") == 1,
                    marks.exists(f"finished:{i}") == 1,
                    (row or b"-").decode(),
                    AsyncResult(cid, app=app).state,
                    cid in counted,
                )
            )
    print(f"flow(first_answers.s(), [replica.s(i, delay) ...], quorum={NEED}) on a prefork "
          f"worker (-c {concurrency}, prefetch 1, acks late)")  # fmt: skip
    print(f"{'child':>5} {'sleeps':>6} {'started':>7} {'finished':>8} {'row':>9} "
          f"{'Celery':>8} {'counted':>7}")  # fmt: skip
    for i, delay, began, ended, row_state, celery_state, used in rows:
        print(f"{i:>5} {delay:>5.1f}s {_yn(began):>7} {_yn(ended):>8} {row_state:>9} "
              f"{celery_state:>8} {_yn(used):>7}")  # fmt: skip
    print(f"parent got {got} (in the order they succeeded) {took:.2f} s after apply_async")
    ran_counted = [r[0] for r in rows if r[2] and r[6]]
    ran_uncounted = [r[0] for r in rows if r[2] and not r[6]]
    never = [r[0] for r in rows if not r[2]]
    print(f"ran and counted: {ran_counted}")
    print(f"running when the quorum was met, finished, not counted: {ran_uncounted}")
    print(f"cancelled before starting (never ran): {never}")


def _yn(flag: Any) -> str:
    return "yes" if flag else "no"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args(argv)
    from celery_echomq.embedded import RedisServer

    with RedisServer() as server:
        url = f"redis://127.0.0.1:{server.port}"
        configure(url)
        run(url, args.concurrency)
    return 0


if __name__ == "__main__":
    sys.exit(main())
