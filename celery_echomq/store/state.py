"""Per-app runtime state: settings, the Redis client, the scripts, and (de)serialization.

A Redis client must not cross a fork (prefork pool children would share its sockets), so the
client and the scripts bound to it are made lazily, once per process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

from kombu.serialization import loads, prepare_accept_content, registry

from celery_echomq.config import Settings, missing_url_error, read_settings
from celery_echomq.errors import ConfigError, StoreFormatError
from celery_echomq.store.codec import serialize
from celery_echomq.store.connection import describe, make_client
from celery_echomq.store.keyspace import Keyspace
from celery_echomq.store.scripts import Scripts
from celery_echomq.store.server_versions import MIN_SERVER

__all__ = [
    "Deliveries",
    "EchoMQ",
    "Kept",
    "find_state",
    "get_state",
    "install_state",
    "make_client",
]

_ATTR = "_echomq_state"

logger = logging.getLogger("celery_echomq")

K = TypeVar("K")
V = TypeVar("V")


class Kept(Generic[K, V]):
    """What one process remembers by key, bounded: the ``size`` entries put last."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[K, V] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: K) -> V | None:
        return self._entries.get(key)

    def put(self, key: K, value: V) -> None:
        self._entries[key] = value
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def pop(self, key: K) -> V | None:
        return self._entries.pop(key, None)


@dataclass
class Deliveries:
    """What one process keeps of the flow jobs delivered to it (the worker's signal receivers,
    worker/signals.py), for the app they belong to."""

    # The token each running flow job was claimed with, by task id (in a pool process).
    tokens: dict[str, str] = field(default_factory=dict)
    # Deliveries whose body is skipped (a duplicate, a forged header, a claim deferred to
    # recovery, a row of a newer store format): ``before_start`` ends them as Ignore.
    skipped: set[str] = field(default_factory=set)
    # In the worker's main process: the headers of flow jobs it received, by task id. A hard
    # time limit reports the failure there, where no task request is on the stack.
    received: Kept[str, Any] = field(default_factory=lambda: Kept(10_000))


class EchoMQ:
    """Everything celery-echomq needs for one Celery app.

    The settings are read from ``app.conf`` when they are first needed (the app finalized,
    a flow sent, a read), as Celery reads its own configuration: ``install(app)`` may come
    before ``config_from_object`` or a test plugin that supplies the URLs. ``settings``
    given here are used as they are (the CLI's, with its own timeouts).

    The store's first use in a process checks its server's version (one INFO, on its first
    connection): one older than ``min_version`` (``MIN_SERVER``; None: not checked, as by
    ``doctor``, which says it itself) raises ConfigError naming both.
    """

    def __init__(
        self,
        app: Any,
        settings: Settings | None = None,
        *,
        min_version: tuple[int, ...] | None = MIN_SERVER,
    ) -> None:
        self.app = app
        self._settings = settings
        self.min_version = min_version
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._client: Any = None
        self._scripts: Scripts | None = None
        self._codec: tuple[str, str, Any] | None = None
        self._keys: Keyspace | None = None
        # The templates of windowed flows this process publishes children of ((queue, parent)
        # -> template; see send/freed.py), read once per flow, not once per child: a flow's
        # template never changes.
        self.templates: Kept[tuple[str, str], bytes | None] = Kept(64)
        self.deliveries = Deliveries()
        # The rows of a newer store format this process has said it leaves alone (one log
        # line each, however often it meets them; store/store_format.py).
        self.told_newer: Kept[str, bool] = Kept(10_000)
        # The message templates of each kombu channel this app publishes a flow's jobs on
        # (wire/templates.py's Templates), gone with the channel.
        self.message_templates: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        # Set once this process's worker has reached the store (worker/checks.py): its
        # background threads wait for it rather than each retrying and warning meanwhile;
        # held by the one thread trying.
        self.reached = threading.Event()
        self.reaching = threading.Lock()

    @property
    def settings(self) -> Settings:
        """The app's ``echomq_*`` settings; a ConfigError names what is wrong, at first use."""
        if self._settings is None:
            with self._lock:
                if self._settings is None:
                    self._settings = read_settings(self.app.conf)
        return self._settings

    @settings.setter
    def settings(self, settings: Settings) -> None:
        # What a test (or an operator's script) swaps in: keys and codec follow it; the client
        # keeps its connection.
        self._settings, self._keys, self._codec = settings, None, None

    def read_early(self) -> None:
        """Read the settings now if they can be read (the app was finalized); an error waits
        for the first use, where it is raised, so a configuration still to come can fix it."""
        if self._settings is None:
            with contextlib.suppress(ConfigError):
                _ = self.settings

    @property
    def keys(self) -> Keyspace:
        if self._keys is None:
            self._keys = Keyspace(self.settings.key_prefix)
        return self._keys

    def _encoding(self) -> tuple[str, str, Any]:
        if self._codec is None:
            settings = self.settings
            content_type, encoding, _ = registry._encoders[settings.serializer]
            accept = prepare_accept_content(settings.accept_content)  # type: ignore[no-untyped-call]
            self._codec = (content_type, encoding, accept)
        return self._codec

    def _ensure(self) -> None:
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    settings = self.settings
                    if settings.redis_url is None:
                        raise missing_url_error()
                    self._client = make_client(settings, min_version=self.min_version)
                    self._scripts = Scripts(
                        self._client,
                        self.keys,
                        retry_timeout=settings.store_retry_timeout,
                        min_replicas=settings.min_replicas,
                        min_replicas_timeout=settings.min_replicas_timeout,
                        store=describe(settings),
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

    @property
    def locator_ttl(self) -> int:
        """Seconds a flow's locator key (``emq:loc:{JOB…}``: its parent's queue) lives. A held
        flow may wait long; the locator only has to outlive the flow's readable life."""
        return max(self.settings.result_ttl * 7, 7 * 86400)

    def tell_newer(self, exc: StoreFormatError, what: str) -> None:
        """Log ``exc`` (a row of a newer store format left alone) once per row in this
        process: ``what`` is the step that left it alone."""
        if exc.row in self.told_newer:
            return
        self.told_newer.put(exc.row, True)
        logger.error("echomq: %s left alone: %s", what, exc)

    def dumps(self, obj: Any) -> bytes:
        _, _, data = serialize(obj, self.settings.serializer)
        return data.encode("utf-8") if isinstance(data, str) else cast(bytes, data)

    def loads(self, data: bytes) -> Any:
        """Decode what :meth:`dumps` stored; content the app does not accept is refused."""
        content_type, encoding, accept = self._encoding()
        return loads(data, content_type, encoding, accept=accept)  # type: ignore[no-untyped-call]


def install_state(app: Any) -> EchoMQ:
    """A fresh state on ``app``, its settings read when the app is finalized (or at first
    use, whichever comes first)."""
    state = EchoMQ(app)
    setattr(app, _ATTR, state)
    if getattr(app, "finalized", False):
        return state  # read at first use

    def finalized(sender: Any = None, **kwargs: Any) -> None:
        # The state installed last is the one in force (the testing plugin installs again).
        if getattr(app, _ATTR, None) is state:
            state.read_early()

    # weak=False: the receiver is a closure that nothing else holds.
    app.on_after_finalize.connect(finalized, weak=False)
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
