"""Tenants (``proxy.listen.tenants``) and isolation across an engine's shared prompt cache
(``proxy.listen.isolation``): with no tenants configured, one namespace for every key; with
several, each key authenticated (401 otherwise) and an engine whose prompt cache crosses
slots serving none of them unless the backend is dedicated to them, its cache stays per
slot, or ``--allow-shared-cache`` is given (403 ``shared_prompt_cache`` before planning)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send

from prefixpin.proxy.listen.app import create_app, create_apps
from prefixpin.proxy.listen.tenants import ANONYMOUS
from prefixpin.proxy.pipeline.router import Router
from prefixpin.proxy.settings import Settings
from tests.app.conftest import clients_of, lanes_ready, running_proxy
from tests.asgi_transport import StreamingASGITransport
from tests.fakes.fake_llama import FakeLlamaConfig, FakeLlamaServer
from tests.ollama.conftest import MODEL, proxy_rig

pytestmark = pytest.mark.anyio

ONE, TWO, THREE = ({"authorization": f"Bearer {t}"} for t in ("tenant-one", "tenant-two",
                                                                "tenant-three"))
NS_ONE, NS_TWO = "tenant-one", "tenant-two"  # each key is a tenant of its own name


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


async def test_one_user_needs_no_tenants_whatever_keys_the_agents_send() -> None:
    """No tenants configured: every key (and none) is the one namespace, served on an
    engine whose cache crosses slots; the keys reach the engine as they came."""
    async with running_proxy() as (client, engine):
        answers = [await ask(client, headers) for headers in (ONE, TWO, {}, THREE)]
        sessions = (await client.admin.get("/sessions")).json()["namespaces"]
        health = (await client.get("/healthz")).json()
    assert [a.status_code for a in answers] == [200] * 4
    assert list(sessions) == [ANONYMOUS]
    assert len(engine.requests) == 4
    assert "assumed shared" in health["upstreams"][0]["shared_cache"]
    assert health["upstreams"][0]["gated"] is False


async def test_configured_tenants_are_refused_on_a_shared_cache_none_is_dedicated(
        tenant_file: Callable[..., Path]) -> None:
    """Several tenants: an engine whose cache crosses slots (its flags unknown: assumed
    shared) serves none of them, whoever came first; nothing reaches the engine."""
    async with running_proxy(tenants_file=tenant_file("tenant-one", "tenant-two")) as (
            client, engine):
        first = await ask(client, ONE)
        second = await ask(client, TWO, "You are tenant one's assistant.")  # a right guess
        health = (await client.get("/healthz")).json()
    assert_refused(first)
    assert_refused(second)
    assert engine.requests == []
    assert health["upstreams"][0]["gated"] is True
    assert "cache_owner" not in health["upstreams"][0]


async def test_a_single_configured_tenant_uses_a_shared_cache(
        tenant_file: Callable[..., Path]) -> None:
    async with running_proxy(tenants_file=tenant_file("tenant-one")) as (client, _):
        answer = await ask(client, ONE)
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("headers", [{}, THREE, {"authorization": "Basic dGVuYW50LW9uZQ=="},
                                     {"x-api-key": "tenant-on"}])
async def test_an_unknown_or_missing_key_is_a_401_before_any_work(
        tenant_file: Callable[..., Path], headers: dict[str, str]) -> None:
    async with running_proxy(FakeLlamaServer(FakeLlamaConfig(cache_ram=0)),
                             tenants_file=tenant_file("tenant-one", "tenant-two")) as (
            client, engine):
        chat = await ask(client, headers)
        messages = await client.post("/v1/messages", headers=headers, json={
            "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        tokenize = await client.post("/tokenize", headers=headers, json={"content": "hi"})
        known = await client.post("/tokenize", headers=ONE, json={"content": "hi"})
    assert chat.status_code == messages.status_code == tokenize.status_code == 401
    assert chat.json()["error"]["code"] == "invalid_api_key"
    assert messages.json()["error"]["type"] == "authentication_error"  # Anthropic's shape
    assert known.status_code == 200
    assert engine.requests == []


async def test_the_x_api_key_header_names_the_same_tenant(
        tenant_file: Callable[..., Path]) -> None:
    async with running_proxy(FakeLlamaServer(FakeLlamaConfig(cache_ram=0)),
                             tenants_file=tenant_file("tenant-one", "tenant-two")) as (
            client, _):
        assert (await ask(client, ONE)).status_code == 200
        assert (await ask(client, {"x-api-key": "tenant-one"})).status_code == 200
        sessions = (await client.admin.get("/sessions")).json()["namespaces"]
    assert list(sessions) == ["tenant-one"]  # the tenant's name, never its key or a hash


class Recorder:
    """The fake engine's app, recording each request's credentials."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.seen: list[dict[str, str]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in ("/v1/chat/completions", "/tokenize"):
            headers = {k.decode(): v.decode() for k, v in scope["headers"]}
            self.seen.append({k: headers[k] for k in ("authorization", "x-api-key")
                              if k in headers})
        await self.app(scope, receive, send)


