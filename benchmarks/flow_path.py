"""How many of the package's files one flow's path runs, from ``apply_async`` to the parent's
release: the Python modules whose functions are called and the Lua files (scripts and their
includes) that Redis runs.

    python3 dev.py bench flow-path             # a parent of three plain children
    python3 dev.py bench flow-path --list      # and the files, one per line

One process: a private redis-server, an in-process worker (threads pool), a trace function
on every thread that records the files of the calls made while the flow runs, on the threads
of its path alone: the producer's (``apply_async``) and the worker's (its consumer and the pool
threads whose signal receivers claim and complete each job, release the parent and run it).
The package's own background threads, recovery's sweep and the deadline poller with what
follows a fired deadline, run beside every flow, not on its path: they are named ``echomq-*``
and left out.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from importlib import resources
from pathlib import Path
from types import FrameType
from typing import Any

from celery import Celery

from celery_echomq import flow
from celery_echomq.embedded import RedisServer
from celery_echomq.store import loader
from celery_echomq.testing import in_process_worker, settings_for

PACKAGE = Path(str(resources.files("celery_echomq"))).resolve()
RUNNER = str(PACKAGE / "store" / "runner.py")
# The name every thread of the package's own starts with (worker/recovery/worker.py,
# worker/deadline_poller.py): they run beside the flows, not on one flow's path.
BACKGROUND = "echomq-"

app = Celery("flow_path")


@app.task(name="flow_path.add")
def add(x: int, y: int) -> int:
    return x + y


@app.task(name="flow_path.total")
def total(values: list[int]) -> int:
    return sum(values)


class Recorder:
    """The package's files whose functions were called while ``on`` on a thread of the flow's
    path, and the scripts run."""

    def __init__(self) -> None:
        self.on = False
        self.files: set[str] = set()
        self.scripts: set[str] = set()

    def trace(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call" or threading.current_thread().name.startswith(BACKGROUND):
            return None
        name = frame.f_code.co_filename
        if name.startswith(str(PACKAGE)):
            self.files.add(name)
            if name == RUNNER and frame.f_code.co_name == "run":
                script = frame.f_locals.get("name")
                if isinstance(script, str):
                    self.scripts.add(script)
        return None


def lua_files(scripts: set[str]) -> set[str]:
    """Each script's file and every include it pulls in, directly or through another."""
    lua = PACKAGE / "store" / "lua"
    found: set[str] = set()
    todo = [lua / f"{name}.lua" for name in scripts]
    while todo:
        path = todo.pop()
        if str(path) in found:
            continue
        found.add(str(path))
        todo.extend(
            lua / "includes" / f"{piece}.lua" for piece in loader.INCLUDE.findall(path.read_text())
        )
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the files too")
    args = parser.parse_args(argv)
    recorder = Recorder()
    sys.settrace(recorder.trace)  # type: ignore[arg-type]
    threading.settrace(recorder.trace)  # type: ignore[arg-type]
    with RedisServer() as server:
        config = settings_for(f"redis://127.0.0.1:{server.port}")
        with in_process_worker(app, config):
            # One flow first, untraced, so that imports done once per process are not counted.
            flow(total.s(), [add.s(1, 1)]).apply_async().get(timeout=30)
            recorder.on = True
            value = flow(total.s(), [add.s(i, i) for i in range(3)]).apply_async().get(timeout=30)
            time.sleep(0.5)  # the parent's own completion settles after its value is stored
            recorder.on = False
    sys.settrace(None)
    threading.settrace(None)  # type: ignore[arg-type]
    assert value == 6, value
    python = sorted(recorder.files)
    lua = sorted(lua_files(recorder.scripts))
    print(f"python files: {len(python)}; lua files: {len(lua)} ({len(recorder.scripts)} scripts)")
    if args.list:
        for name in python + lua:
            print("  " + str(Path(name).relative_to(PACKAGE)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
