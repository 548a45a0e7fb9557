"""prefixpin in front of the fake Ollama (``tests.fakes.fake_ollama``).

Ollama cannot be installed on these machines, so every test here runs against the fake,
which replays Ollama's wire formats as recorded from its documentation, source and
third-party recordings (``tests/fixtures/ollama/``, ``docs/ollama-wire.md``). The proxy
reaches the fake in process (``StreamingASGITransport``); the real-client tests serve the
proxy on a loopback port with uvicorn.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from starlette.applications import Starlette

from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.settings import Settings
from tests.asgi_transport import StreamingASGITransport
from tests.fakes.fake_ollama import (
    FakeModel,
    FakeOllama,
    FakeOllamaConfig,
    create_fake_ollama,
    fake_ollama_state,
)
from tests.fakes.servers import serve_in_thread

MODEL = "fake-smol"
THINKER = "fake-think"
MODELS = (
    FakeModel("fake-smol:latest", tool_arguments={"city": "Paris", "unit": "celsius"}),
    FakeModel("fake-think:latest", reply="The answer is 5.",
              thinking="Two plus three is five, so the answer is 5."),
    FakeModel("fake-other:latest", reply="Another model, another answer."),
)
REPLY = MODELS[0].reply


async def instant_sleep(seconds: float) -> None:
    await anyio.lowlevel.checkpoint()


def fake_config(**overrides: Any) -> FakeOllamaConfig:
    """Instant by default (no real waiting); a cold load is half a second of model time,
    as a real load is (hundreds of milliseconds), so the proxy can tell it from a warm one."""
    settings: dict[str, Any] = {"models": MODELS, "sleep": instant_sleep, "load_seconds": 0.5}
    settings.update(overrides)
    return FakeOllamaConfig(**settings)


@dataclass
class Rig:
    client: httpx.AsyncClient  # talks to the proxy's tenant port
    admin: httpx.AsyncClient  # its operator listener
    proxy: Starlette
    fake: Starlette
    recorder: Recorder | None = None

    @property
    def ollama(self) -> FakeOllama:
        return fake_ollama_state(self.fake)

    async def metrics(self) -> str:
        return (await self.admin.get("/metrics")).text

    async def sessions(self) -> list[dict[str, Any]]:
        body = (await self.admin.get("/sessions")).json()
        return [s for group in body["namespaces"].values() for s in group]


class Recorder:
    """ASGI middleware over the fake: the bodies the proxy forwarded, in order."""

    def __init__(self, app: Starlette) -> None:
        self.app = app
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        self.credentials: list[dict[str, str]] = []  # each POST's authorization, x-api-key

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.credentials.append({k: headers[k] for k in ("authorization", "x-api-key")
                                 if k in headers})
        chunks: list[bytes] = []
        replay: list[Any] = []
        while True:
            message = await receive()
            replay.append(message)
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        try:
            self.bodies.append((scope["path"], json.loads(b"".join(chunks) or b"{}")))
        except ValueError:
            self.bodies.append((scope["path"], {}))

        async def again() -> Any:  # the body once more, then the live channel
            return replay.pop(0) if replay else await receive()

        await self.app(scope, again, send)


@contextlib.asynccontextmanager
async def proxy_rig(config: FakeOllamaConfig | None = None, *, recorder: bool = False,
                    **settings: Any) -> AsyncIterator[Rig]:
    fake = create_fake_ollama(config or fake_config())
    upstream: Any = Recorder(fake) if recorder else fake
    options: dict[str, Any] = {"upstream": "http://fake-ollama", **settings}
    apps = create_apps(Settings(**options), transport=StreamingASGITransport(upstream))
    app = apps.tenant
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=StreamingASGITransport(apps.tenant_listener), base_url="http://proxy",
            timeout=30) as client, httpx.AsyncClient(
            transport=StreamingASGITransport(apps.operator_listener), base_url="http://operator",
            timeout=30) as admin:
        yield Rig(client, admin, app, fake, upstream if recorder else None)


@dataclass
class Served:
    url: str  # the proxy's base URL (the tenant port)
    admin_url: str  # its operator listener's
    fake: Starlette
    recorder: Recorder

    @property
    def ollama(self) -> FakeOllama:
        return fake_ollama_state(self.fake)


@contextlib.contextmanager
def served_proxy(config: FakeOllamaConfig | None = None, **settings: Any) -> Iterator[Served]:
    """The proxy on a loopback port under uvicorn, the fake behind it in process."""
    fake = create_fake_ollama(config or fake_config())
    recorder = Recorder(fake)
    options: dict[str, Any] = {"upstream": "http://fake-ollama", **settings}
    apps = create_apps(Settings(**options), transport=StreamingASGITransport(recorder))
    with serve_in_thread(apps.tenant_listener) as base, serve_in_thread(
            apps.operator_listener) as admin:
        yield Served(base, admin, fake, recorder)


@contextlib.contextmanager
def served_fake(config: FakeOllamaConfig | None = None) -> Iterator[str]:
    """The fake alone on a loopback port: Ollama as a client would meet it directly."""
    with serve_in_thread(create_fake_ollama(config or fake_config())) as base:
        yield base
