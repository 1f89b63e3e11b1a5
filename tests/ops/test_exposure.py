"""Who the dashboard answers, decided before a request reaches a page (no worker, no browser:
the browser tests of framing and rebinding are in ops/test_dashboard.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from celery_echomq import ConfigError
from celery_echomq.ops.dashboard import Exposure, make_app


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


def test_a_store_user_without_script_rights_gets_a_reason_not_a_500(
    proj: Any, env: Any, own_queue: Any
) -> None:
    import uuid

    from celery import Celery

    import celery_echomq
    from celery_echomq.store.state import get_state

    state = get_state(proj.app)
    queue = own_queue("reader")
    state.client.sadd(state.keys.queues_key(), queue)
    parent, child = "JOB" + uuid.uuid4().hex, "JOB" + uuid.uuid4().hex
    job = {"task": "tests.proj.tsum", "args": [], "kwargs": {}, "options": {}, "children": [child]}
    leaf = {"task": "tests.proj.add", "args": [1, 1], "kwargs": {}, "options": {}}
    state.scripts.enqueue_flow(queue, parent, state.dumps(job), [(child, state.dumps(leaf))])
    user = f"reader{uuid.uuid4().hex[:8]}"
    state.client.execute_command(
        "ACL", "SETUSER", user, "on", ">pw", "~*", "&*", "+@all", "-@scripting"
    )
    reader = Celery("reader", broker=env.broker, set_as_current=False)
    reader.conf.echomq_redis_url = env.store.replace("redis://", f"redis://{user}:pw@")
    celery_echomq.install(reader)
    try:
        app = make_app(reader, allow_actions=True)
        page = get(app, "http://127.0.0.1:8008", f"/flows/{parent}")
        assert page.status_code == 200, page.text
        assert 'id="action-cancel"' in page.text

        async def cancel() -> httpx.Response:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://127.0.0.1:8008"
            ) as client:
                token = app.state.dashboard.token
                return await client.post(f"/flows/{parent}/cancel", data={"token": token})

        refused = asyncio.run(cancel())
        assert refused.status_code == 303
        assert "the%20flow%20store%20refused%20the%20cancel" in refused.headers["location"]
        assert state.client.hget(state.keys.job_key(queue, parent), "state") == (
            b"awaiting_children"
        )
    finally:
        state.client.execute_command("ACL", "DELUSER", user)
        reader.close()
