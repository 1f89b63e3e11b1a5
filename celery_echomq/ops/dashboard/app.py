"""``celery -A proj echomq dashboard``: a small Starlette app over the flow store.

    /                       queues with their counts; held, failed and recent flows
    /flows/<JOBID>          a flow: its row, counts and one page of children (readable
                            without JavaScript); ?state=failed|done|...&cursor=...&count=...
    /flows/<JOBID>/live     the same page alone, what the page's script polls to redraw it
    /api/flows/<JOBID>      the same JSON as ``celery echomq show --json JOBID`` (same query)
    /workers                the workers: the extension, clock offset, last recovery pass
    /metrics                Prometheus text (see metrics.py)
    POST /flows/<JOBID>/cancel|retry|release   only with --allow-actions (else 403)

Every page is a plain read of Redis (ops/views.py, overview.py). Actions change flows, so they
are off unless asked for, a flow page shows only those its state allows, and a POST must
carry the token of the page it came from (a cross-site form cannot read it) and no foreign
``Origin``. guard.py refuses other Host names, framing, and requests without the basic auth.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import redis
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from celery_echomq.errors import CursorError, EchoMQError, UnknownFlowError
from celery_echomq.ops.cancel import cancel_flow
from celery_echomq.ops.dashboard.guard import Exposure, Guard
from celery_echomq.ops.dashboard.metrics import registry_for
from celery_echomq.ops.dashboard.overview import read_overview
from celery_echomq.ops.dashboard.timeline import KINDS, build_timeline
from celery_echomq.ops.dashboard.tracebacks import failed_jobs, tracebacks
from celery_echomq.ops.listing import STATES
from celery_echomq.ops.nodes import json_default
from celery_echomq.ops.pages import FILTERS, PAGE, iter_children, read_flow
from celery_echomq.ops.rendering import seconds, short
from celery_echomq.ops.replication import replication_wait, store_refusal
from celery_echomq.ops.views import FINISHED, JobNode, shown_dict
from celery_echomq.store.state import EchoMQ, get_state

logger = logging.getLogger("celery_echomq")
HERE = Path(__file__).resolve().parent
ACTIONS = ("cancel", "retry", "release", "retry-child", "retry-failed")


def _when(ms: int | None) -> str:
    if ms is None:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ms / 1000)) + " UTC"


def _clock(ms: int | None) -> str:
    """A time of day to the millisecond (UTC), for starts and ends in a tree."""
    if ms is None:
        return "-"
    return time.strftime("%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}"


def allowed_actions(node: JobNode) -> list[str]:
    """The actions the flow's state allows: a page shows only these buttons."""
    if node.flow is None:
        return []
    held = node.state == "awaiting_children"
    # From the counts, not the children (a page of them): a held flow with failed children.
    failed_under_fail = node.flow.failed > 0
    actions = []
    if node.state in ("awaiting_children", "pending"):
        actions.append("cancel")
    if (node.state == "failed" and node.flow.failed_child) or (held and failed_under_fail):
        actions.append("retry")
    if held:
        actions.append("release")
    return actions


