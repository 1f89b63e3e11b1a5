"""Every transition script keeps one argument convention (``lua/README.md``): a KEYS slot is one
key, always passed, never found at a position an ARGV names; the required arguments are
positional; every optional one travels in one msgpack map, the last ARGV, which the header
lists and the script reads with ``cmsgpack.unpack(ARGV[#ARGV])``. Read from the source, but
for the last test, which sends a map to a real Redis."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import redis

from celery_echomq.store.keyspace import JOB_SETS, Keyspace, new_job_id
from celery_echomq.store.loader import load_source
from celery_echomq.store.script_values import packed_options
from celery_echomq.store.scripts import ParentRef, ResultWrite, Scripts
from tests.helpers import KEYS, LEASE, TTL, enqueue, run_child

LUA = Path(__file__).resolve().parents[2] / "celery_echomq" / "store" / "lua"
SCRIPTS = sorted(LUA.glob("*.lua"))
PIECES = sorted((LUA / "includes").glob("*.lua"))
# Scripts still on positional optional arguments, each with why; README.md's "Where the
# scripts still differ from this" names each of them.
STILL_POSITIONAL = {
    "enqueue_flow": "its options map and its KEYS after its children's rows are optional",
}
OPTIONS_DECLARED = re.compile(r"^-- ARGV\[([^\]]+)\]\s+the options, a msgpack map", re.M)
OPTIONS_READ = "cmsgpack.unpack(ARGV[#ARGV])"


def header(path: Path) -> list[str]:
    """The comment lines a script opens with, before its includes and its code."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("--") or line.startswith("--- @include"):
            break
        lines.append(line)
    return lines


def code(path: Path) -> str:
    """The script without its comments (a line's trailing comment too)."""
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        kept.append(line.split("--", 1)[0] if not line.lstrip().startswith("--") else "")
    return "\n".join(kept)


def convention_scripts() -> list[Path]:
    return [p for p in SCRIPTS if p.stem not in STILL_POSITIONAL]


def test_every_header_declares_the_keys_and_arguments_its_code_reads() -> None:
    undeclared = {}
    for path in SCRIPTS:
        top = "\n".join(header(path))
        assert top.startswith(f"-- {path.stem}: "), path.name
        declared = set(re.findall(r"^-- ((?:KEYS|ARGV)\[[^\]]+\])", top, re.M))
        assert any(d.startswith("KEYS") for d in declared), path.name
        assert any(d.startswith("ARGV") for d in declared), path.name
        used = set(re.findall(r"(?:KEYS|ARGV)\[\d+\]", code(path)))
        if used - declared:
            undeclared[path.name] = sorted(used - declared)
    assert undeclared == {}


def test_no_positional_argument_or_key_is_optional() -> None:
    optional = {
        path.name: line
        for path in convention_scripts()
        for line in header(path)
        if re.match(r"^-- (KEYS|ARGV)\[", line) and re.search(r"\boptional\b", line)
    }
    assert optional == {}


def test_no_argument_is_read_as_absent_and_no_key_is_found_through_one() -> None:
    found = {}
    for path in [*convention_scripts(), *PIECES]:
        body = code(path)
        # An argument a caller may leave out read as '' (it belongs in the options) ...
        absent = re.findall(r"ARGV\[[^\]]+\]\s+or\s+(?:'[^']*'|\"[^\"]*\"|[\d.-]+)", body)
        # ... and a KEYS position computed from an argument's value: read inline, or through
        # a local that holds one (a variadic list's rows are indexed by its loop, not a count).
        named = re.findall(r"KEYS\[[^\]]*(?:ARGV|tonumber|options)", body)
        values = set(re.findall(r"local (\w+) = tonumber\((?:ARGV|options)", body))
        named += [i for i in re.findall(r"KEYS\[([^\]]*)\]", body) if set(i.split()) & values]
        if absent or named:
            found[path.name] = absent + named
    assert found == {}


