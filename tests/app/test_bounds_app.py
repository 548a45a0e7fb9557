"""Per-namespace bounds through the app: a namespace that fills its share of the slot
queue gets a 429 with Retry-After, and another namespace still queues (fake llama-server:
wire format only)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.app.conftest import running_proxy
from tests.app.test_parking import metric
from tests.fakes.fake_llama import FakeLlamaConfig, FakeLlamaServer

pytestmark = pytest.mark.anyio


def body(key: str) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": f"{key} " + "word " * 40}],
            "max_tokens": 4}


async def test_a_namespace_over_its_queue_share_gets_a_429_and_others_still_queue(
        tenant_file: Callable[..., Path]) -> None:
    engine = FakeLlamaServer(FakeLlamaConfig(n_slots=1, prefill_s_per_token=0.02, batch=8))
    # --allow-shared-cache: two tenants on one fake engine (not what this is about)
    async with running_proxy(engine, max_queued_per_namespace=1, allow_shared_cache=True,
                             tenants_file=tenant_file("tenant-one", "tenant-two")) as (
            client, _):
        one = {"authorization": "Bearer tenant-one"}
        two = {"authorization": "Bearer tenant-two"}
        running = asyncio.create_task(client.post(
            "/v1/chat/completions", json=body("a"), headers={**one, "x-session-id": "a"}))
        await asyncio.sleep(0.2)  # holds the one slot
        queued = asyncio.create_task(client.post(
            "/v1/chat/completions", json=body("b"), headers={**one, "x-session-id": "b"}))
        await asyncio.sleep(0.2)  # waits for the slot: the namespace's one queued request
        refused = await client.post("/v1/chat/completions", json=body("c"),
                                    headers={**one, "x-session-id": "c"})
        other = asyncio.create_task(client.post(
            "/v1/chat/completions", json=body("d"), headers={**two, "x-session-id": "d"}))
        answers = await asyncio.gather(running, queued, other)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "queue_full_namespace"
    assert int(refused.headers["retry-after"]) >= 1
    assert [a.status_code for a in answers] == [200, 200, 200]


async def test_a_body_of_too_many_json_values_is_a_413_before_it_is_parsed() -> None:
    """Millions of tiny values (``[0,0,...]``, ``{}``s) would take seconds and gigabytes to
    parse: refused by their count; a large body of few values is parsed (in a thread)."""
    flood = b'{"messages": [' + b"0," * 30_000 + b'0], "max_tokens": 2}'
    history = [{"role": "user", "content": "x" * (2 << 20)}]  # 2 MiB in one value
    async with running_proxy(max_json_values=10_000) as (client, engine):
        refused = await client.post("/v1/chat/completions", content=flood,
                                    headers={"content-type": "application/json"})
        served = await client.post("/v1/chat/completions",
                                   json={"messages": history, "max_tokens": 2})
        counted = await metric(client, "prefixpin_limit_refusals_total", limit="json_values")
    assert counted == 1
    assert refused.status_code == 413, refused.text
    assert refused.json()["error"]["code"] == "too_many_values"
    assert served.status_code == 200, served.text
    assert len(engine.requests) == 1


async def test_an_engine_reply_past_max_reply_events_ends_with_an_error_event() -> None:
    """An engine that sends more than ``--max-reply-events`` (one ignoring max_tokens, or
    flooding) is cut off: the client gets what came before, then a clean error event."""
    engine = FakeLlamaServer(FakeLlamaConfig(reply=" ".join(f"w{i}" for i in range(1500))))
    async with running_proxy(engine, max_reply_events=1024) as (client, _):
        answer = await client.post("/v1/chat/completions", json={
            **body("long"), "max_tokens": 2000, "stream": True})
    assert answer.status_code == 200
    events = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ")]
    assert "w100 " in answer.text.replace('"', " ")
    assert "--max-reply-events" in events[-1], events[-1]
    assert "w1400" not in answer.text


async def test_a_reply_past_keep_reply_events_streams_whole_and_is_not_joined() -> None:
    """Past ``--keep-reply-events`` the log lets go of what its client read
    (``proxy.pipeline.generation``): the client still gets every token in order, and a retry that
    arrives then starts its own request instead of joining a log that lacks its start."""
    words = [f"w{i}" for i in range(1500)]
    engine = FakeLlamaServer(FakeLlamaConfig(reply=" ".join(words), token_delay_s=0.002))
    stream = {**body("long"), "max_tokens": 2000, "stream": True}
    async with running_proxy(engine, keep_reply_events=256) as (client, _):
        first = asyncio.create_task(client.post("/v1/chat/completions", json=stream,
                                                headers={"idempotency-key": "k"}))
        await asyncio.sleep(1.5)  # past 256 of the 1,500 tokens, not at their end
        retry = await client.post("/v1/chat/completions", json=stream,
                                  headers={"idempotency-key": "k"})
        answer = await first
    for response in (answer, retry):
        assert response.status_code == 200
        chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]
        text = "".join(c["choices"][0]["delta"].get("content") or ""
                       for c in chunks if c["choices"])
        assert text.split() == words
    assert len(engine.requests) == 2  # the retry did not join
