"""What the store asks of its server: the oldest version it runs on (checked at a process's
first use, on a real server), the Lua advisories judged by version, and the least-privilege ACL
user docs/production.md gives, kept in step with the code that sends the commands.

The command lists are read from the sources here, independently of the package's own reading:
every ``redis.call``/``redis.pcall`` of the Lua files, and every redis-py command method or
``execute_command`` the Python calls.
"""

from __future__ import annotations

import ast
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

import celery_echomq
from celery_echomq import flow
from celery_echomq.embedded import RedisServer
from celery_echomq.errors import ConfigError
from celery_echomq.store.server_info import (
    DOCTOR_COMMANDS,
    TRANSACTION_COMMANDS,
    acl_setuser,
    required_commands,
)
from celery_echomq.store.server_versions import (
    LUA_ADVISORIES,
    MIN_SERVER,
    open_advisories,
    server_of,
)
from celery_echomq.store.state import get_state

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "celery_echomq"
DOC = ROOT / "docs" / "production.md"


def documented_line() -> str:
    lines = [line for line in DOC.read_text().splitlines() if line.startswith("ACL SETUSER")]
    assert len(lines) == 1, lines
    return lines[0]


def documented_commands() -> set[str]:
    return {word[1:].upper() for word in documented_line().split() if word.startswith("+")}


# --- The least-privilege user ------------------------------------------------------------------


def test_the_documented_acl_line_is_the_one_the_code_needs() -> None:
    line = documented_line()
    assert line == acl_setuser()
    # Its keys, no channel, no category: each command named.
    assert line.startswith("ACL SETUSER flows reset on >PASSWORD ~emq:* resetchannels +")
    assert "&" not in line and "@" not in line and "+eval " not in line
    assert not documented_commands() & {"CONFIG|GET", "CONFIG", "KEYS", "FLUSHDB", "EVAL"}


def test_every_command_a_script_calls_is_granted() -> None:
    called = set()
    for path in (PACKAGE / "store" / "lua").rglob("*.lua"):
        found = re.findall(r"redis\.p?call\(\s*['\"](\w+)['\"]", path.read_text())
        called.update(name.upper() for name in found)
    assert len(called) > 30  # the reader reads: the scripts call this many
    assert called - documented_commands() == set()


# redis-py's methods whose command is not their name in capitals.
METHOD_COMMANDS = {"delete": "DEL", "hscan_iter": "HSCAN", "scan_iter": "SCAN"}
SUBCOMMANDS = ("script_", "config_", "acl_", "cluster_", "client_")
# Methods of Python's own types, click's and the code's helpers that share a redis-py name,
# redis-py's own that send nothing, and a Sentinel's command (sent to the Sentinels, whose
# users are their own).
NOT_REDIS = set(dir(dict)) | set(dir(list)) | set(dir(set)) | set(dir(str)) | {
    "wait", "set", "time", "close", "pipeline", "execute", "register_script", "reset",
    "info", "cluster", "client", "type", "object", "lock", "echo", "sort", "command",
    "from_url", "sentinel_master",
}  # fmt: skip


def python_commands() -> set[str]:
    """The Redis commands the package's Python sends: each redis-py command method called as
    an attribute, each literal ``execute_command`` and ``info`` (``embedded/`` aside: servers
    of its own, run as their administrator)."""
    methods = {name for name in dir(redis.Redis) if not name.startswith("_")}
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if "embedded" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name = node.func.attr
            if name == "pipeline" and not any(
                k.arg == "transaction" and isinstance(k.value, ast.Constant) and not k.value.value
                for k in node.keywords
            ):
                found.update({"MULTI", "EXEC"})  # redis-py's pipeline is a transaction by default
            elif name in ("execute_command", "send_command") and node.args:
                words = [a.value for a in node.args[:2] if isinstance(a, ast.Constant)]
                if words and isinstance(words[0], str):
                    upper = [str(w).upper() for w in words]
                    found.add("|".join(upper) if upper[0] in ("ACL", "CLUSTER") else upper[0])
            elif name == "info":
                found.add("INFO")
            elif name == "time" and not (
                isinstance(node.func.value, ast.Name) and node.func.value.id == "time"
            ):
                found.add("TIME")
            elif name in methods and name not in NOT_REDIS:
                if name.startswith(SUBCOMMANDS):
                    found.add(name.replace("_", "|", 1).upper())
                else:
                    found.add(METHOD_COMMANDS.get(name, name.upper()))
    return found


def test_every_command_the_python_sends_is_granted_or_the_doctors_own() -> None:
    sent = python_commands()
    # The reader reads: these are sent from Python, not only by the scripts.
    assert {"HGET", "HMGET", "ZRANGEBYSCORE", "WAIT", "TIME", "INFO", "SCAN", "HSCAN"} <= sent
    assert {"CONFIG|GET", "ACL|WHOAMI", "CLUSTER|INFO"} <= sent
    assert {"MULTI", "EXEC", "DISCARD"} <= sent  # a transaction; the doctor's probe
    assert sent - documented_commands() - set(DOCTOR_COMMANDS) == set()
    # And what redis-py sends on its own: scripts loaded, the database selected, a health PING.
    assert {"EVALSHA", "SCRIPT|LOAD", "SCRIPT|EXISTS", "SELECT", "PING"} <= documented_commands()
    assert documented_commands() == {*required_commands(), *TRANSACTION_COMMANDS}


