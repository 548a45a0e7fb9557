"""In-process app tests: the proxy in front of the fake llama-server, both in memory.

The fake engine only stands in for llama-server's wire format here; cache behaviour is
tested against the real llama-server in tests/e2e.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from prefixpin.proxy.listen.app import ProxyApps, create_apps
from prefixpin.proxy.settings import Settings
from tests.asgi_transport import StreamingASGITransport
from tests.fakes.fake_llama import FakeLlamaConfig, FakeLlamaServer

ProxyFactory = Callable[..., Any]


class ProxyClient(httpx.AsyncClient):
    """A tenant's client of the proxy in process (the tenant port); ``admin`` is a client of
    the same process's operator listener (``/sessions``, ``/metrics``, engine paths)."""

    admin: httpx.AsyncClient


async def lanes_ready(app: Starlette, timeout_s: float = 10.0) -> None:
    """Until every lane of the app's router has probed its engine and switched its policies
    on (the lifespan waits only for the first probe)."""
    async with asyncio.timeout(timeout_s):
        while not all(lane.ready for lane in app.state.prefixpin.router.lanes):  # noqa: ASYNC110 (lanes have no event to wait on)
            await asyncio.sleep(0.02)


@asynccontextmanager
async def clients_of(apps: ProxyApps, *, base_url: str = "http://proxy",
                     **options: Any) -> AsyncIterator[ProxyClient]:
    """A client of ``apps.tenant`` with ``admin`` for ``apps.operator`` (the lifespan is the
    caller's: ``apps.tenant.router.lifespan_context``)."""
    async with AsyncExitStack() as stack:
        admin = await stack.enter_async_context(httpx.AsyncClient(
            transport=StreamingASGITransport(apps.operator_listener), base_url=base_url + "-admin",
            **options))
        client = await stack.enter_async_context(ProxyClient(
            transport=StreamingASGITransport(apps.tenant_listener), base_url=base_url, **options))
        client.admin = admin
        yield client


@asynccontextmanager
async def running_proxy(engine: FakeLlamaServer | None = None,
                        **settings: Any) -> AsyncIterator[tuple[ProxyClient,
                                                                 FakeLlamaServer]]:
    engine = engine or FakeLlamaServer(FakeLlamaConfig())
    config = Settings(upstream="http://fake-llama", **settings)
    apps = create_apps(config, transport=StreamingASGITransport(engine.app()))
    app = apps.tenant
    async with app.router.lifespan_context(app), clients_of(apps) as client:
        yield client, engine


@pytest.fixture
def proxy() -> Callable[..., Any]:
    return running_proxy
