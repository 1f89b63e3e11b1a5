"""What a chord costs on the flow engine (``echomq_chords = True``) against Celery's own chord.

    python benchmarks/chord_cost.py            # 5 rounds of each figure
    python benchmarks/chord_cost.py --quick    # 3 rounds (a few minutes)
    python benchmarks/chord_cost.py --batch 50 # the engine's chords 50 header tasks a message

One private redis-server (broker, result backend and flow store, as benchmarks/bench.py sets
them) and one real prefork ``celery worker`` (-c 2). The same canvas, ``chord([add.s(i, i)
...], tsum.s())``, is sent with the setting off (Celery's chord: ``chord``) and on (the
engine: ``chord-engine``), the two interleaved in every round, the order rotating:

(a) kept after it finished: 10 chords x 100 header tasks sent on a flushed backend and store,
    waited for, settled; then the keys (DBSIZE) and ``used_memory`` added per header task,
    with ``MEMORY USAGE`` summed over every key left, by key pattern, and, for the engine,
    the bytes of each field of a finished child's row;
(b) the peak of ``used_memory`` (INFO sampled every 50 ms from a thread) while one chord of
    5,000 runs, above what the server held before it was sent;
(c) the end-to-end time of chords of 100, 500 and 5,000 and of 20 chords x 50: send to the
    body's result stored (as benchmarks/bench.py times a round), medians of the rounds.

Memory and key counts do not depend on the machine's load; the times do (the load average is
printed beside them). Results go to benchmarks/results/chord-cost-<time>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import bench_app
import modes
import redis
from measure import HERE, Size, machine, med, rotated, settle
from modes import CHORD_ENGINE, Waiter, only_queue, result_ids

MODES = ("chord", CHORD_ENGINE)
KEPT = Size(10, 100)
PEAK = Size(1, 5000)
TIMED = (Size(1, 100), Size(1, 500), Size(1, 5000), Size(20, 50))
DBS = sorted({bench_app.BROKER_DB, bench_app.BACKEND_DB, bench_app.STORE_DB})
SAMPLE = 50  # keys of a pattern whose MEMORY USAGE is read (the rest counted at their mean)
ROW = re.compile(rb"^emq:\{[^}]*\}:JOB[^:]*$")
ID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|JOB[0-9a-f]{32}")


def used_memory(admin: Any) -> int:
    return int(admin.info("memory")["used_memory"])


def dbsize(admin_for: Any) -> int:
    return sum(int(admin_for(db).dbsize()) for db in DBS)


def flush(admin_for: Any) -> None:
    """Backend and store emptied; the broker's db keeps its queue bindings."""
    for db in DBS:
        if db != bench_app.BROKER_DB:
            admin_for(db).flushdb()


def pattern(key: bytes, client: Any) -> str:
    name = ID.sub(b"<id>", key).decode()
    if ROW.match(key):
        # A row: a parent's keeps a template or a payload with children, a child's its parent.
        return name + (" (child row)" if client.hexists(key, "parent") else " (parent row)")
    return name


def breakdown(admin_for: Any, before: dict[int, set[bytes]]) -> dict[str, dict[str, float]]:
    """Every key added since ``before``, by pattern: how many, and MEMORY USAGE (a sample's
    mean times the count)."""
    found: dict[str, list[tuple[int, bytes]]] = defaultdict(list)
    for db in DBS:
        client = admin_for(db)
        for key in set(client.scan_iter(count=1000)) - before[db]:
            found[f"db{db} {pattern(key, client)}"].append((db, key))
    out: dict[str, dict[str, float]] = {}
    for name, keys in sorted(found.items()):
        sample = keys[:SAMPLE]
        sizes = [int(admin_for(db).memory_usage(k, samples=0) or 0) for db, k in sample]
        ttls = [int(admin_for(db).ttl(k)) for db, k in sample]
        out[name] = {
            "keys": len(keys),
            "bytes": sum(sizes) / len(sizes) * len(keys),
            "mean_ttl_s": sum(ttls) / len(ttls),
        }
    return out


