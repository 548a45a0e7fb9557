"""The Ollama adapter: engine detection (``--engine auto`` probes ``/api/version`` then
``/props``; a 503 on ``/api/version`` is llama-server loading), the probe, ``measured_cache``
from the version and then from the fields responses carry, request preparation, and the
proxy picking the adapter and the session planner.

Ollama cannot be installed here: "Ollama" is the recorded-format fake
(``tests.fakes.fake_ollama``); "llama-server" is the fake llama-server, and once (marked
``llama``) the real one built by the rig.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from prefixpin.adapters.llama_server import LlamaServerAdapter
from prefixpin.adapters.ollama import OllamaAdapter, detect_engine
from prefixpin.core.errors import UpstreamProtocolError
from prefixpin.proxy.engine.ollama import OllamaPlanner
from prefixpin.proxy.listen.app import create_app
from prefixpin.proxy.settings import Settings
from tests.asgi_transport import StreamingASGITransport
from tests.fakes.fake_llama import FakeLlamaServer
from tests.fakes.fake_ollama import NEW_VERSION, OLD_VERSION, create_fake_ollama
from tests.fakes.servers import free_port
from tests.rig.llama_process import run_llama_server

from .conftest import MODEL, fake_config

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "Say hello."}]


def client_for(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url="http://engine", transport=StreamingASGITransport(app))


def loading_llama_server() -> Starlette:
    """llama-server while it loads its model: 503 "Loading model" on every path."""
    async def loading(request: Request) -> Response:
        return JSONResponse({"error": {"code": 503, "message": "Loading model",
                                       "type": "unavailable_error"}}, status_code=503)

    return Starlette(routes=[Route("/{path:path}", loading, methods=["GET", "POST"])])


def stub_ollama(version: str, lines: list[bytes], usage: dict[str, Any]) -> Starlette:
    """An Ollama-shaped stub whose version and cached fields can disagree (a source build
    reports 0.0.0; an MLX or cloud model may omit the field on a new version)."""
    async def api_version(request: Request) -> Response:
        return JSONResponse({"version": version})

    async def chat(request: Request) -> Response:
        return Response(b"".join(lines), media_type="application/x-ndjson")

    async def v1(request: Request) -> Response:
        chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": usage}
        return Response(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n",
                        media_type="text/event-stream")

    return Starlette(routes=[Route("/api/version", api_version),
                             Route("/api/chat", chat, methods=["POST"]),
                             Route("/v1/chat/completions", v1, methods=["POST"])])


DONE_NEW = (b'{"model":"m","created_at":"2026-10-03T14:11:01Z","message":{"role":"assistant",'
            b'"content":"Hi"},"done":true,"done_reason":"stop","prompt_eval_count":5,'
            b'"prompt_eval_cached_count":4,"eval_count":1}\n')
DONE_OLD = DONE_NEW.replace(b'"prompt_eval_cached_count":4,', b"")


# ----------------------------------------------------------------------------- detection

async def test_detects_ollama_and_llama_server() -> None:
    async with client_for(create_fake_ollama(fake_config())) as ollama, \
            client_for(FakeLlamaServer().app()) as llama, \
            client_for(loading_llama_server()) as loading, \
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{free_port()}") as nothing:
        assert await detect_engine(ollama) == "ollama"
        assert await detect_engine(llama) == "llama-server"
        assert await detect_engine(loading) == "llama-server"  # 503 on /api/version
        assert await detect_engine(nothing) is None


@pytest.mark.llama
async def test_detects_the_real_llama_server() -> None:
    """The real llama-server answers /api/version 404 once loaded (research: 503 while
    loading), and /props 200."""
    with run_llama_server("smollm2", slots=1, ctx_per_slot=1024) as server:
        async with httpx.AsyncClient(base_url=server.url) as http:
            assert (await http.get("/api/version")).status_code == 404
            assert await detect_engine(http) == "llama-server"


@contextlib.asynccontextmanager
async def proxy_over(upstream: Any, **settings: Any) -> AsyncIterator[Starlette]:
    app = create_app(Settings(upstream="http://engine", **settings),
                     transport=StreamingASGITransport(upstream))
    async with app.router.lifespan_context(app):
        yield app


@pytest.mark.parametrize(("engine", "adapter"), [("auto", OllamaAdapter),
                                                 ("ollama", OllamaAdapter),
                                                 ("llama-server", LlamaServerAdapter)])
async def test_the_proxy_picks_the_adapter(engine: str, adapter: type) -> None:
    """auto detects Ollama; --engine forces either (a forced llama-server in front of
    Ollama just never becomes ready)."""
    async with proxy_over(create_fake_ollama(fake_config()), engine=engine,
                          probe_timeout_s=0.5) as app:
        state = app.state.prefixpin
        assert isinstance(state.service.backend.adapter, adapter)
        ollama = adapter is OllamaAdapter
        assert isinstance(state.service.planner, OllamaPlanner) == ollama
        async with httpx.AsyncClient(transport=StreamingASGITransport(app),
                                     base_url="http://proxy") as client:
            health = await client.get("/healthz")
    assert health.status_code == (200 if ollama else 503)
    if ollama:
        assert health.json()["upstream"]["engine"] == "ollama"
        assert health.json()["upstream"]["build"] == f"ollama {NEW_VERSION}"


class LateEngine(httpx.AsyncBaseTransport):
    """No engine at first (connection refused); Ollama once ``start`` is called."""

    def __init__(self, app: Starlette) -> None:
        self.inner = StreamingASGITransport(app)
        self.up = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not self.up:
            raise httpx.ConnectError("connection refused", request=request)
        return await self.inner.handle_async_request(request)


@pytest.mark.slow
async def test_an_ollama_that_starts_after_the_proxy_is_detected() -> None:
    """Nothing answered at start (llama-server assumed); once Ollama answers, the probe
    loop detects it and switches the adapter and the session planner on."""
    late = LateEngine(create_fake_ollama(fake_config()))
    app = create_app(Settings(upstream="http://engine", probe_timeout_s=0.2), transport=late)
    async with app.router.lifespan_context(app):
        service = app.state.prefixpin.service
        assert service.backend.adapter.name == "llama-server"  # assumed while nothing answers
        late.up = True
        async with asyncio.timeout(10):
            # The proxy exposes no event for it: its state is polled, as an operator would.
            while not isinstance(service.planner, OllamaPlanner):  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert isinstance(service.backend.adapter, OllamaAdapter)
        async with httpx.AsyncClient(transport=StreamingASGITransport(app),
                                     base_url="http://proxy") as client:
            response = await client.post("/api/chat", json={"model": MODEL, "messages": USER,
                                                            "stream": False})
    assert response.json()["done"]


# --------------------------------------------------------------------------- the adapter

@pytest.mark.parametrize(("version", "measured"), [(NEW_VERSION, True), (OLD_VERSION, False),
                                                   ("0.30.1", False)])
async def test_measured_cache_follows_the_version(version: str, measured: bool) -> None:
    async with client_for(create_fake_ollama(fake_config(version=version))) as http:
        adapter = OllamaAdapter(http)
        info = await adapter.probe()
        assert info.props == {"version": version}
        assert adapter.capabilities.measured_cache is measured
        assert not adapter.capabilities.slots
        assert await adapter.list_slots() == []


@pytest.mark.parametrize(("version", "path", "carries", "measured"), [
    ("0.0.0", "/api/chat", True, True),  # a source build that reports the field
    (NEW_VERSION, "/api/chat", False, False),  # a new version whose model omits it
    (NEW_VERSION, "/v1/chat/completions", False, False),
    ("0.0.0", "/v1/chat/completions", True, True),
])
async def test_measured_cache_then_follows_the_fields(version: str, path: str, carries: bool,
                                                      measured: bool) -> None:
    usage: dict[str, Any] = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    if carries:
        usage["prompt_tokens_details"] = {"cached_tokens": 4}
    stub = stub_ollama(version, [DONE_NEW if carries else DONE_OLD], usage)
    async with client_for(stub) as http:
        adapter = OllamaAdapter(http)
        await adapter.probe()
        call = adapter.prepare(path, {"model": "m", "messages": USER}, slot=None)
        async with adapter.open_stream(call) as stream:
            frames = [frame async for frame in stream.aiter_frames()]
    assert frames
    assert adapter.capabilities.measured_cache is measured


def test_prepare_streams_and_maps_paths() -> None:
    adapter = OllamaAdapter(httpx.AsyncClient())
    v1 = adapter.prepare("/chat/completions", {"model": "m", "stream": False}, slot=None)
    native = adapter.prepare("/api/chat", {"model": "m", "stream": False, "keep_alive": "1m"},
                             slot=None)
    assert (v1.path, v1.body["stream"], v1.body["stream_options"]) == (
        "/v1/chat/completions", True, {"include_usage": True})
    assert native.body == {"model": "m", "stream": True, "keep_alive": "1m"}
    with pytest.raises(ValueError, match="chooses its own slots"):
        adapter.prepare("/api/chat", {}, slot=0)


async def test_a_native_200_that_is_not_ndjson_is_named() -> None:
    async def html(request: Request) -> Response:
        return Response("<html>proxy error</html>", media_type="text/html")

    app = Starlette(routes=[Route("/api/chat", html, methods=["POST"])])
    async with client_for(app) as http:
        adapter = OllamaAdapter(http)
        call = adapter.prepare("/api/chat", {"model": "m", "messages": USER}, slot=None)
        async with adapter.open_stream(call) as stream:
            with pytest.raises(UpstreamProtocolError, match="not an NDJSON stream"):
                [frame async for frame in stream.aiter_frames()]
