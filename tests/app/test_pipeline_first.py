"""The pipeline's routes served in front of starlette's middleware (``app.PipelineFirst``):
what starlette's stack used to answer on those paths is answered the same way: a method
the route does not take is the tenant app's own answer, a proxy that is not started is a
503 naming it, and an exception nobody translated is an OpenAI-shaped 500, logged."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.settings import Settings


async def post(apps: Any, path: str = "/v1/chat/completions",
               method: str = "POST", app: Any = None) -> httpx.Response:
    transport = httpx.ASGITransport(app=app or apps.tenant_listener)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
        return await client.request(method, path, json={"messages": [
            {"role": "user", "content": "hi"}], "stream": True})


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_a_method_the_route_does_not_take_gets_the_tenant_app_s_own_answer(
        method: str) -> None:
    apps = create_apps(Settings(upstream="http://engine"))
    ours = asyncio.run(post(apps, method=method))
    starlette_s = asyncio.run(post(apps, method=method, app=apps.tenant))
    assert (ours.status_code, ours.json()) == (starlette_s.status_code, starlette_s.json())
    assert ours.status_code == 403  # the catch-all: served on the operator port


def test_a_proxy_not_started_answers_503_with_retry_after() -> None:
    apps = create_apps(Settings(upstream="http://engine"))  # no lifespan ran: no state
    response = asyncio.run(post(apps))
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "starting"


def test_an_untranslated_exception_is_a_logged_openai_500(
        caplog: pytest.LogCaptureFixture) -> None:
    apps = create_apps(Settings(upstream="http://engine"))

    async def handle(request: Any, codec: Any) -> Any:
        raise RuntimeError("a bug in the request path")

    apps.holder.state = SimpleNamespace(router=SimpleNamespace(handle=handle))  # type: ignore[assignment]
    with caplog.at_level(logging.ERROR):
        response = asyncio.run(post(apps, "/v1/messages"))
    assert response.status_code == 500
    assert response.json()["error"]["message"] == "internal proxy error"
    assert "a bug in the request path" not in response.text
    assert any("unexpected error" in record.getMessage() for record in caplog.records)
