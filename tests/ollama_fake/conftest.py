"""Fixtures for the fake Ollama's own tests: configs with instant waiting, a fake clock, and
the fake reached in process (httpx over ASGI) or on a real uvicorn."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import pytest
from starlette.applications import Starlette

from tests.fakes.fake_ollama import FakeModel, FakeOllamaConfig, create_fake_ollama
from tests.fakes.servers import serve_in_thread

MakeClient = Callable[[FakeOllamaConfig], Awaitable[tuple[Starlette, httpx.AsyncClient]]]
Serve = Callable[[FakeOllamaConfig], tuple[Starlette, str]]


async def instant_sleep(seconds: float) -> None:
    await anyio.lowlevel.checkpoint()


@dataclass
class FakeClock:
    """A clock for keep_alive expiry that only moves when a test says so."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


MODELS = (
    FakeModel("fake-smol:latest", tool_arguments={"city": "Paris"}),
    FakeModel("fake-think:latest", reply="The answer is 5.",
              thinking="Two plus three is five, so the answer is 5."),
    FakeModel("fake-other:latest", reply="Another model, another answer."),
)


def make_config(**overrides: Any) -> FakeOllamaConfig:
    settings: dict[str, Any] = {"models": MODELS, "sleep": instant_sleep}
    settings.update(overrides)
    return FakeOllamaConfig(**settings)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def make_client() -> AsyncIterator[MakeClient]:
    clients: list[httpx.AsyncClient] = []

    async def factory(config: FakeOllamaConfig) -> tuple[Starlette, httpx.AsyncClient]:
        app = create_fake_ollama(config)
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                   base_url="http://fake-ollama")
        clients.append(client)
        return app, client

    yield factory
    for client in clients:
        await client.aclose()


@pytest.fixture
def serve() -> Iterator[Serve]:
    with contextlib.ExitStack() as exits:

        def factory(config: FakeOllamaConfig) -> tuple[Starlette, str]:
            app = create_fake_ollama(config)
            return app, exits.enter_context(serve_in_thread(app))

        yield factory
