"""Celery's own canvas integration tests (t/integration/test_canvas.py from its sdist),
unmodified, with ``echomq_chords`` off and then on, on a private redis-server (broker and
result backend, as Celery's suite runs on Redis) and Celery's own session worker.

    python3 benchmarks/celery_canvas.py                # the Celery installed here, both runs
    python3 benchmarks/celery_canvas.py 5.3.6 5.5.3    # those Celery releases
    python3 benchmarks/celery_canvas.py --all          # the newest release of each minor
    python3 benchmarks/celery_canvas.py --only on      # one of the two runs
    python3 benchmarks/celery_canvas.py 5.4.0 -- -k chord   # pytest arguments after --
    python3 benchmarks/celery_canvas.py --all --logs   # the table again, from the last logs

Each Celery release gets a venv of its own, ``canvas-celery<version>`` under
ECHOMQ_VERSIONS_CACHE (default ~/.cache/celery-echomq/versions, beside .ci/versions' venvs),
with ``celery[redis]==<version>`` (and so the kombu and redis-py it allows), the pytest plugins
its suite asks for (the ``pytest*`` lines of its requirements/test.txt, and pydantic), and this
project. With the setting on, ``benchmarks/celery_suite_plugin.py`` (loaded with ``-p``) sets
``echomq_chords`` and calls ``celery_echomq.install`` on every app the suite's fixtures make;
nothing in Celery's files changes. A run takes 5 to 25 minutes on 2 cores; at the end, a table
of each release's counts off and on, and the tests that fail only with the setting on.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import venv
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE = Path(
    os.environ.get("ECHOMQ_VERSIONS_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    / "celery-echomq"
    / "versions"
)
SDISTS = CACHE / "celery-sdist"
LOGS = ROOT / ".cache"
# The newest release of each Celery minor the package supports (as .ci/versions tests).
NEWEST = ("5.3.6", "5.4.0", "5.5.3", "5.6.3", "5.7.0")
# Beyond Celery's own pytest plugins: what its suite imports (5.5 on: pydantic).
EXTRA_PACKAGES = ["pydantic>=2.4"]
COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|rerun)")
SUMMARY = re.compile(r"^=* ?(.*\d+ (?:passed|failed|skipped|errors?).*) in [0-9.]+s", re.MULTILINE)
OUTCOME = re.compile(r"^(FAILED|ERROR) (\S+)", re.MULTILINE)


@dataclass
class Run:
    """One run of the suite: pytest's counts and the tests that failed or errored."""

    counts: dict[str, int] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    summary: str = "(no summary: see the log)"

    def cell(self) -> str:
        if not self.counts:
            return "-"
        bad = self.counts.get("failed", 0) + self.counts.get("error", 0)
        return f"{self.counts.get('passed', 0)}/{bad}/{self.counts.get('skipped', 0)}"


def installed_celery() -> str:
    from importlib.metadata import version

    return version("celery")


def python(version: str) -> Path:
    return CACHE / f"canvas-celery{version}" / "bin" / "python"


def ensure_sdist(version: str) -> Path:
    tree = SDISTS / f"celery-{version}"
    if (tree / "t" / "integration" / "test_canvas.py").is_file():
        return tree
    SDISTS.mkdir(parents=True, exist_ok=True)
    download = [sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:"]
    subprocess.run([*download, "--no-deps", "-d", str(SDISTS), f"celery=={version}"], check=True)
    with tarfile.open(SDISTS / f"celery-{version}.tar.gz") as archive:
        archive.extractall(SDISTS, filter="data")
    return tree


def suite_plugins(tree: Path) -> list[str]:
    """The pytest plugins Celery's requirements/test.txt names, as it pins them (pytest-celery
    without its [all] extra, which adds the Docker backends the suite here does not use)."""
    plugins = []
    for line in (tree / "requirements" / "test.txt").read_text().splitlines():
        if line.startswith("pytest"):
            plugins.append(line.replace("pytest-celery[all]", "pytest-celery"))
    return plugins


def ensure_venv(version: str, tree: Path) -> None:
    """The release's venv, (re)installed when this project's tree or pyproject.toml changed."""
    home = python(version).parent.parent
    packages = [f"celery[redis]=={version}", *suite_plugins(tree), *EXTRA_PACKAGES]
    pyproject = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]
    want = f"{ROOT} {pyproject} {' '.join(packages)}"
    stamp = home / ".installed"
    if stamp.is_file() and stamp.read_text() == want:
        return
    print(f"celery_canvas: making {home}", flush=True)
    venv.EnvBuilder(with_pip=True).create(home)
    pip = [str(python(version)), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, *packages, "-e", f"{ROOT}[embedded]"], check=True)
    stamp.write_text(want)


