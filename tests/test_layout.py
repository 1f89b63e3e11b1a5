"""The package's shape: rooms by concern whose imports run one way, down; no cycle, even
through an import inside a function; no module past 400 lines; no Lua run written twice.

Read from the source with ``ast``: nothing is imported, so a cycle that Python would resolve
at run time (a lazy import) still fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "celery_echomq"
ROOT = "celery_echomq"
# From the bottom up: a module may import its own room and the rooms below it. The leaves
# (errors, config, tracing) any room may import; the top-level modules are what users import.
ROOMS = ["leaf", "embedded", "store", "send", "worker", "ops", "top"]
LEAVES = {"errors", "config", "tracing"}
MAX_LINES = 400
LUA_RUN = 6  # lines: a run this long in two Lua files belongs in lua/includes/


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def room(name: str) -> str:
    parts = name.split(".")
    if len(parts) == 1:
        return "top"  # the package itself: install() and the public names
    if len(parts) == 2 and parts[1] in LEAVES:
        return "leaf"
    return parts[1] if parts[1] in ROOMS else "top"


def imports_of(name: str) -> set[str]:
    """The package's modules ``name`` imports, at the top or inside a function."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if not target.startswith(ROOT):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:
                    found.add(sub)
                elif target in MODULES:
                    found.add(target)
    found.discard(name)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def test_the_graph_is_read_from_real_imports() -> None:
    # Guards the reader itself: a graph with no edges would pass every test below.
    assert "celery_echomq.store.state" in GRAPH["celery_echomq.worker.settle"]
    assert "celery_echomq.send.plan" in GRAPH["celery_echomq.canvas"]
    assert sum(len(targets) for targets in GRAPH.values()) > 150


def test_no_import_cycle() -> None:
    cycles: list[list[str]] = []
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycles.append([*path[path.index(name) :], name])
            return
        if name in done:
            return
        for target in sorted(GRAPH[name]):
            visit(target, [*path, name])
        done.add(name)

    for name in MODULES:
        visit(name, [])
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


def test_imports_run_down_the_rooms() -> None:
    upward = [
        f"{name} ({room(name)}) imports {target} ({room(target)})"
        for name, targets in GRAPH.items()
        for target in targets
        if ROOMS.index(room(target)) > ROOMS.index(room(name))
    ]
    assert upward == []


def test_every_room_is_a_package_a_newcomer_can_name() -> None:
    rooms = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert rooms == {"embedded", "store", "send", "worker", "ops"}
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert top == {"canvas", "result", "eager", "config", "errors", "testing", "tracing"}


def test_no_module_is_over_400_lines() -> None:
    lengths = {name: len(p.read_text(encoding="utf-8").splitlines()) for name, p in MODULES.items()}
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}


def test_no_lua_run_is_written_twice() -> None:
    seen: dict[tuple[str, ...], str] = {}
    repeated: list[str] = []
    for path in sorted((PACKAGE / "store" / "lua").rglob("*.lua")):
        code = [
            line.strip()
            for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip() and not line.strip().startswith("--") and line.strip() != "end"
        ]
        here: set[tuple[str, ...]] = set()
        for i in range(len(code) - LUA_RUN + 1):
            run = tuple(code[i : i + LUA_RUN])
            if run in here:
                continue
            here.add(run)
            first = seen.setdefault(run, path.name)
            if first != path.name:
                repeated.append(f"{first} and {path.name}: {run[0]!r}...")
    assert repeated == [], "Lua runs written twice (move them to lua/includes/): " + "; ".join(
        repeated[:5]
    )
