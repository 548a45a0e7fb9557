"""Tenant isolation across an engine's shared prompt cache (issue 16, ``proxy.isolation``):
an engine whose prompt cache crosses slots serves the first namespace seen there, a second
one is refused before planning (403 ``shared_prompt_cache``) unless the backend is
dedicated to it, its cache stays per slot, or ``--allow-shared-cache`` is given."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from core.asgi_transport import StreamingASGITransport
from proxy.app import create_app
from proxy.identity import namespace_of
from proxy.router import Router
from proxy.settings import Settings
from proxy.testing.fake_llama import FakeLlamaConfig, FakeLlamaServer
from tests.app.conftest import lanes_ready, running_proxy
from tests.app.test_replicas import replicas
from tests.ollama.conftest import MODEL, proxy_rig
from tests.rig.redis_process import RedisProcess, run_redis_server

pytestmark = pytest.mark.anyio

ONE, TWO, THREE = ({"authorization": f"Bearer {t}"} for t in ("tenant-one", "tenant-two",
                                                                "tenant-three"))
NS_ONE, NS_TWO = namespace_of(ONE), namespace_of(TWO)


def chat_body(system: str, user: str = "hello") -> dict[str, Any]:
    return {"model": "m", "max_tokens": 4,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": user}]}


async def ask(client: httpx.AsyncClient, headers: dict[str, str],
              system: str = "You are tenant one's assistant.") -> httpx.Response:
    return await client.post("/v1/chat/completions", headers=headers, json=chat_body(system))


def router_of(app: Starlette) -> Router:
    router: Router = app.state.prefixpin.router
    return router


def assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["code"] == "shared_prompt_cache"
    for fix in ("--cache-ram 0", "namespace= in the --upstreams-file", "--allow-shared-cache"):
        assert fix in error["message"]


async def test_a_second_namespace_is_refused_on_a_fake_whose_flags_are_unknown() -> None:
    """The fake's flags are not readable: its cache is assumed shared (the safe default)."""
    async with running_proxy() as (client, engine):
        first = await ask(client, ONE)
        refused = await ask(client, TWO, "You are tenant one's assistant.")  # a right guess
        again = await ask(client, ONE)
        anonymous = await client.post("/v1/chat/completions", json=chat_body("guess"))
        health = (await client.get("/healthz")).json()
    assert first.status_code == again.status_code == 200
    assert_refused(refused)
    assert_refused(anonymous)
    assert len(engine.requests) == 2  # the refused requests never reached the engine
    assert "assumed shared" in health["upstreams"][0]["shared_cache"]


async def test_views_show_the_shared_cache_and_its_owner() -> None:
    engine = FakeLlamaServer(FakeLlamaConfig())
    config = Settings(upstream="http://fake-llama")
    app = create_app(config, transport=StreamingASGITransport(engine.app()))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=StreamingASGITransport(app),
                                     base_url="http://proxy") as client:
            assert (await ask(client, ONE)).status_code == 200
        backend = router_of(app).sessions_view()["backends"][0]
    assert "assumed shared" in backend["shared_cache"]
    assert backend["cache_owner"] == NS_ONE
    assert backend["namespaces"] is None


async def test_a_fake_declaring_cache_ram_0_serves_every_namespace() -> None:
    async with running_proxy(FakeLlamaServer(FakeLlamaConfig(cache_ram=0))) as (client, _):
        answers = [await ask(client, headers) for headers in (ONE, TWO, ONE, THREE)]
        health = (await client.get("/healthz")).json()
    assert [a.status_code for a in answers] == [200] * 4
    assert health["upstreams"][0]["shared_cache"] is None


async def test_a_fake_declaring_cache_ram_is_shared() -> None:
    async with running_proxy(FakeLlamaServer(FakeLlamaConfig(cache_ram=8192))) as (client, _):
        assert (await ask(client, ONE)).status_code == 200
        assert_refused(await ask(client, TWO))
        health = (await client.get("/healthz")).json()
    assert "/props cache_ram 8192" in health["upstreams"][0]["shared_cache"]


async def test_allow_shared_cache_turns_the_gate_off() -> None:
    async with running_proxy(allow_shared_cache=True) as (client, _):
        answers = [await ask(client, headers) for headers in (ONE, TWO)]
    assert [a.status_code for a in answers] == [200, 200]


URLS = ["http://engine-a:8080", "http://engine-b:8080"]


@asynccontextmanager
async def two_lanes(configs: list[FakeLlamaConfig], **settings: Any
                    ) -> AsyncIterator[tuple[httpx.AsyncClient, list[FakeLlamaServer], Starlette]]:
    engines = [FakeLlamaServer(c) for c in configs]
    config = Settings(upstream=URLS[0], upstreams=URLS[1:], **settings)
    app = create_app(config, transports={url: StreamingASGITransport(e.app())
                                         for url, e in zip(URLS, engines, strict=True)})
    async with app.router.lifespan_context(app):
        await lanes_ready(app)
        async with httpx.AsyncClient(transport=StreamingASGITransport(app),
                                     base_url="http://proxy") as client:
            yield client, engines, app


