"""``--max-bodies`` through the app: the request bodies every connection of the tenant
listener is reading at once share one budget. A body that would pass it gets a 503 with
Retry-After in its client's API shape (counted as ``limit="bodies"``) while the others go
on; refused, disconnected and served requests all give their bytes back.

A held body is one whose client sent part of it: the app is called as the server calls
it, with a ``receive`` that hands the rest over only when the test says so (the in-process
transport hands a body over whole)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from prefixpin.proxy.listen.app import ProxyApps, create_apps
from prefixpin.proxy.pipeline.validation import BodyBudget
from prefixpin.proxy.settings import Settings
from tests.app.conftest import ProxyClient, clients_of
from tests.app.test_parking import metric
from tests.asgi_transport import StreamingASGITransport
from tests.fakes.fake_llama import FakeLlamaConfig, FakeLlamaServer

pytestmark = pytest.mark.anyio

BUDGET = 64 * 1024
Message = MutableMapping[str, Any]


def chat(size: int) -> bytes:
    """A chat body of about ``size`` bytes (one long word: little for the fake to tokenize)."""
    return json.dumps({"messages": [{"role": "user", "content": "x" * size}],
                       "max_tokens": 2}).encode()


def messages(size: int) -> bytes:
    return json.dumps({"model": "fake", "max_tokens": 2,
                       "messages": [{"role": "user", "content": "x" * size}]}).encode()


@dataclass
class Upload:
    """One request whose body arrives in two parts: ``first`` at once, the rest when
    ``go`` is set, or a disconnect instead when ``leave`` is."""

    path: str
    body: bytes
    first: int
    declared: bool
    go: asyncio.Event = field(default_factory=asyncio.Event)
    leave: bool = False
    waiting: asyncio.Event = field(default_factory=asyncio.Event)  # the first part was read
    done: asyncio.Event = field(default_factory=asyncio.Event)
    status: int | None = None
    answer: bytearray = field(default_factory=bytearray)
    _step: int = 0

    async def receive(self) -> Message:
        self._step += 1
        if self._step == 1:
            return {"type": "http.request", "body": self.body[:self.first], "more_body": True}
        if self._step == 2:
            self.waiting.set()
            await self.go.wait()
            if self.leave:
                return {"type": "http.disconnect"}
            return {"type": "http.request", "body": self.body[self.first:], "more_body": False}
        await self.done.wait()  # the answer is sent: then the connection closes
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            self.answer += message.get("body", b"")
            if not message.get("more_body", False):
                self.done.set()

    def scope(self) -> dict[str, Any]:
        headers = [(b"host", b"proxy"), (b"content-type", b"application/json")]
        if self.declared:
            headers.append((b"content-length", str(len(self.body)).encode()))
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                "http_version": "1.1", "method": "POST", "scheme": "http",
                "path": self.path, "raw_path": self.path.encode(), "query_string": b"",
                "headers": headers, "server": ("proxy", 80), "client": ("127.0.0.1", 1),
                "root_path": ""}


@asynccontextmanager
async def proxy(**settings: Any) -> AsyncIterator[tuple[ProxyApps, ProxyClient,
                                                          FakeLlamaServer]]:
    engine = FakeLlamaServer(FakeLlamaConfig())
    apps = create_apps(Settings(upstream="http://fake-llama", **settings),
                       transport=StreamingASGITransport(engine.app()))
    async with apps.tenant.router.lifespan_context(apps.tenant), clients_of(apps) as client:
        yield apps, client, engine


def bodies_of(apps: ProxyApps) -> BodyBudget:
    return apps.holder.get().bodies


async def start(apps: ProxyApps, upload: Upload) -> asyncio.Task[None]:
    """The upload's request, running until its first part is read (and reserved)."""
    async def serve() -> None:
        await apps.tenant_listener(upload.scope(), upload.receive, upload.send)

    task = asyncio.create_task(serve())
    async with asyncio.timeout(10):
        await upload.waiting.wait()
    return task


async def finish(client: ProxyClient, upload: Upload, task: asyncio.Task[None]) -> float:
    """The held upload let go on to its end; the refusals the proxy counted then."""
    upload.go.set()
    async with asyncio.timeout(10):
        await task
    return await metric(client, "prefixpin_limit_refusals_total", limit="bodies")