class Dashboard:
    """The routes' shared state: the flow store, the per-server action token, the switch."""

    def __init__(self, celery_app: Any, *, allow_actions: bool = False) -> None:
        self.state: EchoMQ = get_state(celery_app)
        self.allow_actions = allow_actions
        # A random token per server, put in each page's forms: a request forged by another
        # site cannot know it.
        self.token = secrets.token_urlsafe(24)
        self.registry = registry_for(self.state)
        self.templates = Jinja2Templates(directory=str(HERE / "templates"))
        self.templates.env.filters.update(when=_when, clock=_clock, seconds=seconds, short=short)

    def _page(self, request: Request, name: str, **context: Any) -> Response:
        # Whether the store refuses writes: one INFO per page (and per redraw of a flow's).
        context.update(
            allow_actions=self.allow_actions, token=self.token, refusing=store_refusal(self.state)
        )
        return self.templates.TemplateResponse(request, name, context)

    def index(self, request: Request) -> Response:
        params = request.query_params
        queue = params.get("queue") or None
        only = params.get("state") or None
        # "before": the cursor's earlier name; whatever it holds, a bad cursor is a 400.
        cursor = params.get("cursor") or params.get("before") or None
        if only is not None and only not in STATES:
            return PlainTextResponse(
                f"state must be one of {', '.join(STATES)}, not {only[:40]!r}", status_code=400
            )
        if cursor is not None and only is None:
            return PlainTextResponse(
                "a cursor pages one list: give its state (…&state=failed&cursor=…)",
                status_code=400,
            )
        try:
            views = read_overview(self.state, queue=queue, only=only, cursor=cursor)
        except (CursorError, EchoMQError) as exc:  # a bad cursor, or queue name
            return PlainTextResponse(str(exc), status_code=400)
        return self._page(request, "index.html", queues=views, paged=only is not None, only=queue)

    def goto(self, request: Request) -> Response:
        job_id = (request.query_params.get("id") or "").strip()
        if not job_id:
            return RedirectResponse("/", status_code=303)
        return RedirectResponse(f"/flows/{quote(job_id)}", status_code=303)

    def _tree(self, request: Request) -> tuple[JobNode | None, JobNode | None, str, int]:
        """The flow of the request's page (``?state=&cursor=&count=``) and, on a first page
        of every child of a flow with failed children, a page of those first."""
        job_id = request.path_params["job_id"]
        params = request.query_params
        only, cursor = params.get("state") or None, params.get("cursor") or None
        try:
            count = int(params.get("count") or PAGE)
            node = read_flow(
                self.state, job_id, cursor=cursor, count=count, only=only, with_times=True
            )
            failed = None
            if node.flow and (node.flow.failed or node.flow.ignored) and not (only or cursor):
                failed = read_flow(
                    self.state, job_id, count=10, only="failed", with_result=False,
                    with_times=True,
                )  # fmt: skip
            return node, failed, "", 200
        except UnknownFlowError as exc:
            return None, None, str(exc), 404
        except (EchoMQError, ValueError) as exc:  # an ill-formed id, cursor, state or count
            return None, None, str(exc), 400

    def _flow(self, request: Request, name: str) -> Response:
        node, failed, problem, status = self._tree(request)
        response = self._page(
            request,
            name,
            job_id=request.path_params["job_id"],
            node=node,
            failed=failed,
            timeline=build_timeline(self.state, node) if node else None,
            waiting=replication_wait(self.state, node.queue, node.id, node.state) if node else "",
            kinds=KINDS,
            tracebacks=tracebacks(self.state, failed_jobs((node, failed))),
            filters=FILTERS,
            query=request.url.query,
            problem=problem,
            actions=allowed_actions(node) if node and self.allow_actions else [],
            note=request.query_params.get("note", ""),
            error=request.query_params.get("error", ""),
        )
        response.status_code = status
        return response

    def flow_page(self, request: Request) -> Response:
        return self._flow(request, "flow.html")

    def live(self, request: Request) -> Response:
        return self._flow(request, "live.html")

    def api_flow(self, request: Request) -> Response:
        node, _, problem, status = self._tree(request)
        if node is None:
            return _json_error(status, problem)
        body = json.dumps(shown_dict(node, store_refusal(self.state)), default=json_default)
        return Response(body, media_type="application/json")

    def workers(self, request: Request) -> Response:
        from celery_echomq.ops.dashboard.workers import read_workers

        rows, problem = read_workers(self.state)
        return self._page(request, "workers.html", workers=rows, problem=problem)

    def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def action(self, request: Request) -> Response:
        job_id, action = request.path_params["job_id"], request.path_params["action"]
        if action not in ACTIONS:
            return PlainTextResponse(
                f"unknown action {action!r}; allowed: {', '.join(ACTIONS)}", status_code=404
            )
        if not self.allow_actions:
            return PlainTextResponse(
                "actions are disabled: start the dashboard with --allow-actions", status_code=403
            )
        form = await request.form()
        refused = self._forged(request, str(form.get("token") or ""))
        if refused:
            return PlainTextResponse(refused, status_code=403)
        # The store calls block: run them off the event loop, as Starlette runs sync routes.
        do = self._handlers()[action]
        if action == "retry-child":  # the child of the row the button is on
            child = str(form.get("child") or "")
            do = lambda job_id: self._retry_child(job_id, child)  # noqa: E731
        try:
            note = await run_in_threadpool(do, job_id)
        except EchoMQError as exc:  # a refusal (NotRepairableError...), a bad or unknown id
            return _back(job_id, error=str(exc))
        except redis.RedisError as exc:  # e.g. NOPERM: a store user without script rights
            return _back(job_id, error=f"the flow store refused the {action}: {exc}")
        logger.info("echomq: dashboard %s of flow %s: %s", action, job_id, note)
        return _back(job_id, note=note)

    def _forged(self, request: Request, token: str) -> str:
        """Why a POST is refused as possibly cross-site, or '' when it is not."""
        if not hmac.compare_digest(token.encode(), self.token.encode()):
            return "missing or wrong action token: reload the page and try again"
        origin = request.headers.get("origin")
        if origin and origin != "null":
            host = request.headers.get("host", "")
            if urlsplit(origin).netloc != host:
                return f"cross-site request refused (Origin {origin})"
        if request.headers.get("sec-fetch-site") == "cross-site":
            return "cross-site request refused"
        return ""

    def _handlers(self) -> dict[str, Callable[[str], str]]:
        return {
            "cancel": self._cancel,
            "retry": self._retry,
            "release": self._release,
            "retry-child": self._retry,  # replaced by _retry_child, with the form's child
            "retry-failed": self._retry_failed,
        }

    def _cancel(self, job_id: str) -> str:
        before = read_flow(self.state, job_id, count=1, with_result=False)
        if before.flow is None:
            raise EchoMQError(f"{job_id} is not a flow parent")
        if before.finished:
            raise EchoMQError(f"flow {job_id} already finished ({before.state}); nothing to cancel")
        cancel_flow(self.state, before.queue, job_id)
        after = read_flow(self.state, job_id, count=PAGE, only="active", with_result=False)
        if after.state not in FINISHED:
            # The parent had started: revoked as any task, as FlowResult.revoke() does.
            self.state.app.control.revoke(job_id)
        if after.state != "cancelled":
            return f"the parent was already {after.state}; Celery's revoke was sent for it"
        more = "+" if after.page and after.page.next_cursor else ""
        return f"flow {job_id} cancelled ({len(after.children)}{more} job(s) still running)"

    def _retry(self, job_id: str) -> str:
        # Lazily: the repair module is needed only when an operator presses the button.
        from celery_echomq.ops.repair import retry_flow

        # A refusal is a NotRepairableError (an EchoMQError): shown on the page as is.
        done = retry_flow(self.state, job_id)
        return (
            f"flow {job_id} retried: {len(done.republished)} child(ren) published again; "
            f"parent {done.state}"
        )

    def _retry_child(self, job_id: str, child: str) -> str:
        from celery_echomq.ops.repair import retry_flow

        if not child:
            raise EchoMQError("which child? the form names none")
        done = retry_flow(self.state, job_id, child=child)
        return (
            f"child {child} retried: {len(done.republished)} published again; parent {done.state}"
        )

    def _retry_failed(self, job_id: str) -> str:
        """Every failed child of the flow, whatever its policy: those failed under ``fail``
        as the retry button does, then each other one on its own (a page at a time)."""
        from celery_echomq.ops.repair import retry_flow

        node = read_flow(self.state, job_id, count=1, with_result=False)
        republished = 0
        if "retry" in allowed_actions(node):
            republished += len(retry_flow(self.state, job_id).republished)
        # Read first, then retried: a retry takes a child out of the set being paged.
        ids = [
            c.id for c in iter_children(self.state, job_id, only="failed") if c.state == "failed"
        ]
        for child in ids:
            republished += len(retry_flow(self.state, job_id, child=child).republished)
        if not republished:
            raise EchoMQError(f"flow {job_id} has no failed child to retry")
        after = read_flow(self.state, job_id, count=1, with_result=False)
        return (
            f"flow {job_id}: {republished} failed child(ren) published again; parent {after.state}"
        )

    def _release(self, job_id: str) -> str:
        from celery_echomq.ops.release import release_flow

        done = release_flow(self.state, job_id)
        return (
            f"flow {job_id} released with {done.values} value(s); "
            f"{done.left} child(ren) outstanding"
        )