@pytest.mark.parametrize("engine_key", [None, "engine-secret"])
async def test_tenant_keys_never_reach_the_engine(
        tenant_file: Callable[..., Path], engine_key: str | None) -> None:
    """Configured tenants: a tenant's request reaches the engine with the engine's own key
    (or none), on the pipeline and on a pass-through path alike."""
    engine = FakeLlamaServer(FakeLlamaConfig(cache_ram=0))
    recorder = Recorder(engine.app())
    config = Settings(upstream="http://fake-llama", engine_api_key=engine_key,
                      tenants_file=tenant_file("tenant-one"))
    apps = create_apps(config, transport=StreamingASGITransport(recorder))
    async with apps.tenant.router.lifespan_context(apps.tenant), clients_of(apps) as client:
        await lanes_ready(apps.tenant)
        assert (await ask(client, {**ONE, "x-api-key": "tenant-one"})).status_code == 200
        assert (await client.post("/tokenize", headers=ONE,
                                  json={"content": "hi"})).status_code == 200
    expected = {"authorization": f"Bearer {engine_key}"} if engine_key else {}
    assert recorder.seen == [expected, expected]


async def test_a_fake_declaring_cache_ram_0_serves_every_tenant(
        tenant_file: Callable[..., Path]) -> None:
    async with running_proxy(FakeLlamaServer(FakeLlamaConfig(cache_ram=0)),
                             tenants_file=tenant_file("tenant-one", "tenant-two",
                                                      "tenant-three")) as (client, _):
        answers = [await ask(client, headers) for headers in (ONE, TWO, ONE, THREE)]
        health = (await client.get("/healthz")).json()
    assert [a.status_code for a in answers] == [200] * 4
    assert health["upstreams"][0]["shared_cache"] is None


async def test_a_fake_declaring_cache_ram_is_shared(tenant_file: Callable[..., Path]) -> None:
    async with running_proxy(FakeLlamaServer(FakeLlamaConfig(cache_ram=8192)),
                             tenants_file=tenant_file("tenant-one", "tenant-two")) as (
            client, _):
        assert_refused(await ask(client, ONE))
        health = (await client.get("/healthz")).json()
    assert "/props cache_ram 8192" in health["upstreams"][0]["shared_cache"]


async def test_allow_shared_cache_turns_the_gate_off(tenant_file: Callable[..., Path]) -> None:
    async with running_proxy(allow_shared_cache=True,
                             tenants_file=tenant_file("tenant-one", "tenant-two")) as (
            client, _):
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


async def test_a_dedicated_backend_serves_only_its_tenants(
        tenant_file: Callable[..., Path]) -> None:
    """engine-a (shared cache) is dedicated to tenant one, engine-b to tenant two; a third
    tenant has nowhere to go."""
    tenants = tenant_file("tenant-one", "tenant-two", "tenant-three")
    async with two_lanes([FakeLlamaConfig(), FakeLlamaConfig()], tenants_file=tenants,
                         upstream_namespaces={URLS[0]: [NS_ONE], URLS[1]: [NS_TWO]}) as (
            client, engines, app):
        ones = [await ask(client, ONE, f"session {i} of tenant one") for i in range(6)]
        twos = [await ask(client, TWO, f"session {i} of tenant two") for i in range(6)]
        third = await ask(client, THREE)
        view = router_of(app).sessions_view()["backends"]
    assert all(r.status_code == 200 for r in ones + twos)
    assert len(engines[0].requests) == 6
    assert len(engines[1].requests) == 6
    assert third.status_code == 403
    assert third.json()["error"]["code"] == "namespace_not_served"
    assert view[0]["namespaces"] == [NS_ONE]
    assert view[0]["gated"] is False


