"""Settings read once from the app's ``echomq_*`` keys."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from celery_echomq.errors import ConfigError

REDIS_SCHEMES = (
    "redis://",
    "rediss://",
    "redis+socket://",
    "unix://",
    "redis+cluster://",
    "sentinel://",
)
# Where the flow store's connection options come from, for each setting its URL can come from
# (Celery's own names: a sentinel:// broker takes its master name from broker_transport_options).
OPTIONS_OF = {
    "echomq_redis_url": "echomq_transport_options",
    "broker_url": "broker_transport_options",
    "result_backend": "result_backend_transport_options",
}
# The transport options the flow store uses. Only these are read from broker_transport_options
# and result_backend_transport_options (which also carry kombu's own, such as
# visibility_timeout); in echomq_transport_options anything else is a typo and refused.
TRANSPORT_OPTIONS = {
    "master_name": "the Sentinel service name of the store's primary (sentinel:// only)",
    "sentinel_kwargs": "a dict of connection options for the Sentinels themselves "
    "(password, username, ssl, socket_timeout, ...)",
    "min_other_sentinels": "how many peers a Sentinel must see to be believed (default 0)",
    "socket_timeout": "seconds, for each command (default 30)",
    "socket_connect_timeout": "seconds, for each connect (default 5)",
    "socket_keepalive": "True or False",
    "username": "the Redis ACL user (overrides the URL's)",
    "password": "the Redis password (overrides the URL's)",
    "ssl": "True, or a dict of redis-py ssl_* options (ssl_ca_certs, ssl_cert_reqs, ...)",
}


@dataclass(frozen=True)
class Settings:
    # None: no Redis URL was found on an app installed with task_always_eager, where flows
    # run in process; the first use of the store raises ``missing_url_error()``.
    redis_url: str | None
    # The setting the URL was read from (echomq_redis_url, broker_url or result_backend), for
    # errors about it.
    url_setting: str = "echomq_redis_url"
    key_prefix: str = "emq"
    stall_timeout: float = 30.0
    result_ttl: int = 86400
    recovery_interval: float = 5.0
    chunk_size: int = 1000
    # The most flows per queue the recent-flow index keeps (the dashboard's pages).
    recent_flows: int = 10000
    serializer: str = "json"
    accept_content: tuple[str, ...] = ("json",)
    # Connection options for the store (see TRANSPORT_OPTIONS): echomq_transport_options, or
    # those of the setting the URL was taken from.
    transport_options: Mapping[str, Any] = field(default_factory=dict)
    # How long a command or transition keeps retrying a store that is unreachable, read-only
    # or loading (a failover in progress) before it raises StoreUnavailableError.
    store_retry_timeout: float = 20.0
    # The same bound for a producer starting a flow (apply_async, delay, a flow sent from a
    # task): a web request waits this long at most for an unreachable store. None: the same
    # as store_retry_timeout.
    producer_timeout: float | None = None
    # WAIT for this many replicas after every transition that must survive a failover.
    min_replicas: int = 0
    min_replicas_timeout: float = 1.0
    # Whether a flow's children store their results in Celery's result backend, as a chord's
    # do. False: their values live only in the parent's :processed (children_values()), and
    # each child saves the backend's write and publish.
    child_results: bool = True
    # The most flow levels on any path of one tree (a chain's steps are levels too): what
    # flow(...) and add_children refuse beyond, and what show, cancel and release walk.
    max_depth: int = 32

    @property
    def stall_ms(self) -> int:
        return int(self.stall_timeout * 1000)


def safe_url(url: str) -> str:
    """``url`` with its passwords masked, for errors and logs (every ``;``-joined part of a
    Sentinel URL)."""
    if ";" in url:
        return ";".join(safe_url(part) for part in url.split(";"))
    parts = urlsplit(url)
    password = parts.password
    if not password:
        return url
    netloc = parts.netloc.replace(f":{password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


@dataclass(frozen=True)
class SentinelURL:
    """A ``sentinel://`` URL in Celery's form: ``sentinel://[:PASSWORD@]HOST:PORT[/DB]``, one
    part per Sentinel joined with ``;``. The password, user and database are those of the
    Redis primary (Celery's meaning); the Sentinels' own password goes in
    ``sentinel_kwargs``."""

    hosts: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = None
    password: str | None = None


def parse_sentinel_url(url: str, setting: str = "echomq_redis_url") -> SentinelURL:
    hosts: list[tuple[str, int]] = []
    found: dict[str, set[Any]] = {"db": set(), "username": set(), "password": set()}
    for chunk in filter(None, (c.strip() for c in url.split(";"))):
        where = f"{setting}: {safe_url(chunk)!r}"
        if not chunk.startswith("sentinel://"):
            raise ConfigError(
                f"{where}: every part of a Sentinel URL must be sentinel://HOST:PORT[/DB], "
                "joined with ';'"
            )
        parts = urlsplit(chunk)
        try:
            port = parts.port or 26379
        except ValueError:
            raise ConfigError(f"{where}: the port is not a number") from None
        if not parts.hostname:
            raise ConfigError(f"{where}: no Sentinel host")
        if parts.query or parts.fragment:
            raise ConfigError(
                f"{where}: query options are not read from a Sentinel URL; put connection "
                "options in echomq_transport_options"
            )
        path = parts.path.strip("/")
        if path:
            if not path.isdigit():
                raise ConfigError(f"{where}: the database must be a number, not {path!r}")
            found["db"].add(int(path))
        if parts.username:
            found["username"].add(unquote(parts.username))
        if parts.password:
            found["password"].add(unquote(parts.password))
        hosts.append((parts.hostname, port))
    if not hosts:
        raise ConfigError(f"{setting}={safe_url(url)!r} names no Sentinel")
    for name, values in found.items():
        if len(values) > 1:
            raise ConfigError(
                f"{setting}={safe_url(url)!r}: its parts name different {name}s; name it once, "
                "or the same in every part"
            )
    return SentinelURL(
        hosts=tuple(hosts),
        db=next(iter(found["db"]), 0),
        username=next(iter(found["username"]), None),
        password=next(iter(found["password"]), None),
    )


def parse_cluster_url(
    url: str, setting: str = "echomq_redis_url"
) -> tuple[str, list[tuple[str, int]]]:
    """A ``redis+cluster://[user:password@]host:port[,host:port...][?options]`` URL as the
    ``redis://`` URL of its first seed node (credentials and options with it) and the
    ``(host, port)`` of the others.

    redis-py's ``RedisCluster`` asks its startup nodes, in turn, who serves what: with several
    seeds, a client still finds the cluster when a seed is down (a master lost, not yet
    replaced, or a node removed)."""
    rest = url[len("redis+cluster://") :]
    path = ""
    for mark in "/?":
        if mark in rest:
            index = rest.index(mark)
            rest, path = rest[:index], rest[index:] + path
    userinfo, _, hosts = rest.rpartition("@")
    names = [h.strip() for h in hosts.split(",") if h.strip()]
    if not names:
        raise ConfigError(f"{setting}={safe_url(url)!r} names no cluster node")
    seeds: list[tuple[str, int]] = []
    for name in names:
        parts = urlsplit(f"redis://{name}")
        try:
            port = parts.port or 6379
        except ValueError:
            raise ConfigError(
                f"{setting}={safe_url(url)!r}: the port of {name!r} is not a number"
            ) from None
        if not parts.hostname:
            raise ConfigError(f"{setting}={safe_url(url)!r}: {name!r} names no host")
        seeds.append((parts.hostname, port))
    credentials = f"{userinfo}@" if userinfo else ""
    return f"redis://{credentials}{names[0]}{path}", seeds[1:]


def _transport_options(conf: Any, url_setting: str, url: str) -> dict[str, Any]:
    name = OPTIONS_OF[url_setting]
    raw = conf.get(name) or {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{name}={raw!r} must be a dict")
    if name == "echomq_transport_options":
        unknown = sorted(set(raw) - set(TRANSPORT_OPTIONS))
        if unknown:
            raise ConfigError(
                f"{name} has unknown keys {unknown}; allowed: "
                + "; ".join(f"{k} ({v})" for k, v in TRANSPORT_OPTIONS.items())
            )
    options = {k: v for k, v in raw.items() if k in TRANSPORT_OPTIONS}
    if url.startswith("redis+cluster://"):
        parse_cluster_url(url, url_setting)
    if url.startswith("sentinel://"):
        parse_sentinel_url(url, url_setting)
        master = options.get("master_name")
        if not isinstance(master, str) or not master:
            raise ConfigError(
                f"{url_setting}={safe_url(url)!r} is a Sentinel URL: set {name}"
                f'["master_name"] to the name the Sentinels monitor the primary under '
                f'(e.g. {{"master_name": "mymaster"}})'
            )
    kwargs = options.get("sentinel_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ConfigError(f'{name}["sentinel_kwargs"]={kwargs!r} must be a dict')
    ssl = options.get("ssl")
    if ssl is not None and not isinstance(ssl, (bool, Mapping)):
        raise ConfigError(f'{name}["ssl"]={ssl!r} must be True, False or a dict of ssl_* options')
    return options


def _redis_url(conf: Any) -> tuple[str, str, dict[str, Any]]:
    for name in ("echomq_redis_url", "broker_url", "result_backend"):
        url = conf.get(name)
        if isinstance(url, str) and url.startswith(REDIS_SCHEMES):
            return url, name, _transport_options(conf, name, url)
        if name == "echomq_redis_url" and url:
            raise ConfigError(
                f"echomq_redis_url={safe_url(str(url))!r} is not a Redis URL; allowed schemes: "
                + ", ".join(REDIS_SCHEMES)
                + " (sentinel://HOST:PORT;sentinel://HOST:PORT/DB with "
                'echomq_transport_options={"master_name": ...})'
            )
    raise missing_url_error()


def missing_url_error() -> ConfigError:
    return ConfigError(
        "celery-echomq needs a Redis URL: set app.conf.echomq_redis_url "
        "(broker_url and result_backend are not redis://, rediss://, redis+socket:// or "
        "sentinel:// URLs; only an app with task_always_eager, where flows run in process, "
        "can do without one)"
    )


def _positive(conf: Any, name: str, default: float) -> float:
    value = conf.get(name)
    if value is None:
        return default
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} must be a positive number of seconds") from None
    if number <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive number of seconds")
    return number


def _non_negative(conf: Any, name: str, default: float) -> float:
    value = conf.get(name)
    if value is None:
        return default
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} must be a number of seconds >= 0") from None
    if number < 0:
        raise ConfigError(f"{name}={value!r} must be a number of seconds >= 0")
    return number


def _optional_non_negative(conf: Any, name: str) -> float | None:
    return None if conf.get(name) is None else _non_negative(conf, name, 0.0)


def _replicas(conf: Any) -> int:
    value = conf.get("echomq_min_replicas")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"echomq_min_replicas={value!r} must be a whole number >= 0 (0: do not wait for "
            "replicas)"
        )
    return value


def _flag(conf: Any, name: str, default: bool) -> bool:
    value = conf.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be True or False")
    return value


def read_settings(conf: Any) -> Settings:
    accept = conf.get("accept_content") or ("json",)
    url: str | None
    setting = "echomq_redis_url"
    try:
        url, setting, options = _redis_url(conf)
    except ConfigError:
        # An eager app runs flows in process and needs no store; an explicit
        # echomq_redis_url that is not a Redis URL is still refused.
        if not conf.get("task_always_eager") or conf.get("echomq_redis_url"):
            raise
        url, options = None, {}
    return Settings(
        redis_url=url,
        url_setting=setting,
        transport_options=options,
        store_retry_timeout=_non_negative(conf, "echomq_store_retry_timeout", 20.0),
        producer_timeout=_optional_non_negative(conf, "echomq_producer_timeout"),
        min_replicas=_replicas(conf),
        min_replicas_timeout=_positive(conf, "echomq_min_replicas_timeout", 1.0),
        key_prefix=str(conf.get("echomq_key_prefix") or "emq"),
        stall_timeout=_positive(conf, "echomq_stall_timeout", 30.0),
        result_ttl=int(_positive(conf, "echomq_result_ttl", 86400)),
        recovery_interval=_positive(conf, "echomq_recovery_interval", 5.0),
        chunk_size=int(_positive(conf, "echomq_chunk_size", 1000)),
        recent_flows=int(_positive(conf, "echomq_recent_flows", 10000)),
        serializer=str(conf.get("task_serializer") or "json"),
        accept_content=tuple(accept),
        child_results=_flag(conf, "echomq_child_results", True),
        max_depth=int(_positive(conf, "echomq_max_depth", 32)),
    )
