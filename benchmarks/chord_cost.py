"""What a chord costs on the flow engine (``echomq_chords = True``) against Celery's own chord.

    python benchmarks/chord_cost.py            # 5 rounds of each figure
    python benchmarks/chord_cost.py --quick    # 3 rounds (a few minutes)
    python benchmarks/chord_cost.py --batch 50 # the engine's chords 50 header tasks a message
    python benchmarks/chord_cost.py --parts    # where a header task's bytes go

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

With ``--parts`` it shows instead where a header task's bytes go, structure by structure, as
``used_memory`` freed when each is deleted (medians of the rounds):

(a) one chord of ``--size`` (5,000) sent on queue ``idle``, which no worker consumes, so that
    its whole header waits at once: its messages, and for the engine its header tasks' rows,
    their pending-set entries and the flow's ``:children``; then the rows' state written again
    as one hash per flow (each child's id -> its state and its row's delta), the layout of a
    store with no row per child;
(b) 10 x 100 run to the end, as above; then, for the engine, its finished header tasks' rows
    deleted: what it would keep with a finished child's row folded into its flow;
(c) the peak of a chord of 5,000, and how many messages the broker still held at that peak;
    the engine's also with each finished header task's row deleted by a thread as soon as it
    sees it done: whether folding finished rows would lower the peak.

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
from collections.abc import Callable, Iterator
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
    """``used_memory`` every 50 ms until stopped: its peak, and how many messages the broker's
    queue still held at that moment."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url)
        self.peak, self.waiting = 0, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            now = used_memory(self.client)
            if now > self.peak:
                self.peak, self.waiting = now, int(self.client.llen("celery"))
            self.done.wait(0.05)


class Folder(threading.Thread):
    """``--parts``: deletes each finished header task's row as soon as it sees it done, what
    folding a finished child's row into its flow would free while the chord runs."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url)
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for key, row in child_rows(self.client, "celery").items():
                if row.get(b"state") == b"done":
                    self.client.delete(key)
            self.done.wait(0.05)


def peak(
    admin_for: Any, admin: Any, waiter: Waiter, url: str, mode: str, hook: Any, fold: bool = False
) -> dict[str, float]:
    """The peak above the start (bytes) and the messages waiting then; with ``fold``, each
    finished header task's row deleted as the chord runs (``--parts``)."""
    canvases = modes.build(mode, PEAK)
    flush(admin_for)
    settle(admin)
    time.sleep(0.2)
    base = used_memory(admin)
    sampler = Sampler(url)
    threads: list[Sampler | Folder] = [sampler]
    if fold:
        threads.append(Folder(url.rsplit("/", 1)[0] + f"/{bench_app.STORE_DB}"))
    for thread in threads:
        thread.start()
    with hook(mode):
        results = [c.apply_async() for c in canvases]
    waiter.wait([r.id for r in results], 600)
    settle(admin)
    for thread in threads:
        thread.done.set()
        thread.join()
    for r in results:
        r.get(timeout=60)
    return {"peak": float(sampler.peak - base), "waiting": float(sampler.waiting)}


# --- --parts: where a header task's bytes go ------------------------------------------------

IDLE = "idle"  # the queue no worker consumes: a chord sent there waits whole


def settled_memory(client: Any) -> int:
    time.sleep(0.2)  # the allocator's figures settle after a burst of frees
    return used_memory(client)


def freed(client: Any, keys: list[bytes], drop: Callable[[Any, bytes], Any] | None = None) -> int:
    """``used_memory`` freed by deleting ``keys`` (or by ``drop`` on each)."""
    before = settled_memory(client)
    pipe = client.pipeline(transaction=False)
    for key in keys:
        (drop or (lambda p, k: p.delete(k)))(pipe, key)
    pipe.execute()
    return before - settled_memory(client)


def child_rows(store: Any, queue: str) -> dict[bytes, dict[bytes, bytes]]:
    """Each header task's row on ``queue``'s slot (a row naming a parent), by key."""
    rows = {}
    for key in store.scan_iter(match=f"emq:{{{queue}}}:JOB*", count=1000):
        if ROW.match(key):
            row = store.hgetall(key)
            if b"parent" in row:
                rows[key] = row
    return rows


def waiting(admin_for: Any, mode: str, n: int) -> dict[str, float]:
    """One chord of ``n`` on the idle queue, taken apart structure by structure: bytes per
    header task each frees, and the rows' state written again as one hash per flow."""
    broker, store = admin_for(bench_app.BROKER_DB), admin_for(bench_app.STORE_DB)
    flush(admin_for)
    broker.delete(IDLE)
    start = settled_memory(broker)
    with hook(mode):
        modes.build(mode, Size(1, n), IDLE)[0].apply_async()
    out = {"everything it wrote": (settled_memory(broker) - start) / n}
    if mode == CHORD_ENGINE:
        rows = child_rows(store, IDLE)
        parent = next(iter(rows.values()))[b"parent"].decode()
        ids = [key.rsplit(b":JOB", 1)[1] for key in rows]
        pending = f"emq:{{{IDLE}}}:pending".encode()
        out["the header tasks' rows"] = freed(store, list(rows)) / n
        out["their pending-set entries"] = freed(store, [pending], lambda p, k: p.zrem(k, *ids)) / n
        out["the flow's :children"] = (
            freed(store, [f"emq:{{{IDLE}}}:JOB{parent}:children".encode()]) / n
        )
        flow = f"emq:{{{IDLE}}}:JOB{parent}:states"
        before = settled_memory(store)
        pipe = store.pipeline(transaction=False)
        for cid, row in zip(ids, rows.values(), strict=True):
            pipe.hset(flow, cid, b"p" + row.get(b"delta", b""))
        pipe.execute()
        out["the rows' state as one hash a flow"] = (settled_memory(store) - before) / n
        store.delete(flow)
    out["its messages"] = freed(broker, [IDLE.encode()]) / n
    parts = [v for k, v in out.items() if k != "everything it wrote" and "one hash" not in k]
    out["the rest"] = out["everything it wrote"] - sum(parts)
    return out


