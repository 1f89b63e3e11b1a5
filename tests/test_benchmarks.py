"""The benchmarks' shape, as tests/test_layout.py checks the package's: one entry
(benchmarks/__main__.py, what ``dev.py bench`` runs) that names every benchmark; imports among
benchmarks/ modules that run one way, with no cycle, even through an import inside a function;
and no file that no page cites: each is a benchmark whose command a page cites, or a module
that one imports or runs (a peer's driver, a pytest plugin, a directory put on PYTHONPATH).

Read from the source with ``ast``: nothing of benchmarks/ is imported here but the entry's
table, and the entry itself runs as dev.py runs it.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
# The pages that cite benchmark commands.
PAGES = [REPO / "docs" / "performance.md", BENCH / "NOTES.md", REPO / "README.md"]
if not (BENCH / "__main__.py").is_file():  # a copy of tests/ alone (.ci/wheel's smoke)
    pytest.skip("no benchmarks/ beside tests/", allow_module_level=True)


def load_entry() -> ModuleType:
    spec = importlib.util.spec_from_file_location("benchmarks_entry", BENCH / "__main__.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ENTRY = load_entry()
# Each benchmark the entry runs, by its module name, and the command that runs it.
ENTRIES = {
    ENTRY.DEFAULT.removesuffix(".py"): "dev.py bench",
    **{
        script.removesuffix(".py").replace("/", "."): f"dev.py bench {name}"
        for name, script in ENTRY.BENCHMARKS.items()
    },
}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(BENCH).with_suffix("").parts)


MODULES = {
    module_name(p): p
    for p in sorted(BENCH.rglob("*.py"))
    if "node_modules" not in p.parts and p.name != "__main__.py"
}


def resolve(importer: str, target: str) -> str | None:
    """The benchmarks module ``import target`` in ``importer`` reaches, or None: a script's
    own directory comes first on its path, then benchmarks/ (the entry's PYTHONPATH)."""
    folder = importer.rpartition(".")[0]
    for candidate in (f"{folder}.{target}" if folder else target, target):
        if candidate in MODULES:
            return candidate
    return None


def docstrings(tree: ast.AST) -> set[int]:
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def edges(name: str) -> tuple[set[str], set[str]]:
    """(the benchmarks modules ``name`` imports, the helpers it runs by name: a string constant,
    not a docstring, that is the file name or the module name of a helper in its own folder,
    or the name of a folder beneath its own that holds one: a peer's driver, a pytest plugin,
    a directory put on PYTHONPATH)."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        imported.update(m for t in targets if (m := resolve(name, t)))
    skip = docstrings(tree)
    strings = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
    }
    here = MODULES[name].parent
    named = {
        other
        for other, path in MODULES.items()
        if other not in ENTRIES
        and (
            (path.parent == here and {path.name, path.stem} & strings)
            or (path.parent.parent == here and path.parent.name in strings)
        )
    }
    imported.discard(name)
    named.discard(name)
    return imported, named - imported


IMPORTS = {name: edges(name)[0] for name in MODULES}
RUNS = {name: edges(name)[1] for name in MODULES}


def test_the_graph_is_read_from_real_imports() -> None:
    # Guards the reader: a graph with no edges would pass every test below.
    assert {"measure", "modes", "report", "bench_app"} <= IMPORTS["bench"]
    assert {"measure", "modes", "bench_app"} <= IMPORTS["peers.runner"]
    assert {"peers.protocol", "peers.dramatiq_tasks"} <= IMPORTS["peers.dramatiq_driver"]
    assert {"peers.dramatiq_driver", "peers.rq_driver"} <= RUNS["peers.runner"]
    assert "otel_block.sitecustomize" in RUNS["tracing_cost"]
    assert "celery_suite_plugin" in RUNS["celery_canvas"]


def test_no_import_cycle() -> None:
    cycles: list[list[str]] = []
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            cycles.append([*path[path.index(name) :], name])
            return
        if name in done:
            return
        for target in sorted(IMPORTS[name]):
            visit(target, [*path, name])
        done.add(name)

    for name in MODULES:
        visit(name, [])
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


def test_no_module_imports_a_benchmark() -> None:
    # The benchmarks are the top: what two of them share goes down into a module of its own
    # (measure.py, modes.py, bench_app.py), never one benchmark imported by another.
    upward = [
        f"{name} imports {target}"
        for name, targets in IMPORTS.items()
        for target in targets
        if target in ENTRIES
    ]
    assert upward == []


def test_every_script_with_a_main_is_an_entry_or_run_by_one() -> None:
    scripts = {
        name
        for name, path in MODULES.items()
        if re.search(r"^if __name__ == .__main__.:", path.read_text(encoding="utf-8"), re.M)
    }
    run = {target for targets in RUNS.values() for target in targets}
    missing = sorted(scripts - set(ENTRIES) - run)
    assert missing == [], f"add them to BENCHMARKS in benchmarks/__main__.py: {missing}"
    assert all((BENCH / script).is_file() for script in ENTRY.BENCHMARKS.values())


def test_every_benchmark_is_cited_by_a_page() -> None:
    text = "\n".join(page.read_text(encoding="utf-8") for page in PAGES)
    uncited = [
        f"{name} ({command})"
        for name, command in ENTRIES.items()
        if not re.search(re.escape(command) + r"(?![\w-])", text)
    ]
    assert uncited == [], f"no page cites them: {uncited}"


def test_every_file_is_a_benchmark_or_used_by_one() -> None:
    reached: set[str] = set()
    todo = list(ENTRIES)
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += [*IMPORTS[name], *RUNS[name]]
    assert sorted(set(MODULES) - reached) == []


def entry(*args: str) -> subprocess.CompletedProcess[str]:
    """``dev.py bench ARGS``, as dev.py runs it."""
    return subprocess.run(
        [sys.executable, "benchmarks", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_entry_lists_every_benchmark_and_refuses_an_unknown_name() -> None:
    listed = entry("--list")
    assert listed.returncode == 0, listed.stderr
    for name in ENTRY.BENCHMARKS:
        assert re.search(rf"^  {re.escape(name)}\s", listed.stdout, re.M), name
    wrong = entry("no-such-bench")
    assert wrong.returncode == 2
    assert "no benchmark named 'no-such-bench'" in wrong.stderr
    assert "script-cost" in wrong.stderr


def test_the_entry_runs_a_benchmark_by_name_and_the_default_one() -> None:
    # round-trip imports measure.py from benchmarks/ and starts a redis-server: a real run.
    run = entry("round-trip", "--calls", "20", "--rounds", "1")
    assert run.returncode == 0, run.stderr
    assert "EVALSHA of five commands" in run.stdout
    # The default bench and the peers bench, as far as their options: their imports resolve.
    for args in (["--help"], ["peers", "--help"]):
        helped = entry(*args)
        assert helped.returncode == 0, helped.stderr
        assert "--rounds" in helped.stdout
