"""Per-app runtime state: settings, the Redis client, the scripts, and (de)serialization.

A Redis client must not cross a fork (prefork pool children would share its sockets), so the
client and the scripts bound to it are made lazily, once per process.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, cast

from kombu.serialization import dumps, loads, prepare_accept_content, registry

from .config import Settings, missing_url_error, read_settings
from .errors import ConfigError
from .keyspace import Keyspace
from .scripts import Scripts
from .store import make_client

__all__ = ["EchoMQ", "find_state", "get_state", "install_state", "make_client"]

_ATTR = "_echomq_state"


class EchoMQ:
    """Everything celery-echomq needs for one Celery app."""

    def __init__(self, app: Any, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.keys = Keyspace(settings.key_prefix)
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._client: Any = None
        self._scripts: Scripts | None = None
        self._content_type, self._encoding, _ = registry._encoders[settings.serializer]
        self._accept = prepare_accept_content(settings.accept_content)  # type: ignore[no-untyped-call]
        self._queues: tuple[float, frozenset[str]] = (0.0, frozenset())

    def _ensure(self) -> None:
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    settings = self.settings
                    if settings.redis_url is None:
                        raise missing_url_error()
                    self._client = make_client(settings)
                    self._scripts = Scripts(
                        self._client,
                        self.keys,
                        retry_timeout=settings.store_retry_timeout,
                        min_replicas=settings.min_replicas,
                        min_replicas_timeout=settings.min_replicas_timeout,
                    )
                    self._pid = os.getpid()

    @property
    def client(self) -> Any:
        self._ensure()
        return self._client

    @property
    def scripts(self) -> Scripts:
        self._ensure()
        return cast(Scripts, self._scripts)

    def known_queues(self, max_age: float = 1.0) -> frozenset[str]:
        """The queues that hold flows (``emq:queues``), read at most once per ``max_age``
        seconds: what the id check across queues looks at."""
        read_at, names = self._queues
        now = time.monotonic()
        if now - read_at > max_age or self._pid != os.getpid():
            raw = self.client.smembers(self.keys.queues_key())
            names = frozenset(
                filter(None, (m.decode() if isinstance(m, bytes) else str(m) for m in raw))
            )
            self._queues = (now, names)
        return names

    @property
    def locator_ttl(self) -> int:
        """Seconds a flow's locator key (``emq:loc:{JOB…}``: its parent's queue) lives. A held
        flow may wait long; the locator only has to outlive the flow's readable life."""
        return max(self.settings.result_ttl * 7, 7 * 86400)

    def dumps(self, obj: Any) -> bytes:
        _, _, data = dumps(obj, serializer=self.settings.serializer)  # type: ignore[no-untyped-call]
        return data.encode("utf-8") if isinstance(data, str) else cast(bytes, data)

    def loads(self, data: bytes) -> Any:
        """Decode what :meth:`dumps` stored; content the app does not accept is refused."""
        return loads(  # type: ignore[no-untyped-call]
            data, self._content_type, self._encoding, accept=self._accept
        )


def install_state(app: Any) -> EchoMQ:
    state = EchoMQ(app, read_settings(app.conf))
    setattr(app, _ATTR, state)
    return state


def get_state(app: Any) -> EchoMQ:
    state = getattr(app, _ATTR, None)
    if state is None:
        raise ConfigError(
            f"celery-echomq is not installed on app {app.main!r}: call celery_echomq.install(app) "
            "in the module that defines the app"
        )
    return cast(EchoMQ, state)


def find_state(app: Any) -> EchoMQ | None:
    return cast(EchoMQ | None, getattr(app, _ATTR, None))
