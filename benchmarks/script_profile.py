"""Where a flow's Redis commands go, script by script: one small run under MONITOR.

    python3 dev.py bench script-profile                     # 40 flows of 5, then 4 of 50
    python3 dev.py bench script-profile --sizes 10x5 --mode flow-window
    python3 dev.py bench script-profile --mode group

On one private redis-server and one real prefork worker (modes.py's), K flows of N no-op
children (modes.py's ``build``) run under ``MONITOR``. Each EVALSHA is named by its script
(the sha1 of ``store/loader.py``'s source of every transition) and the commands it ran (the
``lua`` lines that follow it) are counted under it; every other client command under its own
name. Printed per flow and per child: the calls of each script and client command, and each
script's inner commands. MONITOR slows the server: read the counts, not the time.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import re
import socket
import threading
import time
from collections import Counter

import bench_app
import redis
from measure import Size, parse_sizes, settle
from modes import Waiter, Worker, build, only_queue, release_results, result_ids

from celery_echomq.embedded import RedisServer
from celery_echomq.store.loader import TRANSITIONS, load_source

LINE = re.compile(r'^\+?[\d.]+ \[\d+ ([^\]]+)\] "([^"]+)"(?: "((?:[^"\\]|\\.)*)")?')


def shas() -> dict[str, str]:
    return {hashlib.sha1(load_source(n).encode()).hexdigest(): n for n in TRANSITIONS}


class Monitor(threading.Thread):
    """MONITOR on a raw socket, its lines kept until stopped."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(b"MONITOR\r\n")
        self.lines: list[str] = []
        self.stopping = False

    def run(self) -> None:
        buf = b""
        with contextlib.suppress(OSError):
            while not self.stopping:
                data = self.sock.recv(1 << 16)
                if not data:
                    break
                buf += data
                *whole, buf = buf.split(b"\r\n")
                self.lines.extend(x.decode(errors="replace") for x in whole)

    def stop(self) -> None:
        self.stopping = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.join(5)


def attribute(lines: list[str], names: dict[str, str]) -> tuple[Counter[str], Counter[str]]:
    """(calls by script or client command, inner commands by 'script: COMMAND')."""
    calls: Counter[str] = Counter()
    inner: Counter[str] = Counter()
    current = "?"
    for line in lines:
        m = LINE.match(line)
        if not m:
            continue
        who, cmd, first = m.group(1), m.group(2).upper(), m.group(3) or ""
        if who == "lua":
            inner[f"{current}: {cmd}"] += 1
            continue
        if cmd in ("INFO", "MONITOR"):
            continue
        if cmd in ("EVALSHA", "EVAL"):
            current = names.get(first, f"sha {first[:8]}") if cmd == "EVALSHA" else "eval"
            calls[f"script {current}"] += 1
        else:
            current = cmd
            calls[cmd] += 1
    return calls, inner


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes("40x5,4x50"))
    p.add_argument("--mode", default="flow", help="flow, flow-window, group, chord")
    args = p.parse_args(argv)
    names = shas()
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(RedisServer())
        stack.callback(release_results)
        base = f"redis://127.0.0.1:{server.port}"
        bench_app.configure(base)
        admin = redis.Redis.from_url(f"{base}/0")
        worker = Worker(base, "celery")
        stack.callback(worker.stop)
        backend = redis.Redis.from_url(f"{base}/{bench_app.BACKEND_DB}")
        waiter = Waiter(backend)

        def once(size: Size) -> None:
            canvases = build(args.mode, size)
            only_queue("celery")
            results = [c.apply_async() for c in canvases]
            waiter.wait([i for r in results for i in result_ids(args.mode, r)], 300)
            settle(admin, limit=3.0)

        once(Size(4, 5))  # warm: scripts loaded, pools forked
        for size in args.sizes:
            settle(admin, limit=3.0)
            mon = Monitor(server.port)
            mon.start()
            time.sleep(0.2)
            once(size)
            time.sleep(0.5)
            mon.stop()
            calls, inner = attribute(mon.lines, names)
            # The waiter's own polls are the bench's, not the mode's.
            calls["EXISTS"] -= waiter.polls
            waiter.polls = 0
            flows, children = size.flows, size.total
            print(f"\n== {args.mode} {size.label}: per flow · per child (calls)")
            total = sum(calls.values())
            for name, n in calls.most_common():
                if n > 0:
                    print(f"  {name:<34}{n / flows:>9.2f}{n / children:>9.3f}")
            print(f"  {'total client commands':<34}{total / flows:>9.2f}{total / children:>9.3f}")
            print("  inner commands of scripts:")
            for name, n in sorted(inner.items()):
                print(f"    {name:<40}{n / flows:>9.2f}{n / children:>9.3f}")
            all_cmds = total + sum(inner.values())
            print(f"  {'all commands (commandstats)':<34}{all_cmds / children:>18.3f} / child")


if __name__ == "__main__":
    main()
