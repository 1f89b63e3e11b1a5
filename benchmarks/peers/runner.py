"""Flow beside the fan-ins a Python team would pick, end to end on one private redis-server,
in one run.

The same K fan-ins of N no-op children (``add(i, i)``, a parent summing their values) as a
Celery chord, a Celery plain group (no fan-in: timed to its last child's result), a flow,
Dramatiq's group with a completion callback (``dramatiq[redis]``, 2 processes x 1 thread), RQ's
``depends_on`` (2 SimpleWorkers) and BullMQ's flow (Node, one Worker of concurrency 2). Each is
timed from its first enqueue to the last parent's value, the peers interleaved over the rounds
(the order rotating); Redis's CPU (``INFO cpu``: used_cpu_user + used_cpu_sys) and its commands
(``INFO commandstats``) are read before and after each run.

While one peer runs, every other peer's processes are stopped (SIGSTOP), so that their idle
polls neither load the machine nor count in its Redis CPU; its own idle polls until Redis is
quiet again do count. Dramatiq and RQ are installed on first use into a virtualenv of their own
(``.cache/peers-venv``, from ``benchmarks/peers/requirements.txt``), BullMQ with ``npm ci`` in
``benchmarks/bullmq/``; a peer whose runtime is missing is skipped with a message.

    python3 dev.py bench peers --rounds 5                  # sizes 200x5,20x50
    python3 dev.py bench peers --quick                     # sizes 40x5,4x50, 2 rounds
    python3 dev.py bench peers --sizes 10x5 --rounds 1 --peer flow --peer "bullmq flow"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import bench_app
import redis
from measure import (
    RESULTS,
    ROOT,
    Deadline,
    Size,
    command_counts,
    command_delta,
    log,
    machine,
    med,
    parse_sizes,
    redis_cpu,
    rotated,
    settle,
    time_limit,
)
from modes import (
    BATCH,
    BULLMQ_DIR,
    GROUP_ONE_MORE,
    WINDOW,
    Worker,
    build,
    bullmq_ready,
    expected,
    only_queue,
    release_results,
    result_ids,
)

from celery_echomq.embedded import RedisServer

HERE = Path(__file__).resolve().parent
VENV = ROOT / ".cache" / "peers-venv"
REQUIREMENTS = HERE / "requirements.txt"
PEERS_SIZES = "200x5,20x50"
QUICK_SIZES = "40x5,4x50"
CELERY_PEERS = {
    "celery group": "group",
    "celery chord": "chord",
    "flow": "flow",
    # max_active=BENCH_WINDOW (20 by default) children at once; run it by name (--peer).
    "flow window": WINDOW,
    # As many Celery messages as a flow (N children and one task for its parent), no fan-in.
    "celery group + 1": GROUP_ONE_MORE,
    # batch=BATCH_SIZE (50): up to 50 children a broker message; run it by name (--peer).
    "flow batch": BATCH,
}
OPT_IN = {"flow window", "celery group + 1", "flow batch"}
# With --against DIR: the flow (and the windowed flow, when it runs) again, on a worker of its
# own whose store (and this producer's, for its rounds) runs the scripts of DIR, another
# tree's: a before and after in one run.
AGAINST = {"flow (against)": "flow", "flow window (against)": WINDOW}
AGAINST_QUEUE = "against"
# Every peer a Celery worker of this bench runs, and the mode (modes.py) it runs.
CELERY_MODES = {**CELERY_PEERS, **AGAINST}
# Each subprocess peer on a database of its own (Celery's broker and backend are 0 and 1).
DRIVERS = {
    "dramatiq group+callback": ("dramatiq_driver.py", 4),
    "rq depends_on": ("rq_driver.py", 5),
    "bullmq flow": ("flow_e2e.js", 6),
}


def peers_python() -> Path | str:
    """The peers' virtualenv's python, made and filled on first use; or why it cannot be."""
    python = VENV / "bin" / "python"
    stamp = VENV / "requirements.txt"
    wanted = REQUIREMENTS.read_text()
    if python.is_file() and stamp.is_file() and stamp.read_text() == wanted:
        return python
    pins = [line for line in wanted.splitlines() if line and not line.startswith("#")]
    log(f"bench peers: installing {', '.join(pins)} into {VENV}")
    made = subprocess.run(
        [sys.executable, "-m", "venv", str(VENV)], capture_output=True, text=True, check=False
    )
    if made.returncode != 0:
        return f"python -m venv failed: {made.stderr.strip()[-300:]}"
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)],
        capture_output=True,
        text=True,
        check=False,
    )
    if pip.returncode != 0:
        return f"pip install -r {REQUIREMENTS} failed: {pip.stderr.strip()[-300:]}"
    stamp.write_text(wanted)
    return python


class Driver:
    """A peer's driver subprocess (benchmarks/peers/protocol.py's lines), in a process group
    of its own with the workers it starts, so the group can be stopped and continued whole."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            cmd,
            cwd=HERE,
            env={**os.environ, **env, "PEERS_LOG": str(log_path)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log_path, "ab"),  # noqa: SIM115 - the child holds it
            text=True,
            start_new_session=True,
        )
        self.log_path = log_path
        self.version = str(self._reply(120).get("version", "?"))

    def _reply(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{self.name}: no answer within {timeout:.0f} s:\n{tail}")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.name}: {reply['error']}")
        return reply

    def run(self, size: Size) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"run {size.flows} {size.children}\n")
        self.proc.stdin.flush()
        return float(self._reply(max(120.0, size.total / 20))["seconds"])

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        self.signal(signal.SIGCONT)
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)


