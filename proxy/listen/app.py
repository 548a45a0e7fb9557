"""The ASGI app factories. State is built in the lifespan and passed explicitly; nothing global.

Two listeners, one process, one state (issue 16: tenants never reach what is not theirs):

- the **tenant app** (``ProxyApps.tenant``, the ``--port`` listener) serves the pipeline's
  routes (``proxy.codecs.routes()``), ``GET /healthz`` and the read-only engine paths of
  ``proxy.listen.passthrough.TENANT_PATHS``. Every other path is a 403 naming the operator
  listener: ``/slots`` (erase, save, restore), Ollama's ``/api/delete``, ``/api/pull``,
  ... and the views. (llama-server's native ``/completion``, ``/completions`` and
  ``/infill`` are pipeline routes: ``proxy.codecs.llama_native``.)
- the **operator app** (``ProxyApps.operator``, ``--admin-listen``) serves the status page,
  ``/sessions``, ``/metrics``, ``/healthz`` and every engine path as it came; with
  ``--admin-token`` only to requests carrying ``Authorization: Bearer <token>``.

``create_apps(settings)`` builds both around one ``StateHolder``: the tenant app's lifespan
opens the router (fronting the engines at ``settings.upstream`` and ``upstreams``, or the
embedded engine when none is given) and puts the ``AppState`` in the holder, which the
operator app reads (it has no lifespan of its own, and answers 503 until the state is
there). ``create_app`` is the tenant app alone. Tests and benchmarks inject ``transport``
(an httpx transport, e.g. ``StreamingASGITransport`` over a fake engine) or ``transports``
per upstream URL instead of network connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from prefixpin.core.errors import (
    ProxyError,
    error_response,
    openai_error,
)
from prefixpin.proxy.codecs import Codec
from prefixpin.proxy.codecs import routes as codec_routes
from prefixpin.proxy.listen.cors import (
    CorsRules,
    browser_gate,
    llama_server_rules,
    ollama_rules,
    rules_for,
    tenant_cors,
)
from prefixpin.proxy.listen.passthrough import TENANT_PATHS, forward
from prefixpin.proxy.listen.paths import canonical_paths
from prefixpin.proxy.listen.tenants import CREDENTIAL_HEADERS
from prefixpin.proxy.ops.logs import get_logger
from prefixpin.proxy.ops.metrics import Metrics
from prefixpin.proxy.pipeline.router import Router, headers_of, open_router
from prefixpin.proxy.pipeline.service import ProxyService
from prefixpin.proxy.pipeline.validation import BodyBudget, read_body
from prefixpin.proxy.session.sessions import SessionStore
from prefixpin.proxy.settings import Settings

STATIC_DIR = Path(__file__).resolve().parents[1] / "ops" / "static"  # the status page
ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
Handler = Callable[[Request], Awaitable[Response]]


@dataclass(slots=True)
class AppState:
    settings: Settings
    router: Router
    metrics: Metrics
    started: float
    bodies: BodyBudget  # --max-bodies: the tenant listener's request bodies, all together

    @property
    def sessions(self) -> SessionStore:
        return self.router.store

    @property
    def service(self) -> ProxyService:
        """The first lane's request path (the only one with a single engine)."""
        return self.router.lanes[0].service


class NotStarted(ProxyError):
    status_code = 503
    error_type = "server_error"
    code = "starting"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}


class StateHolder:
    """The one ``AppState`` both listeners serve: set by the tenant app's lifespan, read by
    both apps' routes."""

    def __init__(self) -> None:
        self.state: AppState | None = None

    def get(self) -> AppState:
        if self.state is None:
            raise NotStarted("prefixpin is starting (or stopping): try again shortly")
        return self.state


@dataclass(frozen=True, slots=True)
class ProxyApps:
    tenant: Starlette  # --port: what tenants may reach; its lifespan owns the router
    operator: Starlette  # --admin-listen: the views and every engine path
    holder: StateHolder
    metrics: Metrics  # the server's own bounds count their refusals here too

    cors_rules: Callable[[], CorsRules]  # the tenant port's: the engines' (proxy.listen.cors)

    @property
    def tenant_listener(self) -> ASGIApp:
        """What the tenant port serves: browsers answered first (``proxy.listen.cors``: a
        preflight before any key is looked at), then the tenant app behind the canonical
        path (``proxy.listen.paths``: an alias is routed as the path it means, or refused),
        its pipeline routes served straight from there (``PipelineFirst``)."""
        return tenant_cors(canonical_paths(PipelineFirst(self.tenant, self.holder)),
                           self.cors_rules)

    @property
    def operator_listener(self) -> ASGIApp:
        """What the operator listener serves: nothing to another origin's page, then
        behind the canonical path too."""
        return browser_gate(canonical_paths(self.operator))


