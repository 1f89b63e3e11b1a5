"""Dramatiq's peer: K groups of N ``add`` children, each with ``tsum`` as its completion
callback, on ``dramatiq --processes 2 --threads 1``; timed from the first enqueue to the last
callback's value (read from the results backend). Runs in the peers' virtualenv."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from protocol import expected_sum, serve

HERE = Path(__file__).resolve().parent


def main() -> None:
    import dramatiq
    import dramatiq_tasks as tasks

    log = open(os.environ.get("PEERS_LOG", os.devnull), "ab")  # noqa: SIM115 - lives with the worker
    worker = subprocess.Popen(
        [sys.executable, "-m", "dramatiq", "dramatiq_tasks", "--processes", "2", "--threads", "1",
         "--queues", tasks.QUEUE],
        cwd=HERE, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    # The workers are ready once one round trip goes through them.
    probe = tasks.add.send(1, 1)
    tasks.results.get_result(probe, block=True, timeout=60_000)

    def run(flows: int, children: int) -> float:
        groups = []
        for _ in range(flows):
            msgs = [tasks.add.message(i, i) for i in range(children)]
            parent = tasks.tsum.message([m.message_id for m in msgs])
            g = dramatiq.group(msgs)
            g.add_completion_callback(parent)
            groups.append((g, parent))
        t0 = time.perf_counter()
        for g, _ in groups:
            g.run()
        values = [tasks.results.get_result(p, block=True, timeout=600_000) for _, p in groups]
        seconds = time.perf_counter() - t0
        if values != [expected_sum(children)] * flows:
            raise AssertionError(f"wrong parent values: {values[:5]}")
        return seconds

    def stop() -> None:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()

    serve(run, stop, dramatiq.__version__)


if __name__ == "__main__":
    main()
