"""The release: the version is written once (``celery_echomq.__version__``, which
pyproject.toml reads and CHANGELOG.md has an entry for), and the wheel ships every file of the
package with that version. ``python3 dev.py wheel`` builds the wheel and runs the wheel's
tests on it (``ECHOMQ_TEST_WHEEL``: its path); without one they are skipped.

Read from the files with ``ast`` and ``zipfile``: nothing here imports what it checks.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import zipfile
from collections.abc import Iterator
from email.parser import HeaderParser
from pathlib import Path

import pytest
from packaging.version import Version

from tests.helpers import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest's own dependency on Python 3.10
    import tomli as tomllib

PACKAGE = ROOT / "celery_echomq"
# Files of the package's source folder that are for its readers, not its users.
NOT_SHIPPED = {"celery_echomq/store/lua/README.md"}


def written_version() -> str:
    """``__version__`` as celery_echomq/__init__.py assigns it."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text(encoding="utf-8"))
    found = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
        and isinstance(node.value, ast.Constant)
    ]
    assert len(found) == 1, "celery_echomq/__init__.py assigns __version__ once, a string"
    return str(found[0])


@pytest.fixture(scope="module")
def version() -> str:
    # Read by each test, not at import: a copy of tests/ collected away from the source tree
    # (the smoke against the installed wheel, .ci/wheel) has no celery_echomq/ beside it.
    return written_version()


def test_the_version_is_written_once_in_the_package(version: str) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]
    dynamic = pyproject["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "celery_echomq.__version__"}
    assert str(Version(version)) == version  # PEP 440, in its normal form
    # The README's install section names the wheel that python -m build makes of it.
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"celery_echomq-([^-\s]+)-py3-none-any\.whl", readme))
    assert named == {version}


def test_the_changelog_has_an_unreleased_section_then_the_version(version: str) -> None:
    headings = re.findall(
        r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"), re.MULTILINE
    )
    assert headings[0] == "[Unreleased]"
    released = [re.fullmatch(r"\[(.+)\] - (\d{4}-\d{2}-\d{2})", h) for h in headings[1:]]
    assert all(released), f"a release's heading is '## [VERSION] - YYYY-MM-DD': {headings}"
    versions = [Version(m[1]) for m in released if m]
    assert versions[0] == Version(version), "the newest entry is the package's version"
    assert versions == sorted(versions, reverse=True), "newest first"


@pytest.fixture(scope="module")
def wheel() -> Iterator[zipfile.ZipFile]:
    path = os.environ.get("ECHOMQ_TEST_WHEEL")
    if not path:
        pytest.skip("no wheel to check: python3 dev.py wheel builds one and runs this")
    with zipfile.ZipFile(path) as built:
        yield built


def test_the_wheel_ships_every_file_of_the_package(wheel: zipfile.ZipFile) -> None:
    shipped = {name for name in wheel.namelist() if name.startswith("celery_echomq/")}
    source = {
        path.relative_to(ROOT).as_posix()
        for path in PACKAGE.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    } - NOT_SHIPPED
    # Guards the reader: each kind of file the package needs at run time is compared.
    kinds = {"store/lua/claim.lua", "store/lua/includes/gate.lua", "py.typed"}
    kinds |= {"ops/dashboard/templates/base.html", "ops/dashboard/static/flow.js"}
    assert {f"celery_echomq/{name}" for name in kinds} <= source
    assert sorted(source - shipped) == [], "in the source tree, not in the wheel"
    assert sorted(shipped - source) == [], "in the wheel, not in the source tree"


def test_the_wheels_metadata_has_the_version_the_extras_and_the_entry_points(
    wheel: zipfile.ZipFile, version: str
) -> None:
    info = f"celery_echomq-{version}.dist-info"
    assert Path(str(wheel.filename)).name == f"celery_echomq-{version}-py3-none-any.whl"
    metadata = HeaderParser().parsestr(wheel.read(f"{info}/METADATA").decode())
    assert metadata["Name"] == "celery-echomq"
    assert metadata["Version"] == version
    # Every extra the README's install table offers.
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    offered = set(re.findall(r"^\| `celery-echomq\[(\w+)\]` \|", readme, re.MULTILINE))
    assert offered >= {"embedded", "dashboard", "otel", "test"}
    assert offered <= set(metadata.get_all("Provides-Extra") or [])
    entry_points = wheel.read(f"{info}/entry_points.txt").decode()
    assert "echomq = celery_echomq.ops.cli:echomq" in entry_points  # celery echomq ...
    assert "celery_echomq.testing = celery_echomq.testing" in entry_points  # the pytest plugin
