"""A real ``celery worker`` subprocess."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from celery_echomq.embedded.servers import ServerBase


class WorkerProcess(ServerBase):
    """A real ``celery -A APP worker`` subprocess (prefork), in a process group of its own.

    For the quickstart, the examples and the tests: ``start()`` returns once the worker logs
    that it is ready; ``stop()`` asks for a warm shutdown, then kills whatever is left;
    ``kill()`` SIGKILLs the main process and its pool at once, as a crash would.
    """

    def __init__(
        self,
        app: str,
        *,
        log: str | os.PathLike[str],
        cwd: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        queues: str | None = None,
        concurrency: int = 2,
        name: str | None = None,
        pool: str = "prefork",
        ready_timeout: float = 60,
        loglevel: str = "INFO",
        ready_file: str | os.PathLike[str] | None = None,
        stop_timeout: float = 30,
    ) -> None:
        """``ready_file``: a file the app writes when its worker is ready (a ``worker_ready``
        receiver), for a worker whose ``loglevel`` hides the "ready." line; else that line.
        ``stop_timeout``: how long ``stop()`` waits for a warm shutdown before the kill."""
        self.log = Path(log)
        self.ready_file = Path(ready_file) if ready_file is not None else None
        self.stop_timeout = stop_timeout
        self.cmd = [
            sys.executable, "-m", "celery", "-A", app, "worker", "-P", pool,
            "-c", str(concurrency), "--loglevel", loglevel,
            "--without-gossip", "--without-mingle", "--without-heartbeat",
            *(["-Q", queues] if queues else []),
            *(["-n", f"{name}@%h"] if name else []),
        ]  # fmt: skip
        self.cwd, self.env, self.ready_timeout = cwd, env, ready_timeout
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                self.cmd, cwd=self.cwd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited early:\n{self.output()}")
            if self._ready():
                return self
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"worker not ready in {self.ready_timeout} s:\n{self.output()}")

    def _ready(self) -> bool:
        if self.ready_file is not None:
            return self.ready_file.exists()
        return b" ready." in self.log.read_bytes()

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the worker was not started"
        return self.proc.pid

    def output(self) -> str:
        return self.log.read_bytes().decode(errors="replace") if self.log.exists() else ""

    def pool_pids(self) -> list[int]:
        found = subprocess.run(
            ["pgrep", "-P", str(self.pid)], capture_output=True, text=True, check=False
        )
        return [int(p) for p in found.stdout.split()]

    def kill(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(self.stop_timeout)
        # The pool processes too, whatever state the main process left them in.
        self.kill()
