"""Settings read once from the app's ``echomq_*`` keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .errors import ConfigError

REDIS_SCHEMES = ("redis://", "rediss://", "redis+socket://", "unix://", "redis+cluster://")


@dataclass(frozen=True)
class Settings:
    redis_url: str
    key_prefix: str = "emq"
    stall_timeout: float = 30.0
    result_ttl: int = 86400
    recovery_interval: float = 5.0
    chunk_size: int = 1000
    serializer: str = "json"
    accept_content: tuple[str, ...] = ("json",)

    @property
    def stall_ms(self) -> int:
        return int(self.stall_timeout * 1000)


def safe_url(url: str) -> str:
    """``url`` with its password masked, for errors and logs."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _redis_url(conf: Any) -> str:
    for name in ("echomq_redis_url", "broker_url", "result_backend"):
        url = conf.get(name)
        if isinstance(url, str) and url.startswith(REDIS_SCHEMES):
            return url
        if name == "echomq_redis_url" and url:
            raise ConfigError(
                f"echomq_redis_url={safe_url(str(url))!r} is not a Redis URL; allowed schemes: "
                + ", ".join(REDIS_SCHEMES)
            )
    raise ConfigError(
        "celery-echomq needs a Redis URL: set app.conf.echomq_redis_url "
        "(broker_url and result_backend are not redis://, rediss:// or redis+socket:// URLs)"
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


def read_settings(conf: Any) -> Settings:
    accept = conf.get("accept_content") or ("json",)
    return Settings(
        redis_url=_redis_url(conf),
        key_prefix=str(conf.get("echomq_key_prefix") or "emq"),
        stall_timeout=_positive(conf, "echomq_stall_timeout", 30.0),
        result_ttl=int(_positive(conf, "echomq_result_ttl", 86400)),
        recovery_interval=_positive(conf, "echomq_recovery_interval", 5.0),
        chunk_size=int(_positive(conf, "echomq_chunk_size", 1000)),
        serializer=str(conf.get("task_serializer") or "json"),
        accept_content=tuple(accept),
    )
