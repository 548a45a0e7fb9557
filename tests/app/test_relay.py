"""The non-streaming fold, and what is answered before or without a relayed stream, in
process against the fake engine. Streamed chat answers through the relay are
``test_relay_served.py``'s, served on real sockets."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from prefixpin.proxy.listen.app import create_app
from prefixpin.proxy.settings import Settings
from tests.app.conftest import running_proxy
from tests.asgi_transport import StreamingASGITransport
from tests.fakes.fake_llama import LINGER_S, FakeLlamaServer

pytestmark = pytest.mark.anyio

CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


def sse_events(text: str) -> list[str]:
    return [block for block in text.split("\n\n") if block]


def data_of(events: list[str]) -> list[Any]:
    return [json.loads(e[6:]) if e != "data: [DONE]" else "[DONE]"
            for e in events if e.startswith("data: ")]


async def test_non_streaming_clients_get_one_folded_body_with_cached_tokens() -> None:
    """A non-streaming client gets a chat.completion whose usage has cached_tokens."""
    async with running_proxy() as (client, _):
        response = await client.post("/v1/chat/completions", json=CHAT)
    body = response.json()
    assert response.status_code == 200
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant",
                                             "content": "Hello from the fake"}
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert body["usage"]["completion_tokens"] == 4


async def test_completions_endpoint_streams_and_folds() -> None:
    """/v1/completions works streaming and not."""
    async with running_proxy() as (client, _):
        folded = (await client.post("/v1/completions",
                                    json={"prompt": "a b c", "max_tokens": 2})).json()
        streamed = await client.post("/v1/completions",
                                     json={"prompt": "a b c", "max_tokens": 2, "stream": True})
    assert folded["object"] == "text_completion"
    assert folded["choices"][0]["text"] == "Hello from"
    assert data_of(sse_events(streamed.text))[-1] == "[DONE]"


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_status_before_the_deadline_keeps_its_status_and_body(stream: bool) -> None:
    """A context-too-long 400 from the engine reaches the client as that 400, stream or not."""
    async with running_proxy(first_byte_ms=2000) as (client, engine):
        engine.faults.append("context")
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "exceed_context_size_error"


async def test_faults_of_a_non_streaming_request_are_an_error_status() -> None:
    """A non-streaming client has no headers out yet: the error keeps a real status."""
    async with running_proxy() as (client, engine):
        engine.faults.append("bad_json")
        response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 502
    assert "not JSON" in response.json()["error"]["message"]


async def test_unreachable_engine_is_a_502_with_an_openai_error() -> None:
    """Nothing listening: 502 whose body is an OpenAI error object."""
    app = create_app(Settings(upstream="http://127.0.0.1:9", connect_timeout_s=1))
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=StreamingASGITransport(app), base_url="http://proxy") as client:
        for stream in (False, True):
            response = await client.post("/v1/chat/completions",
                                         json={**CHAT, "stream": stream})
            assert response.status_code == 502
            assert response.json()["error"]["code"] == "upstream_unavailable"
        health = await client.get("/healthz")
    assert health.status_code == 503
    assert health.json()["upstream"]["status"] == "unreachable"


@pytest.mark.parametrize(("content", "status", "fragment"), [
    (b"{nope", 400, "not valid JSON"),
    (b'{"model": "x"}', 400, "'messages' is required"),
    (b"x" * 5000, 413, "exceeds the limit"),
])
async def test_bad_input_is_rejected_before_the_engine_sees_it(
        content: bytes, status: int, fragment: str) -> None:
    """Invalid JSON, missing messages and oversized bodies are clear 4xx; nothing forwarded."""
    async with running_proxy(max_body_bytes=4096) as (client, engine):
        response = await client.post("/v1/chat/completions", content=content,
                                     headers={"content-type": "application/json"})
    assert response.status_code == status
    assert fragment in response.json()["error"]["message"]
    assert engine.requests == []


async def test_other_paths_pass_through_unchanged() -> None:
    """llama-server's own endpoints answer through the proxy: the read-only ones on the
    tenant port, all of them on the operator listener."""
    async with running_proxy() as (client, engine):
        props = await client.get("/props")
        slots = await client.admin.get("/slots")
        missing = await client.admin.get("/no-such-endpoint")
        refused = await client.get("/no-such-endpoint")
    assert props.json()["total_slots"] == engine.config.n_slots
    assert [s["id"] for s in slots.json()] == [0, 1]
    assert missing.status_code == 404
    assert refused.status_code == 403


async def test_a_folded_answer_ends_with_the_engines_done_not_its_body() -> None:
    """A non-streaming client's answer ends at the engine's [DONE]: the end of the engine's
    body (which a busy server may send late) and the slot's release come after, off the
    client's latency. The turn is committed before the client can send its next one. (A
    streamed answer's: ``test_relay_served.py``.)"""
    engine = FakeLlamaServer()
    engine.faults.append("linger")
    async with running_proxy(engine) as (client, _):
        started = time.monotonic()
        response = await client.post("/v1/chat/completions", json=CHAT,
                                     headers={"x-session-id": "A"})
        elapsed = time.monotonic() - started
        sessions = (await client.admin.get("/sessions")).json()["namespaces"]
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "Hello from the fake"
    assert elapsed < LINGER_S / 2, f"the client waited {elapsed:.2f} s for the engine's body"
    [session] = [s for group in sessions.values() for s in group]
    assert session["last_decision"] == "new"
    assert session["committed_tokens"] > 0