def create_apps(settings: Settings, *, transport: httpx.AsyncBaseTransport | None = None,
                transports: Mapping[str, httpx.AsyncBaseTransport] | None = None) -> ProxyApps:
    metrics = Metrics()
    logger = get_logger()
    bodies = BodyBudget(settings.max_bodies_bytes, logger)
    holder = StateHolder()
    operator = _operator_app(settings, holder)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        router = await open_router(settings, metrics, logger, bodies=bodies,
                                   transports=transports, transport=transport)
        state = AppState(settings, router, metrics, time.time(), bodies)
        holder.state = app.state.prefixpin = operator.state.prefixpin = state
        try:
            # The first probe runs before the first request is served; an engine that is
            # down does not hold the proxy up (its lane keeps probing in the background).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(settings.probe_timeout_s * 4):
                    await router.first_probe.wait()
            yield
        finally:
            holder.state = None
            await router.aclose()

    refused = _operator_only(settings)
    routes: list[BaseRoute] = [
        *(_pipeline_route(path, codec, holder) for path, codec in codec_routes().items()),
        Route("/healthz", _healthz(holder, tenants_port=True), methods=["GET"]),
        *(Route(path, _passthrough(holder, path), methods=[method])
          for path, method in TENANT_PATHS.items()),
        Route("/{path:path}", refused, methods=ALL_METHODS),
    ]
    tenant = Starlette(routes=routes, lifespan=lifespan,
                       exception_handlers={ProxyError: _proxy_error, Exception: _unexpected})
    return ProxyApps(tenant, operator, holder, metrics, _cors_rules(settings, holder))


def create_app(settings: Settings, *, transport: httpx.AsyncBaseTransport | None = None,
               transports: Mapping[str, httpx.AsyncBaseTransport] | None = None) -> Starlette:
    """The tenant app alone (its operator app is unreachable): for tests and benches that
    need no operator view."""
    return create_apps(settings, transport=transport, transports=transports).tenant


def _cors_rules(settings: Settings, holder: StateHolder) -> Callable[[], CorsRules]:
    """The rules of the engines serving now (before they are known, of the engine named
    by ``--engine``), each kind's read from ``--cors-origins`` once."""
    llama_server = llama_server_rules(settings.cors_origins)
    ollama = ollama_rules(settings.cors_origins)

    def rules() -> CorsRules:
        state = holder.state
        engines = ([lane.adapter.name for lane in state.router.lanes] if state is not None
                   else [settings.engine])
        return rules_for(engines, llama_server, ollama)

    return rules


def _operator_app(settings: Settings, holder: StateHolder) -> Starlette:
    token = settings.admin_token
    routes: list[BaseRoute] = [
        Route("/healthz", _healthz(holder), methods=["GET"]),
        Route("/metrics", _metrics(holder), methods=["GET"]),
        Route("/sessions", _sessions(holder), methods=["GET"]),
        Route("/", _status_page, methods=["GET"]),
        Mount("/_prefixpin", StaticFiles(directory=STATIC_DIR), name="static"),
        # The operator's Authorization is prefixpin's token, not the engine's.
        Route("/{path:path}", _passthrough(holder, None, drop_authorization=token is not None),
              methods=ALL_METHODS),
    ]
    middleware = ([] if token is None else
                  [Middleware(BearerGate, token=token.get_secret_value())])
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={ProxyError: _proxy_error, Exception: _unexpected})