def test_optional_arguments_are_read_only_from_the_declared_options() -> None:
    wrong = {}
    for path in convention_scripts():
        top, body = "\n".join(header(path)), code(path)
        declared_at = OPTIONS_DECLARED.findall(top)
        unpacks = re.findall(r"cmsgpack\.unpack\(([^)]*)\)", body)
        if not declared_at and not unpacks:
            continue  # a script without options
        problems = []
        if len(declared_at) != 1 or unpacks != ["ARGV[#ARGV]"]:
            problems.append(f"declared at {declared_at}, unpacked from {unpacks}")
        # The options are the last ARGV: none declared after them.
        after = top.split("the options, a msgpack map", 1)[-1]
        if re.search(r"^-- ARGV\[", after, re.M):
            problems.append("an ARGV declared after the options")
        listed = after.split("\n--\n", 1)[0]  # the options' list ends at a bare "--"
        names = set(re.findall(r"^--   (\w+)\s", listed, re.M))
        read = set(re.findall(r"\boptions\.(\w+)", body))
        read |= set(re.findall(r"cmsgpack\.unpack\(ARGV\[#ARGV\]\)\.(\w+)", body))
        if names != read:
            problems.append(f"declared {sorted(names)}, read {sorted(read)}")
        if problems:
            wrong[path.name] = problems
    assert wrong == {}


def test_the_exceptions_are_named_where_the_convention_is_described() -> None:
    readme = (LUA / "README.md").read_text(encoding="utf-8")
    differ = readme.split("## Where the scripts still differ from this", 1)[1]
    assert [name for name in STILL_POSITIONAL if f"`{name}.lua`" not in differ] == []


def test_the_window_made_on_demand_reads_pieces_written_above_it() -> None:
    # complete.lua makes the window's functions inside a function, only for a windowed child:
    # the pieces window.lua includes must be written before, at the top, where the rest of
    # the script reads them too (the loader writes a piece once, where it first appears).
    source = load_source("complete")
    inner = source.index("local function window_functions()")
    for piece in ("local function now_ms()", "local function now_text()", "newer_format("):
        assert source.index(piece) < inner, piece


def test_the_host_pads_no_argument() -> None:
    store = LUA.parent
    padded = [p.name for p in sorted(store.glob("*.py")) if '[""] *' in p.read_text("utf-8")]
    assert padded == []


def test_options_reach_a_script_byte_for_byte_and_absent_ones_are_not_there(
    db: redis.Redis,
) -> None:
    # Redis's own cmsgpack (the one the scripts read with): any bytes, a text, a left-out one.
    raw = bytes(range(256)) * 3
    read = "local o = cmsgpack.unpack(ARGV[#ARGV]); return {o.raw, o.text, tostring(o.none)}"
    reply = db.eval(read, 0, "positional", packed_options(raw=raw, text="K/N", none=None))
    assert reply == [raw, b"K/N", b"nil"]


def claimed(scripts: Scripts, queue: str, job_id: str) -> str:
    token = uuid.uuid4().hex
    assert scripts.claim(queue, job_id, token, LEASE)[0] == "claimed"
    return token


def test_no_script_writes_the_placeholder_passed_for_a_key_a_call_has_not(
    db: redis.Redis, scripts: Scripts
) -> None:
    here, there = ("q" + uuid.uuid4().hex[:8] for _ in range(2))
    # Children of a parent on another slot: its keys are placeholders on theirs.
    parent, (done, failed) = new_job_id(), (new_job_id(), new_job_id())
    ref = ParentRef(parent, there)
    scripts.open_flow(there, parent, b"parent", 2, "")
    scripts.add_children(here, ref, [(done, b"a", ""), (failed, b"b", "")])
    token = claimed(scripts, here, done)
    assert scripts.complete(
        here, done, token, ttl=TTL, is_parent=False, parent=ref, value=b"1"
    ) == ("staged")
    token = claimed(scripts, here, failed)
    assert scripts.fail(here, failed, token, "E: x", ttl=TTL, is_parent=False, parent=ref)[0] == (
        "staged"
    )
    # Flow parents with no parent of their own, one writing its result, one failing.
    for outcome in ("done", "failed"):
        top, (child,) = enqueue(scripts, here, 1)
        assert run_child(scripts, here, top, child, b"1") == "released"
        token = claimed(scripts, here, top)
        if outcome == "done":
            write = ResultWrite(
                f"celery-task-meta-{top}", b"meta", None, channel=f"celery-task-meta-{top}"
            )
            status = scripts.complete(
                here, top, token, ttl=TTL, is_parent=True, parent=None, value=b"2", result=write
            )
            assert status == "done" and db.get(write.key) == b"meta"
        else:
            status, _ = scripts.fail(here, top, token, "E: y", ttl=TTL, is_parent=True, parent=None)
            assert status == "failed"
    assert db.exists(KEYS.unused_key(here), KEYS.unused_key(there)) == 0


