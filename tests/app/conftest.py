"""In-process app tests: the proxy in front of the fake llama-server, both in memory.

The fake engine only stands in for llama-server's wire format here; cache behaviour is
tested against the real llama-server in tests/e2e.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from core.asgi_transport import StreamingASGITransport
from proxy.app import create_app
from proxy.settings import Settings
from proxy.testing.fake_llama import FakeLlamaConfig, FakeLlamaServer

ProxyFactory = Callable[..., Any]


@asynccontextmanager
async def running_proxy(engine: FakeLlamaServer | None = None,
                        **settings: Any) -> AsyncIterator[tuple[httpx.AsyncClient,
                                                                 FakeLlamaServer]]:
    engine = engine or FakeLlamaServer(FakeLlamaConfig())
    config = Settings(upstream="http://fake-llama", **settings)
    app = create_app(config, transport=StreamingASGITransport(engine.app()))
    async with app.router.lifespan_context(app):
        transport = StreamingASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            yield client, engine


@pytest.fixture
def proxy() -> Callable[..., Any]:
    return running_proxy