class BearerGate:
    """Every operator request carries ``Authorization: Bearer <--admin-token>`` (compared in
    constant time), else 401."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = JSONResponse(
                    openai_error("the operator listener needs Authorization: Bearer "
                                 "<--admin-token>", "authentication_error",
                                 code="invalid_admin_token"),
                    status_code=401, headers={"WWW-Authenticate": 'Bearer realm="prefixpin"'})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _operator_only(settings: Settings) -> Handler:
    """The tenant port's answer for every path that is not a tenant's: 403, naming where the
    operator finds it (Ollama's error shape under ``/api/``, else OpenAI's)."""
    where = f"the operator port {settings.admin_display()} (--admin-listen)"

    async def refuse(request: Request) -> Response:
        path = request.url.path
        message = (f"{request.method} {path} is not served on this port: it is served on "
                   f"{where}")
        if path.startswith("/api/"):
            return JSONResponse({"error": message}, status_code=403)
        return JSONResponse(openai_error(message, "permission_error", code="operator_only"),
                            status_code=403)

    return refuse


def _pipeline_route(path: str, codec: Codec, holder: StateHolder) -> Route:
    """A route of the request path, answered in its codec's wire format (what the tenant
    app serves when ``PipelineFirst`` is not in front of it)."""
    async def handle(request: Request) -> Response:
        return await holder.get().router.handle(request, codec)

    return Route(path, handle, methods=["POST"], name=f"{codec.name} {path}")


class PipelineFirst:
    """A ``POST`` to a pipeline route goes straight to the router; everything else to
    ``app`` (the tenant app, the same routes behind starlette's middleware).

    Why: every event a client receives is one ``send`` through the app's stack, and a
    streamed answer's task resumes through every frame of it per event. Starlette's stack
    (its error middleware, the exception handlers' wrapper, the router and the route, each
    a coroutine frame and two of them wrapping ``send``) is the same work every event for
    nothing the pipeline uses: the router answers its own errors in each API's shape
    (``Router.handle``); what is left is translated here as the tenant app translates it
    (``NotStarted`` and any other ``ProxyError``, an unexpected exception as a logged 500).
    Paths under a ``root_path`` (a mount) are left to starlette's routing."""

    def __init__(self, app: ASGIApp, holder: StateHolder) -> None:
        self.app = app
        self.holder = holder
        self.routes: dict[str, Codec] = dict(codec_routes())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            codec = self.routes.get(scope["path"])
            if codec is not None:
                await self._serve(Request(scope, receive, send), codec, send)
                return
        await self.app(scope, receive, send)

    async def _serve(self, request: Request, codec: Codec, send: Send) -> None:
        try:
            response = await self.holder.get().router.handle(request, codec)
        except ProxyError as exc:
            response = error_response(exc)
        except Exception as exc:
            response = await _unexpected(request, exc)
        await response(request.scope, request.receive, send)


def _passthrough(holder: StateHolder, path: str | None, *,
                 drop_authorization: bool = False) -> Handler:
    """To the first lane that answers, as it came: to ``path`` (a tenant path, the route's
    own) or, on the operator listener (``None``), to the request's path."""
    dropped = ("authorization",) if drop_authorization else ()

    async def handle(request: Request) -> Response:
        state = holder.get()
        router = state.router
        if path is None:  # the operator's: as it came
            lane = router.lane_for_passthrough()
            return await forward(request, lane.adapter.http,
                                 drop_headers=dropped, operator=True)
        # A tenant's: with tenants configured its key checked first (401), and never sent
        # on (the engine gets its own key: ``operator``, prefixpin's credentials); its
        # body within --max-body, read before anything is sent on, and counted in
        # --max-bodies until it is sent.
        configured = router.tenants.configured
        if configured:
            router.tenants.namespace_of(headers_of(request))
        with state.bodies.reservation() as held:
            try:
                content = await read_body(request.stream(),
                                          request.headers.get("content-length"),
                                          state.settings.max_body_bytes, held)
            except ProxyError as exc:
                if exc.limit is not None:
                    state.metrics.limit_refusals.labels(exc.limit).inc()
                raise
            lane = router.lane_for_passthrough()
            return await forward(request, lane.adapter.http, content,
                                 path=path,
                                 drop_headers=CREDENTIAL_HEADERS if configured else dropped,
                                 operator=configured)

    return handle


def _metrics(holder: StateHolder) -> Handler:
    async def handle(request: Request) -> Response:
        body = holder.get().metrics.exposition()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    return handle


async def _status_page(request: Request) -> Response:
    """The built-in status page (plain HTML and a small script; no build step)."""
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html")


def _sessions(holder: StateHolder) -> Handler:
    """Per namespace: each session, its slot, committed tokens and last decision; per
    backend: its slots and parked sessions."""
    async def handle(request: Request) -> Response:
        return JSONResponse(holder.get().router.sessions_view())

    return handle


def _healthz(holder: StateHolder, *, tenants_port: bool = False) -> Handler:
    """``tenants_port``: anyone may ask there, without a key: which tenants a backend is
    dedicated to is the operator's to see, not theirs."""
    async def handle(request: Request) -> Response:
        state = holder.get()
        router = state.router
        upstreams = await router.health()
        if tenants_port:
            upstreams = [{k: v for k, v in u.items() if k != "namespaces"} for u in upstreams]
        healthy = any(u["status"] == "ok" for u in upstreams)
        body = {"status": "ok" if healthy else "degraded",
                "uptime_s": round(time.time() - state.started),
                "inflight": sum(len(lane.generations) for lane in router.lanes),
                "replica": router.replica, "upstream": upstreams[0], "upstreams": upstreams}
        return JSONResponse(body, status_code=200 if healthy else 503)

    return handle


async def _proxy_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ProxyError)
    return error_response(exc)


async def _unexpected(request: Request, exc: Exception) -> Response:
    # Internals stay in the log; the client gets a plain OpenAI-shaped 500.
    get_logger().exception("unexpected error", extra={"fields": {"path": request.url.path}})
    return JSONResponse(openai_error("internal proxy error", "server_error"), status_code=500)