def start_drivers(base: str, logs: Path, only: set[str]) -> dict[str, Driver]:
    drivers: dict[str, Driver] = {}
    python = peers_python() if only & {"dramatiq group+callback", "rq depends_on"} else ""
    for name, (script, db) in DRIVERS.items():
        if name not in only:
            continue
        env = {"PEERS_REDIS_URL": f"{base}/{db}"}
        if script.endswith(".js"):
            why = bullmq_ready()
            cmd = ["node", str(BULLMQ_DIR / script), "--url", f"{base}/{db}"]
        else:
            why = python if isinstance(python, str) else None
            cmd = [str(python), str(HERE / script)]
        if why:
            log(f"bench peers: {name} skipped: {why}")
            continue
        log(f"bench peers: starting {name}")
        drivers[name] = Driver(name, cmd, env, logs / f"{script}.log")
    return drivers


@dataclass
class PeerRun:
    peer: str
    size: str
    round: int
    children: int
    seconds: float
    redis_cpu_s: float
    commands: int
    by_command: dict[str, int]
    usec_by_command: dict[str, int]

    @property
    def rate(self) -> float:
        return self.children / self.seconds

    @property
    def cpu_ms_per_1000(self) -> float:
        return self.redis_cpu_s * 1e6 / self.children


def command_usec(admin: Any) -> dict[str, int]:
    stats = admin.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["usec"]) for name, v in stats.items()}