# --- keys: each named once, at the top; a key not passed comes from includes/keys.lua ------

KEYS_PIECE = LUA / "includes" / "keys.lua"
LOCAL_KEY = re.compile(r"^local (\w+) = KEYS\[(\d+)\]$")
# A variadic tail's offset: ``local children_at = 7 -- child i's row is KEYS[children_at + i]``.
LOCAL_OFFSET = re.compile(r"^local (\w+_at) = \d+ -- .*KEYS\[\1 \+ \w+\]")


def locals_block(path: Path) -> list[str]:
    """The lines right after a script's header that name its keys."""
    lines = path.read_text(encoding="utf-8").splitlines()[len(header(path)) :]
    top = 0
    while top < len(lines) and (LOCAL_KEY.match(lines[top]) or LOCAL_OFFSET.match(lines[top])):
        top += 1
    return lines[:top]


def test_every_key_is_named_once_at_the_top_and_read_through_its_name() -> None:
    wrong = {}
    for path in SCRIPTS:
        block = locals_block(path)
        named = [m.groups() for m in map(LOCAL_KEY.match, block) if m]
        positions = [int(n) for _, n in named]
        declared = {int(n) for n in re.findall(r"^-- KEYS\[(\d+)\]", "\n".join(header(path)), re.M)}
        problems = []
        if positions != list(range(1, len(positions) + 1)) or set(positions) != declared:
            problems.append(f"named {positions}, declared {sorted(declared)}")
        if len({name for name, _ in named}) != len(named):
            problems.append("a name twice")
        # Past the names, no KEYS position is written as a number: a fixed key is read by
        # its name, a variadic tail through its named offset.
        body = code(path).splitlines()[len(header(path)) + len(block) :]
        raw = [line.strip() for line in body if re.search(r"KEYS\[\s*\d", line)]
        if raw:
            problems.append(f"raw KEYS: {raw}")
        if problems:
            wrong[path.name] = problems
    assert wrong == {}


def derived_suffixes() -> set[str]:
    """The suffixes includes/keys.lua derives from a row: ``return row .. ':<suffix>'``, and
    the ones it reads back (``':dependencies'``)."""
    source = KEYS_PIECE.read_text(encoding="utf-8")
    made = set(re.findall(r"^\s+return row \.\. ':(\w+)'$", source, re.M))
    read = set(re.findall(r"string\.sub\(\w+, -\d+\) == ':(\w+)'", source))
    assert made and read, "includes/keys.lua no longer has the forms this test reads"
    return made | read


def test_no_script_or_piece_but_keys_lua_names_a_key_of_its_own() -> None:
    # A key's form in a string literal (a suffix of a row, a queue's set, a hash tag's end)
    # anywhere but includes/keys.lua is a key named past the one include.
    suffixes = derived_suffixes() | set(JOB_SETS) | {"counters", "loc", "id"}
    form = re.compile(r"(?:^|[^%\w]):(?:" + "|".join(sorted(suffixes)) + r")\b|}:")
    found = {}
    for path in [*SCRIPTS, *PIECES]:
        if path == KEYS_PIECE:
            continue
        literals = re.findall(r"'([^'\n]*)'|\"([^\"\n]*)\"", code(path))
        named = [a or b for a, b in literals if form.search(a or b)]
        if named:
            found[path.name] = named
    assert found == {}


def test_every_derived_key_has_a_keyspace_method_and_a_readme_line() -> None:
    keys, queue, job = Keyspace("emq"), "q", new_job_id()
    readme = (LUA / "README.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^- `<row>:(\w+)`", readme, re.M))
    missing = {}
    for suffix in sorted(derived_suffixes()):
        method = getattr(keys, f"{suffix}_key", None)
        if method is None or method(queue, job) != f"{keys.job_key(queue, job)}:{suffix}":
            missing[suffix] = "no Keyspace method giving it"
        elif suffix not in listed:
            missing[suffix] = "not listed in lua/README.md"
    assert missing == {}
    # The method of each suffix Keyspace names beside a row is the one keys.lua derives too:
    # nothing listed that no script or host makes.
    assert listed <= derived_suffixes() | {"processed", "settled", "adding"}