def finished(admin_for: Any, admin: Any, waiter: Waiter, mode: str) -> dict[str, float]:
    """10 x 100 run to the end, as (a); then, for the engine, its header tasks' rows deleted."""
    out = {"kept": float(kept(admin_for, admin, waiter, mode, hook)["used_memory_per_task"])}
    if mode == CHORD_ENGINE:
        rows = child_rows(admin_for(bench_app.STORE_DB), "celery")
        out["the finished header tasks' rows"] = (
            freed(admin_for(bench_app.STORE_DB), list(rows)) / KEPT.total
        )
        out["kept, less those rows"] = out["kept"] - out["the finished header tasks' rows"]
    return out


def parts_table(runs: dict[str, list[dict[str, float]]], title: str, fmt: str) -> list[str]:
    names = list(dict.fromkeys(k for rs in runs.values() for r in rs for k in r))
    lines = [f"| {title} | engine | Celery |", "|---|---|---|"]
    for name in names:
        cells = []
        for mode in (CHORD_ENGINE, "chord"):
            values = [r[name] for r in runs[mode] if name in r]
            cells.append(
                (fmt if "MiB" in name else "{:,.0f}").format(med(values)) if values else ""
            )
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return lines


def parts(admin_for: Any, waiter: Waiter, url: str, rounds: int, size: int) -> list[str]:
    """``--parts``: (a) a chord of ``size`` waiting whole, (b) 10 x 100 finished, (c) the peak
    of a chord of 5,000, the engine's also with finished rows deleted as it runs."""
    admin = admin_for(bench_app.BROKER_DB)
    waits: dict[str, list[dict[str, float]]] = defaultdict(list)
    ends: dict[str, list[dict[str, float]]] = defaultdict(list)
    peaks: dict[str, list[dict[str, float]]] = defaultdict(list)
    for rnd in range(rounds):
        for mode in rotated(MODES, rnd):
            settle(admin)
            waits[mode].append(waiting(admin_for, mode, size))
            ends[mode].append(finished(admin_for, admin, waiter, mode))
        for mode, fold in rotated(
            [("chord", False), (CHORD_ENGINE, False), (CHORD_ENGINE, True)], rnd
        ):
            found = peak(admin_for, admin, waiter, url, mode, hook, fold)
            tail = ", finished rows deleted as it runs" if fold else ""
            peaks[mode].append(
                {
                    f"peak MiB{tail}": found["peak"] / 2**20,
                    f"messages waiting then{tail}": found["waiting"],
                }
            )
        print(f"chord_cost --parts: round {rnd + 1}/{rounds} done", file=sys.stderr)
    return [
        *parts_table(waits, f"a chord of {size:,} waiting, B per header task", "{:,.0f}"),
        "",
        *parts_table(ends, "10 x 100 finished, B per header task", "{:,.0f}"),
        "",
        *parts_table(peaks, "a chord of 5,000 running", "{:,.1f}"),
    ]


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
    p.add_argument(
        "--parts",
        action="store_true",
        help="where a header task's bytes go, structure by structure (see the module's doc)",
    )
    p.add_argument("--size", type=int, default=5000, help="--parts: the waiting chord's size")
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
        if args.parts:
            lines = parts(admin_for, waiter, f"{base}/0", rounds, args.size)
            print("\n".join(lines))
            report.update(size=args.size, table=lines)
            return save(report, "chord-cost-parts")

        kept_runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
        peaks: dict[str, list[float]] = defaultdict(list)
        waiting_then: dict[str, list[float]] = defaultdict(list)
        times: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for rnd in range(rounds):
            for mode in rotated(MODES, rnd):
                kept_runs[mode].append(kept(admin_for, admin, waiter, mode, hook))
            for mode in rotated(MODES, rnd):
                found = peak(admin_for, admin, waiter, f"{base}/0", mode, hook)
                peaks[mode].append(found["peak"])
                waiting_then[mode].append(found["waiting"])
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
    e, c = med(waiting_then[CHORD_ENGINE]), med(waiting_then["chord"])
    lines.append(f"| messages on the broker at that peak | {e:,.0f} | {c:,.0f} | |")
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
    report.update(
        kept=dict(kept_runs),
        peaks=dict(peaks),
        waiting_then=dict(waiting_then),
        times=times,
        load=load,
        table=lines,
    )
    return save(report, "chord-cost")


def save(report: dict[str, Any], name: str) -> int:
    out = HERE / "results" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=dict))
    print(f"\nchord_cost: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
