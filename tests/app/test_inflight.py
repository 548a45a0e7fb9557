"""Join in flight: identical requests share one engine generation; a resend within the
grace period after every client left joins the generation still running."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from proxy.testing.fake_llama import FakeLlamaConfig, FakeLlamaServer
from tests.app.conftest import running_proxy

pytestmark = pytest.mark.anyio

BODY = {"messages": [{"role": "user", "content": "word " * 60}], "max_tokens": 6}


def slow_engine() -> FakeLlamaServer:
    # ~60 tokens prefilled in batches of 8, 20 ms per token: about 1.2 s of prefill.
    return FakeLlamaServer(FakeLlamaConfig(prefill_s_per_token=0.02, batch=8))


def text_of_stream(raw: str) -> str:
    out = []
    for block in raw.split("\n\n"):
        if block.startswith("data: {"):
            for choice in json.loads(block[6:]).get("choices") or []:
                out.append((choice.get("delta") or {}).get("content") or "")
    return "".join(out)


async def test_identical_concurrent_requests_share_one_generation() -> None:
    """Three identical requests (two streaming, one not) during one prefill: one engine
    request, three complete and equal answers."""
    async with running_proxy(slow_engine()) as (client, engine):
        async def streaming() -> str:
            response = await client.post("/v1/chat/completions", json={**BODY, "stream": True})
            return text_of_stream(response.text)

        async def folded() -> str:
            response = await client.post("/v1/chat/completions", json=BODY)
            content: str = response.json()["choices"][0]["message"]["content"]
            return content

        first = asyncio.create_task(streaming())
        await asyncio.sleep(0.3)
        answers = await asyncio.gather(first, streaming(), folded())
        metrics = (await client.get("/metrics")).text
    assert len(engine.requests) == 1
    assert answers[0] == answers[1] == answers[2] != ""
    assert 'prefixpin_inflight_joins_total{endpoint="chat"} 2.0' in metrics


async def test_a_resend_after_the_client_left_joins_within_the_grace_period() -> None:
    """The client times out mid-prefill and resends: the engine prefills once."""
    async with running_proxy(slow_engine(), retry_grace_s=5) as (client, engine):
        with pytest.raises(TimeoutError):  # the client gives up mid-prefill
            await asyncio.wait_for(
                client.post("/v1/chat/completions", json={**BODY, "stream": True}), 0.5)
        resend = await client.post("/v1/chat/completions", json={**BODY, "stream": True})
    assert len(engine.requests) == 1
    assert text_of_stream(resend.text) == "Hello from the fake engine, one"


async def test_without_grace_the_engine_request_is_cancelled_and_a_resend_starts_anew() -> None:
    """--retry-grace 0: the first request is cancelled when its client leaves."""
    async with running_proxy(slow_engine(), retry_grace_s=0) as (client, engine):
        with pytest.raises(TimeoutError):  # the client gives up mid-prefill
            await asyncio.wait_for(
                client.post("/v1/chat/completions", json={**BODY, "stream": True}), 0.5)
        await asyncio.sleep(0.1)
        await client.post("/v1/chat/completions", json={**BODY, "stream": True})
    assert len(engine.requests) == 2


@pytest.mark.parametrize("change", [
    {"max_tokens": 7},
    {"messages": [{"role": "user", "content": "word " * 61}]},
])
async def test_different_requests_do_not_join(change: dict[str, Any]) -> None:
    """Any difference in what shapes the generation starts its own."""
    async with running_proxy(slow_engine()) as (client, engine):
        await asyncio.gather(
            client.post("/v1/chat/completions", json=BODY),
            client.post("/v1/chat/completions", json={**BODY, **change}))
    assert len(engine.requests) == 2


async def test_tenants_never_join_each_other() -> None:
    """The same body from two bearer tokens: two generations."""
    async with running_proxy(slow_engine()) as (client, engine):
        await asyncio.gather(
            client.post("/v1/chat/completions", json=BODY,
                        headers={"authorization": "Bearer one"}),
            client.post("/v1/chat/completions", json=BODY,
                        headers={"authorization": "Bearer two"}))
    assert len(engine.requests) == 2


async def test_identical_requests_arriving_together_share_one_generation() -> None:
    """Planning awaits (fingerprints run in a thread): requests that arrive in the same
    instant still find the first one's reservation and join it."""
    from tests.rig.models import ensure_model

    async with running_proxy(slow_engine(), tokenizer=ensure_model("smollm2")) as (client,
                                                                                 engine):
        answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=BODY)
                                         for _ in range(4)))
        metrics = (await client.get("/metrics")).text
    assert len(engine.requests) == 1
    assert len({a.json()["choices"][0]["message"]["content"] for a in answers}) == 1
    assert 'prefixpin_inflight_joins_total{endpoint="chat"} 3.0' in metrics


async def test_a_released_reservation_lets_waiters_plan_for_themselves() -> None:
    """The first request fails to plan: a request waiting on its reservation gets None
    (it plans anew) rather than hanging or failing with the first one's error."""
    from proxy.inflight import InFlight

    inflight = InFlight()
    reservation = inflight.reserve(b"key")
    waiter = asyncio.create_task(inflight.find(b"key"))
    await asyncio.sleep(0)
    inflight.release(b"key", reservation)
    assert await asyncio.wait_for(waiter, 1) is None
    assert await inflight.find(b"key") is None
