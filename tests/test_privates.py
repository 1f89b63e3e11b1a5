"""What the package takes from the insides of the libraries it extends, kept in one list.

Every private name of Celery, kombu, redis-py or OpenTelemetry that the package imports or
reads (an attribute or a ``getattr`` of a name with one leading underscore that the package
does not define itself), and every Celery attribute it replaces, is a place where the next
release of that library can break the extension. ``docs/design.md`` lists each, with where it
is used and why no public seam serves; these tests hold that list to the code both ways.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import TypeGuard

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "celery_echomq"
DESIGN = REPO / "docs" / "design.md"
LIBRARIES = ("celery", "kombu", "redis", "opentelemetry")
SECTION = "## What is taken from Celery's insides"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_names(trees: list[ast.Module]) -> set[str]:
    """Every name the package defines: functions, classes, arguments, names and attributes it
    assigns (``self._x = ...``), and attributes it sets by name (``setattr(obj, "_x", v)``)."""
    own: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                # A constant naming an attribute the package keeps on another's object.
                value = node.value.value
                if isinstance(value, str) and _private(value):
                    own.add(value)
            elif _call_named(node, "setattr"):
                own.add(_string_arg(node))
    return own


def _call_named(node: ast.AST, name: str) -> TypeGuard[ast.Call]:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == name
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    )


def _string_arg(node: ast.Call) -> str:
    value = node.args[1]
    assert isinstance(value, ast.Constant)
    return str(value.value)


def private_names_read() -> dict[str, set[str]]:
    """Each private name of another library the package reads, with the modules that read it:
    ``module._name`` where it is imported, ``_name`` where it is an attribute."""
    paths = sorted(PACKAGE.rglob("*.py"))
    trees = [ast.parse(p.read_text(encoding="utf-8")) for p in paths]
    own = _own_names(trees)
    read: dict[str, set[str]] = {}
    for path, tree in zip(paths, trees, strict=True):
        where = path.relative_to(REPO).as_posix()
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(LIBRARIES):
                names = [f"{node.module}.{a.name}" for a in node.names if _private(a.name)]
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                names = [node.attr] if _private(node.attr) and node.attr not in own else []
            elif _call_named(node, "getattr") or _call_named(node, "hasattr"):
                name = _string_arg(node)
                names = [name] if _private(name) and name not in own else []
            for name in names:
                read.setdefault(name, set()).add(where)
    return read


def listed() -> dict[str, str]:
    """The names ``docs/design.md`` lists under its section on Celery's insides: the first
    cell of each table row, with the row."""
    text = DESIGN.read_text(encoding="utf-8")
    assert SECTION in text, f"docs/design.md has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \|(.*)$", section, re.MULTILINE)
    return {name: row for name, row in rows}


def test_every_private_name_read_is_listed_with_its_reason() -> None:
    read, rows = private_names_read(), listed()
    missing = {name: sorted(where) for name, where in read.items() if name not in rows}
    assert not missing, f"read but not listed in docs/design.md ({SECTION}): {missing}"
    for name in read:
        cells = [c.strip() for c in rows[name].split("|")]
        assert len(cells) >= 3 and all(cells[:2]), f"{name}: where and why, each said"


def test_every_name_listed_is_read_replaced_or_overridden() -> None:
    read, rows = private_names_read(), listed()
    patched = {name for name, row in rows.items() if "replaced" in row or "overridden" in row}
    stale = sorted(set(rows) - set(read) - patched)
    assert not stale, f"listed in docs/design.md but no longer read: {stale}"


def test_every_override_listed_is_defined_where_the_list_says() -> None:
    for name, row in listed().items():
        if "overridden" in row:
            module = re.search(r"`([a-z_/]+\.py)`", row)
            assert module, f"{name}: the module that overrides it"
            source = (PACKAGE / module.group(1)).read_text(encoding="utf-8")
            assert re.search(rf"^    def {re.escape(name)}\(", source, re.MULTILINE), (
                f"{name} is not overridden in {module.group(1)}"
            )


def test_every_patched_attribute_listed_is_assigned_where_the_list_says() -> None:
    rows = listed()
    patched = {name: row for name, row in rows.items() if "replaced" in row}
    assert patched, "the list names no replaced attribute"
    for name, row in patched.items():
        module = re.search(r"`([a-z_/]+\.py)`", row)
        assert module, f"{name}: the module that replaces it"
        owner, attr = name.rsplit(".", 1)
        source = (PACKAGE / module.group(1)).read_text(encoding="utf-8")
        assert re.search(rf"\b{re.escape(owner)}\.{re.escape(attr)} = ", source), (
            f"{name} is not replaced in {module.group(1)}"
        )
