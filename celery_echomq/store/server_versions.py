"""The servers this release runs on: the oldest Redis it needs, and the published advisories
against the Lua engine every transition runs in, kept as data (pure: INFO's fields in).

Every transition is a Lua script, so a flaw of the server's Lua engine is reachable through
the store's own rights. Judged by version alone: a distribution may back-port the fixes and
keep the version number (Debian's 7.0.15-1~deb12u10 has them), so an open line is a warning to
verify, and an unknown build is not proof of a fixed one. To add an advisory, add an entry to
``LUA_ADVISORIES``; nothing else changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

Version = tuple[int, ...]

# The oldest Redis the store runs on, and why no older one: channel rules in an ACL
# (``resetchannels``, the least-privilege user of docs/production.md) came in 6.2, and every
# test runs on a Redis 6.2. The scripts alone need 5.0 (a script writes after TIME:
# effects replication, the default since 5.0). Valkey reports Redis 7.2.4 as redis_version.
MIN_SERVER: Version = (6, 2)


def parse(raw: str) -> Version:
    """``"7.0.15"`` as ``(7, 0, 15)``; a part that is not a number ends it."""
    parts: list[int] = []
    for part in raw.split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def dotted(version: Version) -> str:
    return ".".join(map(str, version))


@dataclass(frozen=True)
class Server:
    """A server as its INFO names it: Redis or Valkey, its own version, and the Redis
    version it is compatible with (Valkey's ``redis_version``)."""

    name: str
    version: Version
    compat: Version

    def __str__(self) -> str:
        return f"{self.name} {dotted(self.version)}"


def server_of(info: Mapping[str, Any]) -> Server:
    compat = parse(str(info.get("redis_version", "0")))
    if "valkey_version" in info or str(info.get("server_name", "")).lower() == "valkey":
        return Server("Valkey", parse(str(info.get("valkey_version", dotted(compat)))), compat)
    return Server("Redis", compat, compat)


@dataclass(frozen=True)
class Advisory:
    """Flaws of one server's Lua engine, fixed per release line (``(major, minor)`` -> the
    first fixed release of that line); a line from ``fixed_from`` on was released fixed, and
    any other line has no fixed release known here."""

    server: str
    cves: tuple[str, ...]
    what: str
    fixed: Mapping[Version, Version]
    fixed_from: Version

    def open_on(self, server: Server) -> bool:
        if server.name != self.server:
            return False
        line = server.version[:2]
        if line >= self.fixed_from:
            return False
        first = self.fixed.get(line)
        return first is None or server.version < first

    def fixes(self, server: Server) -> str:
        """The fixed releases, and the server's own line where none is known."""
        releases = ", ".join(dotted(v) for _, v in sorted(self.fixed.items()))
        found = f"{self.server} {releases}, {dotted(self.fixed_from)}+"
        line = server.version[:2]
        return found if line in self.fixed else f"{found}; none known on the {dotted(line)} line"


_LUA_2025 = ("CVE-2025-49844", "CVE-2025-46817", "CVE-2025-46818", "CVE-2025-46819")
_LUA_2025_WHAT = (
    "Lua: a use-after-free in the parser (code execution, CVSS 9.9), an integer overflow in "
    "unpack, a script run as another user, an out-of-bounds read"
)
LUA_ADVISORIES: tuple[Advisory, ...] = (
    Advisory(
        "Redis",
        _LUA_2025,
        _LUA_2025_WHAT,
        # 7.0 reached its end of life before: no 7.0 release has the fixes.
        {
            (6, 2): (6, 2, 20),
            (7, 2): (7, 2, 11),
            (7, 4): (7, 4, 6),
            (8, 0): (8, 0, 4),
            (8, 2): (8, 2, 2),
        },
        (8, 4),
    ),
    Advisory(
        "Valkey",
        _LUA_2025,
        _LUA_2025_WHAT,
        # The 7.2 line had a release that day too (7.2.11); its notes were not confirmed here.
        {(8, 0): (8, 0, 6), (8, 1): (8, 1, 4)},
        (9, 0),
    ),
)


def open_advisories(server: Server) -> list[Advisory]:
    """The advisories ``server``'s version is open to (a back-ported fix is not seen)."""
    return [a for a in LUA_ADVISORIES if a.open_on(server)]


def too_old(info: Mapping[str, Any], minimum: Version) -> str | None:
    """What is wrong with the server whose INFO is ``info`` when it is older than ``minimum``
    (by its Redis version; Valkey's compatible one), else None."""
    server = server_of(info)
    if server.compat >= minimum:
        return None
    found = f"{server}" + ("" if server.name == "Redis" else f" (Redis {dotted(server.compat)})")
    return (
        f"the flow store's server is {found}, older than Redis {dotted(minimum)}, the oldest "
        f"celery-echomq runs on: upgrade it to Redis {dotted(minimum)} or newer (or any Valkey)"
    )
