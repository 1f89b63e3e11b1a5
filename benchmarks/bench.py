"""flow vs chord vs a plain group, on one private Redis and one real prefork `celery worker`.

Modes: group, chord, flow, and flow-lean (a flow with echomq_child_results = False: its
children store no result in Celery's backend); beside the plain flow, what three capabilities
cost: flow-deadline (``flow(..., deadline=3600)``), flow-traced (OpenTelemetry's SDK in the
producer and in a second worker of the same options that runs the traced flows alone, tracing
being process-wide) and flow-batch (``flow(..., batch=50)``: the children delivered up to 50 a
broker message, each still a job of its own). Before the worker starts, flow's enqueue is
paired with BullMQ's FlowProducer (benchmarks/bullmq/, run with node; skipped with a message
where node is absent) on the same redis-server. Then, on the same worker, chain children: one
parent over N chains of S tasks as a flow (flow-chain) and as a chord with the chains in its
header (chord-chain), beside a flow and a chord over N*S plain children (--chains). The report
splits each mode's Redis commands by command name, per child and per flow (printed for flow,
chord and group at 200x5: "where the commands go"), and its closing table gives each target,
met or missed, with BullMQ's figure beside flow's, and the capabilities' costs and the chain
rows as information.

    python3 dev.py bench                 # the default run (tens of minutes)
    python3 dev.py bench --quick         # a smoke run (smaller sizes, 2 rounds: several minutes)
    python3 dev.py bench --sizes 20x50,2x1000 --rounds 5
    python3 dev.py bench --chains-only --chains 50x3,200x3   # the chain section alone
    python3 dev.py bench --enqueue-only --rounds 9   # enqueue vs BullMQ alone (about a minute)
    python3 dev.py bench --list          # the other benchmarks (dev.py bench peers, ...)

Every number is taken side by side: the modes run interleaved (the order rotates each round)
against the same worker, and the report gives medians and the per-round paired ratios, since
the machine is shared and an absolute time alone says little. Results go to
benchmarks/results/bench-<time>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import bench_app
import redis
from measure import (
    RESULTS,
    Deadline,
    Size,
    command_counts,
    command_delta,
    log,
    machine,
    med,
    parse_chain_sizes,
    parse_sizes,
    quartiles,
    rotated,
    settle,
    spread,
    time_limit,
)
from modes import (
    BATCH,
    BATCH_SIZE,
    BULLMQ_DIR,
    CHORD_ENGINE,
    DEADLINE,
    DEADLINE_S,
    LEAN,
    MODES,
    TRACED,
    Waiter,
    Worker,
    build,
    bullmq_ready,
    expected,
    only_queue,
    release_results,
    result_ids,
)
from report import (
    Run,
    fmt_rate,
    fmt_ratio,
    paired,
    profile,
    render,
    render_profile,
    render_targets,
    summarize,
    targets,
)

from celery_echomq.embedded import RedisServer

TRACED_QUEUE = "bench_traced"
BULLMQ_DB = 3
BULLMQ_SIZES = "10x1000,200x5"
HOLD_QUEUE = "bench_hold"  # no worker consumes it: what is enqueued there stays held
PLAIN_QUEUES = {"install": "plain_on", "no_install": "plain_off"}
DEFAULT_SIZES = "200x5,20x50,2x1000,1x10000"
QUICK_SIZES = "40x5,4x50,1x500"
# Chain children: N children, each a chain of S tasks, fanned in by one parent (flow-chain vs
# chord-chain), beside flow and chord over N*S plain children (the same number of tasks).
CHAIN_MODES = ("flow-chain", "chord-chain", "flow", "chord")
DEFAULT_CHAINS = "50x3,200x3"
ModeHook = Callable[[str], contextlib.AbstractContextManager[None]]


def all_keys(admin_for: Callable[[int], Any]) -> dict[int, set[bytes]]:
    dbs = (bench_app.BROKER_DB, bench_app.BACKEND_DB, bench_app.STORE_DB)
    return {db: set(admin_for(db).scan_iter(count=1000)) for db in dbs}


def run_once(
    admin: redis.Redis,  # type: ignore[type-arg]
    waiter: Waiter,
    mode: str,
    size: Size,
    rnd: int,
    hook: ModeHook,
    queue: str | None = None,
) -> Run:
    canvases = build(mode, size, queue)
    timeout = max(120.0, size.total / 20)
    only_queue(queue or "celery")
    settle(admin)
    before = command_counts(admin)
    polls = waiter.polls
    with hook(mode):
        t0 = time.perf_counter()
        results = [c.apply_async() for c in canvases]
        t1 = time.perf_counter()
    waiter.wait([i for res in results for i in result_ids(mode, res)], timeout)
    t2 = time.perf_counter()
    settle(admin)
    delta = command_delta(before, command_counts(admin))
    delta["exists"] = delta.get("exists", 0) - (waiter.polls - polls)
    delta = {k: v for k, v in delta.items() if v}
    # After the counters: reading the values also drains the producer's result subscriptions.
    for res in results:
        value = res.get(timeout=timeout)
        if value != expected(mode, size):
            raise AssertionError(f"{mode} {size.label}: wrong value {str(value)[:80]}")
    return Run(mode, size.label, rnd, size.total, t1 - t0, t2 - t0, sum(delta.values()), delta)


# --- held memory (no worker) --------------------------------------------------------------


@dataclass
class Held:
    mode: str
    size: str
    children: int
    used_memory: int
    key_bytes: int
    keys: int

    @property
    def used_memory_per_child(self) -> float:
        return self.used_memory / self.children

    @property
    def key_bytes_per_child(self) -> float:
        return self.key_bytes / self.children


def clear_held(admin_for: Callable[[int], Any]) -> None:
    # Only what a held run leaves: the broker's queue bindings must survive for later sends.
    admin_for(bench_app.BROKER_DB).delete(HOLD_QUEUE)
    admin_for(bench_app.BACKEND_DB).flushdb()
    admin_for(bench_app.STORE_DB).flushdb()


def measure_held(admin_for: Callable[[int], Any], mode: str, size: Size, hook: ModeHook) -> Held:
    admin = admin_for(0)
    canvases = build(mode, size, queue=HOLD_QUEUE)
    clear_held(admin_for)
    keys_before = all_keys(admin_for)
    time.sleep(0.1)
    mem_before = int(admin.info("memory")["used_memory"])
    with hook(mode):
        for c in canvases:
            c.apply_async()
    time.sleep(0.1)
    mem_after = int(admin.info("memory")["used_memory"])
    key_bytes = count = 0
    for db, keys in all_keys(admin_for).items():
        for key in keys - keys_before[db]:
            key_bytes += int(admin_for(db).memory_usage(key, samples=0) or 0)
            count += 1
    clear_held(admin_for)
    return Held(mode, size.label, size.total, mem_after - mem_before, key_bytes, count)


# --- plain tasks with and without install --------------------------------------------------


@dataclass
class PlainRun:
    variant: str
    round: int
    tasks: int
    e2e_s: float
    commands: int

    @property
    def rate(self) -> float:
        return self.tasks / self.e2e_s


def plain_once(
    admin: redis.Redis,  # type: ignore[type-arg]
    waiter: Waiter,
    variant: str,
    tasks: int,
    rnd: int,
) -> PlainRun:
    queue = PLAIN_QUEUES[variant]
    timeout = max(120.0, tasks / 20)
    settle(admin)
    before = command_counts(admin)
    polls = waiter.polls
    t0 = time.perf_counter()
    results = [bench_app.add.apply_async((i, i), queue=queue) for i in range(tasks)]
    waiter.wait([r.id for r in results], timeout)
    elapsed = time.perf_counter() - t0
    settle(admin)
    delta = command_delta(before, command_counts(admin))
    commands = sum(delta.values()) - (waiter.polls - polls)
    for i, res in enumerate(results):
        if res.get(timeout=timeout) != 2 * i:
            raise AssertionError(f"plain task {i} returned a wrong value")
    return PlainRun(variant, rnd, tasks, elapsed, commands)


# --- chain children: flow-chain vs chord-chain ---------------------------------------------


def chain_case(mode: str, size: Size) -> Size:
    """What ``mode`` runs for the chain size ``size``: the chains themselves, or (flow, chord)
    the same number of tasks as plain children of one parent."""
    return size if mode.endswith("-chain") else Size(1, size.children * size.steps)


# Ratios of the chain section, numerator/denominator, in the bench's convention: e2e is the
# numerator's tasks per second over the denominator's (>1: the numerator is faster, i.e. the
# denominator's time per round over the numerator's), cmds the numerator's over the other's.
CHAIN_RATIOS = ("flow-chain/chord-chain", "flow/chord", "flow-chain/flow", "chord-chain/chord")


def summarize_chains(runs: list[Run], size: Size) -> dict[str, Any]:
    out: dict[str, Any] = {
        "chains": size.children,
        "steps": size.steps,
        "tasks": size.total,
        "modes": {},
        "ratios": {},
    }
    for mode in CHAIN_MODES:
        mine = [r for r in runs if r.mode == mode]
        top: dict[str, int] = {}
        for r in mine:
            for cmd, n in r.by_command.items():
                top[cmd] = top.get(cmd, 0) + n
        out["modes"][mode] = {
            "canvas": f"{size.children} chains of {size.steps}"
            if mode.endswith("-chain")
            else f"{size.total} plain children",
            "e2e_s": spread([r.e2e_s for r in mine]),
            "enqueue_s": med([r.enqueue_s for r in mine]),
            "e2e_tasks_per_s": med([r.e2e_rate for r in mine]),
            "commands_per_task": med([r.commands_per_child for r in mine]),
            "commands_per_task_by_command": {
                cmd: round(n / sum(r.children for r in mine), 3)
                for cmd, n in sorted(top.items(), key=lambda kv: -kv[1])
            },
        }
    for key in CHAIN_RATIOS:
        num, den = key.split("/")
        out["ratios"][key] = {
            "e2e": spread(paired(runs, num, den, lambda r: r.e2e_rate)),
            "commands_per_task": spread(paired(runs, num, den, lambda r: r.commands_per_child)),
        }
    return out


def versus_chains(
    admin: redis.Redis,  # type: ignore[type-arg]
    waiter: Waiter,
    sizes: Sequence[Size],
    rounds: int,
    hook: ModeHook,
) -> dict[str, Any]:
    """Each chain size: the four modes interleaved (order rotating) against the running worker."""
    out: dict[str, Any] = {}
    for mode in CHAIN_MODES:  # warm up: the chain shapes' scripts and the chord's counters
        run_once(admin, waiter, mode, chain_case(mode, Size(1, 5, 3)), -1, hook)
    for size in sizes:
        label = f"{size.children}x{size.steps}"
        runs: list[Run] = []
        for rnd in range(rounds):
            for mode in rotated(CHAIN_MODES, rnd):
                run = run_once(admin, waiter, mode, chain_case(mode, size), rnd, hook)
                runs.append(run)
                log(
                    f"  {label:<8} round {rnd} {mode:<12} e2e {run.e2e_s * 1000:>7.0f} ms "
                    f"({run.e2e_rate:>6,.0f} tasks/s)  {run.commands_per_child:5.1f} cmds/task"
                )
        out[label] = {
            **summarize_chains(runs, size),
            "runs": [{**asdict(r), "e2e_rate": r.e2e_rate} for r in runs],
        }
    return out


def render_chains(chains: dict[str, Any]) -> str:
    w = max(len(x) for x in (*CHAIN_MODES, *CHAIN_RATIOS)) + 2
    head = (
        f"{'chains':<9}{'mode':<{w}}{'canvas':<20}{'e2e ms/round [min-max]':>26}"
        f"{'tasks/s':>10}{'cmds/task':>11}"
    )
    lines = [head, "-" * len(head)]
    for label, summary in chains.items():
        for mode, m in summary["modes"].items():
            t = m["e2e_s"]
            span = f"{t['median'] * 1000:,.0f} [{t['min'] * 1000:,.0f}-{t['max'] * 1000:,.0f}]"
            lines.append(
                f"{label:<9}{mode:<{w}}{m['canvas']:<20}{span:>26}"
                f"{fmt_rate(m['e2e_tasks_per_s']):>10}{m['commands_per_task']:>11.1f}"
            )
        for key, r in summary["ratios"].items():
            lines.append(
                f"{'':<9}{key:<{w}}{'':<20}{fmt_ratio(r['e2e']):>26}{'':>10}"
                f"{r['commands_per_task']['median']:>10.2f}x"
            )
        lines.append("")
    lines.append("chains NxS: one parent over N chains of S tasks (flow-chain, chord-chain); flow")
    lines.append("and chord: one parent over N*S plain children, the same number of tasks. An e2e")
    lines.append("ratio A/B is B's time per round over A's, median [min-max] of the per-round")
    lines.append("pairs (>1: A is faster); cmds/task counts every Redis command (INFO")
    lines.append("commandstats delta) per task run, the parent excluded from the count of tasks.")
    return "\n".join(lines)


@contextlib.contextmanager
def no_hook(_mode: str) -> Iterator[None]:
    yield


@contextlib.contextmanager
def lean_hook(mode: str) -> Iterator[None]:
    """``flow-lean``: the producer plans the flow with ``echomq_child_results = False``."""
    if mode != LEAN:
        yield
        return
    import dataclasses

    from celery_echomq.store.state import get_state

    state = get_state(bench_app.app)
    settings = state.settings
    state.settings = dataclasses.replace(settings, child_results=False)
    try:
        yield
    finally:
        state.settings = settings


class ProducerTracing:
    """The producer's side of ``flow-traced``: an SDK tracer for celery-echomq's send span
    and opentelemetry-instrumentation-celery's publish spans, on only while a flow-traced
    round enqueues (outside the clock: the other modes' producer stays as it is, with the
    API's no-op tracer). The provider is the bench's own, not the global one, and its spans
    are dropped as the traced worker's are."""

    def __init__(self) -> None:
        from opentelemetry.instrumentation.celery import CeleryInstrumentor
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        from tests.otel_setup import NullExporter

        self.provider = TracerProvider(resource=Resource.create({"service.name": "bench"}))
        self.provider.add_span_processor(SimpleSpanProcessor(NullExporter()))
        self.instrumentor = CeleryInstrumentor()  # type: ignore[no-untyped-call]

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        from importlib import metadata

        from celery_echomq import tracing

        saved = tracing._tracer
        tracing._tracer = self.provider.get_tracer(
            tracing.TRACER, metadata.version("celery-echomq")
        )
        self.instrumentor.instrument(tracer_provider=self.provider)
        try:
            yield
        finally:
            self.instrumentor.uninstrument()
            tracing._tracer = saved


def tracing_missing() -> str | None:
    """Why ``flow-traced`` cannot run here, or None."""
    from celery_echomq import tracing

    if not tracing.ON:
        return "the [otel] extra is not installed (or ECHOMQ_OTEL=0)"
    import importlib

    try:
        for name in ("opentelemetry.sdk.trace", "opentelemetry.instrumentation.celery"):
            importlib.import_module(name)
    except ImportError as exc:
        return f"no OpenTelemetry SDK or Celery instrumentation ({exc})"
    return None


def mode_hooks(traced: ProducerTracing | None) -> ModeHook:
    """``flow-lean``'s settings and ``flow-traced``'s producer tracing, each for its mode."""

    @contextlib.contextmanager
    def hook(mode: str) -> Iterator[None]:
        if mode == TRACED and traced is not None:
            with traced.on():
                yield
        elif mode == CHORD_ENGINE:
            # The producer decides where a chord it sends fans in.
            bench_app.app.conf.echomq_chords = True
            try:
                yield
            finally:
                bench_app.app.conf.echomq_chords = False
        else:
            with lean_hook(mode):
                yield

    return hook


# --- enqueue against BullMQ's FlowProducer ------------------------------------------------


def bullmq_once(base: str, size: Size) -> float:
    """Children per second BullMQ's FlowProducer enqueues, K flows of N (no worker)."""
    out = subprocess.run(
        [
            "node",
            str(BULLMQ_DIR / "flow_enqueue.js"),
            "--url",
            f"{base}/{BULLMQ_DB}",
            "--flows",
            str(size.flows),
            "--children",
            str(size.children),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the BullMQ peer failed: {out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return float(result["children"]) / float(result["seconds"])


def flow_enqueue_once(admin_for: Callable[[int], Any], size: Size) -> float:
    """Children per second ``flow(...).apply_async()`` enqueues, K flows of N (no worker)."""
    canvases = build("flow", size, queue=HOLD_QUEUE)
    clear_held(admin_for)
    t0 = time.perf_counter()
    for c in canvases:
        c.apply_async()
    elapsed = time.perf_counter() - t0
    clear_held(admin_for)
    return size.total / elapsed


def versus_bullmq(
    admin_for: Callable[[int], Any], base: str, sizes: Sequence[Size], rounds: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    flow_enqueue_once(admin_for, Size(2, 5))  # warm up
    for size in sizes:
        pairs: list[tuple[float, float]] = []
        for rnd in range(rounds):
            rates: dict[str, float] = {}
            for who in rotated(["flow", "bullmq"], rnd):
                if who == "flow":
                    rates[who] = flow_enqueue_once(admin_for, size)
                else:
                    rates[who] = bullmq_once(base, size)
            pairs.append((rates["flow"], rates["bullmq"]))
            log(
                f"  {size.label:<8} round {rnd} enqueue flow {rates['flow']:>9,.0f} ch/s  "
                f"BullMQ FlowProducer {rates['bullmq']:>9,.0f} ch/s"
            )
        ratios = [f / b for f, b in pairs]
        out[size.label] = {
            "flow_children_per_s": med([f for f, _ in pairs]),
            "bullmq_children_per_s": med([b for _, b in pairs]),
            "ratio": {"median": med(ratios), "min": min(ratios), "max": max(ratios)},
        }
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"smoke run: sizes {QUICK_SIZES}, 2 rounds")
    p.add_argument("--sizes", type=parse_sizes, help=f"KxN,... (default {DEFAULT_SIZES})")
    p.add_argument("--rounds", type=int, help="interleaved rounds per size (default 5)")
    p.add_argument("--plain-tasks", type=int, help="tasks per plain-task round (default 1000)")
    p.add_argument("--no-plain", action="store_true", help="skip the install/no-install ratio")
    p.add_argument("--no-held", action="store_true", help="skip the held-memory phase")
    p.add_argument(
        "--no-lean",
        action="store_true",
        help=f"skip {LEAN} (flow with echomq_child_results = False)",
    )
    p.add_argument(
        "--no-deadline",
        action="store_true",
        help=f"skip {DEADLINE} (flow with deadline={DEADLINE_S}, beside the plain flow)",
    )
    p.add_argument(
        "--no-traced",
        action="store_true",
        help=f"skip {TRACED} (flow with an OpenTelemetry SDK in producer and worker)",
    )
    p.add_argument(
        "--no-batch",
        action="store_true",
        help=f"skip {BATCH} (flow with batch={BATCH_SIZE}: up to {BATCH_SIZE} children a message)",
    )
    p.add_argument(
        "--bullmq-sizes",
        type=parse_sizes,
        help=f"KxN,... for enqueue vs BullMQ's FlowProducer (default {BULLMQ_SIZES})",
    )
    p.add_argument("--no-bullmq", action="store_true", help="skip enqueue vs BullMQ")
    p.add_argument(
        "--chains",
        type=parse_chain_sizes,
        help="NxS,... for N chain children of S steps, flow vs chord, beside N*S plain "
        f"children (default {DEFAULT_CHAINS}; --quick 20x3)",
    )
    p.add_argument(
        "--chain-rounds",
        type=int,
        help="interleaved rounds per chain size (default 9, --quick 3: its rounds are short)",
    )
    p.add_argument("--no-chains", action="store_true", help="skip the chain-children section")
    p.add_argument(
        "--chains-only",
        action="store_true",
        help="only the chain-children section (no held, BullMQ, KxN sizes or plain tasks)",
    )
    p.add_argument(
        "--enqueue-only",
        action="store_true",
        help="only enqueue vs BullMQ's FlowProducer (no worker, held, KxN sizes, chains or "
        "plain tasks)",
    )
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/bench-*.json)")
    p.add_argument("--max-seconds", type=int, default=1500, help="stop everything after this long")
    args = p.parse_args(argv)
    if args.sizes is None:
        args.sizes = parse_sizes(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    if args.bullmq_sizes is None:
        args.bullmq_sizes = parse_sizes("2x500,40x5" if args.quick else BULLMQ_SIZES)
    if args.plain_tasks is None:
        args.plain_tasks = 300 if args.quick else 1000
    if args.chains is None:
        args.chains = parse_chain_sizes("20x3" if args.quick else DEFAULT_CHAINS)
    if args.chain_rounds is None:
        args.chain_rounds = 3 if args.quick else 9
    if args.rounds < 1 or args.plain_tasks < 1 or args.chain_rounds < 1:
        p.error("--rounds, --chain-rounds and --plain-tasks must be positive")
    if args.chains_only and args.no_chains:
        p.error("--chains-only and --no-chains exclude each other")
    if args.chains_only:
        args.sizes, args.no_held, args.no_bullmq, args.no_plain = [], True, True, True
    if args.enqueue_only:
        args.sizes, args.chains, args.no_held, args.no_plain = [], [], True, True
    if args.no_chains:
        args.chains = []
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    with time_limit(args.max_seconds):
        return run(args)


def run(args: argparse.Namespace) -> dict[str, Any]:
    modes: list[str] = list(MODES if args.no_lean else (*MODES, LEAN))
    modes.append(CHORD_ENGINE)
    if not args.no_deadline:
        modes.append(DEADLINE)
    if not args.no_batch:
        modes.append(BATCH)
    traced: ProducerTracing | None = None
    if not args.no_traced and args.sizes:
        why_not = tracing_missing()
        if why_not is None:
            traced = ProducerTracing()
            modes.append(TRACED)
        else:
            log(f"bench: {TRACED} skipped: {why_not}")
    hook: ModeHook = mode_hooks(traced)
    started = time.time()
    report: dict[str, Any] = {
        "machine": machine(),
        "config": {
            "sizes": [s.label for s in args.sizes],
            "rounds": args.rounds,
            "plain_tasks": args.plain_tasks,
            "modes": list(modes),
            "deadline_s": DEADLINE_S if DEADLINE in modes else None,
            "traced": f"{TRACED} on a second worker (queue {TRACED_QUEUE}), same options, "
            "OpenTelemetry SDK + opentelemetry-instrumentation-celery, spans dropped"
            if TRACED in modes
            else None,
            "chains": [f"{s.children}x{s.steps}" for s in args.chains],
            "chain_rounds": args.chain_rounds,
            "worker": "celery worker -P prefork -c 2 --loglevel WARNING "
            "--without-gossip --without-mingle --without-heartbeat",
        },
        "modes": list(modes),
        "sizes": {},
        "held": {},
        "held_ratios": {},
        "held_detail": [],
        "runs": [],
    }
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(RedisServer())
        stack.callback(release_results)
        base = f"redis://127.0.0.1:{server.port}"
        bench_app.configure(base)
        clients: dict[int, Any] = {}

        def admin_for(db: int) -> Any:
            if db not in clients:
                clients[db] = redis.Redis.from_url(f"{base}/{db}")
            return clients[db]

        admin = admin_for(0)
        waiter = Waiter(admin_for(bench_app.BACKEND_DB))
        report["machine"]["redis_server"] = admin.info("server")["redis_version"]
        log(f"bench: private redis-server on {base}")

        if not args.no_held:
            log("bench: held memory (no worker consuming)")
            held_modes = [m for m in modes if m in (*MODES, LEAN)]
            for mode in held_modes:  # warm up allocations, script cache and queue bindings
                measure_held(admin_for, mode, Size(1, 5), hook)
            for size in args.sizes:
                got: dict[tuple[str, int], float] = {}
                # Rounds, the order rotating, as for the other figures: used_memory moves
                # with the allocator's state, and one measure is one sample of it.
                for rnd in range(args.rounds):
                    for mode in rotated(held_modes, rnd):
                        held = measure_held(admin_for, mode, size, hook)
                        report["held_detail"].append({**asdict(held), "round": rnd})
                        got[(mode, rnd)] = held.used_memory_per_child
                report["held"][size.label] = {
                    m: med([got[(m, k)] for k in range(args.rounds)]) for m in held_modes
                }
                report["held_ratios"][size.label] = {
                    f"{m}/chord": spread(
                        [got[(m, k)] / got[("chord", k)] for k in range(args.rounds)]
                    )
                    for m in held_modes
                    if m.startswith("flow") and got[("chord", 0)]
                }

        if not args.no_bullmq:
            why = bullmq_ready()
            if why is not None:
                log(f"bench: enqueue vs BullMQ's FlowProducer skipped: {why}")
            else:
                log("bench: enqueue, flow vs BullMQ's FlowProducer (no worker consuming)")
                report["bullmq"] = versus_bullmq(admin_for, base, args.bullmq_sizes, args.rounds)

        if args.sizes:
            log(f"bench: {' / '.join(modes)} against one worker")
        # The KxN sizes and the chain section run against one worker (none for --enqueue-only).
        worker = Worker(base, "celery") if args.sizes or args.chains else None
        if worker is not None:
            stack.callback(worker.stop)
        queues: dict[str, str] = {}
        traced_worker: Worker | None = None
        if TRACED in modes:
            traced_worker = Worker(base, TRACED_QUEUE, extra_env={bench_app.ENV_OTEL: "1"})
            stack.callback(traced_worker.stop)
            queues[TRACED] = TRACED_QUEUE
        for mode in modes if args.sizes else ():
            run_once(admin, waiter, mode, Size(5, 20), -1, hook, queues.get(mode))
        runs: list[Run] = []
        for size in args.sizes:
            size_runs: list[Run] = []
            for rnd in range(args.rounds):
                for mode in rotated(modes, rnd):
                    run = run_once(admin, waiter, mode, size, rnd, hook, queues.get(mode))
                    size_runs.append(run)
                    log(
                        f"  {size.label:<8} round {rnd} {mode:<12} enqueue "
                        f"{run.enqueue_rate:>9,.0f} ch/s  e2e {run.e2e_rate:>7,.0f} ch/s  "
                        f"{run.commands_per_child:5.1f} cmds/child"
                    )
            report["sizes"][size.label] = summarize(size_runs, modes)
            runs += size_runs
        report["runs"] = [
            {**asdict(r), "enqueue_rate": r.enqueue_rate, "e2e_rate": r.e2e_rate} for r in runs
        ]
        if traced_worker is not None:  # its idle polls would count in the chain rounds
            traced_worker.stop()
        if args.chains:
            log("bench: chain children, flow-chain / chord-chain / flow / chord (same worker)")
            t_chains = time.time()
            report["chains"] = versus_chains(admin, waiter, args.chains, args.chain_rounds, hook)
            report["chains_elapsed_s"] = round(time.time() - t_chains, 1)
        if worker is not None:
            worker.stop()

        if not args.no_plain:
            log("bench: plain tasks, worker with install vs without (interleaved)")
            workers = {
                v: Worker(base, q, install=(v == "install")) for v, q in PLAIN_QUEUES.items()
            }
            for w in workers.values():
                stack.callback(w.stop)
            for v in workers:
                plain_once(admin, waiter, v, 50, -1)
            plain: list[PlainRun] = []
            # Short rounds, many pairs: a burst of someone else's load spoils one pair, not
            # the median.
            for rnd in range(args.rounds * 2 + 1):
                for v in rotated(list(workers), rnd):
                    run_p = plain_once(admin, waiter, v, args.plain_tasks, rnd)
                    plain.append(run_p)
                    log(f"  plain round {rnd} {v:<11} {run_p.rate:>7,.0f} tasks/s")
            for w in workers.values():
                w.stop()
            by = {(r.variant, r.round): r for r in plain}
            ratios = [
                by[("install", k)].rate / by[("no_install", k)].rate
                for k in sorted({r.round for r in plain})
            ]
            report["plain"] = {
                "tasks": args.plain_tasks,
                "rate_install": med([r.rate for r in plain if r.variant == "install"]),
                "rate_no_install": med([r.rate for r in plain if r.variant == "no_install"]),
                "commands_per_task_install": med(
                    [r.commands / r.tasks for r in plain if r.variant == "install"]
                ),
                "commands_per_task_no_install": med(
                    [r.commands / r.tasks for r in plain if r.variant == "no_install"]
                ),
                "ratio": {
                    "median": med(ratios),
                    "min": min(ratios),
                    "max": max(ratios),
                    "q1": quartiles(ratios)[0],
                    "q3": quartiles(ratios)[1],
                },
                "runs": [asdict(r) for r in plain],
            }
    report["elapsed_s"] = round(time.time() - started, 1)
    report["profile"] = profile(report)
    report["targets"] = targets(report)

    if report["sizes"]:
        print(render(report))
    if report.get("chains"):
        print()
        print(render_chains(report["chains"]))
        print(f"(chain section: {report['chains_elapsed_s']:.0f} s)")
    if report.get("plain"):
        p = report["plain"]
        print(
            f"\nplain task, worker with install / without: {fmt_ratio(p['ratio'])} "
            f"({fmt_rate(p['rate_install'])} vs {fmt_rate(p['rate_no_install'])} tasks/s, "
            f"{p['commands_per_task_install']:.1f} vs {p['commands_per_task_no_install']:.1f} "
            "cmds/task)"
        )
    if report["profile"]:
        print()
        print(render_profile(report["profile"]))
    print()
    print(render_targets(report["targets"]))
    out = args.out or RESULTS / time.strftime("bench-%Y%m%d-%H%M%S.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    m = report["machine"]
    print(
        f"\n{m['cpus']} cores, {m['memory_gib']} GiB, Python {m['python']}, Celery {m['celery']}, "
        f"kombu {m['kombu']}, redis-py {m['redis_py']}, redis-server {m['redis_server']}, "
        f"commit {m['commit']}"
    )
    print(f"{report['elapsed_s']:.0f} s; JSON: {out}")
    return report


if __name__ == "__main__":
    try:
        main()
    except Deadline as exc:
        log(f"bench: {exc}; worker and redis-server stopped")
        sys.exit(1)