def run(version: str, tree: Path, setting: str, url: str, db: int, extra: list[str]) -> Run:
    """One run of the suite, read from its log."""
    env = {
        **os.environ,
        "TEST_BROKER": f"{url}/{db}",
        "TEST_BACKEND": f"{url}/{db + 1}",
        # The suite's own Redis reads (redis_echo, redis_count): the same server, where the
        # suite reads them (Celery 5.3's suite takes the host alone: the default port, 6379).
        "REDIS_HOST": "127.0.0.1",
        "REDIS_PORT": url.rsplit(":", 1)[1],
        "PYTHONPATH": str(HERE),
    }
    args = [str(python(version)), "-m", "pytest", "t/integration/test_canvas.py", "-q", "-rfE"]
    args += ["-p", "no:cacheprovider"]
    if setting == "on":
        args += ["-p", "celery_suite_plugin"]
    LOGS.mkdir(exist_ok=True)
    log = log_of(version, setting)
    print(f"celery_canvas: Celery {version}, echomq_chords {setting}: log in {log}", flush=True)
    with log.open("w") as out:
        subprocess.run([*args, *extra], cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
    return read(version, setting)


def log_of(version: str, setting: str) -> Path:
    return LOGS / f"celery-canvas-{version}-{setting}.log"


def read(version: str, setting: str) -> Run:
    """A run's counts and failures, from its log."""
    text = log_of(version, setting).read_text()
    result = Run(failed={name for _, name in OUTCOME.findall(text)})
    found = SUMMARY.findall(text)
    if found:
        result.summary = found[-1]
        for number, word in COUNT.findall(found[-1]):
            result.counts["error" if word.startswith("error") else word] = int(number)
    print(f"celery_canvas: Celery {version}, echomq_chords {setting}: {result.summary}", flush=True)
    return result


def main(argv: list[str]) -> int:
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("versions", nargs="*", help="Celery releases (default: the one installed here)")
    p.add_argument("--all", action="store_true", help=f"the newest of each minor: {NEWEST}")
    p.add_argument("--only", choices=("off", "on"), help="one run instead of both")
    p.add_argument("--logs", action="store_true", help="the table from the last runs' logs")
    args = p.parse_args(argv)
    versions = list(NEWEST) if args.all else args.versions or [installed_celery()]
    settings = [s for s in ("off", "on") if args.only in (None, s)]
    from celery_echomq.embedded import RedisServer

    results: dict[str, dict[str, Run]] = {}
    for version in versions if args.logs else ():
        found = [s for s in settings if log_of(version, s).is_file()]
        results[version] = {setting: read(version, setting) for setting in found}
    for version in () if args.logs else versions:
        tree = ensure_sdist(version)
        ensure_venv(version, tree)
        results[version] = {}
        with RedisServer() as server:  # a fresh server per release
            for db, setting in ((0, "off"), (2, "on")):
                if setting in settings:
                    url = f"redis://127.0.0.1:{server.port}"
                    results[version][setting] = run(version, tree, setting, url, db, extra)

    print("\nt/integration/test_canvas.py of each Celery release, unmodified")
    print("(echomq_chords off, then on: passed/failed/skipped, errors counted as failed)\n")
    print(f"{'Celery':<8} {'off':>12} {'on':>12}")
    for version, runs in results.items():
        cells = [runs[s].cell() if s in runs else "-" for s in ("off", "on")]
        print(f"{version:<8} {cells[0]:>12} {cells[1]:>12}")
    for version, runs in results.items():
        if "off" in runs and "on" in runs:
            for name in sorted(runs["on"].failed - runs["off"].failed):
                print(f"  Celery {version}: fails only with echomq_chords on: {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