@pytest.mark.parametrize("declared", [True, False])
async def test_a_body_that_would_pass_the_budget_is_a_503_while_the_held_one_goes_on(
        declared: bool) -> None:
    """One client's 40 KiB body is on its way (declared: reserved whole; streamed: its
    first 36 KiB); a second 40 KiB body would pass the 64 KiB budget: a 503 with
    Retry-After in the OpenAI shape, never forwarded. The first is then served."""
    async with proxy(max_bodies_bytes=BUDGET) as (apps, client, engine):
        held = Upload("/v1/chat/completions", chat(40_000), 36_000, declared)
        task = await start(apps, held)
        assert bodies_of(apps).held == (len(held.body) if declared else 36_000)
        refused = await client.post("/v1/chat/completions", content=chat(40_000),
                                    headers={"content-type": "application/json"})
        assert engine.requests == []
        counted = await finish(client, held, task)
        outcome = await metric(client, "prefixpin_requests_total", endpoint="chat",
                               outcome="bodies_full", api="openai")
        assert bodies_of(apps).held == 0
        after = await client.post("/v1/chat/completions", content=chat(60_000),
                                  headers={"content-type": "application/json"})
        assert bodies_of(apps).held == 0
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "request_bodies_full"
    assert error["type"] == "server_busy"
    assert "--max-bodies" in error["message"]
    assert int(refused.headers["retry-after"]) >= 1
    assert held.status == 200, bytes(held.answer)
    assert json.loads(held.answer)["choices"][0]["message"]["content"]
    assert after.status_code == 200, after.text  # the budget is free again
    assert len(engine.requests) == 2
    assert counted == 1
    assert outcome == 1


async def test_an_anthropic_client_is_refused_in_its_own_shape() -> None:
    async with proxy(max_bodies_bytes=BUDGET) as (apps, client, _):
        held = Upload("/v1/messages", messages(40_000), 20_000, True)
        task = await start(apps, held)
        refused = await client.post("/v1/messages", content=messages(40_000),
                                    headers={"content-type": "application/json"})
        counted = await finish(client, held, task)
        assert bodies_of(apps).held == 0
    assert refused.status_code == 503, refused.text
    assert refused.json()["type"] == "error"
    assert refused.json()["error"]["type"] == "overloaded_error"
    assert "--max-bodies" in refused.json()["error"]["message"]
    assert int(refused.headers["retry-after"]) >= 1
    assert held.status == 200, bytes(held.answer)
    assert json.loads(held.answer)["type"] == "message"
    assert counted == 1


async def test_a_pass_through_body_counts_in_the_budget_too() -> None:
    """The tenant port's pass-through POSTs (/tokenize) reserve their bodies as well: a
    second one that would pass the budget is a 503, never sent to the engine."""
    tokenize = json.dumps({"content": "x" * 40_000}).encode()
    async with proxy(max_bodies_bytes=BUDGET) as (apps, client, engine):
        held = Upload("/tokenize", tokenize, 10_000, True)
        task = await start(apps, held)
        before = len(engine.requests)
        refused = await client.post("/tokenize", content=tokenize,
                                    headers={"content-type": "application/json"})
        assert len(engine.requests) == before
        counted = await finish(client, held, task)
        assert bodies_of(apps).held == 0
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "request_bodies_full"
    assert int(refused.headers["retry-after"]) >= 1
    assert held.status == 200, bytes(held.answer)
    assert counted == 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("declared", [True, False])
async def test_a_client_that_leaves_mid_body_gives_its_reservation_back(
        path: str, declared: bool) -> None:
    async with proxy(max_bodies_bytes=BUDGET) as (apps, client, engine):
        before = len(engine.requests)
        gone = Upload(path, chat(60_000), 30_000, declared, leave=True)
        task = await start(apps, gone)
        assert bodies_of(apps).held == (len(gone.body) if declared else 30_000)
        gone.go.set()  # then a disconnect instead of the rest
        async with asyncio.timeout(10):
            await task
        assert bodies_of(apps).held == 0
        assert len(engine.requests) == before
        after = await client.post("/v1/chat/completions", content=chat(60_000),
                                  headers={"content-type": "application/json"})
        assert bodies_of(apps).held == 0
    assert after.status_code == 200, after.text


async def test_a_request_cancelled_mid_body_gives_its_reservation_back() -> None:
    """The server cancels a request's task (shutdown, a body timeout): its bytes too."""
    async with proxy(max_bodies_bytes=BUDGET) as (apps, _, _):
        held = Upload("/v1/chat/completions", chat(60_000), 30_000, True)
        task = await start(apps, held)
        assert bodies_of(apps).held == len(held.body)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert bodies_of(apps).held == 0
