"""The ASGI app factory. State is built in the lifespan and passed explicitly; nothing global.

``create_app(settings)`` fronts the engines at ``settings.upstream`` and ``upstreams`` (or
runs the embedded engine when none is given), always through one router (``proxy.router``):
one engine is a router with one lane. Tests and benchmarks inject ``transport`` (an httpx
transport, e.g. ``StreamingASGITransport`` over a fake engine) or ``transports`` per
upstream URL instead of network connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from core.errors import ProxyError, error_response, openai_error
from proxy.codecs import Codec
from proxy.codecs import routes as codec_routes
from proxy.logs import get_logger
from proxy.metrics import Metrics
from proxy.passthrough import forward
from proxy.router import Router, open_router
from proxy.service import ProxyService
from proxy.sessions import SessionStore
from proxy.settings import Settings

STATIC_DIR = Path(__file__).resolve().parent / "static"
ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


@dataclass(slots=True)
class AppState:
    settings: Settings
    router: Router
    metrics: Metrics
    started: float

    @property
    def sessions(self) -> SessionStore:
        return self.router.store

    @property
    def service(self) -> ProxyService:
        """The first lane's request path (the only one with a single engine)."""
        return self.router.lanes[0].service


def create_app(settings: Settings, *, transport: httpx.AsyncBaseTransport | None = None,
               transports: Mapping[str, httpx.AsyncBaseTransport] | None = None) -> Starlette:
    metrics = Metrics()
    logger = get_logger()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        router = await open_router(settings, metrics, logger, transports=transports,
                                   transport=transport)
        app.state.prefixpin = AppState(settings, router, metrics, time.time())
        try:
            # The first probe runs before the first request is served; an engine that is
            # down does not hold the proxy up (its lane keeps probing in the background).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(settings.probe_timeout_s * 4):
                    await router.first_probe.wait()
            yield
        finally:
            await router.aclose()

    routes = [
        *(_pipeline_route(path, codec) for path, codec in codec_routes().items()),
        Route("/healthz", _healthz, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
        Route("/sessions", _sessions, methods=["GET"]),
        Route("/", _status_page, methods=["GET"]),
        Mount("/_prefixpin", StaticFiles(directory=STATIC_DIR), name="static"),
        Route("/{path:path}", _passthrough, methods=ALL_METHODS),
    ]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={ProxyError: _proxy_error, Exception: _unexpected})


def state_of(request: Request) -> AppState:
    state: AppState = request.app.state.prefixpin
    return state


def _pipeline_route(path: str, codec: Codec) -> Route:
    """A route of the request path, answered in its codec's wire format."""
    async def handle(request: Request) -> Response:
        return await state_of(request).router.handle(request, codec)

    return Route(path, handle, methods=["POST"], name=f"{codec.name} {path}")


async def _passthrough(request: Request) -> Response:
    lane = state_of(request).router.lane_for_passthrough()
    return await forward(request, lane.service.backend.adapter.http)


async def _metrics(request: Request) -> Response:
    body = state_of(request).metrics.exposition()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


async def _status_page(request: Request) -> Response:
    """The built-in status page (plain HTML and a small script; no build step)."""
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html")


async def _sessions(request: Request) -> Response:
    """Per namespace: each session, its slot, committed tokens and last decision; per
    backend: its slots and parked sessions."""
    return JSONResponse(state_of(request).router.sessions_view())


async def _healthz(request: Request) -> Response:
    state = state_of(request)
    router = state.router
    upstreams = await router.health()
    healthy = any(u["status"] == "ok" for u in upstreams)
    body = {"status": "ok" if healthy else "degraded",
            "uptime_s": round(time.time() - state.started),
            "inflight": sum(len(lane.service.generations) for lane in router.lanes),
            "replica": router.replica, "upstream": upstreams[0], "upstreams": upstreams}
    return JSONResponse(body, status_code=200 if healthy else 503)


async def _proxy_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ProxyError)
    return error_response(exc)


async def _unexpected(request: Request, exc: Exception) -> Response:
    # Internals stay in the log; the client gets a plain OpenAI-shaped 500.
    get_logger().exception("unexpected error", extra={"fields": {"path": request.url.path}})
    return JSONResponse(openai_error("internal proxy error", "server_error"), status_code=500)