async def test_tenants_go_to_the_backend_without_a_shared_cache(
        tenant_file: Callable[..., Path]) -> None:
    """Nobody claims the shared-cache engine by arriving first: tenant one's many sessions
    and the others' all go to the engine whose cache stays per slot."""
    tenants = tenant_file("tenant-one", "tenant-two", "tenant-three")
    async with two_lanes([FakeLlamaConfig(), FakeLlamaConfig(cache_ram=0)],
                         tenants_file=tenants) as (client, engines, _):
        ones = [await ask(client, ONE, f"session {i} of tenant one") for i in range(8)]
        others = [await ask(client, h, f"session {i} of another tenant")
                  for i in range(4) for h in (TWO, THREE)]
    assert all(r.status_code == 200 for r in ones + others)
    assert engines[0].requests == []
    assert len(engines[1].requests) == 16


async def test_no_tenant_keeps_another_off_a_backend_dedicated_to_both(
        tenant_file: Callable[..., Path]) -> None:
    """Tenants the operator trusts together on one shared-cache engine: however much one
    sends, and first, the other is served there too."""
    tenants = tenant_file("tenant-one", "tenant-two")
    async with two_lanes([FakeLlamaConfig(), FakeLlamaConfig(cache_ram=0)],
                         tenants_file=tenants,
                         upstream_namespaces={URLS[0]: [NS_ONE, NS_TWO],
                                              URLS[1]: [NS_TWO]}) as (client, engines, _):
        ones = [await ask(client, ONE, f"session {i} of tenant one") for i in range(10)]
        two = await ask(client, TWO, "tenant two's only session")
    assert all(r.status_code == 200 for r in [*ones, two])
    on_a = [str(r.get("messages")) for r in engines[0].requests]
    assert sum("tenant one" in m for m in on_a) == 10  # engine-b is not tenant one's


async def test_every_backend_dedicated_elsewhere_is_a_403(
        tenant_file: Callable[..., Path]) -> None:
    async with two_lanes([FakeLlamaConfig(cache_ram=0), FakeLlamaConfig(cache_ram=0)],
                         tenants_file=tenant_file("tenant-one", "tenant-two"),
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


async def test_ollama_serves_several_tenants_only_where_dedicated(
        tenant_file: Callable[..., Path]) -> None:
    """Every Ollama shares cached prefixes across requests: with several tenants, none of
    them is served there unless the operator dedicates it; one user needs nothing."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False}
    async with proxy_rig(tenants_file=tenant_file("tenant-one", "tenant-two")) as rig:
        native = await rig.client.post("/api/chat", headers=ONE, json=body)
        openai = await rig.client.post("/v1/chat/completions", headers=TWO,
                                       json={"model": MODEL, "messages": body["messages"]})
        unload = await rig.client.post("/api/generate", headers=TWO,
                                       json={"model": MODEL, "keep_alive": 0})
        health = (await rig.client.get("/healthz")).json()
    assert native.status_code == openai.status_code == unload.status_code == 403
    assert "--cache-ram 0" in native.json()["error"]  # Ollama's own error shape
    assert openai.json()["error"]["code"] == "shared_prompt_cache"
    assert "Ollama" in health["upstreams"][0]["shared_cache"]
    async with proxy_rig() as rig:
        keyless = await rig.client.post("/api/chat", json=body)
        keyed = await rig.client.post("/v1/chat/completions", headers=ONE,
                                      json={"model": MODEL, "messages": body["messages"]})
    assert keyless.status_code == keyed.status_code == 200, (keyless.text, keyed.text)


async def test_the_tenant_ports_health_names_no_tenant(tenant_file: Callable[..., Path]) -> None:
    """Anyone may ask the tenant port's /healthz, without a key: the tenants a backend is
    dedicated to are on the operator listener's only."""
    async with two_lanes([FakeLlamaConfig(), FakeLlamaConfig(cache_ram=0)],
                         tenants_file=tenant_file("tenant-one", "tenant-two"),
                         upstream_namespaces={URLS[0]: [NS_ONE]}) as (client, _, app):
        tenants_port = (await client.get("/healthz")).json()
        view = router_of(app).sessions_view()["backends"]
    assert "tenant-one" not in str(tenants_port)
    assert view[0]["namespaces"] == [NS_ONE]
