"""One wiring for every topology: a single engine is a router with one lane, and lanes of
different engine kinds sit behind one router, each running the pipeline its kind allows.

The llama-server lanes are the fake llama-server (wire format only) and the Ollama lane is
the fake Ollama: Ollama cannot be installed on these machines, and the fake replays its
recorded wire formats (``tests.fakes.fake_ollama``, ``docs/ollama-wire.md``). Cache
behaviour against real engines is tested in tests/e2e.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixpin.adapters.llama_server import LlamaServerAdapter
from prefixpin.adapters.ollama import OllamaAdapter
from prefixpin.proxy.engine.engines import ENGINES, EngineKind, kind_of, register
from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.settings import Settings
from tests.app.conftest import ProxyClient, clients_of, lanes_ready
from tests.app.test_backends import Switch
from tests.asgi_transport import StreamingASGITransport
from tests.fakes.fake_llama import FakeLlamaConfig, FakeLlamaServer
from tests.fakes.fake_ollama import FakeOllamaConfig, create_fake_ollama, fake_ollama_state
from tests.ollama.conftest import MODELS, instant_sleep

pytestmark = pytest.mark.anyio

LLAMA, OLLAMA = "http://llama-a:8080", "http://ollama-b:11434"


@asynccontextmanager
async def mixed(ollama_link: Switch | None = None, **settings: Any
                ) -> AsyncIterator[tuple[ProxyClient, FakeLlamaServer, Any]]:
    llama = FakeLlamaServer(FakeLlamaConfig(n_slots=2))
    ollama = create_fake_ollama(FakeOllamaConfig(models=MODELS, sleep=instant_sleep))
    link = ollama_link or Switch(StreamingASGITransport(ollama))
    link.inner = StreamingASGITransport(ollama)
    transports = {LLAMA: StreamingASGITransport(llama.app()), OLLAMA: link}
    apps = create_apps(Settings(upstream=LLAMA, upstreams=[OLLAMA], health_interval_s=0.2,
                                **settings), transports=transports)
    app = apps.tenant
    async with app.router.lifespan_context(app):
        await lanes_ready(app)
        async with clients_of(apps, timeout=30) as client:
            yield client, llama, ollama


def test_every_adapter_has_one_registered_kind() -> None:
    assert {"llama-server", "ollama", "embedded"} <= set(ENGINES)
    assert kind_of(LlamaServerAdapter(httpx.AsyncClient())).name == "llama-server"
    assert kind_of(OllamaAdapter(httpx.AsyncClient())).name == "ollama"
    with pytest.raises(ValueError, match="registered twice"):
        register(EngineKind("ollama", ENGINES["ollama"].sessions_on,
                            ENGINES["ollama"].shared_cache))


async def test_a_single_engine_is_a_router_with_one_lane() -> None:
    engine = FakeLlamaServer(FakeLlamaConfig(n_slots=2))
    apps = create_apps(Settings(upstream=LLAMA), transport=StreamingASGITransport(engine.app()))
    app = apps.tenant
    async with app.router.lifespan_context(app):
        router = app.state.prefixpin.router
        assert [lane.label for lane in router.lanes] == ["llama-a:8080"]
        async with clients_of(apps) as client:
            messages = [{"role": "user", "content": "hello there"}]
            for _ in range(2):
                reply = await client.post("/v1/chat/completions", headers={"x-session-id": "s"},
                                          json={"messages": messages, "max_tokens": 4})
                assert reply.status_code == 200, reply.text
                messages = [*messages, reply.json()["choices"][0]["message"],
                            {"role": "user", "content": "and again"}]
            view = (await client.admin.get("/sessions")).json()
        assert view["affinity"] is True
        assert view["placement"] is None
        assert [b["upstream"] for b in view["backends"]] == ["llama-a:8080"]
        (session,) = view["namespaces"]["anon"]
        assert session["last_decision"] == "resumed"
        assert session["backend"] == "llama-a:8080"


async def test_ollama_and_llama_server_lanes_behind_one_router() -> None:
    """Ollama's native API goes only to the lane that serves it, through the pipeline
    (sessions, figures); OpenAI sessions are placed on either lane and stay there."""
    async with mixed() as (client, llama, ollama):
        llama_before = len(llama.requests)
        history = [{"role": "user", "content": "Why is the sky blue?"}]
        for _ in range(2):
            reply = await client.post("/api/chat", headers={"x-session-id": "native"},
                                      json={"model": "fake-smol", "messages": history,
                                            "stream": False})
            assert reply.status_code == 200, reply.text
            history = [*history, reply.json()["message"], {"role": "user", "content": "More."}]
        served = fake_ollama_state(ollama)
        assert len([r for r in served.requests if r.path == "/api/chat"]) == 2
        assert len(llama.requests) == llama_before

        where = {}
        for key in ("one", "two", "three", "four"):
            messages = [{"role": "system", "content": f"Session {key}."},
                        {"role": "user", "content": "Hello."}]
            lanes = set()
            for _ in range(3):
                response = await client.post(
                    "/v1/chat/completions", headers={"x-session-id": key},
                    json={"model": "fake-smol", "messages": messages, "max_tokens": 4})
                assert response.status_code == 200, response.text
                messages = [*messages, response.json()["choices"][0]["message"],
                            {"role": "user", "content": "Go on."}]
                view = (await client.admin.get("/sessions")).json()
                (session,) = [s for s in view["namespaces"]["anon"] if s["key"] == key]
                lanes.add(session["backend"])
            assert len(lanes) == 1, lanes  # every turn on the session's lane
            where[key] = lanes.pop()
        assert set(where.values()) == {"llama-a:8080", "ollama-b:11434"}, where
        view = (await client.admin.get("/sessions")).json()
        assert {b["upstream"]: b["engine"] for b in view["backends"]} == {
            "llama-a:8080": "llama-server", "ollama-b:11434": "ollama"}
        (native,) = [s for s in view["namespaces"]["anon"] if s["key"] == "native"]
        assert native["last_decision"] == "resumed"
        assert native["backend"] == "ollama-b:11434"


async def test_a_lifecycle_request_reaches_the_ollama_lane_as_it_came() -> None:
    async with mixed() as (client, llama, _):
        before = len(llama.requests)
        response = await client.post("/api/generate", json={"model": "fake-smol",
                                                            "keep_alive": 0})
        assert response.status_code == 200, response.text
        assert response.json()["done_reason"] == "unload"
        assert len(llama.requests) == before



async def test_an_ollama_engine_lost_chills_only_the_ollama_lanes_sessions() -> None:
    """Ollama's lost engine (every model's cache gone) marks its own lane's sessions cold,
    never another lane's."""
    link = Switch(httpx.MockTransport(lambda request: httpx.Response(500)))
    async with mixed(link) as (client, _, _):
        for key in ("one", "two", "three", "four"):
            messages = [{"role": "system", "content": f"Session {key}."},
                        {"role": "user", "content": "Hello."}]
            response = await client.post("/v1/chat/completions", headers={"x-session-id": key},
                                         json={"model": "fake-smol", "messages": messages,
                                               "max_tokens": 4})
            assert response.status_code == 200, response.text
        link.down = True
        health = (await client.get("/healthz")).json()  # the watch learns it now
        assert [u["status"] for u in health["upstreams"]] == ["ok", "unreachable"]
        view = (await client.admin.get("/sessions")).json()
        keys = {s["key"]: (s["backend"], s["last_decision"]) for s in view["namespaces"]["anon"]}
        assert {backend for backend, _ in keys.values()} == {"llama-a:8080",
                                                             "ollama-b:11434"}, keys
        for backend, decision in keys.values():
            assert (decision == "cold") == (backend == "ollama-b:11434"), keys

