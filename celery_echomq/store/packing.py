"""A transition script's options: every argument a call may leave out travels in one msgpack
map, the script's last ARGV, which the script reads with ``cmsgpack.unpack(ARGV[#ARGV])``
(``lua/README.md``, "ARGV"). An option not given is not in the map: no position is padded
and none is read as ``''`` for being absent."""

from __future__ import annotations

import msgpack

from celery_echomq.store.runner import Value


def packed(**options: Value | None) -> bytes:
    """The options as the script's last ARGV: each given one (a string or bytes, as the
    positional ARGV are), keyed by its name in the script's header; None is not given, and is
    left out (a caller passes ``x or None`` where an empty value means none)."""
    given = {name: value for name, value in options.items() if value is not None}
    # Every value as msgpack's str (raw) type: the cmsgpack of Redis before 7 reads no bin
    # type, and a Lua string holds any bytes either way.
    return bytes(msgpack.packb(given, use_bin_type=False))
