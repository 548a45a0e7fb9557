"""The ASGI app factory. State is built in the lifespan and passed explicitly; nothing global.

``create_app(settings)`` fronts the engine at ``settings.upstream``; tests and benchmarks
inject ``transport`` (an httpx transport, e.g. ``StreamingASGITransport`` over a fake
engine) instead of a network connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from adapters.base import Adapter
from adapters.llama_server import LlamaServerAdapter
from adapters.ollama import EngineKind, OllamaAdapter, detect_engine
from proxy.affinity import AffinityPlanner
from proxy.backends import Router, open_router
from core.errors import ProxyError, UpstreamError, error_response, openai_error
from proxy.implicit import Fingerprinter, load_fingerprinter
from proxy.logs import get_logger, log_event
from proxy.metrics import Metrics
from proxy.ollama import OllamaPlanner, handle_native
from proxy.parking import ParkManager, open_parking
from proxy.passthrough import forward
from proxy.placement import SlotPool
from proxy.repair import RepairConfig, Repairer
from proxy.service import Backend, ProxyService
from proxy.sessions import SessionStore
from proxy.settings import Settings
from proxy.tokens import TokenCounter
from proxy.watch import EngineWatch, RestartHook, probe, probe_until_ready

STATIC_DIR = Path(__file__).resolve().parent / "static"
ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


@dataclass(slots=True)
class AppState:
    settings: Settings
    service: ProxyService
    metrics: Metrics
    started: float
    sessions: SessionStore
    router: Router | None = None  # several backends, or state shared with other replicas


def create_app(settings: Settings, *, transport: httpx.AsyncBaseTransport | None = None,
               adapter: Adapter | None = None,
               transports: Mapping[str, httpx.AsyncBaseTransport] | None = None) -> Starlette:
    """``transports``: per upstream URL, for tests of several backends."""
    metrics = Metrics()
    logger = get_logger()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if settings.several():
            async with _routed(app, settings, metrics, logger, transports or {}):
                yield
            return
        backend_adapter = adapter or await _open_adapter(settings, transport)
        backend = Backend(label=_label(settings), adapter=backend_adapter)
        service = ProxyService(settings, backend, metrics, logger=logger)
        store = SessionStore()
        app.state.prefixpin = AppState(settings, service, metrics, time.time(), store)
        first_probe = asyncio.Event()
        startup = asyncio.create_task(
            _start_policies(settings, service, store, logger, first_probe))
        try:
            # The first probe runs before the first request is served; an engine that is
            # down does not hold the proxy up (it keeps probing in the background).
            probed = asyncio.ensure_future(first_probe.wait())
            await asyncio.wait({startup, probed}, timeout=settings.probe_timeout_s * 4,
                               return_when=asyncio.FIRST_COMPLETED)
            probed.cancel()
            yield
        finally:
            startup.cancel()
            await asyncio.gather(startup, return_exceptions=True)
            await service.aclose()
            await backend_adapter.aclose()

    routes = [
        Route("/v1/chat/completions", _chat, methods=["POST"]),
        Route("/chat/completions", _chat, methods=["POST"]),
        Route("/v1/completions", _completions, methods=["POST"]),
        Route("/completions", _completions, methods=["POST"]),
        Route("/api/chat", _native_chat, methods=["POST"]),
        Route("/api/generate", _native_generate, methods=["POST"]),
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


async def _chat(request: Request) -> Response:
    state = state_of(request)
    if state.router is not None:
        return await state.router.handle(request, "chat")
    return await state.service.handle(request, "chat")


async def _completions(request: Request) -> Response:
    state = state_of(request)
    if state.router is not None:
        return await state.router.handle(request, "completions")
    return await state.service.handle(request, "completions")


async def _native_chat(request: Request) -> Response:
    return await handle_native(_service_of(request), request, "chat")


async def _native_generate(request: Request) -> Response:
    return await handle_native(_service_of(request), request, "completions")


async def _passthrough(request: Request) -> Response:
    return await forward(request, _service_of(request).backend.adapter.http)


def _service_of(request: Request) -> ProxyService:
    """The service for paths that are not placed per session: with several backends, the
    first one answering (in --upstream order)."""
    state = state_of(request)
    if state.router is not None:
        return state.router.lane_for_passthrough().service
    return state.service


async def _metrics(request: Request) -> Response:
    body = state_of(request).metrics.exposition()
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


async def _status_page(request: Request) -> Response:
    """The built-in status page (plain HTML and a small script; no build step)."""
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html")


async def _sessions(request: Request) -> Response:
    """Per namespace: each session, its slot, committed tokens and last decision."""
    state = state_of(request)
    if state.router is not None:
        return JSONResponse(_routed_sessions(state, state.router))
    pool = state.service.pool
    body = {
        "affinity": state.service.planner.__class__.__name__ == "AffinityPlanner",
        "slots": [{"slot": e.index, "session": e.occupant, "kind": e.kind, "tokens": e.tokens,
                   "busy": e.busy} for e in pool.entries] if pool else [],
        "namespaces": {ns: [s.view() for s in sessions]
                       for ns, sessions in state.sessions.namespaces().items()},
    }
    parking = _parking_of(state.service)
    body["parking"] = parking.parked_view() if parking is not None else None
    return JSONResponse(body)


async def _healthz(request: Request) -> Response:
    state = state_of(request)
    if state.router is not None:
        upstreams = state.router.health()
        healthy = any(u["status"] == "ok" for u in upstreams)
        return JSONResponse({"status": "ok" if healthy else "degraded",
                             "uptime_s": round(time.time() - state.started),
                             "inflight": sum(len(lane.service.generations)
                                             for lane in state.router.lanes),
                             "replica": state.router.cluster.replica
                             if state.router.cluster is not None else None,
                             "upstreams": upstreams}, status_code=200 if healthy else 503)
    backend = state.service.backend
    upstream: dict[str, Any] = {"label": backend.label, "engine": backend.adapter.name}
    try:
        info = await probe(backend.adapter, state.settings.probe_timeout_s)
        backend.info = info
        upstream.update(status="ok", model=info.model, slots=info.n_slots,
                        n_ctx_slot=info.n_ctx_slot, build=info.build)
        healthy = True
    except UpstreamError as exc:
        upstream.update(status="unreachable", error=exc.message)
        healthy = False
    state.metrics.upstream_up.labels(backend.label).set(1 if healthy else 0)
    body = {"status": "ok" if healthy else "degraded",
            "uptime_s": round(time.time() - state.started),
            "inflight": len(state.service.generations), "upstream": upstream}
    return JSONResponse(body, status_code=200 if healthy else 503)


async def _proxy_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ProxyError)
    return error_response(exc)


async def _unexpected(request: Request, exc: Exception) -> Response:
    # Internals stay in the log; the client gets a plain OpenAI-shaped 500.
    get_logger().exception("unexpected error", extra={"fields": {"path": request.url.path}})
    return JSONResponse(openai_error("internal proxy error", "server_error"), status_code=500)


async def _start_policies(settings: Settings, service: ProxyService, store: SessionStore,
                          logger: logging.Logger, first_probe: asyncio.Event) -> None:
    """Probe the engine until it answers, switch on what it supports, then watch it."""
    backend = service.backend

    async def not_ready() -> None:
        first_probe.set()  # serve (and fail) meanwhile
        await _redetect(settings, backend, logger)

    info = await probe_until_ready(service, settings.probe_timeout_s, logger, not_ready)
    watch = EngineWatch(service, settings.health_interval_s, logger)
    service.on_upstream_lost = watch.suspect
    if not settings.affinity:
        log_event(logger, logging.INFO, "affinity off", reason="PREFIXPIN_AFFINITY=0")
    elif isinstance(backend.adapter, OllamaAdapter):
        watch.on_lost.append(await _ollama_sessions_on(settings, service, store, logger))
    elif not backend.adapter.capabilities.slots:
        log_event(logger, logging.INFO, "affinity off",
                  reason=f"{info.engine} does not let the proxy choose slots")
    else:
        watch.on_restart.append(await _affinity_on(settings, service, store, logger))
        watch.on_lost.append(store.mark_unverified)
    first_probe.set()
    try:
        await watch.run()
    finally:
        if (parking := _parking_of(service)) is not None:
            await parking.aclose(service.pool)  # a clean shutdown parks idle slots


async def _affinity_on(settings: Settings, service: ProxyService, store: SessionStore,
                       logger: logging.Logger) -> RestartHook:
    """Session affinity planner in place; returns what must run when the engine restarts."""
    backend, metrics = service.backend, service.metrics
    info = backend.info
    assert info is not None
    fingerprinter = await load_fingerprinter(settings.tokenizer, info.props, logger)
    parking = await open_parking(settings, backend.adapter, info, store, metrics, logger)
    pool = SlotPool(info.n_slots, on_evict=parking.park if parking is not None else None)
    service.pool = pool
    planner = AffinityPlanner(store, pool, metrics, fingerprinter, logger,
                              _repairer(settings, fingerprinter, logger),
                              budget_tokens=info.n_ctx_slot or None, parking=parking)
    service.planner = planner
    log_event(logger, logging.INFO, "affinity on", slots=info.n_slots,
              implicit=fingerprinter is not None)
    return planner.engine_restarted


async def _ollama_sessions_on(settings: Settings, service: ProxyService, store: SessionStore,
                              logger: logging.Logger) -> Callable[[str], None]:
    """Sessions, repair, estimates and the model lifecycle in front of Ollama (no slots:
    a pool of none, and no slot is ever leased). Returns the engine-lost hook."""
    backend = service.backend
    assert backend.info is not None
    fingerprinter = await load_fingerprinter(settings.tokenizer, backend.info.props, logger)
    inner = AffinityPlanner(store, SlotPool(0), service.metrics, fingerprinter, logger,
                            _repairer(settings, fingerprinter, logger))
    planner = OllamaPlanner(inner, service.metrics, logger, backend.label)
    service.planner = planner
    log_event(logger, logging.INFO, "sessions on", engine="ollama", slots="chosen by Ollama",
              implicit=fingerprinter is not None,
              cached_tokens="measured" if backend.adapter.capabilities.measured_cache
              else "estimated unless Ollama reports them")
    return planner.engine_lost


@asynccontextmanager
async def _routed(app: Starlette, settings: Settings, metrics: Metrics, logger: logging.Logger,
                  transports: Mapping[str, httpx.AsyncBaseTransport]) -> AsyncIterator[None]:
    """Several backends and/or replicas sharing state in Redis (proxy.backends)."""
    if not settings.backend_urls():
        raise ValueError("several backends or --redis need --upstream URLs (the embedded "
                         "engine is one process's)")

    def client(url: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=url, transport=transports.get(url),
                                 timeout=settings.upstream_timeout(),
                                 limits=httpx.Limits(max_connections=None,
                                                     max_keepalive_connections=64))

    router = await open_router(settings, metrics, logger, client, _repairer)
    app.state.prefixpin = AppState(settings, router.lanes[0].service, metrics, time.time(),
                                   router.store, router)
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(settings.probe_timeout_s * 4):
                await router.first_probe.wait()
        yield
    finally:
        await router.aclose()


def _routed_sessions(state: AppState, router: Router) -> dict[str, Any]:
    backends = []
    for lane in router.lanes:
        pool = lane.service.pool
        backends.append({"upstream": lane.label, "up": lane.up, "slots": [
            {"slot": e.index, "session": e.occupant, "kind": e.kind, "tokens": e.tokens,
             "busy": e.busy} for e in pool.entries] if pool else []})
    return {"affinity": state.settings.affinity, "placement": state.settings.placement,
            "backends": backends, "slots": backends[0]["slots"] if backends else [],
            "namespaces": {ns: [s.view() for s in sessions]
                           for ns, sessions in state.sessions.namespaces().items()},
            "parking": None}


def _parking_of(service: ProxyService) -> ParkManager | None:
    planner = service.planner
    return planner.parking if isinstance(planner, AffinityPlanner) else None


async def _open_adapter(settings: Settings,
                        transport: httpx.AsyncBaseTransport | None) -> Adapter:
    if settings.upstream is not None or transport is not None:
        http = _upstream_client(settings, transport)
        engine: EngineKind | None = None
        if settings.engine in ("ollama", "llama-server"):
            engine = settings.engine
        elif settings.engine == "auto":
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(settings.probe_timeout_s):
                    engine = await detect_engine(http)
            if engine is None:  # not answering yet: probed again until it does
                log_event(get_logger(), logging.WARNING, "engine not detected",
                          upstream=_label(settings), assumed="llama-server",
                          hint="--engine ollama|llama-server skips detection")
        return OllamaAdapter(http) if engine == "ollama" else LlamaServerAdapter(http)
    # Imported here: the embedded engine needs the `embedded` extra (llama-cpp-python).
    from adapters.embedded import EmbeddedAdapter, EngineConfig

    if settings.model is None:
        raise ValueError("the embedded engine needs settings.model (the CLI resolves it)")
    config = EngineConfig(model_path=settings.model, n_slots=settings.slots,
                          n_ctx=settings.ctx_size, n_threads=settings.threads,
                          slot_save_path=settings.slot_dir())
    return await EmbeddedAdapter.open(config, settings.upstream_timeout())


def _repairer(settings: Settings, fingerprinter: Fingerprinter | None,
              logger: logging.Logger) -> Repairer | None:
    if not settings.repair:
        log_event(logger, logging.INFO, "repair off", reason="PREFIXPIN_REPAIR=0")
        return None
    config = RepairConfig.from_switches(settings.repair_switches(),
                                        settings.repair_volatile_rules)
    config = dataclasses.replace(config, budget_fraction=settings.repair_budget)
    counter = TokenCounter(fingerprinter.tokenizer if fingerprinter else None)
    log_event(logger, logging.INFO, "repair on", policies=sorted(config.enabled),
              exact_token_counts=counter.exact)
    return Repairer(config, counter.count_messages)


def _upstream_client(settings: Settings,
                     transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
    base_url = settings.upstream or "http://engine.invalid"
    return httpx.AsyncClient(base_url=base_url, transport=transport,
                             timeout=settings.upstream_timeout(),
                             limits=httpx.Limits(max_connections=None,
                                                 max_keepalive_connections=64))


async def _redetect(settings: Settings, backend: Backend, logger: logging.Logger) -> None:
    """``--engine auto`` and the engine did not answer as the one assumed: ask again which
    engine it is (an Ollama that started after the proxy was first taken for llama-server)."""
    if settings.engine != "auto" or backend.adapter.name not in ("llama-server", "ollama"):
        return
    engine: EngineKind | None = None
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(settings.probe_timeout_s):
            engine = await detect_engine(backend.adapter.http)
    if engine is None or engine == backend.adapter.name:
        return
    http = backend.adapter.http
    backend.adapter = OllamaAdapter(http) if engine == "ollama" else LlamaServerAdapter(http)
    log_event(logger, logging.INFO, "engine detected", upstream=backend.label, engine=engine)


def _label(settings: Settings) -> str:
    if settings.upstream is None:
        return "embedded"
    return httpx.URL(settings.upstream).netloc.decode() or settings.upstream