def row_fields(admin_for: Any) -> dict[str, float]:
    """The engine's finished child rows: mean bytes of each field (name + value), and the
    share of the rows in each of Redis's encodings."""
    client = admin_for(bench_app.STORE_DB)
    sums: dict[str, int] = defaultdict(int)
    encodings: dict[str, int] = defaultdict(int)
    rows = 0
    for key in client.scan_iter(match="emq:*:JOB*", count=1000):
        if not ROW.match(key) or client.type(key) != b"hash":
            continue
        row = client.hgetall(key)
        if b"parent" not in row:
            continue
        rows += 1
        encodings[f"encoding: {client.object('encoding', key).decode()}"] += 1
        for field, value in row.items():
            sums[field.decode()] += len(field) + len(value)
        if rows >= SAMPLE:
            break
    if not rows:
        return {}
    fields = {f: v / rows for f, v in sorted(sums.items(), key=lambda kv: -kv[1])}
    # A value over 64 bytes makes the row a hashtable rather than a listpack: several times
    # its bytes (Redis's hash-max-listpack-value).
    return {**fields, **{e: n / rows for e, n in encodings.items()}}


# ``--batch N``: the engine's chords also with ``echomq_chord_batch = N`` (their header tasks
# delivered up to N a message); None: one message a header task, as Celery sends them.
BATCH: list[int | None] = [None]


@contextlib.contextmanager
def hook(mode: str) -> Iterator[None]:
    """The engine's chords: the producer decides where a chord it sends fans in."""
    bench_app.app.conf.echomq_chords = mode == CHORD_ENGINE
    bench_app.app.conf.echomq_chord_batch = BATCH[0] if mode == CHORD_ENGINE else None
    try:
        yield
    finally:
        bench_app.app.conf.echomq_chords = False
        bench_app.app.conf.echomq_chord_batch = None


def timed(admin: Any, waiter: Waiter, mode: str, size: Size) -> float:
    """Seconds from the first send to the last body's result stored, the values checked."""
    canvases = modes.build(mode, size, None)
    timeout = max(120.0, size.total / 20)
    only_queue("celery")
    settle(admin)
    with hook(mode):
        t0 = time.perf_counter()
        results = [c.apply_async() for c in canvases]
    waiter.wait([i for res in results for i in result_ids(mode, res)], timeout)
    took = time.perf_counter() - t0
    for res in results:
        if res.get(timeout=timeout) != modes.expected(mode, size):
            raise AssertionError(f"{mode} {size.label}: wrong value")
    return took


def kept(admin_for: Any, admin: Any, waiter: Waiter, mode: str, hook: Any) -> dict[str, Any]:
    canvases = modes.build(mode, KEPT)
    flush(admin_for)
    settle(admin)
    time.sleep(0.2)
    keys_before = {db: set(admin_for(db).scan_iter(count=1000)) for db in DBS}
    n_before, mem_before = dbsize(admin_for), used_memory(admin)
    with hook(mode):
        results = [c.apply_async() for c in canvases]
    waiter.wait([r.id for r in results], 300)
    for r in results:
        if r.get(timeout=60) != modes.expected(mode, KEPT):
            raise AssertionError(f"{mode}: wrong value")
    settle(admin)
    time.sleep(0.2)
    tasks = KEPT.total
    out: dict[str, Any] = {
        "keys_per_task": (dbsize(admin_for) - n_before) / tasks,
        "used_memory_per_task": (used_memory(admin) - mem_before) / tasks,
        "patterns": breakdown(admin_for, keys_before),
    }
    out["key_bytes_per_task"] = sum(p["bytes"] for p in out["patterns"].values()) / tasks
    if mode == CHORD_ENGINE:
        out["child_row_fields"] = row_fields(admin_for)
    return out