class Celery:
    """chord, group and flow on one `celery worker -P prefork -c 2` (modes.py's); with
    ``lua``, the flow alone on its own queue, its scripts read from that directory (in the
    worker, and in this producer while it runs)."""

    def __init__(self, base: str, admin: Any, lua: Path | None = None) -> None:
        self.queue = AGAINST_QUEUE if lua else "celery"
        env = {bench_app.ENV_LUA: str(lua)} if lua else {}
        self.worker = Worker(base, self.queue, extra_env=env)
        self.scripts: dict[str, Any] | None = None
        if lua is not None:
            from celery_echomq.store.state import get_state

            runner = get_state(bench_app.app).scripts.runner
            self.scripts = bench_app.registered_from(runner.client, lua)
        self.backend = redis.Redis.from_url(f"{base}/{bench_app.BACKEND_DB}")
        self.admin = admin
        self.version = __import__("celery").__version__
        self.polls = 0  # the EXISTS this producer sent, left out of the mode's commands

    def wait(self, task_ids: Sequence[str], timeout: float) -> None:
        """Until every result is stored: one single-key EXISTS a poll, on the last result
        still missing (they land about in order), so the wait costs Redis next to nothing
        (modes.py's Waiter checks 256 keys a poll)."""
        keys = [bench_app.app.backend.get_key_for_task(t) for t in task_ids]
        deadline = time.monotonic() + timeout
        while keys:
            self.polls += 1
            if self.backend.exists(keys[-1]):
                keys.pop()
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(keys)} results not stored within {timeout:.0f} s")
            time.sleep(0.005)

    def run(self, mode: str, size: Size) -> float:
        queue = None if self.queue == "celery" else self.queue
        canvases = build(mode, size, queue=queue)
        only_queue(self.queue)
        if self.scripts is None:
            return self._run(mode, size, canvases)
        from celery_echomq.store.state import get_state

        runner = get_state(bench_app.app).scripts.runner
        own, runner.registered = runner.registered, self.scripts
        try:
            return self._run(mode, size, canvases)
        finally:
            runner.registered = own

    def _run(self, mode: str, size: Size, canvases: list[Any]) -> float:
        t0 = time.perf_counter()
        results = [c.apply_async() for c in canvases]
        self.wait([i for r in results for i in result_ids(mode, r)], 600)
        seconds = time.perf_counter() - t0
        want = expected(mode, size)
        got = [r.get(timeout=60) for r in results]
        if got != [want] * len(got):
            raise AssertionError(f"{mode}: wrong values {got[:3]}")
        return seconds

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.worker.pid, sig)


def one_run(
    admin: Any,
    peer: str,
    size: Size,
    rnd: int,
    celery: Celery | None,
    drivers: dict[str, Driver],
    against: Celery | None = None,
) -> PeerRun:
    own = against if peer in AGAINST else celery
    target: Celery | Driver = own if peer in CELERY_MODES else drivers[peer]  # type: ignore[assignment]
    target.signal(signal.SIGCONT)
    try:
        settle(admin, limit=2.0)
        polls0 = target.polls if isinstance(target, Celery) else 0
        cpu0, cmds0, usec0 = (
            redis_cpu(admin),
            command_counts(admin),
            command_usec(admin),
        )
        if isinstance(target, Celery):
            seconds = target.run(CELERY_MODES[peer], size)
        else:
            seconds = target.run(size)
        # The work after the last value (acks, the parent's own completion) belongs to the run.
        settle(admin, limit=2.0)
        cpu1, cmds1, usec1 = (
            redis_cpu(admin),
            command_counts(admin),
            command_usec(admin),
        )
    finally:
        target.signal(signal.SIGSTOP)
    delta = command_delta(cmds0, cmds1)
    if isinstance(target, Celery):
        delta["exists"] = delta.get("exists", 0) - (target.polls - polls0)
    usec = {n: v - usec0.get(n, 0) for n, v in usec1.items() if n in delta}
    return PeerRun(
        peer, size.label, rnd, size.total, seconds, cpu1 - cpu0, sum(delta.values()), delta, usec
    )


