"""The canonical path in front of the real app and the fake llama-server: aliases of the
chat route are served by the chat route (the engine sees the canonical path and the
proxy's ``id_slot``) or refused with a 400, never a 500 and never a pass-through; a
pass-through path reaches the engine only as its canonical path.

Paths are sent as raw bytes (an ASGI scope built here, as uvicorn builds it; and raw
request lines over TCP to uvicorn), because httpx would normalise them first.
"""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.parse
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from prefixpin.proxy.listen.app import create_app
from prefixpin.proxy.listen.http_limits import http_options
from prefixpin.proxy.listen.passthrough import forward
from prefixpin.proxy.listen.paths import PathRejected, canonical_paths, is_canonical
from prefixpin.proxy.settings import Settings
from tests.asgi_transport import StreamingASGITransport
from tests.fakes.fake_llama import FakeLlamaConfig, FakeLlamaServer
from tests.fakes.servers import serve_in_thread
from tests.unit.test_paths import REJECT, aliases

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                   "stream": False}).encode()
HEADERS = [(b"host", b"proxy"), (b"content-type", b"application/json"),
           (b"authorization", b"Bearer tenant-a")]


@dataclass
class Engine:
    fake: FakeLlamaServer
    seen: list[tuple[str, bytes]] = field(default_factory=list)  # (path, raw_path) per request

    def app(self) -> ASGIApp:
        inner = self.fake.app()

        async def recording(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http":
                self.seen.append((scope["path"], scope["raw_path"]))
            await inner(scope, receive, send)

        return recording


@asynccontextmanager
async def guarded_proxy() -> AsyncIterator[tuple[ASGIApp, Engine]]:
    """The tenant app wrapped in ``canonical_paths`` (as the listener will serve it) in
    front of the fake engine, which records every path it is sent."""
    engine = Engine(FakeLlamaServer(FakeLlamaConfig()))
    app = create_app(Settings(upstream="http://fake-llama"),
                     transport=StreamingASGITransport(engine.app()))
    async with app.router.lifespan_context(app):
        yield canonical_paths(app), engine


async def send_raw(app: ASGIApp, method: str, raw_path: bytes,
                   body: bytes = b"") -> tuple[int, bytes]:
    """One request with ``raw_path`` as it came on the wire; ``path`` as uvicorn decodes it."""
    done = asyncio.Event()
    sent: list[dict[str, Any]] = []
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            done.set()

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1", "method": method, "scheme": "http",
        "path": urllib.parse.unquote(raw_path.decode("latin-1")), "raw_path": raw_path,
        "query_string": b"", "headers": HEADERS, "server": ("proxy", 80),
        "client": ("127.0.0.1", 40000), "root_path": "",
    }
    await asyncio.wait_for(app(scope, receive, send), 30)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def assert_refused(status: int, body: bytes) -> None:
    assert status == 400, body
    assert json.loads(body)["error"]["code"] == "invalid_path"


async def test_aliases_of_the_chat_route_are_the_chat_route_or_400() -> None:
    async with guarded_proxy() as (app, engine):
        served = refused = 0
        for how, raw, expected in aliases(CHAT):
            engine.seen.clear()
            before = len(engine.fake.requests)
            status, body = await send_raw(app, "POST", raw, BODY)
            assert status != 500, (how, raw, body)
            if expected is REJECT:
                assert_refused(status, body)
                assert not engine.seen, (how, raw)  # nothing was forwarded
                refused += 1
                continue
            assert status == 200, (how, raw, body)
            assert json.loads(body)["object"] == "chat.completion"
            # Served by the pipeline: the engine got the chat path, canonical, and the
            # proxy's slot pin.
            assert (CHAT, CHAT.encode()) in engine.seen, (how, raw, engine.seen)
            assert all(is_canonical(path) and raw_seen == path.encode()
                       for path, raw_seen in engine.seen), engine.seen
            assert len(engine.fake.requests) == before + 1
            assert "id_slot" in engine.fake.requests[-1], (how, raw)
            served += 1
        assert served > 40
        assert refused > 300


@pytest.mark.parametrize("raw", [b"//v1/chat/completions", b"/./v1/chat/completions",
                                 b"///v1//chat/./completions"])
async def test_the_reported_aliases_are_served_by_the_chat_route(raw: bytes) -> None:
    async with guarded_proxy() as (app, engine):
        status, body = await send_raw(app, "POST", raw, BODY)
        assert status == 200, body
        assert engine.fake.requests[-1]["id_slot"] >= 0


