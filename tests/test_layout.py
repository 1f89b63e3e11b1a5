"""The package's shape: rooms by concern whose imports run one way, down; no cycle, even
through an import inside a function; no private name imported from another module; no Lua run
written twice. A module is as large as its concern: no length cap cuts one in two, and what
two modules share is named as their interface (the private-import check), so a concern cut
in two rooms shows.

Read from the source with ``ast``: nothing is imported, so a cycle that Python would resolve
at run time (a lazy import) still fails here.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "celery_echomq"
ROOT = "celery_echomq"
# From the bottom up: a module may import its own room and the rooms below it. The leaves
# (errors, config, tracing) any room may import; the top-level modules are what users import.
# ``wire``, Celery's and kombu's formats, sits on the store (whose scripts write them as given)
# and under everything that sends a message or writes a result.
ROOMS = ["leaf", "embedded", "store", "wire", "send", "worker", "ops", "top"]
LEAVES = {"errors", "config", "tracing"}
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
    assert rooms == {"embedded", "store", "wire", "send", "worker", "ops"}
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert top == {"canvas", "chords", "result", "eager", "config", "errors", "testing", "tracing"}


def test_no_module_imports_a_private_name_of_another() -> None:
    # A name two modules share is part of its module's interface, and named as such; two
    # modules that share their privates are one concern in two rooms.
    private = [
        f"{name} imports {node.module}.{alias.name}"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(ROOT)
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert private == []


KEYS_NAMED = re.compile(r"^local \w+ = (KEYS\[\d+\]|\d+ -- .*KEYS\[)")


def test_no_lua_run_is_written_twice() -> None:
    seen: dict[tuple[str, ...], str] = {}
    repeated: list[str] = []
    for path in sorted((PACKAGE / "store" / "lua").rglob("*.lua")):
        code = [
            line.strip()
            for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()
            and not line.strip().startswith("--")
            and line.strip() != "end"
            # A script's names of its KEYS (lua/README.md): scripts that share a layout share them.
            and not KEYS_NAMED.match(line)
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


# --- Names in the prose: every module a docstring, a comment or a doc names exists ----------

REPO = PACKAGE.parent
# Where the package's modules are named: its own source, the docs, and the code around it
# (but this file, which names missing ones on purpose).
PROSE = sorted(
    path
    for path in [
        *PACKAGE.rglob("*.py"),
        *(REPO / "docs").glob("*.md"),
        REPO / "README.md",
        *PACKAGE.rglob("*.lua"),
        *PACKAGE.rglob("*.md"),
        *(REPO / "tests").glob("*.py"),
        *(REPO / "examples").glob("*.py"),
        *(REPO / "benchmarks").glob("*.py"),
        REPO / "dev.py",
    ]
    if path != Path(__file__).resolve()
)
DOTTED = re.compile(r"(?<![\w.])celery_echomq(?:\.\w+)+")
ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|exc|obj):`~?(\.?[\w.]+)`")
PATH = re.compile(r"(?<![\w/])celery_echomq/[\w/]+\.(?:py|lua)\b")
# A path inside the package, written from one of its rooms (``send/fan_in.py``,
# ``store/lua/complete.lua``, ``lua/includes/gate.lua``, ``includes/gate.lua``), and a
# script named by its file alone (``credit.lua``): each names a file of the package.
SHORT_PATH = re.compile(
    r"(?<![\w/.-])(?:embedded|store|wire|send|worker|ops|lua|includes)/[\w/]+\.(?:py|lua)\b"
)
LUA_FILE = re.compile(r"(?<![\w/.-])\w+\.lua\b")
# Where a short path is read from: the package, its store (``lua/...``), its scripts.
SHORT_ROOTS = (PACKAGE, PACKAGE / "store", PACKAGE / "store" / "lua")
LUA_FILES = {p.name for p in (PACKAGE / "store" / "lua").rglob("*.lua")}
# ``a module`` a package's docstring lists (``producer.send_flow``: a name in one): in a list,
# so followed by a comma, a parenthesis, a colon or "and" (not "the ``republished`` counter").
LISTED = re.compile(r"``([a-z_][a-z0-9_]*)(?:\.(\w+))?``(?=\s*[(),:]|\s+and\b)")


def top_level_names(name: str) -> set[str]:
    """What ``import`` of module ``name`` would define: its functions, classes, assigned names
    and imported names (a package's also its submodules)."""
    found = {sub.rpartition(".")[2] for sub in MODULES if sub.rpartition(".")[0] == name}
    for node in ast.parse(MODULES[name].read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update((a.asname or a.name).split(".")[0] for a in node.names)
    return found


def string_names() -> set[str]:
    """Dotted names the package gives that are not modules: its tasks' and loggers' names,
    each a string constant of its own in its source (``SPREAD_TASK = "celery_echomq.spread"``;
    a docstring that mentions one is not such a constant)."""
    return {
        node.value
        for path in MODULES.values()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and DOTTED.fullmatch(node.value)
    }


STRING_NAMES = string_names()


def unresolved(ref: str) -> str | None:
    """Why ``ref`` (``celery_echomq.x.y``) names nothing, or None: its longest prefix that is a
    module must define the next part, if any."""
    parts = ref.split(".")
    for end in range(len(parts), 0, -1):
        module = ".".join(parts[:end])
        if module in MODULES:
            rest = parts[end:]
            if not rest or rest[0] in top_level_names(module):
                return None
            return f"{module} has no {rest[0]!r}"
    return "no such module"


def references(path: Path) -> list[tuple[str, str]]:
    """``(name, where)`` for each module reference in ``path``: dotted names, Sphinx roles
    (a relative ``:func:`~.sweep.run_pass``` read from the module's own package) and paths."""
    text = path.read_text(encoding="utf-8")
    where = str(path.relative_to(REPO))
    found = [(ref.rstrip("."), where) for ref in DOTTED.findall(text)]
    if path.suffix == ".py" and PACKAGE in path.parents:
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found += [(package + ref, where) for ref in ROLE.findall(text) if ref.startswith(".")]
    found += [(ref, where) for ref in PATH.findall(text)]
    return found


def test_the_reference_reader_finds_and_resolves_names() -> None:
    # Guards the reader: a module, a name in one, a task name and a relative role resolve; a
    # module that is gone and a missing name do not.
    refs = {ref for path in PROSE for ref, _ in references(path)}
    assert "celery_echomq.ops.views" in refs
    assert "celery_echomq.worker.recovery.sweep.run_pass" in refs
    assert unresolved("celery_echomq.ops.listing.read_flows") is None
    assert unresolved("celery_echomq.add_children") is None
    assert "celery_echomq.spread" in STRING_NAMES
    assert unresolved("celery_echomq.views") == "celery_echomq has no 'views'"
    assert unresolved("celery_echomq.ops.views.no_such_read") is not None


def short_references(path: Path) -> list[str]:
    """Why each file ``path`` names by a short path (``send/fan_in.py``, ``credit.lua``)
    names nothing, if it does not."""
    text = path.read_text(encoding="utf-8")
    stale = [
        f"{ref} (no such file)"
        for ref in SHORT_PATH.findall(text)
        if not any((root / ref).exists() for root in SHORT_ROOTS)
    ]
    stale += [f"{ref} (no such script)" for ref in LUA_FILE.findall(text) if ref not in LUA_FILES]
    return stale


def listed_modules(path: Path, name: str = "") -> list[str]:
    """Why each module a package's docstring lists (``sweep``, ``producer.send_flow``) names
    nothing, if it does not: a module of the package, one of the package's rooms beside it
    (``store``), or a library it names."""
    name = name or module_name(path)
    up = name.rpartition(".")[0]  # the package's own package: its siblings
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    stale = []
    for first, rest in LISTED.findall(doc):
        module = next(
            (m for m in (f"{name}.{first}", f"{up}.{first}", f"{ROOT}.{first}") if m in MODULES),
            None,
        )
        if module is None:
            if importlib.util.find_spec(first) is None:
                stale.append(f"``{first}`` (no such module)")
        elif rest and unresolved(f"{module}.{rest}"):
            stale.append(f"``{first}.{rest}`` ({unresolved(f'{module}.{rest}')})")
    return stale


def test_the_short_reference_reader_tells_a_file_from_prose(tmp_path: Path) -> None:
    # Guards the reader: paths that exist, from each root, pass; gone ones do not; prose with
    # a slash or a dot in it ("and/or", "e.g.", "x.lua's") is no reference.
    page = tmp_path / "page.md"
    page.write_text(
        "send/fan_in.py, store/lua/complete.lua, lua/includes/gate.lua, includes/keys.lua, "
        "credit.lua; and/or e.g. a KEYS/ARGV header; send/gone.py, worker/gone.py, gone.lua",
        encoding="utf-8",
    )
    assert short_references(page) == [
        "send/gone.py (no such file)",
        "worker/gone.py (no such file)",
        "gone.lua (no such script)",
    ]
    package = tmp_path / "__init__.py"
    package.write_text(
        '"""The modules: ``keyspace``, ``gone``, ``keyspace.row_id`` and ``keyspace.gone`` (a '
        'name); the ``lost`` counter (prose)."""'
    )
    assert listed_modules(package, "celery_echomq.store") == [
        "``gone`` (no such module)",
        "``keyspace.gone`` (celery_echomq.store.keyspace has no 'gone')",
    ]


def test_every_module_a_docstring_or_doc_names_exists() -> None:
    stale = [
        f"{path.relative_to(REPO)}: {why}"
        for path in PROSE
        for why in [
            *short_references(path),
            *(listed_modules(path) if path.name == "__init__.py" else []),
        ]
    ]
    for path in PROSE:
        for ref, where in references(path):
            if "/" in ref:
                if not (REPO / ref).exists():
                    stale.append(f"{where}: {ref} (no such file)")
            elif ref not in STRING_NAMES and (why := unresolved(ref)):
                stale.append(f"{where}: {ref} ({why})")
    assert stale == [], "names of modules that do not exist:\n" + "\n".join(sorted(set(stale)))


# --- Links between the docs: every file and heading a Markdown link names exists -----------

MARKDOWN = sorted([*(REPO / "docs").glob("*.md"), REPO / "README.md", *PACKAGE.rglob("*.md")])
LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)")


def anchors(path: Path) -> set[str]:
    """The anchors a Markdown file's headings get (GitHub's rule: lower case, punctuation
    dropped, spaces to hyphens)."""
    found = set()
    for line in path.read_text().splitlines():
        heading = re.match(r"#+\s+(.*)", line)
        if heading:
            words = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower())
            found.add(words.replace(" ", "-"))
    return found


def test_every_link_between_the_docs_reaches_its_file_and_heading() -> None:
    broken = []
    for path in MARKDOWN:
        for target, anchor in LINK.findall(path.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            linked = (path.parent / target) if target else path
            where = f"{path.relative_to(REPO)}: ({target}#{anchor})"
            if not linked.exists():
                broken.append(f"{where} no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{where} no such heading")
    assert broken == [], "links that lead nowhere:\n" + "\n".join(broken)


def test_dir_of_the_package_lists_its_public_names_and_not_its_imports() -> None:
    import celery_echomq

    names = dir(celery_echomq)
    assert "annotations" not in names and "Any" not in names
    assert set(celery_echomq.__all__) <= set(names)
    assert all(hasattr(celery_echomq, name) for name in names)