def summarize(runs: list[PeerRun], peers: Sequence[str], sizes: Sequence[Size]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size in sizes:
        by = {(r.peer, r.round): r for r in runs if r.size == size.label}
        rounds = sorted({k for _, k in by})
        row: dict[str, Any] = {}
        for peer in peers:
            mine = [by[(peer, k)] for k in rounds if (peer, k) in by]
            if not mine:
                continue
            vs_flow = [
                by[(peer, k)].rate / by[("flow", k)].rate
                for k in rounds
                if (peer, k) in by and ("flow", k) in by
            ]
            row[peer] = {
                "children_per_s": med([r.rate for r in mine]),
                "children_per_s_min": min(r.rate for r in mine),
                "children_per_s_max": max(r.rate for r in mine),
                "redis_cpu_ms_per_1000": med([r.cpu_ms_per_1000 for r in mine]),
                "commands_per_child": med([r.commands / r.children for r in mine]),
                "e2e_vs_flow": med(vs_flow) if vs_flow else None,
            }
        out[size.label] = row
    return out


def where_commands_go(runs: list[PeerRun], size: str, peers: Sequence[str]) -> dict[str, Any]:
    """Per command name, each Celery mode's commands and the microseconds Redis spent in them
    (INFO commandstats: a script's commands counted inside its EVALSHA too), per 1,000
    children, the median over the rounds."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    for peer in peers:
        mine = [r for r in runs if r.peer == peer and r.size == size]
        names = {n for r in mine for n in r.by_command}
        out[peer] = {
            n: (
                med([r.by_command.get(n, 0) * 1000 / r.children for r in mine]),
                med([r.usec_by_command.get(n, 0) * 1000 / r.children for r in mine]),
            )
            for n in names
        }
    return out


def render_commands(table: dict[str, dict[str, tuple[float, float]]], size: str) -> str:
    """Calls and Redis microseconds per 1,000 children, by command (evalsha's microseconds
    include its scripts' own commands, listed on their rows too)."""
    peers = list(table)
    zero = (0.0, 0.0)
    names = sorted(
        {n for row in table.values() for n in row},
        key=lambda n: -max(r.get(n, zero)[0] for r in table.values()),
    )
    head = f"{'per 1,000 children ' + size:<26}" + "".join(
        f"{p + ' calls · us':>26}" for p in peers
    )
    lines = [head, "-" * len(head)]
    for name in names:
        if max(table[p].get(name, zero)[0] for p in peers) < 5:
            continue
        cells = (table[p].get(name, zero) for p in peers)
        lines.append(f"{name:<26}" + "".join(f"{f'{c:,.0f} · {u:,.0f}':>26}" for c, u in cells))
    totals = (sum(c for c, _ in table[p].values()) for p in peers)
    lines.append(f"{'total calls':<26}" + "".join(f"{t:>26,.0f}" for t in totals))
    return "\n".join(lines)


def render(summary: dict[str, Any], peers: Sequence[str]) -> str:
    sizes = list(summary)
    head = (
        f"{'peer':<26}"
        + "".join(f"{'e2e ch/s ' + s:>18}{'/flow':>7}" for s in sizes)
        + "".join(f"{'CPU ms/1k ' + s:>18}" for s in sizes)
        + "".join(f"{'cmds/ch ' + s:>15}" for s in sizes)
    )
    lines = [head, "-" * len(head)]
    for peer in peers:
        rows = [summary[s].get(peer) for s in sizes]
        if not any(rows):
            continue
        line = f"{peer:<26}"
        for r in rows:
            ratio = f"{r['e2e_vs_flow']:.2f}x" if r and r["e2e_vs_flow"] else "-"
            line += f"{(format(r['children_per_s'], ',.0f') if r else '-'):>18}{ratio:>7}"
        for r in rows:
            line += f"{(format(r['redis_cpu_ms_per_1000'], ',.0f') if r else '-'):>18}"
        for r in rows:
            line += f"{(format(r['commands_per_child'], '.1f') if r else '-'):>15}"
        lines.append(line)
    return "\n".join(lines)


def run(
    sizes: Sequence[Size],
    rounds: int,
    only: Sequence[str] | None,
    out: Path | None,
    against_lua: Path | None = None,
) -> dict[str, Any]:
    peers = [p for p in (*CELERY_PEERS, *DRIVERS) if (p in only if only else p not in OPT_IN)]
    if against_lua is not None:
        for name, mode in AGAINST.items():
            own = next(p for p, m in CELERY_PEERS.items() if m == mode)
            if own in peers:
                peers.insert(peers.index(own) + 1, name)
    logs = ROOT / ".cache" / "peers-logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.time()
    report: dict[str, Any] = {"machine": machine(), "load_before": os.getloadavg()}
    runs: list[PeerRun] = []
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(RedisServer())
        stack.callback(release_results)
        base = f"redis://127.0.0.1:{server.port}"
        bench_app.configure(base)
        admin = redis.Redis.from_url(f"{base}/0")
        report["machine"]["redis_server"] = admin.info("server")["redis_version"]
        log(f"bench peers: private redis-server on {base}")
        celery: Celery | None = None
        if set(peers) & set(CELERY_PEERS):
            celery = Celery(base, admin)
            stack.callback(celery.worker.stop)
            stack.callback(celery.signal, signal.SIGCONT)
        against: Celery | None = None
        if against_lua is not None:
            against = Celery(base, admin, against_lua)
            stack.callback(against.worker.stop)
            stack.callback(against.signal, signal.SIGCONT)
            report["against"] = str(against_lua)
        drivers = start_drivers(base, logs, set(peers))
        for d in drivers.values():
            stack.callback(d.stop)
        peers = [p for p in peers if p in CELERY_MODES or p in drivers]
        versions = {p: drivers[p].version for p in peers if p in drivers}
        if celery is not None:
            versions = {"celery": celery.version, **versions}
        report["versions"] = versions
        for target in [celery, against, *drivers.values()]:
            if target is not None:
                target.signal(signal.SIGSTOP)
        for peer in peers:  # warm up: scripts loaded, connections made, pools forked
            one_run(admin, peer, Size(4, 5), -1, celery, drivers, against)
        active = list(peers)
        for size in sizes:
            for rnd in range(rounds):
                for peer in rotated(list(active), rnd):
                    try:
                        run = one_run(admin, peer, size, rnd, celery, drivers, against)
                    except RuntimeError as exc:  # a peer that fails leaves the others running
                        log(f"bench peers: {peer} dropped: {exc}")
                        report.setdefault("dropped", {})[peer] = str(exc)
                        active.remove(peer)
                        continue
                    runs.append(run)
                    log(
                        f"  {size.label:<8} round {rnd} {peer:<24} e2e {run.rate:>7,.0f} ch/s  "
                        f"Redis CPU {run.cpu_ms_per_1000:>6,.0f} ms/1k children  "
                        f"{run.commands / run.children:5.1f} cmds/child"
                    )
    report["load_after"] = os.getloadavg()
    report["elapsed_s"] = round(time.time() - started, 1)
    report["config"] = {"sizes": [s.label for s in sizes], "rounds": rounds, "peers": peers}
    report["runs"] = [asdict(r) for r in runs]
    report["summary"] = summarize(runs, peers, sizes)
    print(render(report["summary"], peers))
    celery_modes = [p for p in CELERY_MODES if p in peers]
    report["commands"] = {}
    for size in sizes:
        table = where_commands_go(runs, size.label, celery_modes)
        report["commands"][size.label] = table
        if celery_modes:
            print()
            print(render_commands(table, size.label))
    path = out or RESULTS / time.strftime("peers-%Y%m%d-%H%M%S.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    m = report["machine"]
    print(
        f"\n{m['cpus']} cores, Python {m['python']}, redis-server {m['redis_server']}, "
        + ", ".join(f"{p.split()[0]} {v}" for p, v in versions.items())
        + f", commit {m['commit']}; load {report['load_before'][0]:.2f} -> "
        f"{report['load_after'][0]:.2f}; {report['elapsed_s']:.0f} s; JSON: {path}"
    )
    return report


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES}, 2 rounds")
    p.add_argument("--sizes", type=parse_sizes, help=f"KxN,... (default {PEERS_SIZES})")
    p.add_argument("--rounds", type=int, help="interleaved rounds per size (default 5)")
    p.add_argument(
        "--peer",
        action="append",
        help="run only this peer (repeatable; e.g. flow, 'bullmq flow'); "
        "'flow window', 'celery group + 1' and 'flow batch' run only by name",
    )
    p.add_argument(
        "--against",
        type=bench_app.against_dir,
        help="the flow (and a windowed flow) also as peer 'flow (against)' ('flow window "
        "(against)'), on a worker of its own running the scripts of this directory (another "
        "tree's celery_echomq/store/lua)",
    )
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/peers-*.json)")
    p.add_argument("--max-seconds", type=int, default=1500, help="stop everything after this long")
    args = p.parse_args(argv)
    sizes = args.sizes or parse_sizes(QUICK_SIZES if args.quick else PEERS_SIZES)
    rounds = args.rounds or (2 if args.quick else 5)
    if rounds < 1:
        p.error("--rounds must be positive")
    with time_limit(args.max_seconds):
        return run(sizes, rounds, args.peer, args.out, args.against)


if __name__ == "__main__":
    try:
        main()
    except Deadline as exc:
        log(f"bench peers: {exc}; workers, drivers and redis-server stopped")
        sys.exit(1)
