"""RQ's peer: K parents, each ``depends_on`` its N ``add`` jobs (enqueued in one
``enqueue_many``), on two ``rq worker --worker-class rq.worker.SimpleWorker`` processes
(SimpleWorker: no fork per job); timed from the first enqueue to the last parent's return
value. Runs in the peers' virtualenv."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from protocol import expected_sum, serve

HERE = Path(__file__).resolve().parent
QUEUE = "peers"


def main() -> None:
    import rq
    import rq_tasks
    from redis import Redis
    from rq import Queue

    url = os.environ["PEERS_REDIS_URL"]
    conn = Redis.from_url(url)
    queue = Queue(QUEUE, connection=conn)
    log = open(os.environ.get("PEERS_LOG", os.devnull), "ab")  # noqa: SIM115 - lives with the workers
    cmd = [str(Path(sys.executable).parent / "rq"), "worker", "-u", url, "--worker-class",
           "rq.worker.SimpleWorker", "--logging_level", "WARNING", QUEUE]  # fmt: skip
    workers = [
        subprocess.Popen(cmd, cwd=HERE, stdout=log, stderr=subprocess.STDOUT) for _ in range(2)
    ]
    probe = queue.enqueue(rq_tasks.add, 1, 1)
    if probe.latest_result(timeout=60) is None:
        raise RuntimeError("the rq workers did not start")

    def run(flows: int, children: int) -> float:
        batches = [
            [Queue.prepare_data(rq_tasks.add, (i, i)) for i in range(children)]
            for _ in range(flows)
        ]
        t0 = time.perf_counter()
        parents = []
        for batch in batches:
            kids = queue.enqueue_many(batch)
            parents.append(queue.enqueue(rq_tasks.tsum, depends_on=kids))
        # Polled: a blocking read (latest_result(timeout=...)) outlasts the socket timeout
        # RQ gives its connection when the machine is loaded.
        values = []
        deadline = time.monotonic() + 90  # within the runner's wait for this answer
        for p in parents:
            result = p.latest_result()
            while result is None and time.monotonic() < deadline:
                time.sleep(0.005)
                result = p.latest_result()
            if result is None:
                deps = [d.get_status() for d in p.fetch_dependencies()]
                raise TimeoutError(
                    f"parent {p.id} is {p.get_status()} after 90 s, its dependencies {deps}"
                )
            values.append(result.return_value)
        seconds = time.perf_counter() - t0
        if values != [expected_sum(children)] * flows:
            raise AssertionError(f"wrong parent values: {values[:5]}")
        return seconds

    def stop() -> None:
        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w in workers:
            try:
                w.wait(20)
            except subprocess.TimeoutExpired:
                w.kill()

    serve(run, stop, rq.__version__)


if __name__ == "__main__":
    main()
