"""Where a flow's time goes, on the producer and on the worker.

    python benchmarks/profile_flow.py                # producer + worker, N=1000
    python benchmarks/profile_flow.py --children 1000 --flows 4

Producer: ``flow(...).apply_async()`` with N children onto a queue no worker consumes, timed
in phases by thin wrappers around the library's own steps (cheap enough not to distort them),
then once under cProfile for the functions inside the phases; chord's ``apply_async`` of the
same children, and the flow with the publish path it had before P1 (proposals.py), run
interleaved as references. Worker: a real prefork worker runs flows, then
chords, of the same size while py-spy samples every process of it (``pip install py-spy``;
without it, each pool process profiles itself with cProfile). Nothing in celery_echomq is
changed: the wrappers are installed in this process only.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import json
import pstats
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import redis

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import bench  # noqa: E402 - needs the path above
import bench_app  # noqa: E402
import proposals  # noqa: E402

import celery_echomq.canvas as echomq_canvas  # noqa: E402
import celery_echomq.send.publish as echomq_publish  # noqa: E402
from celery_echomq.embedded import RedisServer  # noqa: E402
from celery_echomq.store.scripts import Scripts  # noqa: E402
from celery_echomq.store.state import EchoMQ  # noqa: E402

# --- producer ----------------------------------------------------------------------------


class PhaseTimer:
    """Wall time spent inside each wrapped step, summed over calls."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - t0

        return timed


@contextlib.contextmanager
def phases(timer: PhaseTimer) -> Iterator[None]:
    """Wrap the steps of ``flow.apply_async``; everything else is ``start_flow``'s pipelines."""
    targets: list[tuple[Any, str, str]] = [
        (echomq_canvas, "plan_flow", "plan: ids, gate, job dicts"),
        (echomq_publish, "send_jobs", "publish: N messages"),
        (Scripts, "enqueue_flow_at", "enqueue_flow script (EVALSHA)"),
        (EchoMQ, "dumps", "serialize payloads for Redis"),
    ]
    # A step the library no longer has is left out; its time shows up under "other".
    targets = [t for t in targets if hasattr(t[0], t[1])]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in targets]
    try:
        for owner, attr, label in targets:
            setattr(owner, attr, timer.wrap(label, getattr(owner, attr)))
        yield
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)


def clear_hold(admin_for: Callable[[int], Any]) -> None:
    bench.clear_held(admin_for)


def producer_profile(
    admin_for: Callable[[int], Any], size: bench.Size, rounds: int, top: int
) -> dict[str, Any]:
    per_child: dict[str, list[float]] = defaultdict(list)
    modes = ["chord", "flow", *proposals.PRODUCER_VARIANTS]
    for rnd in range(rounds):
        for mode in bench.rotated(modes, rnd):
            canvases = bench.build(mode, size, queue=bench.HOLD_QUEUE)
            timer = PhaseTimer()
            # The phase wrappers go around whatever publish the mode's hook installs.
            with proposals.hook(mode), phases(timer):
                t0 = time.perf_counter()
                for c in canvases:
                    c.apply_async()
                total = time.perf_counter() - t0
            clear_hold(admin_for)
            per_child[f"{mode} apply_async total"].append(total / size.total)
            if mode == "flow":
                inner = sum(timer.spent.values())
                for label, spent in timer.spent.items():
                    per_child[label].append(spent / size.total)
                per_child["other: policy/locator pipelines, FlowResult"].append(
                    (total - inner) / size.total
                )
    summary = {k: statistics.median(v) * 1e6 for k, v in per_child.items()}

    # cProfile once per mode, for what sits inside the phases.
    profiles: dict[str, str] = {}
    for mode in ("flow", "chord"):
        canvases = bench.build(mode, size, queue=bench.HOLD_QUEUE)
        prof = cProfile.Profile()
        prof.enable()
        for c in canvases:
            c.apply_async()
        prof.disable()
        clear_hold(admin_for)
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("cumulative").print_stats(top)
        profiles[mode] = out.getvalue()
    return {"us_per_child": summary, "cprofile": profiles}