def _json_error(status: int, message: str) -> Response:
    return Response(
        json.dumps({"error": message}), status_code=status, media_type="application/json"
    )


def _back(job_id: str, **message: str) -> Response:
    # POST-redirect-GET: a reload of the page does not repeat the action.
    ((key, text),) = message.items()
    return RedirectResponse(f"/flows/{quote(job_id)}?{key}={quote(text)}", status_code=303)


def make_app(
    celery_app: Any, *, allow_actions: bool = False, exposure: Exposure | None = None
) -> Any:
    """The dashboard as an ASGI app (serve it with any ASGI server; :func:`serve` uses
    uvicorn), behind its guard (``exposure``: loopback Host names only, no auth, by
    default). ``.state.dashboard`` is its :class:`Dashboard`."""
    dash = Dashboard(celery_app, allow_actions=allow_actions)

    async def store_down(request: Request, exc: Exception) -> Response:
        return PlainTextResponse(f"cannot reach the flow store in Redis: {exc}", status_code=503)

    async def store_refused(request: Request, exc: Exception) -> Response:
        # Not a crash of the page: the store said no (an ACL user without a right, ...).
        return PlainTextResponse(f"the flow store refused: {exc}", status_code=503)

    routes = [
        Route("/", dash.index),
        Route("/flows", dash.goto),
        Route("/flows/{job_id}", dash.flow_page),
        Route("/flows/{job_id}/live", dash.live),
        Route("/api/flows/{job_id}", dash.api_flow),
        Route("/workers", dash.workers),
        Route("/metrics", dash.metrics),
        Route("/flows/{job_id}/{action:str}", dash.action, methods=["POST"]),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={
            redis.ConnectionError: store_down,
            redis.TimeoutError: store_down,
            redis.RedisError: store_refused,
        },
    )
    app.state.dashboard = dash
    return Guard(app, exposure or Exposure())


def serve(
    celery_app: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8008,
    allow_actions: bool = False,
    exposure: Exposure | None = None,
) -> None:
    """Run the dashboard until interrupted (uvicorn, one process)."""
    import uvicorn

    exposure = exposure or Exposure.of(host, (), None, allow_actions)
    app = make_app(celery_app, allow_actions=allow_actions, exposure=exposure)
    logger.info(
        "echomq: dashboard on http://%s:%d/ (actions %s)",
        host, port, "enabled" if allow_actions else "disabled",
    )  # fmt: skip
    uvicorn.run(app, host=host, port=port, log_level="info")
