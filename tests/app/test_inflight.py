"""Join in flight: identical requests share one engine generation; a resend within the
grace period after every client left joins the generation still running."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.app.conftest import running_proxy
from tests.fakes.fake_llama import FakeLlamaConfig, FakeLlamaServer

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


async def test_identical_concurrent_requests_are_independent_samples() -> None:
    """pass@k: two clients sample the same prompt at the same time. Neither is a retry of
    the other: two engine requests, no join."""
    async with running_proxy(slow_engine()) as (client, engine):
        first = asyncio.create_task(client.post("/v1/chat/completions", json=BODY))
        await asyncio.sleep(0.3)
        second = await client.post("/v1/chat/completions", json=BODY)
        await first
        metrics = (await client.admin.get("/metrics")).text
    assert len(engine.requests) == 2
    assert second.status_code == 200
    assert 'prefixpin_inflight_joins_total{api="openai",endpoint="chat"}' not in metrics.replace(
        'prefixpin_inflight_joins_total{api="openai",endpoint="chat"} 0.0', "")


async def test_retries_that_say_so_share_one_generation() -> None:
    """Three identical requests (two streaming, one not) during one prefill; the later two
    are SDK retries (``x-stainless-retry-count``): one engine request, three complete and
    equal answers."""
    async with running_proxy(slow_engine()) as (client, engine):
        async def streaming(headers: dict[str, str]) -> str:
            response = await client.post("/v1/chat/completions", json={**BODY, "stream": True},
                                         headers=headers)
            return text_of_stream(response.text)

        async def folded(headers: dict[str, str]) -> str:
            response = await client.post("/v1/chat/completions", json=BODY, headers=headers)
            content: str = response.json()["choices"][0]["message"]["content"]
            return content

        first = asyncio.create_task(streaming({}))
        await asyncio.sleep(0.3)
        answers = await asyncio.gather(first, streaming({"x-stainless-retry-count": "1"}),
                                       folded({"X-Stainless-Retry-Count": "2"}))
        metrics = (await client.admin.get("/metrics")).text
    assert len(engine.requests) == 1
    assert answers[0] == answers[1] == answers[2] != ""
    assert 'prefixpin_inflight_joins_total{api="openai",endpoint="chat"} 2.0' in metrics


async def test_an_idempotency_key_joins_only_its_own_request() -> None:
    async with running_proxy(slow_engine()) as (client, engine):
        first = asyncio.create_task(client.post("/v1/chat/completions", json=BODY,
                                                headers={"Idempotency-Key": "k1"}))
        await asyncio.sleep(0.3)
        await asyncio.gather(first, client.post("/v1/chat/completions", json=BODY,
                                                headers={"idempotency-key": "k1"}))
    assert len(engine.requests) == 1


async def test_a_retry_count_of_zero_or_another_idempotency_key_does_not_join() -> None:
    async with running_proxy(slow_engine()) as (client, engine):
        first = asyncio.create_task(client.post("/v1/chat/completions", json=BODY,
                                                headers={"idempotency-key": "a"}))
        await asyncio.sleep(0.3)
        await asyncio.gather(
            first,
            client.post("/v1/chat/completions", json=BODY,
                        headers={"x-stainless-retry-count": "0"}),
            client.post("/v1/chat/completions", json=BODY,
                        headers={"idempotency-key": "b", "x-stainless-retry-count": "1"}))
    assert len(engine.requests) == 3


async def test_back_to_back_identical_requests_never_replay_a_complete_answer() -> None:
    """The engine's body ends late after [DONE] (its generation still runs): a resend, even
    one marked as a retry, is a new request, not a replay of the complete answer."""
    engine = FakeLlamaServer(FakeLlamaConfig())
    async with running_proxy(engine) as (client, _):
        engine.faults.append("linger")
        first = await client.post("/v1/chat/completions", json=BODY)
        second = await client.post("/v1/chat/completions", json=BODY,
                                   headers={"x-stainless-retry-count": "1"})
    assert first.status_code == second.status_code == 200
    assert len(engine.requests) == 2


async def test_sub_agents_with_different_session_ids_never_share() -> None:
    """Two sub-agents send identical bodies under their own ``x-session-id`` (even as
    retries): two generations, and both sessions are recorded."""
    async with running_proxy(slow_engine()) as (client, engine):
        first = asyncio.create_task(client.post(
            "/v1/chat/completions", json=BODY, headers={"x-session-id": "agent-a"}))
        await asyncio.sleep(0.3)
        await asyncio.gather(first, client.post(
            "/v1/chat/completions", json=BODY,
            headers={"x-session-id": "agent-b", "x-stainless-retry-count": "1"}))
        view = (await client.admin.get("/sessions")).json()
    assert len(engine.requests) == 2
    keys = {s["key"] for s in view["namespaces"]["anon"]}
    assert {"agent-a", "agent-b"} <= keys


async def test_bare_completions_is_llama_servers_native_api_and_never_joins_v1() -> None:
    """On llama-server a bare ``/completions`` is its native API (another answer format
    than ``/v1/completions``): the proxy asks the engine on the path the client used, and
    a retry on one path never joins a generation of the other."""
    body = {"prompt": "word " * 60, "max_tokens": 6}
    async with running_proxy(slow_engine()) as (client, engine):
        first = asyncio.create_task(client.post("/v1/completions", json=body))
        await asyncio.sleep(0.3)
        native = await client.post("/completions", json=body,
                                   headers={"x-stainless-retry-count": "1"})
        answer = await first
        metrics = (await client.admin.get("/metrics")).text
    assert answer.status_code == 200, answer.text
    # the fake engine has no native routes: the engine's own 404 comes back, not a join
    assert native.status_code == 404, native.text
    assert len(engine.requests) == 1  # the native request reached the engine's 404 route
    assert not [line for line in metrics.splitlines()
                if line.startswith("prefixpin_inflight_joins_total{")]


def test_the_inflight_key_names_the_path_and_the_session() -> None:
    from prefixpin.proxy.pipeline.inflight import inflight_key

    body = {"prompt": "x"}
    base = inflight_key("anon", "completions", "/v1/completions", None, body)
    assert base == inflight_key("anon", "completions", "/v1/completions", None,
                                {**body, "stream": True})
    assert base != inflight_key("anon", "completions", "/completions", None, body)
    assert base != inflight_key("anon", "completions", "/v1/completions", "a", body)
    assert inflight_key("anon", "completions", "/v1/completions", "a", body) != \
        inflight_key("anon", "completions", "/v1/completions", "b", body)


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
    """The same body from two bearer tokens: two generations (--allow-shared-cache: the
    fake's prompt cache is assumed shared, and this test is about joins)."""
    async with running_proxy(slow_engine(), allow_shared_cache=True) as (client, engine):
        await asyncio.gather(
            client.post("/v1/chat/completions", json=BODY,
                        headers={"authorization": "Bearer one"}),
            client.post("/v1/chat/completions", json=BODY,
                        headers={"authorization": "Bearer two"}))
    assert len(engine.requests) == 2


async def test_identical_requests_arriving_together_share_one_generation() -> None:
    """Planning awaits (fingerprints run in a thread): retries (one idempotency key) that
    arrive in the same instant still find the first one's reservation and join it."""
    from tests.rig.models import ensure_model

    async with running_proxy(slow_engine(), tokenizer=ensure_model("smollm2")) as (client,
                                                                                 engine):
        answers = await asyncio.gather(*(client.post("/v1/chat/completions", json=BODY,
                                                     headers={"idempotency-key": "same"})
                                         for _ in range(4)))
        metrics = (await client.admin.get("/metrics")).text
    assert len(engine.requests) == 1
    assert len({a.json()["choices"][0]["message"]["content"] for a in answers}) == 1
    assert 'prefixpin_inflight_joins_total{api="openai",endpoint="chat"} 3.0' in metrics


async def test_a_released_reservation_lets_waiters_plan_for_themselves() -> None:
    """The first request fails to plan: a request waiting on its reservation gets None
    (it plans anew) rather than hanging or failing with the first one's error."""
    from prefixpin.proxy.pipeline.inflight import InFlight, JoinIntent

    inflight = InFlight()
    retry = JoinIntent(retry=True)
    reservation = inflight.reserve(b"key")
    waiter = asyncio.create_task(inflight.find(b"key", retry))
    await asyncio.sleep(0)
    assert not waiter.done()  # a retry waits for the reservation to be planned
    inflight.release(b"key", reservation)
    assert await asyncio.wait_for(waiter, 1) is None
    assert await inflight.find(b"key", retry) is None
    assert len(inflight) == 0


async def test_a_request_that_is_no_retry_does_not_wait_for_a_reservation() -> None:
    from prefixpin.proxy.pipeline.inflight import InFlight, JoinIntent

    inflight = InFlight()
    inflight.reserve(b"key", JoinIntent(idempotency_key="a"))
    assert await asyncio.wait_for(inflight.find(b"key"), 1) is None
    assert await asyncio.wait_for(
        inflight.find(b"key", JoinIntent(retry=True, idempotency_key="b")), 1) is None
    assert len(inflight) == 1


def test_join_intent_reads_the_sdk_headers() -> None:
    from prefixpin.proxy.pipeline.inflight import JoinIntent

    assert JoinIntent.of({}) == JoinIntent()
    assert JoinIntent.of({"x-stainless-retry-count": "2"}).retry
    assert not JoinIntent.of({"x-stainless-retry-count": "0"}).retry
    assert not JoinIntent.of({"x-stainless-retry-count": "-1"}).retry
    assert JoinIntent.of({"idempotency-key": " k "}).idempotency_key == "k"
    assert JoinIntent.of({"idempotency-key": "x" * 300}).idempotency_key is None