@pytest.mark.embedded
async def test_an_embedded_lane_behind_the_router_beside_a_llama_server_lane(
        tmp_path: Path) -> None:
    """``--upstream embedded`` makes the in-process engine one lane among others: sessions
    placed on it keep their slot and their cache (the engine's own cached-token count),
    its parking is on, and the llama-server lane serves the rest."""
    from tests.rig.models import ensure_model

    llama = FakeLlamaServer(FakeLlamaConfig(n_slots=1))
    config = Settings(upstream=LLAMA, upstreams=["embedded"], model=ensure_model("smollm2"),
                      slots=1, ctx_size=2048, threads=2, park_dir=tmp_path,
                      park_min_tokens=64, overload_occupancy=1.0)
    apps = create_apps(config, transports={LLAMA: StreamingASGITransport(llama.app())})
    app = apps.tenant
    async with app.router.lifespan_context(app):
        await lanes_ready(app, timeout_s=60)
        router = app.state.prefixpin.router
        assert [lane.label for lane in router.lanes] == ["llama-a:8080", "embedded"]
        assert router.lanes[1].parking is not None
        async with clients_of(apps, timeout=300) as client:
            placed: dict[str, str] = {}
            for key in ("first", "second"):
                messages = [{"role": "system", "content": f"You answer for {key}. " * 12},
                            {"role": "user", "content": "Name a colour."}]
                cached = []
                for _ in range(2):
                    response = await client.post(
                        "/v1/chat/completions", headers={"x-session-id": key},
                        json={"messages": messages, "max_tokens": 4, "temperature": 0})
                    assert response.status_code == 200, response.text
                    body = response.json()
                    cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
                    messages = [*messages, body["choices"][0]["message"],
                                {"role": "user", "content": "Another."}]
                view = (await client.admin.get("/sessions")).json()
                (session,) = [s for s in view["namespaces"]["anon"] if s["key"] == key]
                placed[key] = session["backend"]
                assert session["last_decision"] == "resumed", session
                if placed[key] == "embedded":
                    assert cached[1] >= body["usage"]["prompt_tokens"] // 2, cached
        assert sorted(placed.values()) == ["embedded", "llama-a:8080"], placed
