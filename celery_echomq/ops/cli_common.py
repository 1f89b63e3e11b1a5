"""What every ``celery echomq`` command shares: the app, a store that gives up in time, and
one plain line for every error a user can cause or meet.

A command talks to the store through a state of its own: the app's settings with the
command's ``--timeout`` (default 5 s) as the store's retry timeout and socket timeout, and a
one-second connect timeout, so that an unreachable store says ``retrying (store
unreachable)...`` on stderr after a second and ends the command after ``--timeout`` with one
line, where a worker would wait ``echomq_store_retry_timeout`` (20 s) for a failover.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import click
import redis
from kombu.exceptions import OperationalError

from celery_echomq.errors import EchoMQError
from celery_echomq.ops.nodes import json_default
from celery_echomq.store.connection import describe
from celery_echomq.store.refusals import Refusal, refusal_of, refused
from celery_echomq.store.state import EchoMQ, get_state

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_TIMEOUT = 5.0
# How long a command waits on an unreachable store before it says so.
NOTICE_AFTER = 1.0
CONNECT_TIMEOUT = 1.0
RETRYING = "retrying (store unreachable)..."
_TIMEOUT_KEY = "echomq.timeout"
_STATE_KEY = "echomq.state"


def cli_app(ctx: click.Context) -> Any:
    app = getattr(ctx.obj, "app", None)
    if app is None:
        # Run outside `celery` (e.g. click's CliRunner on this group): the current app.
        from celery import current_app

        app = current_app
    return app


def cli_state(ctx: click.Context, *, check_version: bool = True) -> EchoMQ:
    """The flow store as this command reads it: the app's settings, this command's timeouts.
    ``check_version=False``: a server older than the oldest supported is not refused at the
    first command (``doctor`` reports it among its findings)."""
    made = ctx.meta.get(_STATE_KEY)
    if made is not None:
        return cast(EchoMQ, made)
    app = cli_app(ctx)
    settings = get_state(app).settings
    timeout = float(ctx.meta.get(_TIMEOUT_KEY, DEFAULT_TIMEOUT))
    options = dict(settings.transport_options)
    options["socket_timeout"] = min(float(options.get("socket_timeout") or timeout), timeout)
    options.setdefault("socket_connect_timeout", CONNECT_TIMEOUT)
    state = EchoMQ(
        app,
        dataclasses.replace(settings, store_retry_timeout=timeout, transport_options=options),
    )
    if not check_version:
        state.min_version = None
    ctx.meta[_STATE_KEY] = state
    return state


def set_timeout(ctx: click.Context, timeout: float) -> None:
    ctx.meta[_TIMEOUT_KEY] = timeout


class _Unreachable(logging.Handler):
    """Notes the store's "unavailable, retrying" warning (store.call_until logs it)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.set()


@contextmanager
def _notice_retries() -> Iterator[None]:
    """While the block runs: say ``retrying (store unreachable)...`` on stderr, once, when
    the store has failed and a second has passed."""
    handler = _Unreachable()
    store_logger = logging.getLogger("celery_echomq.store")
    store_logger.addHandler(handler)
    done = threading.Event()
    started = time.monotonic()

    def watch() -> None:
        while not done.wait(0.05):
            if handler.seen.is_set() and time.monotonic() - started >= NOTICE_AFTER:
                click.echo(RETRYING, err=True)
                return

    watcher = threading.Thread(target=watch, name="echomq-cli-notice", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(timeout=1)
        store_logger.removeHandler(handler)


def _refused(refusal: Refusal, exc: BaseException) -> Exception:
    """The error naming the store, the refusal and its remedy, for a command's plain write."""
    context = click.get_current_context(silent=True)
    store = describe(cli_state(context).settings) if context is not None else ""
    return refused(
        refusal, store, "the command stopped at that write and did nothing after it", exc
    )


def plain_errors(func: F) -> F:
    """Turn every error a user can cause or meet (bad id, unknown flow, refused action, any
    Redis error: unreachable, auth, permission) into one line on stderr and exit status 1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with _notice_retries():
                return func(*args, **kwargs)
        except EchoMQError as exc:  # UnknownFlowError, InvalidIdError, ConfigError, ...
            raise click.ClickException(str(exc)) from None
        except redis.AuthenticationError as exc:  # before ConnectionError: a subclass of it
            raise click.ClickException(f"the flow store refused the login: {exc}") from None
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise click.ClickException(f"cannot reach the flow store in Redis: {exc}") from None
        except redis.RedisError as exc:  # NOPERM (an ACL user without script rights), ...
            refusal = refusal_of(exc)
            if refusal is not None:  # a plain command's (a script's is ours already)
                raise click.ClickException(str(_refused(refusal, exc))) from None
            raise click.ClickException(f"the flow store refused: {exc}") from None
        except (OperationalError, OSError) as exc:  # the broker, for a revoke
            raise click.ClickException(f"cannot reach the broker: {exc}") from None

    return cast(F, wrapper)


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=json_default))