@pytest.mark.parametrize(("raw", "refused"), [
    (b"/api/chat", False),
    (b"/./api/chat", False),
    (b"//api/chat", False),
    (b"/api/x/../chat", False),
    (b"/%61pi/chat", False),
    (b"/api/chat/", True),
    (b"/api%2Fchat", True),
    (b"/api/chat;x", True),
    (b"/api\\chat", True),
])
async def test_an_api_no_engine_serves_is_never_forwarded(raw: bytes, refused: bool) -> None:
    """llama-server does not speak Ollama's API through the pipeline: /api/chat (and every
    alias of it) is a 404 naming the API, an alias that is no path a 400; nothing reaches
    the engine, which might answer it unpinned."""
    async with guarded_proxy() as (app, engine):
        engine.seen.clear()
        status, body = await send_raw(app, "POST", raw, BODY)
        assert status != 500, body
        assert not [seen for seen in engine.seen if seen[0].startswith("/api")]
        if refused:
            assert_refused(status, body)
        else:
            assert status == 404, body
            assert b"serves the ollama API" in body  # in the API's own error shape


@pytest.mark.parametrize("raw", [b"/props", b"/./props", b"//props", b"/x/../props",
                                 b"/%70rops", b"/props/", b"/props%2F", b"/pro%00ps"])
async def test_an_engine_path_alias_never_reaches_the_engine_as_an_alias(raw: bytes) -> None:
    async with guarded_proxy() as (app, engine):
        engine.seen.clear()
        status, _ = await send_raw(app, "GET", raw)
        assert status != 500
        assert all(path == "/props" or path in ("/health", "/slots", "/metrics")
                   for path, _ in engine.seen)  # the watch's probes may run meanwhile
        assert all(raw_seen == path.encode() for path, raw_seen in engine.seen)


@pytest.mark.parametrize("path", ["/./v1/chat/completions", "//v1/chat/completions",
                                  "/v1/x/../chat/completions", "/a\\b", "/v1/chat/completions/"])
async def test_forward_refuses_a_path_that_is_not_canonical(path: str) -> None:
    """Without the middleware (an app not wrapped yet), the pass-through still never lets
    httpx normalise an alias into another route, nor fails with a 500."""
    sent: list[httpx.Request] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200)

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
             "query_string": b"", "headers": [], "root_path": ""}
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler),
                                 base_url="http://engine") as http:
        with pytest.raises(PathRejected):
            await forward(Request(scope), http, b"{}")
        response = await forward(Request(scope), http, b"{}", path="/props")
        await response.background()  # type: ignore[misc]
    assert [r.url.raw_path.partition(b"?")[0] for r in sent] == [b"/props"]


# ------------------------------------------------------- raw request lines, real uvicorn

def raw_request(base: str, target: bytes) -> int:
    host, port = base.removeprefix("http://").split(":")
    request = (b"POST " + target + b" HTTP/1.1\r\nhost: proxy\r\n"
               b"authorization: Bearer tenant-a\r\ncontent-type: application/json\r\n"
               b"content-length: " + str(len(BODY)).encode() + b"\r\nconnection: close\r\n\r\n"
               + BODY)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1])


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
def test_raw_request_lines_over_tcp(anyio_backend: str) -> None:
    engine = Engine(FakeLlamaServer(FakeLlamaConfig()))
    app = create_app(Settings(upstream="http://fake-llama"),
                     transport=StreamingASGITransport(engine.app()))
    cases = {b"/v1/chat/completions": 200, b"/./v1/chat/completions": 200,
             b"//v1/chat/completions": 200, b"/v1/x/../chat/completions": 200,
             b"/v1/%63hat/completions": 200, b"/v1%2Fchat/completions": 400,
             b"/v1/chat/completions;x": 400, b"/%2e%2e/v1/chat/completions": 400,
             b"/../v1/chat/completions": 400, b"/v1/chat/completions/": 400,
             b"/v1/chat/completions%00": 400, b"/v1/chat/completions%C0%AE": 400}
    with serve_in_thread(canonical_paths(app), **http_options()) as base:
        got = {target: raw_request(base, target) for target in cases}
    assert got == cases
    chats = [seen for seen in engine.seen if "chat" in seen[0]]
    assert chats == [(CHAT, CHAT.encode())] * 5
    assert all("id_slot" in body for body in engine.fake.requests)
