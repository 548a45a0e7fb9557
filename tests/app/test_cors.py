"""Browsers on the two listeners (issue 46), against the fake engines: the tests are about
the proxy's own headers. The tenant port answers a page on another origin as the engine
behind it would (llama-server's --cors-origins, Ollama's OLLAMA_ORIGINS), before any key is
looked at; the operator listener serves no other origin. The same with the real
llama-server and a real browser: tests/e2e/test_cors_llama.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import Message, Receive, Scope, Send

from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.settings import Settings
from tests.app.conftest import ProxyClient, clients_of
from tests.asgi_transport import StreamingASGITransport
from tests.fakes.fake_llama import FakeLlamaServer
from tests.ollama.conftest import proxy_rig

pytestmark = pytest.mark.anyio

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
LOCAL = ["http://localhost", "http://localhost:8080", "http://127.0.0.1",
         "http://127.0.0.1:3000", "http://[::1]", "http://[::1]:3000", "https://localhost:5173"]
FOREIGN = ["http://web.mydomain.fr", "http://evil.com", "http://notlocalhost",
           "http://localhost.evil.com", "localhost", "null", "http://127.0.0.2:3000"]
LLAMA_PREFLIGHT = {"access-control-allow-credentials": "true",
                   "access-control-allow-methods": "GET, POST, DELETE, OPTIONS",
                   "access-control-allow-headers": "*"}


def preflight_of(origin: str) -> dict[str, str]:
    return {"origin": origin, "access-control-request-method": "POST",
            "access-control-request-headers": "authorization,content-type"}


def cors_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items()
            if k.startswith("access-control-") or k == "vary"}


class EngineWithCors:
    """The fake llama-server as llama-server answers browsers by default (every origin
    reflected, with credentials), counting every request that reaches it."""

    def __init__(self) -> None:
        self.fake = FakeLlamaServer()
        self.app = self.fake.app()
        self.paths: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.paths.append(f"{scope['method']} {scope['path']}")

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [
                    *message.get("headers", ()),
                    (b"access-control-allow-origin", b"http://evil.com"),
                    (b"access-control-allow-credentials", b"true")]}
            await send(message)

        await self.app(scope, receive, sending)


@asynccontextmanager
async def proxy_of(**settings: Any) -> AsyncIterator[tuple[ProxyClient, EngineWithCors]]:
    engine = EngineWithCors()
    apps = create_apps(Settings(upstream="http://fake-llama", **settings),
                       transport=StreamingASGITransport(engine))
    app = apps.tenant
    async with app.router.lifespan_context(app), clients_of(apps) as client:
        yield client, engine


# ---------------------------------------------------------------- the tenant port, llama-server

@pytest.mark.parametrize("origin", LOCAL)
async def test_a_localhost_preflight_is_answered_as_llama_server_answers_it(
        origin: str) -> None:
    async with proxy_of() as (client, engine):
        response = await client.options("/v1/chat/completions", headers=preflight_of(origin))
    assert response.status_code == 200
    assert response.content == b""
    assert cors_headers(response) == {**LLAMA_PREFLIGHT, "access-control-allow-origin": origin,
                                      "vary": "Origin"}
    assert not any(p.startswith("OPTIONS") for p in engine.paths)


@pytest.mark.parametrize("origin", FOREIGN)
async def test_another_origins_preflight_gets_a_200_without_the_allow_header(
        origin: str) -> None:
    async with proxy_of() as (client, engine):
        response = await client.options("/v1/chat/completions", headers=preflight_of(origin))
    assert response.status_code == 200
    assert response.content == b""
    assert cors_headers(response) == LLAMA_PREFLIGHT
    assert not any(p.startswith("OPTIONS") for p in engine.paths)


@pytest.mark.parametrize("origin", FOREIGN)
async def test_another_origins_request_is_refused_unread_and_never_served(
        origin: str) -> None:
    async with proxy_of() as (client, engine):
        served_before = list(engine.paths)
        response = await client.post("/v1/chat/completions", json=CHAT,
                                     headers={"origin": origin})
        models = await client.get("/v1/models", headers={"origin": origin})
    for refused in (response, models):
        assert refused.status_code == 403
        assert cors_headers(refused) == {}  # nothing the page may read
        assert refused.json()["error"]["code"] == "origin_not_allowed"
    assert engine.paths == served_before
    assert engine.fake.requests == []


async def test_an_allowed_origin_reads_the_stream_and_the_engines_own_header_is_dropped(
        ) -> None:
    async with proxy_of() as (client, engine):
        streamed = await client.post("/v1/chat/completions", json={**CHAT, "stream": True},
                                     headers={"origin": "http://localhost:3000"})
        models = await client.get("/v1/models", headers={"origin": "http://localhost:3000"})
        plain = await client.get("/v1/models")
    assert streamed.status_code == 200
    assert "data: " in streamed.text
    for allowed in (streamed, models):
        assert cors_headers(allowed) == {"access-control-allow-origin": "http://localhost:3000",
                                         "vary": "Origin"}
    assert "/v1/models" in " ".join(engine.paths)  # passed through, its CORS answer dropped
    assert cors_headers(plain) == {}


async def test_a_request_from_its_own_host_is_no_cross_origin_request() -> None:
    async with proxy_of() as (client, _):
        response = await client.get("/v1/models", headers={"origin": "http://proxy"})
    assert response.status_code == 200
    assert cors_headers(response) == {}


async def test_every_origin_with_a_star_and_exactly_the_listed_ones_with_a_list() -> None:
    async with proxy_of(cors_origins="*") as (client, _):
        star = await client.options("/v1/chat/completions",
                                    headers=preflight_of("http://web.mydomain.fr"))
        bare = await client.options("/completions", headers=preflight_of("localhost"))
    assert star.headers["access-control-allow-origin"] == "http://web.mydomain.fr"
    assert bare.headers["access-control-allow-origin"] == "localhost"
    listed = "https://chat.example, http://localhost:3000"
    async with proxy_of(cors_origins=listed) as (client, _):
        ok = await client.post("/v1/chat/completions", json=CHAT,
                               headers={"origin": "https://chat.example"})
        other = await client.post("/v1/chat/completions", json=CHAT,
                                  headers={"origin": "http://localhost:8080"})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "https://chat.example"
    assert other.status_code == 403


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/slots/0", "/sessions",
                                  "/no-such-path", "/v1//chat/completions"])
async def test_with_tenants_a_preflight_says_nothing_about_keys_or_tenants(
        path: str, tenant_file: Any) -> None:
    """The same answer whatever key it carries (a tenant's, an unknown one, none) and
    whatever the path: answered before the key is looked at."""
    tenants: Path = tenant_file("sk-alice", "sk-bob")
    answers = set()
    async with proxy_of(tenants_file=tenants) as (client, engine):
        for origin in ("http://localhost:3000", "http://evil.com"):
            for key in ("sk-alice", "sk-bob", "sk-nobody", None):
                headers = preflight_of(origin)
                if key is not None:
                    headers["authorization"] = f"Bearer {key}"
                response = await client.options(path, headers=headers)
                answers.add((origin, response.status_code, response.content,
                             tuple(sorted(cors_headers(response).items()))))
    assert len(answers) == 2  # one per origin
    assert {status for _, status, _, _ in answers} == {200}
    assert not any(p.startswith("OPTIONS") for p in engine.paths)


async def test_an_allowed_origin_reads_its_401_as_from_llama_server(tenant_file: Any) -> None:
    async with proxy_of(tenants_file=tenant_file("sk-alice")) as (client, _):
        missing = await client.post("/v1/chat/completions", json=CHAT,
                                    headers={"origin": "http://localhost:3000"})
        given = await client.post("/v1/chat/completions", json=CHAT, headers={
            "origin": "http://localhost:3000", "authorization": "Bearer sk-alice"})
    assert missing.status_code == 401
    assert missing.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert given.status_code == 200


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/slots/0?action=erase"), ("GET", "/slots"), ("GET", "/sessions"),
    ("GET", "/metrics"), ("POST", "/props")])
async def test_an_allowed_origin_reaches_no_operator_path_through_the_tenant_port(
        method: str, path: str) -> None:
    async with proxy_of(cors_origins="*") as (client, engine):
        served_before = list(engine.paths)
        preflight = await client.options(path, headers=preflight_of("http://localhost:3000"))
        response = await client.request(method, path, json={},
                                        headers={"origin": "http://localhost:3000"})
    assert preflight.status_code == 200  # a preflight opens nothing by itself
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "operator_only"
    assert engine.paths == served_before


# ---------------------------------------------------------------- the operator listener

@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://evil.com",
                                    "http://proxy"])
async def test_the_operator_listener_serves_no_other_origin(origin: str) -> None:
    """Not even one the tenant port allows, nor the tenant port's own: its pages are its
    own (``http://proxy-admin`` here), and an engine path there could erase a slot."""
    async with proxy_of(cors_origins="*") as (client, engine):
        admin = client.admin
        served_before = list(engine.paths)
        preflight = await admin.options("/slots/0", headers=preflight_of(origin))
        erase = await admin.post("/slots/0?action=erase", json={},
                                 headers={"origin": origin})
        sessions = await admin.get("/sessions", headers={"origin": origin})
    for refused in (preflight, erase, sessions):
        assert refused.status_code == 403
        assert cors_headers(refused) == {}
    assert engine.paths == served_before


async def test_the_operator_listener_refuses_what_the_browser_marks_as_another_sites(
        ) -> None:
    async with proxy_of(admin_token="s3cret") as (client, _):
        admin = client.admin
        token = {"authorization": "Bearer s3cret"}
        cross = await admin.get("/sessions", headers={**token, "sec-fetch-site": "cross-site"})
        same_site = await admin.get("/sessions", headers={**token, "sec-fetch-site": "same-site"})
        own = await admin.get("/sessions", headers={**token, "sec-fetch-site": "same-origin",
                                                    "origin": "http://proxy-admin"})
        typed = await admin.get("/sessions", headers={**token, "sec-fetch-site": "none"})
        unsigned = await admin.options("/sessions", headers=preflight_of("http://evil.com"))
    assert cross.status_code == same_site.status_code == 403
    assert own.status_code == typed.status_code == 200
    assert unsigned.status_code == 403  # refused before the token is looked at
    assert "WWW-Authenticate" not in unsigned.headers


async def test_the_engines_cors_answer_never_reaches_the_operator_client() -> None:
    async with proxy_of() as (client, _):
        slots = await client.admin.get("/slots")
    assert slots.status_code == 200
    assert cors_headers(slots) == {}


# ---------------------------------------------------------------- in front of Ollama

OLLAMA_HEADERS = ("Authorization,Content-Type,User-Agent,Accept,X-Requested-With,Openai-Beta,"
                  "X-Stainless-Arch,X-Stainless-Async,X-Stainless-Custom-Poll-Interval,"
                  "X-Stainless-Helper-Method,X-Stainless-Lang,X-Stainless-Os,"
                  "X-Stainless-Package-Version,X-Stainless-Poll-Helper,X-Stainless-Retry-Count,"
                  "X-Stainless-Runtime,X-Stainless-Runtime-Version,X-Stainless-Timeout")


@pytest.mark.parametrize("origin", ["http://localhost:3000", "https://127.0.0.1",
                                    "http://0.0.0.0:8080", "app://desktop", "file://x",
                                    "vscode-webview://abc"])
async def test_ollamas_own_origins_are_answered_as_gin_cors_answers_them(origin: str) -> None:
    async with proxy_rig() as rig:
        preflight = await rig.client.options("/api/chat", headers=preflight_of(origin))
        tags = await rig.client.get("/api/tags", headers={"origin": origin})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == origin
    assert preflight.headers["access-control-allow-methods"] == (
        "GET,POST,PUT,PATCH,DELETE,HEAD,OPTIONS")
    assert preflight.headers["access-control-allow-headers"] == OLLAMA_HEADERS
    assert preflight.headers["access-control-max-age"] == "43200"
    assert "access-control-allow-credentials" not in preflight.headers
    assert preflight.headers.get_list("vary") == [
        "Origin", "Access-Control-Request-Method", "Access-Control-Request-Headers"]
    assert tags.status_code == 200
    assert cors_headers(tags) == {"access-control-allow-origin": origin, "vary": "Origin"}


async def test_ollama_refuses_other_origins_with_a_403() -> None:
    async with proxy_rig() as rig:
        preflight = await rig.client.options("/api/chat",
                                             headers=preflight_of("http://evil.com"))
        chat = await rig.client.post("/api/chat", headers={"origin": "http://evil.com"},
                                     json={"model": "x", "messages": []})
    for refused in (preflight, chat):
        assert refused.status_code == 403
        assert refused.content == b""
        assert cors_headers(refused) == {}


async def test_ollama_origins_add_to_its_own_and_a_star_allows_every_one() -> None:
    async with proxy_rig(cors_origins="https://*.example.com, chrome-extension://*") as rig:
        sub = await rig.client.options("/api/chat",
                                       headers=preflight_of("https://chat.example.com"))
        extension = await rig.client.options("/api/chat",
                                             headers=preflight_of("chrome-extension://abc"))
        own = await rig.client.options("/api/chat", headers=preflight_of("http://localhost"))
        other = await rig.client.options("/api/chat", headers=preflight_of("https://e.org"))
    assert sub.status_code == extension.status_code == own.status_code == 204
    assert other.status_code == 403
    async with proxy_rig(cors_origins="*") as rig:
        every = await rig.client.options("/api/chat", headers=preflight_of("https://e.org"))
        tags = await rig.client.get("/api/tags", headers={"origin": "https://e.org"})
    assert every.status_code == 204
    assert every.headers["access-control-allow-origin"] == "*"
    assert "vary" not in every.headers
    assert tags.headers["access-control-allow-origin"] == "*"