# --- The Lua advisories, by version (pure) -------------------------------------------------------


@pytest.mark.parametrize(
    ("info", "open_", "line_note"),
    [
        ({"redis_version": "6.2.14"}, True, ""),
        ({"redis_version": "6.2.20"}, False, ""),
        ({"redis_version": "7.0.15"}, True, "none known on the 7.0 line"),
        ({"redis_version": "7.2.10"}, True, ""),
        ({"redis_version": "7.2.11"}, False, ""),
        ({"redis_version": "7.4.6"}, False, ""),
        ({"redis_version": "8.0.3"}, True, ""),
        ({"redis_version": "8.2.2"}, False, ""),
        ({"redis_version": "8.4.0"}, False, ""),
        ({"redis_version": "7.2.4", "server_name": "valkey", "valkey_version": "8.1.3"}, True, ""),
        ({"redis_version": "7.2.4", "server_name": "valkey", "valkey_version": "8.1.4"}, False, ""),
        ({"redis_version": "7.2.4", "server_name": "valkey", "valkey_version": "8.0.6"}, False, ""),
        ({"redis_version": "7.2.4", "server_name": "valkey", "valkey_version": "9.0.0"}, False, ""),
        (
            {"redis_version": "7.2.4", "server_name": "valkey", "valkey_version": "7.2.8"},
            True,
            "none known on the 7.2 line",
        ),
    ],
)
def test_a_server_is_judged_against_the_advisories_by_its_version(
    info: dict[str, str], open_: bool, line_note: str
) -> None:
    server = server_of(info)
    found = open_advisories(server)
    assert bool(found) is open_
    if found:
        (advisory,) = found
        assert "CVE-2025-49844" in advisory.cves and len(advisory.cves) == 4
        fixes = advisory.fixes(server)
        assert fixes.startswith(server.name)
        assert line_note in fixes
    # Valkey is judged by its own version, and its Redis-compatible one is kept for the minimum.
    assert server.compat >= MIN_SERVER


def test_the_advisory_table_names_every_fixed_release_once() -> None:
    redis_fixes = next(a for a in LUA_ADVISORIES if a.server == "Redis")
    assert redis_fixes.fixes(server_of({"redis_version": "8.2.1"})) == (
        "Redis 6.2.20, 7.2.11, 7.4.6, 8.0.4, 8.2.2, 8.4+"
    )


# --- The oldest server, checked at a process's first use, on a real server -----------------------


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as running:
        yield running


def _app(server: RedisServer) -> tuple[Any, Any]:
    name = f"minimum{uuid.uuid4().hex[:8]}"
    app = Celery(name, broker=server.url(0), backend=server.url(1), set_as_current=False)
    app.conf.echomq_redis_url = server.url(1)

    @app.task(name=f"{name}.add")
    def add(a: int, b: int) -> int:
        return a + b

    celery_echomq.install(app)
    return app, add


def _info_calls(server: RedisServer) -> int:
    stats = server.client().info("commandstats")
    return int(stats.get("cmdstat_info", {}).get("calls", 0))


def test_a_server_older_than_the_minimum_is_refused_at_first_use_naming_both(
    server: RedisServer,
) -> None:
    found = server.client().info("server")["redis_version"]
    app, add = _app(server)
    state = get_state(app)
    # The real server, with the minimum set above it: as a server older than MIN_SERVER is.
    state.min_version = (99, 1)
    with pytest.raises(ConfigError) as refused:
        flow(add.s(0, 0), [add.s(1, 1)]).apply_async()
    message = str(refused.value)
    assert f"is Redis {found}, older than Redis 99.1" in message
    assert f"echomq_redis_url='{server.url(1)}'" in message
    assert "upgrade it to Redis 99.1 or newer" in message
    # Refused before anything was written, and again at the next use (nothing is kept).
    assert server.client(db=1).dbsize() == 0 and server.client(db=0).dbsize() == 0
    with pytest.raises(ConfigError, match=r"older than Redis 99\.1"):
        state.client.get("anything")


def test_a_supported_server_is_checked_once_per_process(server: RedisServer) -> None:
    app, add = _app(server)
    assert get_state(app).min_version == MIN_SERVER
    sent = [_info_calls(server)]  # each reading is an INFO itself, counted by the next
    for _ in range(2):
        results = [flow(add.s(0, 0), [add.s(i, i)]).apply_async() for i in range(3)]
        assert all(r.id for r in results)
        sent.append(_info_calls(server))
    assert server.client(db=1).dbsize() > 0
    # The first flows: the reading before them and the process's one INFO server; the next
    # flows: the reading alone.
    assert [sent[1] - sent[0], sent[2] - sent[1]] == [2, 1]


def test_doctor_names_a_server_below_the_minimum_and_the_version_it_needs() -> None:
    from celery_echomq.ops.doctor import check_version
    from celery_echomq.store.server_info import NodeFacts

    old = NodeFacts("10.0.0.5:6379", {"redis_version": "6.0.16"}, None)
    finding = check_version([old])
    assert (finding.status, finding.change) == (
        "wrong",
        "upgrade to Redis 6.2 or newer (or any Valkey)",
    )
    assert finding.detail.startswith("Redis 6.0.16: older than Redis 6.2, the oldest")
    valkey = NodeFacts("a", {"redis_version": "7.2.4", "valkey_version": "8.1.1"}, None)
    assert check_version([valkey]).detail == "Valkey 8.1.1 (Redis 6.2 or newer needed)"
