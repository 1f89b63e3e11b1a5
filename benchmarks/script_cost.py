"""Redis CPU of a flow's own scripts alone, per child: no broker, no worker, no pool.

    python3 dev.py bench script-cost                        # 200x5 and 20x50, 5 rounds
    python3 dev.py bench script-cost --sizes 10x1000 --window 20

K flows of N children are enqueued on a private redis-server with no worker; then this
process does what a worker's signal receivers do for each job, one script call at a time
(``Scripts.claim`` and ``Scripts.complete_settling``, the parent handed back inline, a
window's freed children claimed in turn), and reads the server's CPU (``INFO cpu``:
used_cpu_user + used_cpu_sys) around each phase: the enqueue, the children's claims, their
completions, the parents' claims and completions. What a real run adds (kombu's messages and
acks, the results' SUBSCRIBEs) is not here, so the figures move with the scripts alone and
spread far less than ``bench peers``'s: the tool to compare two versions of the scripts
(``--against DIR``: the scripts of another tree (its ``celery_echomq/store/lua``) run too, round
for round with this tree's on the same server, and the report gives both and their per-round
ratio: two versions of the scripts compared with the least noise this machine allows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import bench_app
import redis
from measure import Size, parse_sizes, redis_cpu, rotated
from modes import only_queue

from celery_echomq import flow
from celery_echomq.embedded import RedisServer
from celery_echomq.store.connection import text
from celery_echomq.store.script_values import Freed, ParentRef, ResultWrite
from celery_echomq.store.state import get_state
from celery_echomq.worker.claims import new_token

QUEUE = "celery"
PHASES = ("enqueue", "claim", "complete", "parent claim", "parent complete")


def flows_per_block(size: Size) -> int:
    """Flows of ``size`` in a block of about 50 children: the sets take turns block by block."""
    return max(1, 50 // size.children)


def one_round(
    admin: Any, size: Size, window: int | None, sets: dict[str, dict[str, Any]]
) -> dict[str, dict[str, float]]:
    """One round's Redis CPU per 1,000 children, by set of scripts and phase. The flows are
    dealt to the sets in blocks of about 50 children, alternating, and every phase runs block
    by block, its set's scripts registered, the server's CPU read at each block's ends: both
    sets meet the same moments of a shared machine. Without a window: every child claimed,
    then every child completed, then the parents claimed, then completed. With one, a child's
    claim and completion and the claims of the children it freed run in turn, so they count
    as one phase (claim)."""
    state = get_state(bench_app.app)
    scripts, keys, runner = state.scripts, state.keys, state.scripts.runner
    lease, ttl, chunk = (
        state.settings.stall_ms,
        state.settings.result_ttl,
        state.settings.chunk_size,
    )
    opts = {"max_active": window} if window else {}
    names = list(sets)
    per_block = flows_per_block(size)
    blocks = [(names[(k // per_block) % len(names)], k) for k in range(size.flows)]
    canvases = [
        flow(bench_app.tsum.s(), [bench_app.add.s(i, i) for i in range(size.children)], **opts)
        for _ in range(size.flows)
    ]
    only_queue(QUEUE)
    spent = {name: dict.fromkeys(PHASES, 0.0) for name in names}
    children = {name: 0 for name in names}

    def by_block(phase: str, work: Any) -> None:
        """``work(k)`` for each flow k, a block at a time, timed under its set's scripts."""
        for first in range(0, size.flows, per_block):
            name = blocks[first][0]
            runner.registered = sets[name]
            c0 = redis_cpu(admin)
            for k in range(first, min(first + per_block, size.flows)):
                work(k)
            spent[name][phase] += redis_cpu(admin) - c0

    parents: list[str] = [""] * size.flows

    def enqueue(k: int) -> None:
        parents[k] = canvases[k].apply_async().id

    by_block("enqueue", enqueue)
    for name, _ in blocks:
        children[name] += size.children
    client = state.client
    pending = keys.queue_key(QUEUE, "pending")
    ready: list[list[tuple[str, int]]] = []
    for pid in parents:
        kids = [text(c) for c in client.lrange(keys.job_key(QUEUE, pid) + ":children", 0, -1)]
        scores = [client.zscore(pending, k) for k in kids]
        ready.append([(k, int(s)) for k, s in zip(kids, scores, strict=True) if s is not None])
    tokens: dict[str, str] = {}
    released: set[str] = set()

    def claim(pid: str, kid: str, since: int) -> None:
        tokens[kid] = new_token()
        scripts.claim(QUEUE, kid, tokens[kid], lease, since=since, parent=pid)

    def complete(pid: str, kid: str) -> list[Freed]:
        key = f"celery-task-meta-{kid}"
        result = ResultWrite(key, '{"status": "SUCCESS"}', 86400, channel=key)
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
            released.add(pid)
        return freed

    def run_windowed(k: int) -> None:
        kids = ready[k]
        while kids:
            kid, since = kids.pop()
            claim(parents[k], kid, since)
            kids.extend((f.id, f.since) for f in complete(parents[k], kid))

    if window:
        by_block("claim", run_windowed)
    else:
        by_block("claim", lambda k: [claim(parents[k], c, t) for c, t in ready[k]])
        by_block("complete", lambda k: [complete(parents[k], c) for c, _ in ready[k]])
    if len(released) < len(parents):
        print(f"  ({len(parents) - len(released)} parents not released)", file=sys.stderr)

    def parent_claim(k: int) -> None:
        if parents[k] in released:
            tokens[parents[k]] = new_token()
            scripts.claim(QUEUE, parents[k], tokens[parents[k]], lease)

    def parent_complete(k: int) -> None:
        if parents[k] in released:
            scripts.complete_settling(
                QUEUE,
                parents[k],
                tokens.pop(parents[k]),
                ttl=ttl,
                is_parent=True,
                parent=None,
                value=b"10",
            )

    by_block("parent claim", parent_claim)
    by_block("parent complete", parent_complete)
    return {
        name: {p: v * 1e6 / max(1, children[name]) for p, v in spent[name].items()}
        for name in names
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes("200x5,20x50"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--window", type=int, default=None, help="max_active of every flow")
    p.add_argument("--pid-file", type=Path, help="write the server's pid here, then wait 2 s")
    p.add_argument(
        "--against", type=bench_app.against_dir, help="another tree's celery_echomq/store/lua"
    )
    args = p.parse_args(argv)
    for size in args.sizes if args.against else ():
        if size.flows <= flows_per_block(size):
            p.error(
                f"--against takes turns in blocks of {flows_per_block(size)} flows of "
                f"{size.children}: {size.label} fills one block, none is left for the other "
                f"scripts (at least {flows_per_block(size) + 1} flows)"
            )
    with RedisServer() as server:
        base = f"redis://127.0.0.1:{server.port}"
        bench_app.configure(base)
        admin = redis.Redis.from_url(f"{base}/0")
        runner = get_state(bench_app.app).scripts.runner
        sets = {"this tree": dict(runner.registered)}
        if args.against:
            sets["against"] = bench_app.registered_from(runner.client, args.against)
        one_round(admin, Size(4, 5), args.window, sets)  # warm: scripts loaded
        if args.pid_file:  # for a profiler to attach to the server (perf record -p)
            args.pid_file.write_text(str(admin.info("server")["process_id"]))
            time.sleep(2)
        for size in args.sizes:
            rounds: dict[str, list[dict[str, float]]] = {name: [] for name in sets}
            for rnd in range(args.rounds):
                order = {n: sets[n] for n in rotated(list(sets), rnd)}
                admin.flushall()
                time.sleep(0.05)
                for name, got in one_round(admin, size, args.window, order).items():
                    rounds[name].append(got)
            label = f"{size.label}" + (f" window {args.window}" if args.window else "")
            print(f"{label}: Redis CPU ms per 1,000 children, median [min-max] of {args.rounds}")
            totals = {}
            for name, mine in rounds.items():
                print(f" {name}")
                for phase in (*PHASES, "total"):
                    vals = [
                        sum(r[q] for q in PHASES if q != "enqueue")
                        if phase == "total"
                        else r[phase]
                        for r in mine
                    ]
                    totals[name] = vals
                    print(
                        f"  {phase:<18}{statistics.median(vals):8.1f}  "
                        f"[{min(vals):.1f}-{max(vals):.1f}]"
                    )
            if "against" in totals:
                ratios = [
                    a / b for a, b in zip(totals["this tree"], totals["against"], strict=True)
                ]
                print(
                    f" this tree / against, total per round: median {statistics.median(ratios):.3f}"
                    f" [{min(ratios):.3f}-{max(ratios):.3f}]"
                )


if __name__ == "__main__":
    main()
