"""What tracing costs per flow child: end to end on a real prefork worker, and in Redis
commands (INFO commandstats, every database of one private redis-server).

Modes, each its own producer process and worker (tests/proj.py's app):
  absent     opentelemetry not importable (the [otel] extra not installed)
  api        opentelemetry-api importable, no SDK: OpenTelemetry's no-op tracer
  instr      SDK + opentelemetry-instrumentation-celery, celery-echomq's tracing off
             (ECHOMQ_OTEL=0): what the instrumentation alone costs
  echomq     SDK + the instrumentation + celery-echomq's tracing (the flow's span, links)
The SDK exports to a processor that drops the spans (no I/O counted).

    python3 dev.py bench tracing-cost                   # 3 rounds of 20 flows x 20 children
    python3 dev.py bench tracing-cost --rounds 5 --flows 10 --children 50
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODES = ("absent", "api", "instr", "echomq")


def mode_env(mode: str) -> dict[str, str]:
    env = {"PYTHONPATH": str(ROOT)}
    if mode == "absent":
        env["PYTHONPATH"] = f"{HERE / 'otel_block'}{os.pathsep}{ROOT}"
    if mode in ("instr", "echomq"):
        env["ECHOMQ_T_OTEL_NULL"] = "1"
    if mode == "instr":
        env["ECHOMQ_OTEL"] = "0"
    return env


def commands(client: Any) -> int:
    return sum(int(v["calls"]) for k, v in client.info("commandstats").items())


def driver(args: argparse.Namespace) -> None:
    """One mode: its worker, its rounds; prints one JSON line."""
    import redis

    from celery_echomq import flow
    from celery_echomq.embedded import WorkerProcess
    from tests import proj

    logs = Path(tempfile.mkdtemp(prefix="echomq-otel-cost-"))
    env = {**os.environ}
    worker = WorkerProcess(
        "tests.proj", log=logs / "w.log", cwd=ROOT, env=env, concurrency=2, name="cost"
    ).start()
    client = redis.Redis.from_url(os.environ["ECHOMQ_T_STORE"])
    try:
        flow(proj.tsum.s(), [proj.add.s(0, 0)]).apply_async().get(timeout=60)  # warm
        per_child, cmds = [], []
        for _ in range(args.rounds):
            n = args.flows * args.children
            before = commands(client)
            t0 = time.perf_counter()
            results = [
                flow(proj.tsum.s(), [proj.add.s(i, 1) for i in range(args.children)]).apply_async()
                for _ in range(args.flows)
            ]
            for res in results:
                res.get(timeout=120)
            per_child.append((time.perf_counter() - t0) / n * 1e6)
            time.sleep(1.0)  # the workers' lease ticks settle
            cmds.append((commands(client) - before) / n)
    finally:
        worker.stop()
    print(json.dumps({"rounds_us": per_child, "rounds_cmds": cmds}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flows", type=int, default=20)
    parser.add_argument("--children", type=int, default=20)
    parser.add_argument("--driver", choices=MODES, default=None)
    args = parser.parse_args()
    if args.driver:
        driver(args)
        return 0
    from celery_echomq.embedded import RedisServer

    rounds: dict[str, dict[str, list[float]]] = {m: {"us": [], "cmds": []} for m in MODES}
    with RedisServer() as server:
        # Each mode twice, in palindrome order, so that a drift of the shared machine over
        # the run weighs on every mode alike.
        for mode in (*MODES, *reversed(MODES)):
            env = {
                **os.environ,
                "ECHOMQ_T_BROKER": server.url(1),
                "ECHOMQ_T_BACKEND": server.url(2),
                "ECHOMQ_T_STORE": server.url(3),
                **mode_env(mode),
            }
            out = subprocess.run(
                [sys.executable, __file__, "--driver", mode, "--rounds", str(args.rounds),
                 "--flows", str(args.flows), "--children", str(args.children)],
                env=env, cwd=ROOT, capture_output=True, text=True, timeout=900,
            )  # fmt: skip
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            got = json.loads(out.stdout.strip().splitlines()[-1])
            rounds[mode]["us"] += got["rounds_us"]
            rounds[mode]["cmds"] += got["rounds_cmds"]
            print(mode, got, flush=True)
    report = {
        m: {"us": statistics.median(r["us"]), "cmds": statistics.median(r["cmds"])}
        for m, r in rounds.items()
    }
    print(json.dumps(report, indent=2))
    base = report["absent"]
    for mode in MODES[1:]:
        print(
            f"{mode:7} {report[mode]['us'] - base['us']:+8.1f} us/child "
            f"{report[mode]['cmds'] - base['cmds']:+6.2f} commands/child vs absent"
        )
    print(
        f"echomq vs instr: {report['echomq']['us'] - report['instr']['us']:+.1f} us/child, "
        f"{report['echomq']['cmds'] - report['instr']['cmds']:+.2f} commands/child"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
