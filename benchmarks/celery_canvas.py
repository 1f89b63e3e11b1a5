"""Celery's own canvas integration tests (t/integration/test_canvas.py from its sdist),
unmodified, with ``echomq_chords`` off and then on, on one private redis-server (broker and
result backend, as Celery's suite runs on Redis) and Celery's own session worker.

    python3 benchmarks/celery_canvas.py              # both runs, then the counts side by side
    python3 benchmarks/celery_canvas.py --only on    # one of them
    python3 benchmarks/celery_canvas.py -- -k chord  # pytest arguments after --

The first run makes ``.venv-celery-suite`` beside this repository's ``.venv``: Celery at the
version installed here, the plugins its suite needs (from its requirements/test.txt), and
this project. With the setting on, ``benchmarks/celery_suite_plugin.py`` (loaded with ``-p``)
sets ``echomq_chords`` and calls ``celery_echomq.install`` on every app the suite's fixtures
make; nothing in Celery's files changes. Each run takes about 15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SUITE_VENV = ROOT / ".venv-celery-suite"
CACHE = ROOT / ".cache" / "celery-sdist"
# What Celery's integration suite imports or marks with, beyond Celery itself.
SUITE_PACKAGES = [
    "pytest",
    "pytest-rerunfailures",
    "pytest-timeout",
    "pytest-order",
    "pytest-subtests",
    "pytest-celery>=1.3",
    "pydantic",
]
SUMMARY = re.compile(r"^=* ?(\d.*\d+ (passed|failed).*) in [0-9.]+s", re.MULTILINE)


def python() -> Path:
    return SUITE_VENV / "bin" / "python"


def celery_version() -> str:
    from importlib.metadata import version

    return version("celery")


def ensure_venv(version: str) -> None:
    stamp = SUITE_VENV / f".installed-{version}"
    if stamp.exists():
        return
    print(f"celery_canvas: making {SUITE_VENV}", flush=True)
    venv.EnvBuilder(with_pip=True).create(SUITE_VENV)
    pip = [str(python()), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, f"celery[redis]=={version}", *SUITE_PACKAGES], check=True)
    subprocess.run([*pip, "-e", f"{ROOT}[embedded]"], check=True)
    stamp.touch()


def ensure_sdist(version: str) -> Path:
    tree = CACHE / f"celery-{version}"
    if (tree / "t" / "integration" / "test_canvas.py").is_file():
        return tree
    CACHE.mkdir(parents=True, exist_ok=True)
    download = [str(python()), "-m", "pip", "download", "-q", "--no-binary", ":all:"]
    subprocess.run([*download, "--no-deps", "-d", str(CACHE), f"celery=={version}"], check=True)
    with tarfile.open(CACHE / f"celery-{version}.tar.gz") as archive:
        archive.extractall(CACHE, filter="data")
    return tree


def run(tree: Path, setting: str, url: str, db: int, extra: list[str]) -> str:
    """One run of the suite; its closing line (pytest's counts)."""
    env = {
        **os.environ,
        "TEST_BROKER": f"{url}/{db}",
        "TEST_BACKEND": f"{url}/{db + 1}",
        "PYTHONPATH": str(HERE),
    }
    args = [str(python()), "-m", "pytest", "t/integration/test_canvas.py", "-q", "-rfEX"]
    args += ["-p", "no:cacheprovider"]
    if setting == "on":
        args += ["-p", "celery_suite_plugin"]
    log = ROOT / f".cache/celery-canvas-{setting}.log"
    print(f"celery_canvas: echomq_chords {setting}: log in {log}", flush=True)
    with log.open("w") as out:
        subprocess.run([*args, *extra], cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
    text = log.read_text()
    found = SUMMARY.findall(text)
    failed = re.findall(r"^FAILED (\S+)", text, re.MULTILINE)
    summary = found[-1][0] if found else "(no summary: see the log)"
    return summary + "".join(f"\n    failed: {name}" for name in failed)


def main(argv: list[str]) -> int:
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("off", "on"), help="one run instead of both")
    args = p.parse_args(argv)
    version = celery_version()
    ensure_venv(version)
    tree = ensure_sdist(version)
    from celery_echomq.embedded import RedisServer

    results: dict[str, str] = {}
    with RedisServer() as server:
        for db, setting in ((0, "off"), (2, "on")):
            if args.only in (None, setting):
                results[setting] = run(tree, setting, f"redis://127.0.0.1:{server.port}", db, extra)
    print(f"\nCelery {version}, t/integration/test_canvas.py, unmodified:")
    for setting, summary in results.items():
        print(f"  echomq_chords {setting}: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