async def test_a_dedicated_backend_serves_only_its_namespaces() -> None:
    """engine-b is dedicated to tenant two; engine-a (shared cache) goes to the first
    namespace seen; a third namespace has nowhere to go."""
    async with two_lanes([FakeLlamaConfig(), FakeLlamaConfig()],
                         upstream_namespaces={URLS[1]: [NS_TWO]}) as (client, engines, app):
        ones = [await ask(client, ONE, f"session {i} of tenant one") for i in range(6)]
        twos = [await ask(client, TWO, f"session {i} of tenant two") for i in range(6)]
        third = await ask(client, THREE)
        view = router_of(app).sessions_view()["backends"]
    assert all(r.status_code == 200 for r in ones + twos)
    assert len(engines[0].requests) == 6
    assert len(engines[1].requests) == 6
    assert_refused(third)
    assert view[0]["cache_owner"] == NS_ONE
    assert view[1]["namespaces"] == [NS_TWO]
    assert view[1]["cache_owner"] is None


async def test_a_second_namespace_goes_to_the_backend_without_a_shared_cache() -> None:
    async with two_lanes([FakeLlamaConfig(), FakeLlamaConfig(cache_ram=0)]) as (
            client, engines, _):
        # tenant one may land on either; once it owns engine-a, others only get engine-b
        ones = [await ask(client, ONE, f"session {i} of tenant one") for i in range(8)]
        others = [await ask(client, h, f"session {i} of another tenant")
                  for i in range(4) for h in (TWO, THREE)]
    assert all(r.status_code == 200 for r in ones + others)
    on_a = [str(r.get("messages")) for r in engines[0].requests]
    assert any("tenant one" in m for m in on_a)  # rendezvous spreads 8 sessions over both
    assert not any("another tenant" in m for m in on_a)  # engine-a is tenant one's alone


async def test_every_backend_dedicated_elsewhere_is_a_403() -> None:
    async with two_lanes([FakeLlamaConfig(cache_ram=0), FakeLlamaConfig(cache_ram=0)],
                         upstream_namespaces={URLS[0]: [NS_TWO], URLS[1]: [NS_TWO]}) as (
            client, _, _):
        refused = await ask(client, ONE)
        served = await ask(client, TWO)
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "namespace_not_served"
    assert served.status_code == 200


async def test_namespaces_for_a_backend_that_is_not_an_upstream_fail_at_start() -> None:
    config = Settings(upstream=URLS[0], upstream_namespaces={"http://other:1": [NS_ONE]})
    engine = FakeLlamaServer()
    app = create_app(config, transports={URLS[0]: StreamingASGITransport(engine.app())})
    with pytest.raises(ValueError, match="not upstreams"):
        async with app.router.lifespan_context(app):
            pass


async def test_ollama_refuses_a_second_namespace() -> None:
    """Every Ollama shares cached prefixes across requests: one namespace per Ollama."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False}
    async with proxy_rig() as rig:
        first = await rig.client.post("/api/chat", headers=ONE, json=body)
        second = await rig.client.post("/api/chat", headers=TWO, json=body)
        openai = await rig.client.post("/v1/chat/completions", headers=TWO,
                                       json={"model": MODEL, "messages": body["messages"]})
        health = (await rig.client.get("/healthz")).json()
    assert first.status_code == 200, first.text
    assert second.status_code == openai.status_code == 403
    assert "--cache-ram 0" in second.json()["error"]  # Ollama's own error shape
    assert openai.json()["error"]["code"] == "shared_prompt_cache"
    assert "Ollama" in health["upstreams"][0]["shared_cache"]


async def test_another_namespace_cannot_unload_the_owners_model() -> None:
    """A model load or unload empties every session's cache on that Ollama: it is the
    owning namespace's to ask for, like any request there."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False}
    async with proxy_rig() as rig:
        first = await rig.client.post("/api/chat", headers=ONE, json=body)
        unload = await rig.client.post("/api/generate", headers=TWO,
                                       json={"model": MODEL, "keep_alive": 0})
        own = await rig.client.post("/api/generate", headers=ONE,
                                    json={"model": MODEL, "keep_alive": 0})
    assert first.status_code == 200, first.text
    assert unload.status_code == 403, unload.text
    assert "--cache-ram 0" in unload.json()["error"]
    assert own.status_code == 200, own.text


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisProcess]:
    with run_redis_server() as handle:
        yield handle


@pytest.mark.usefixtures("redis_server_binary")
async def test_replicas_agree_on_the_owner_through_redis(redis_server: RedisProcess) -> None:
    """Tenant one takes the shared-cache lane on replica 0; replica 1 refuses tenant two
    there (one SET NX key), and serves tenant one."""
    engine = FakeLlamaServer(FakeLlamaConfig())
    async with replicas(redis_server.url, [engine]) as (clients, _):
        first = await ask(clients[0], ONE)
        other = await ask(clients[1], TWO)
        same = await ask(clients[1], ONE)
    assert first.status_code == same.status_code == 200
    assert_refused(other)
