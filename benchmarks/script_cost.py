"""Redis CPU of a flow's own scripts alone, per child: no broker, no worker, no pool.

    python benchmarks/script_cost.py                        # 200x5 and 20x50, 5 rounds
    python benchmarks/script_cost.py --sizes 10x1000 --window 20

K flows of N children are enqueued on a private redis-server with no worker; then this
process does what a worker's signal receivers do for each job, one script call at a time
(``Scripts.claim`` and ``Scripts.complete_settling``, the parent handed back inline, a
window's freed children claimed in turn), and reads the server's CPU (``INFO cpu``:
used_cpu_user + used_cpu_sys) around each phase: the enqueue, the children's claims, their
completions, the parents' claims and completions. What a real run adds (kombu's messages and
acks, the results' SUBSCRIBEs) is not here, so the figures move with the scripts alone and
spread far less than ``bench --peers``'s: the tool to compare two versions of the scripts
(run it from each tree, interleaved). ``commandstats`` gives the scripts' inner commands.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(HERE), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

import bench  # noqa: E402
import bench_app  # noqa: E402
import redis  # noqa: E402

from celery_echomq import flow  # noqa: E402
from celery_echomq.embedded import RedisServer  # noqa: E402
from celery_echomq.store.connection import text  # noqa: E402
from celery_echomq.store.script_values import Freed, ParentRef, ResultWrite  # noqa: E402
from celery_echomq.store.state import get_state  # noqa: E402
from celery_echomq.worker.claims import new_token  # noqa: E402

QUEUE = "celery"
PHASES = ("enqueue", "claim", "complete", "parent claim", "parent complete")


def cpu(admin: Any) -> float:
    info = admin.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def one_round(admin: Any, size: bench.Size, window: int | None) -> dict[str, float]:
    """One round's Redis CPU per 1,000 children, by phase (the server's CPU read at each
    phase's ends only). Without a window: every child claimed, then every child completed,
    then the parents claimed, then completed. With one, a child's claim and completion and
    the claims of the children it freed run in turn, so they count as one phase (claim)."""
    state = get_state(bench_app.app)
    scripts, keys = state.scripts, state.keys
    lease, ttl, chunk = (
        state.settings.stall_ms,
        state.settings.result_ttl,
        state.settings.chunk_size,
    )
    opts = {"max_active": window} if window else {}
    canvases = [
        flow(bench_app.tsum.s(), [bench_app.add.s(i, i) for i in range(size.children)], **opts)
        for _ in range(size.flows)
    ]
    bench.only_queue(QUEUE)
    spent = dict.fromkeys(PHASES, 0.0)
    c0 = cpu(admin)
    parents = [c.apply_async().id for c in canvases]
    spent["enqueue"] = cpu(admin) - c0
    client = state.client
    pending = keys.queue_key(QUEUE, "pending")
    ready: dict[str, list[tuple[str, int]]] = {}
    for pid in parents:
        kids = [text(c) for c in client.lrange(keys.job_key(QUEUE, pid) + ":children", 0, -1)]
        scores = [client.zscore(pending, k) for k in kids]
        ready[pid] = [(k, int(s)) for k, s in zip(kids, scores, strict=True) if s is not None]
    tokens: dict[str, str] = {}
    handed: dict[str, Any] = {}

    def claim(pid: str, kid: str, since: int) -> None:
        tokens[kid] = new_token()
        scripts.claim(QUEUE, kid, tokens[kid], lease, since=since, parent=pid)

    def complete(pid: str, kid: str) -> list[Freed]:
        result = ResultWrite(f"celery-task-meta-{kid}", '{"status": "SUCCESS"}', 86400)
        freed: list[Freed] = []
        _, _, got, _ = scripts.complete_settling(
            QUEUE,
            kid,
            tokens.pop(kid),
            ttl=ttl,
            is_parent=False,
            parent=ParentRef(pid, QUEUE),
            value=b"2",
            result=result,
            inline_max=chunk,
            freed=freed,
        )
        if got is not None:
            handed[pid] = got
        return freed

    c0 = cpu(admin)
    if window:
        for pid, kids in ready.items():
            while kids:
                kid, since = kids.pop()
                claim(pid, kid, since)
                kids.extend((f.id, f.since) for f in complete(pid, kid))
        spent["claim"] = cpu(admin) - c0
    else:
        for pid, kids in ready.items():
            for kid, since in kids:
                claim(pid, kid, since)
        c1 = cpu(admin)
        for pid, kids in ready.items():
            for kid, _ in kids:
                complete(pid, kid)
        spent["claim"], spent["complete"] = c1 - c0, cpu(admin) - c1
    if len(handed) < len(parents):
        print(f"  ({len(parents) - len(handed)} parents not released)", file=sys.stderr)
    parents = [p for p in parents if p in handed]
    c0 = cpu(admin)
    for pid in parents:
        tokens[pid] = new_token()
        scripts.claim(QUEUE, pid, tokens[pid], lease)
    c1 = cpu(admin)
    for pid in parents:
        scripts.complete_settling(
            QUEUE, pid, tokens.pop(pid), ttl=ttl, is_parent=True, parent=None, value=b"10"
        )
    spent["parent claim"], spent["parent complete"] = c1 - c0, cpu(admin) - c1
    return {p: v * 1e6 / size.total for p, v in spent.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=bench.parse_sizes, default=bench.parse_sizes("200x5,20x50"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--window", type=int, default=None, help="max_active of every flow")
    p.add_argument("--pid-file", type=Path, help="write the server's pid here, then wait 2 s")
    args = p.parse_args()
    with RedisServer() as server:
        base = f"redis://127.0.0.1:{server.port}"
        bench_app.configure(base)
        admin = redis.Redis.from_url(f"{base}/0")
        one_round(admin, bench.Size(4, 5), args.window)  # warm: scripts loaded
        if args.pid_file:  # for a profiler to attach to the server (perf record -p)
            args.pid_file.write_text(str(admin.info("server")["process_id"]))
            time.sleep(2)
        for size in args.sizes:
            rounds = []
            for _ in range(args.rounds):
                admin.flushall()
                time.sleep(0.05)
                rounds.append(one_round(admin, size, args.window))
            label = f"{size.label}" + (f" window {args.window}" if args.window else "")
            print(f"{label}: Redis CPU ms per 1,000 children, median [min-max] of {args.rounds}")
            for phase in (*PHASES, "total"):
                vals = [
                    sum(r[q] for q in PHASES if q != "enqueue") if phase == "total" else r[phase]
                    for r in rounds
                ]
                print(
                    f"  {phase:<18}{statistics.median(vals):8.1f}  "
                    f"[{min(vals):.1f}-{max(vals):.1f}]"
                )


if __name__ == "__main__":
    main()
