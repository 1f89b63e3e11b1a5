"""What makes the dashboard safe to expose: who may ask, from which page, under which name.

- **Host allow-list.** A request is answered only for a Host the server was told of: the
  loopback names, the address it listens on (unless a wildcard), and each ``--allow-host``.
  A page fetched under a rebound DNS name (``evil.example`` resolving to 127.0.0.1) is
  refused, so it never hands out the action token nor accepts an action.
- **No framing.** Every response says ``X-Frame-Options: DENY`` and
  ``Content-Security-Policy: frame-ancestors 'none'`` (and scripts, styles and forms from the
  dashboard itself only): no other page can put it under a click.
- **Basic auth.** With ``--basic-auth USER:PASSWORD`` (or ``ECHOMQ_DASHBOARD_AUTH``) every
  request must carry them. Actions on an address beyond loopback are refused at start without
  it; a read-only page beyond loopback without it starts with a warning.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from celery_echomq.errors import ConfigError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARDS = frozenset({"0.0.0.0", "::", ""})
HEADERS = [
    (b"x-frame-options", b"DENY"),
    (
        b"content-security-policy",
        b"default-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    ),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


def is_loopback(host: str) -> bool:
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Exposure:
    """Where the dashboard listens and who it answers."""

    allowed_hosts: frozenset[str] = LOOPBACK_NAMES
    auth: tuple[str, str] | None = None
    warning: str = ""

    @classmethod
    def of(
        cls,
        bind: str,
        allow_hosts: tuple[str, ...] | list[str] = (),
        auth: str | None = None,
        allow_actions: bool = False,
    ) -> Exposure:
        """The exposure of a server bound to ``bind``; refuses (ConfigError) actions beyond
        loopback without ``auth``, and an ``auth`` that is not ``USER:PASSWORD``."""
        pair: tuple[str, str] | None = None
        if auth:
            user, sep, password = auth.partition(":")
            if not sep or not user or not password:
                raise ConfigError(
                    "--basic-auth must be USER:PASSWORD (a user and a password, both non-empty)"
                )
            pair = (user, password)
        names = set(LOOPBACK_NAMES) | {h.strip("[]").lower() for h in allow_hosts if h}
        if bind not in WILDCARDS:
            names.add(bind.strip("[]").lower())
        local = is_loopback(bind)
        if not local and allow_actions and pair is None:
            raise ConfigError(
                f"--allow-actions on {bind} (beyond loopback) needs --basic-auth USER:PASSWORD "
                "(or ECHOMQ_DASHBOARD_AUTH): anyone who reaches the port could cancel flows"
            )
        warning = ""
        if not local and pair is None:
            warning = (
                f"the dashboard listens on {bind} without --basic-auth: anyone who reaches "
                "the port can read task arguments, values and errors"
            )
        if bind in WILDCARDS and not allow_hosts:
            warning += ("; " if warning else "") + (
                "only loopback Host names are answered: add --allow-host NAME for the names "
                "it is reached by"
            )
        return cls(frozenset(names), pair, warning)


def _host_of(header: str) -> str:
    """The name in a Host header, without its port (``[::1]:8008`` -> ``::1``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Guard:
    """ASGI middleware: the Host allow-list, basic auth, and the headers that refuse framing."""

    def __init__(self, app: ASGIApp, exposure: Exposure) -> None:
        self.app = app
        self.exposure = exposure
        # The wrapped app's state (``.state.dashboard``), for callers and tests.
        self.state: Any = getattr(app, "state", None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        host = _host_of(headers.get("host", ""))
        if host not in self.exposure.allowed_hosts:
            await _plain(
                send,
                400,
                f"host {host!r} is not one this dashboard answers: start it with --allow-host "
                f"{host or 'NAME'} if that is the name it is reached by",
            )
            return
        if self.exposure.auth is not None and not self._authorized(headers):
            await _plain(
                send,
                401,
                "this dashboard asks for a user and password",
                [(b"www-authenticate", b'Basic realm="echomq", charset="UTF-8"')],
            )
            return

        async def guarded(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *HEADERS]
            await send(message)

        await self.app(scope, receive, guarded)

    def _authorized(self, headers: dict[str, str]) -> bool:
        scheme, _, encoded = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            given = base64.b64decode(encoded, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return False
        user, _, password = given.partition(":")
        want_user, want_password = self.exposure.auth or ("", "")
        # Both compared whatever the first gives: the time says nothing of which was wrong.
        ok_user = hmac.compare_digest(user.encode(), want_user.encode())
        ok_password = hmac.compare_digest(password.encode(), want_password.encode())
        return ok_user and ok_password


async def _plain(
    send: Send, status: int, text: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = (text + "\n").encode()
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
        *HEADERS,
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
