"""Who the dashboard answers, decided before a request reaches a page (no worker, no browser:
the browser tests of framing and rebinding are in test_dashboard.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from celery_echomq import ConfigError
from celery_echomq.dashboard import Exposure, make_app


def get(app: Any, base_url: str, path: str) -> httpx.Response:
    """One request to the ASGI app in this process, as a browser at ``base_url`` sends it."""

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=base_url) as client:
            return await client.get(path)

    return asyncio.run(go())


def test_loopback_names_only_by_default_and_the_names_allowed() -> None:
    local = Exposure.of("127.0.0.1")
    assert {"127.0.0.1", "localhost", "::1"} <= local.allowed_hosts and local.warning == ""
    named = Exposure.of("10.1.2.3", ["flows.example.com"], "ops:pw", allow_actions=True)
    assert {"10.1.2.3", "flows.example.com"} <= named.allowed_hosts
    assert named.auth == ("ops", "pw") and named.warning == ""


def test_beyond_loopback_actions_need_auth_and_a_page_without_it_is_warned_of() -> None:
    with pytest.raises(ConfigError, match="needs --basic-auth USER:PASSWORD"):
        Exposure.of("0.0.0.0", allow_actions=True)
    open_page = Exposure.of("0.0.0.0")
    assert "without --basic-auth" in open_page.warning
    assert "--allow-host NAME" in open_page.warning  # a wildcard bind answers loopback names
    for bad in ("user", ":pw", "user:"):
        with pytest.raises(ConfigError, match="USER:PASSWORD"):
            Exposure.of("127.0.0.1", auth=bad)


def test_a_foreign_host_header_is_refused_before_any_page(proj: Any) -> None:
    refused = get(make_app(proj.app, allow_actions=True), "http://rebound.test", "/")
    assert refused.status_code == 400
    assert "host 'rebound.test' is not one this dashboard answers" in refused.text
    assert refused.headers["x-frame-options"] == "DENY"
    local = get(make_app(proj.app), "http://localhost:8008", "/metrics")
    assert local.status_code == 200
    assert "frame-ancestors 'none'" in local.headers["content-security-policy"]