def render_producer(result: dict[str, Any], size: bench.Size) -> str:
    us = result["us_per_child"]
    flow_total = us["flow apply_async total"]
    lines = [f"producer: apply_async of {size.label}, microseconds per child (median of rounds)"]
    chord_total = us["chord apply_async total"]
    lines.append(f"  {'chord apply_async total':<48}{chord_total:>8.1f}")
    lines.append(f"  {'flow apply_async total':<48}{flow_total:>8.1f}  100%")
    for label, value in sorted(us.items(), key=lambda kv: -kv[1]):
        if "apply_async total" in label:
            continue
        lines.append(f"    {label:<46}{value:>8.1f}  {100 * value / flow_total:>3.0f}%")
    for mode in proposals.PRODUCER_VARIANTS:
        value = us[f"{mode} apply_async total"]
        lines.append(
            f"  {f'{mode} (variant) apply_async total':<48}{value:>8.1f}  "
            f"= {chord_total / value:.2f}x chord's children/s"
        )
    lines.append(f"  flow as installed = {chord_total / flow_total:.2f}x chord's children/s")
    return "\n".join(lines)


# --- worker ------------------------------------------------------------------------------

# A sampled stack is charged to the first category whose marker appears in it, in this order.
CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("echomq claim (task_prerun)", ("on_prerun (celery_echomq",)),
    ("echomq complete (task_success)", ("on_success (celery_echomq",)),
    ("echomq dispatch parent", ("dispatch_parent (celery_echomq",)),
    ("chord part return (backend)", ("on_chord_part_return",)),
    ("store result (backend)", ("store_result", "mark_as_done")),
    ("task body", ("add (bench_app", "tsum (bench_app")),
    ("message receive/ack (kombu)", ("kombu/transport/redis.py", "kombu/message.py")),
    ("celery task tracing", ("celery/app/trace.py",)),
    ("celery worker strategy/request", ("celery/worker/",)),
    ("pool IPC (billiard)", ("billiard/",)),
]
SAMPLE_RATE = 200
# The pool-side functions worth reading in a cProfile listing.
CPROFILE_FOCUS = (
    r"on_prerun|on_success|store_result|on_chord_part_return|trace_task|claim|complete|"
    r"dispatch_parent|_set\b|execute_command|bench_app|on_task_received|publish",
)


def categorize(stack: str) -> str:
    for label, markers in CATEGORIES:
        if any(m in stack for m in markers):
            return label
    return "other"


_PROCESS = re.compile(r"process (\d+):")


def read_pyspy(path: Path, pool_pids: set[int]) -> dict[str, dict[str, int]]:
    """Samples per role (main or pool) and category, from py-spy's raw collapsed stacks."""
    out: dict[str, dict[str, int]] = {"main": defaultdict(int), "pool": defaultdict(int)}
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        # With --subprocesses a pool process's stack starts with its parent's "process N:"
        # frame, then its own: the last one names the process that was sampled.
        pids = _PROCESS.findall(stack)
        role = "pool" if pids and int(pids[-1]) in pool_pids else "main"
        out[role][categorize(stack)] += int(count)
    return out