class Sampler(threading.Thread):
    """``used_memory`` every 50 ms until stopped: its peak."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url)
        self.peak = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, used_memory(self.client))
            self.done.wait(0.05)


def peak(admin_for: Any, admin: Any, waiter: Waiter, url: str, mode: str, hook: Any) -> float:
    canvases = modes.build(mode, PEAK)
    flush(admin_for)
    settle(admin)
    time.sleep(0.2)
    base = used_memory(admin)
    sampler = Sampler(url)
    sampler.start()
    with hook(mode):
        results = [c.apply_async() for c in canvases]
    waiter.wait([r.id for r in results], 600)
    settle(admin)
    sampler.done.set()
    sampler.join()
    for r in results:
        r.get(timeout=60)
    return float(sampler.peak - base)


def ratio(engine: float, celery: float) -> str:
    return f"{engine / celery:.2f}x" if celery else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 rounds of each figure")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 5, --quick 3)")
    p.add_argument(
        "--batch",
        type=int,
        help="the engine's chords with echomq_chord_batch = N (default: off, one message a task)",
    )
    args = p.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 5)
    BATCH[0] = args.batch
    report: dict[str, Any] = {"machine": machine(), "rounds": rounds, "batch": args.batch}
    load = [os.getloadavg()[0]]
    with contextlib.ExitStack() as stack:
        base = modes.private_worker(stack)
        clients: dict[int, Any] = {}

        def admin_for(db: int) -> Any:
            if db not in clients:
                clients[db] = redis.Redis.from_url(f"{base}/{db}")
            return clients[db]

        admin = admin_for(0)
        waiter = Waiter(admin_for(bench_app.BACKEND_DB))
        for mode in MODES:  # warm: script cache, templates, queue bindings
            timed(admin, waiter, mode, Size(2, 20))

        kept_runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
        peaks: dict[str, list[float]] = defaultdict(list)
        times: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for rnd in range(rounds):
            for mode in rotated(MODES, rnd):
                kept_runs[mode].append(kept(admin_for, admin, waiter, mode, hook))
            for mode in rotated(MODES, rnd):
                peaks[mode].append(peak(admin_for, admin, waiter, f"{base}/0", mode, hook))
            flush(admin_for)
            for size in TIMED:
                for mode in rotated(MODES, rnd):
                    times[size.label][mode].append(timed(admin, waiter, mode, size))
            load.append(os.getloadavg()[0])
            print(
                f"chord_cost: round {rnd + 1}/{rounds} done, load {load[-1]:.2f}", file=sys.stderr
            )

    def kept_med(mode: str, what: str) -> float:
        return med([r[what] for r in kept_runs[mode]])

    lines = [
        f"rounds {rounds}, load average {min(load):.2f}-{max(load):.2f} (2 cores shared); "
        f"echomq_chord_batch {args.batch or 'off'}",
        "",
    ]
    lines.append("| figure | chord-engine | chord (Celery) | engine / Celery |")
    lines.append("|---|---|---|---|")
    for what, label, unit in (
        ("keys_per_task", "keys per header task, after 10 x 100", "{:.2f}"),
        ("used_memory_per_task", "used_memory per header task, after 10 x 100", "{:,.0f} B"),
        ("key_bytes_per_task", "MEMORY USAGE per header task, after 10 x 100", "{:,.0f} B"),
    ):
        e, c = kept_med(CHORD_ENGINE, what), kept_med("chord", what)
        lines.append(f"| {label} | {unit.format(e)} | {unit.format(c)} | {ratio(e, c)} |")
    e, c = med(peaks[CHORD_ENGINE]), med(peaks["chord"])
    lines.append(
        f"| peak used_memory above start, chord of 5,000 | {e / 2**20:.1f} MiB "
        f"| {c / 2**20:.1f} MiB | {ratio(e, c)} |"
    )
    for label, by_mode in times.items():
        e, c = med(by_mode[CHORD_ENGINE]), med(by_mode["chord"])
        per_round = ", ".join(
            f"{a / b:.2f}" for a, b in zip(by_mode[CHORD_ENGINE], by_mode["chord"], strict=True)
        )
        lines.append(
            f"| end to end, {label} | {e * 1000:,.0f} ms | {c * 1000:,.0f} ms "
            f"| {ratio(e, c)} (rounds: {per_round}) |"
        )
    for mode in MODES:
        lines += ["", f"{mode}: what is kept after 10 x 100, by key pattern (last round)"]
        for name, p in kept_runs[mode][-1]["patterns"].items():
            lines.append(
                f"  {name:<60} {p['keys'] / KEPT.total:5.2f} keys/task "
                f"{p['bytes'] / KEPT.total:7.1f} B/task  ttl {p['mean_ttl_s']:,.0f} s"
            )
    fields = kept_runs[CHORD_ENGINE][-1].get("child_row_fields", {})
    if fields:
        lines += [
            "",
            "chord-engine: a finished header task's row, bytes of each field (name+value)",
        ]
        lines += [f"  {f:<20} {b:6.2f}" for f, b in fields.items()]
    print("\n".join(lines))
    report.update(kept=dict(kept_runs), peaks=dict(peaks), times=times, load=load, table=lines)
    out = HERE / "results" / f"chord-cost-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=dict))
    print(f"\nchord_cost: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