def find_pyspy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def worker_profile(
    base: str,
    admin: Any,
    waiter: bench.Waiter,
    size: bench.Size,
    rounds: int,
    pyspy: str | None,
) -> dict[str, Any]:
    results: dict[str, Any] = {"profiler": "py-spy" if pyspy else "cProfile", "modes": {}}
    for mode in ("flow", "chord"):
        prof_dir = Path(tempfile.mkdtemp(prefix="echomq-prof-"))
        worker = bench.Worker(base, "celery", profile_dir=None if pyspy else prof_dir)
        try:
            bench.run_once(admin, waiter, mode, bench.Size(2, 20), -1, bench.no_hook)
            pids = worker.pids()
            spy: subprocess.Popen[bytes] | None = None
            raw = prof_dir / "pyspy.txt"
            if pyspy:
                spy = subprocess.Popen(
                    [
                        pyspy,
                        "record",
                        "--pid",
                        str(worker.pid),
                        "--subprocesses",
                        "--format",
                        "raw",
                        "--rate",
                        str(SAMPLE_RATE),
                        "-o",
                        str(raw),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                time.sleep(1.0)
            t0 = time.perf_counter()
            runs = [
                bench.run_once(admin, waiter, mode, size, rnd, bench.no_hook)
                for rnd in range(rounds)
            ]
            elapsed = time.perf_counter() - t0
            if spy is not None:
                spy.send_signal(2)
                spy.wait(30)
        finally:
            worker.stop()
        entry: dict[str, Any] = {
            "children": size.total * rounds,
            "seconds": elapsed,
            "commands_per_child": statistics.median(r.commands_per_child for r in runs),
        }
        if pyspy and raw.exists():
            entry["samples"] = {
                role: dict(sorted(cats.items(), key=lambda kv: -kv[1]))
                for role, cats in read_pyspy(raw, set(pids[1:])).items()
            }
        else:
            stats = None
            for f in prof_dir.glob("pool-*.prof"):
                if stats is None:
                    stats = pstats.Stats(str(f), stream=io.StringIO())
                else:
                    stats.add(str(f))
            if stats is not None:
                out = io.StringIO()
                stats.stream = out  # type: ignore[attr-defined]
                stats.sort_stats("cumulative").print_stats(*CPROFILE_FOCUS)
                entry["cprofile"] = out.getvalue()
        results["modes"][mode] = entry
        shutil.rmtree(prof_dir, ignore_errors=True)
    return results


def render_worker(result: dict[str, Any]) -> str:
    lines = [f"worker ({result['profiler']}): share of CPU samples per category"]
    for mode, entry in result["modes"].items():
        lines.append(
            f"  {mode}: {entry['children']} children in {entry['seconds']:.1f} s, "
            f"{entry['commands_per_child']:.1f} Redis commands/child"
        )
        for role, cats in entry.get("samples", {}).items():
            total = sum(cats.values()) or 1
            us = 1e6 / SAMPLE_RATE / entry["children"]
            lines.append(
                f"    {role} process{'es' if role == 'pool' else ''}: "
                f"{total * us:.0f} us CPU per child"
            )
            for label, n in cats.items():
                lines.append(f"      {label:<36}{n * us:>7.0f} us {100 * n / total:>5.1f}%")
        if "cprofile" in entry:
            lines.append(entry["cprofile"])
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--flows", type=int, default=1)
    p.add_argument("--children", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--top", type=int, default=35, help="cProfile lines to print per mode")
    p.add_argument("--no-worker", action="store_true")
    p.add_argument(
        "--worker-profiler",
        choices=("py-spy", "cprofile"),
        default="py-spy",
        help="py-spy samples CPU (falls back to cprofile when py-spy is not installed); "
        "cprofile times every call in the pool processes, waits included",
    )
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    size = bench.Size(args.flows, args.children)
    report: dict[str, Any] = {"size": size.label, "machine": bench.machine()}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(RedisServer())
        base = f"redis://127.0.0.1:{server.port}"
        bench_app.configure(base)
        clients: dict[int, Any] = {}

        def admin_for(db: int) -> Any:
            if db not in clients:
                clients[db] = redis.Redis.from_url(f"{base}/{db}")
            return clients[db]

        stack.callback(bench.release_results)
        for mode in ("chord", "flow"):  # warm up imports, connections and the script cache
            for c in bench.build(mode, bench.Size(1, 10), queue=bench.HOLD_QUEUE):
                c.apply_async()
        clear_hold(admin_for)
        producer = producer_profile(admin_for, size, args.rounds, args.top)
        report["producer"] = producer
        print(render_producer(producer, size))
        for mode, text in producer["cprofile"].items():
            print(f"\n--- cProfile, producer, {mode} apply_async ({size.label}) ---")
            print(text)
        if not args.no_worker:
            waiter = bench.Waiter(admin_for(bench_app.BACKEND_DB))
            pyspy = find_pyspy() if args.worker_profiler == "py-spy" else None
            worker = worker_profile(
                base, admin_for(0), waiter, size, max(2, args.rounds // 2), pyspy
            )
            report["worker"] = worker
            print(render_worker(worker))
    out = args.out or HERE / "results" / time.strftime("profile-%Y%m%d-%H%M%S.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
