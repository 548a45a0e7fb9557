"""The real ``ollama`` Python client and the ``openai`` SDK, pointed at prefixpin (served by
uvicorn on a loopback port) in front of Ollama: chat streaming and not, generate, a tool
loop, thinking, errors, and what each sees during a long prefill.

Ollama cannot be installed here: the engine is the recorded-format fake
(``tests.fakes.fake_ollama``). The long-prefill tests give both clients a read timeout
shorter than the prefill: Ollama itself sends nothing at all until the first token (not
even headers), so against it both time out; through prefixpin a *streaming* client gets
headers at once and then a keep-alive every ``--heartbeat`` seconds (spaces before the
next NDJSON line on ``/api/chat``, SSE comments on ``/v1``), which no client shows to its
caller, and it survives; a ``stream: false`` client gets nothing until the one body, from
Ollama or from prefixpin, and times out all the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import openai
import pytest
from openai.types.chat import (
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageParam,
    ChatCompletionToolParam,
)

from tests.fakes.fake_ollama import NEW_VERSION, OLD_VERSION, FakeOllamaConfig, Fault

from .conftest import MODEL, MODELS, REPLY, THINKER, Served, fake_config, served_fake, served_proxy

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]
TOOLS: list[ChatCompletionToolParam] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture
def proxy() -> Iterator[Served]:
    with served_proxy() as served:
        yield served


def ollama_client(base: str, **options: Any) -> ollama.Client:
    return ollama.Client(host=base, **options)


def openai_client(base: str, **options: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="ollama", max_retries=0, **options)


# ----------------------------------------------------------------------- ollama client

@pytest.mark.parametrize("stream", [False, True])
def test_ollama_chat(proxy: Served, stream: bool) -> None:
    with ollama_client(proxy.url) as client:
        if stream:
            parts = list(client.chat(model=MODEL, messages=USER, stream=True))
            assert "".join(p.message.content or "" for p in parts) == REPLY
            assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
            last = parts[-1]
        else:
            last = client.chat(model=MODEL, messages=USER)
            assert last.message.content == REPLY
    served = proxy.ollama.requests[0]
    assert (last.done_reason, last.eval_count) == ("stop", served.eval_count)
    assert last.prompt_eval_count == served.prompt_tokens
    assert last.load_duration


def test_ollama_generate_and_thinking(proxy: Served) -> None:
    with ollama_client(proxy.url) as client:
        parts = list(client.generate(model=MODEL, prompt="Hi", stream=True))
        assert "".join(p.response or "" for p in parts) == REPLY
        follow = client.generate(model=MODEL, prompt="More", context=parts[-1].context)
        thought = client.chat(model=THINKER, messages=USER, think=True)
    assert follow.response == REPLY
    assert thought.message.thinking == MODELS[1].thinking


def test_ollama_tool_loop_is_one_session_served_from_cache(proxy: Served) -> None:
    """The agent loop as ollama-python users write it: the reply goes back (without the
    call ids, which the client drops) with the tool result; the second request resumes
    the session, its forwarded history extends the first, and Ollama reuses the whole
    first prompt."""
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    with ollama_client(proxy.url, headers={"x-session-id": "weather"}) as client:
        first = client.chat(model=MODEL, messages=messages, tools=TOOLS)
        [call] = first.message.tool_calls or []
        messages += [first.message, {"role": "tool", "tool_name": call.function.name,
                                     "content": "Sunny, 21 degrees."}]
        second = client.chat(model=MODEL, messages=messages, tools=TOOLS)
    assert call.function.arguments == {"city": "Paris", "unit": "celsius"}
    assert second.message.content == REPLY
    forwarded = [body["messages"] for _, body in proxy.recorder.bodies]
    assert forwarded[1][:len(forwarded[0])] == forwarded[0]
    sessions = httpx.get(f"{proxy.admin_url}/sessions").json()["namespaces"]["anon"]
    assert sessions[0]["last_decision"] == "resumed"
    first_served, second_served = proxy.ollama.requests
    assert second_served.cached_tokens >= first_served.prompt_tokens


def test_ollama_errors_keep_ollamas_status(proxy: Served) -> None:
    with ollama_client(proxy.url) as client:
        with pytest.raises(ollama.ResponseError) as missing:
            client.chat(model="nope", messages=USER)
        assert (missing.value.status_code, missing.value.error) == (404,
                                                                   "model 'nope' not found")
        with pytest.raises(ollama.ResponseError) as streamed:
            list(client.chat(model="nope", messages=USER, stream=True))
        assert streamed.value.status_code == 404
        proxy.ollama.inject(Fault("error_mid_stream", after_chunks=2, message="died"))
        seen: list[Any] = []
        parts = client.chat(model=MODEL, messages=USER, stream=True)
        with pytest.raises(ollama.ResponseError) as late:
            seen.extend(parts)
    assert len(seen) == 2
    assert late.value.status_code == -1  # the status was 200, as from Ollama
    assert "died" in late.value.error


def test_ollama_lifecycle_through_the_proxy(proxy: Served) -> None:
    with ollama_client(proxy.url) as client:
        client.chat(model=MODEL, messages=USER, keep_alive="10m")
        assert [m.model for m in client.ps().models] == [MODEL + ":latest"]
        client.chat(model=MODEL, messages=[], keep_alive=0)
        assert client.ps().models == []
        assert {m.model for m in client.list().models} == {m.name for m in MODELS}


# --------------------------------------------------------------------------- openai SDK

@pytest.mark.parametrize("version", [OLD_VERSION, NEW_VERSION])
def test_openai_chat(version: str) -> None:
    """Cached tokens in usage exactly when Ollama measured them; never an estimate."""
    with served_proxy(fake_config(version=version)) as proxy, \
            openai_client(proxy.url) as client:
        whole = client.chat.completions.create(model=MODEL, messages=USER)
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True}))
    assert whole.choices[0].message.content == REPLY
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    for usage in (whole.usage, chunks[-1].usage):
        assert usage is not None
        details = usage.prompt_tokens_details
        if version == NEW_VERSION:
            assert details is not None
            assert details.cached_tokens is not None
        else:
            assert details is None
    assert chunks[-1].usage is not None
    if version == NEW_VERSION:
        assert chunks[-1].usage.prompt_tokens_details is not None
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (
            chunks[-1].usage.prompt_tokens - 1)


def test_openai_tools_completions_and_models(proxy: Served) -> None:
    with openai_client(proxy.url) as client:
        completion = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
        text = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt="Hi", stream=True) if c.choices)
        models = {m.id for m in client.models.list()}
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    assert call.function.arguments == '{"city":"Paris","unit":"celsius"}'
    assert text == REPLY
    assert models == {m.name for m in MODELS}


def test_openai_errors(proxy: Served) -> None:
    """A late Ollama failure, which Ollama's own /v1 turns into a silent stop, reaches the
    SDK as an error through prefixpin (the stream ended without [DONE])."""
    with openai_client(proxy.url) as client:
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=USER, stream=True)
        proxy.ollama.inject(Fault("error_mid_stream", after_chunks=2, message="died"))
        with pytest.raises(openai.APIError, match="closed the stream"):
            list(client.chat.completions.create(model=MODEL, messages=USER, stream=True))


# --------------------------------------------------------------- during a long prefill

def slow_prefill() -> FakeOllamaConfig:
    """About 2.5 s of prefill for LONG, in 8-token batches; no model load."""
    return fake_config(sleep=FakeOllamaConfig().sleep, load_seconds=0.0,
                       prefill_seconds_per_token=0.05, batch_tokens=8)


LONG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "word " * 25}]
# Shorter than the prefill, and longer than the heartbeat (0.2 s) and the first byte (0.1 s)
# with 0.8 s to spare: the proxy serves from a thread of the test process, and once, late
# in a full run, the SDK waited over 0.5 s for headers the proxy sends at 0.1 s; a stall of
# the test process must not read as the proxy's silence.
READ_TIMEOUT = 1.0


def ollama_chat(base: str, stream: bool) -> str:
    with ollama_client(base, timeout=READ_TIMEOUT) as client:
        if stream:
            return "".join(p.message.content or "" for p in client.chat(
                model=MODEL, messages=LONG, stream=True))
        return client.chat(model=MODEL, messages=LONG).message.content or ""


def openai_chat(base: str, stream: bool) -> str:
    with openai_client(base, timeout=READ_TIMEOUT) as client:
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in client.chat.completions
                           .create(model=MODEL, messages=LONG, stream=True) if c.choices)
        return client.chat.completions.create(model=MODEL,
                                              messages=LONG).choices[0].message.content or ""


CLIENTS = {"ollama": ollama_chat, "openai": openai_chat}
TIMEOUTS = (httpx.ReadTimeout, openai.APITimeoutError)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(CLIENTS))
def test_a_streaming_client_survives_a_long_prefill_only_through_prefixpin(kind: str) -> None:
    chat = CLIENTS[kind]
    with served_fake(slow_prefill()) as ollama_url, pytest.raises(TIMEOUTS):
        chat(ollama_url, True)  # Ollama: no headers, no byte, until the first token
    with served_proxy(slow_prefill(), heartbeat_s=0.2) as proxy:
        assert chat(proxy.url, True) == REPLY


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(CLIENTS))
def test_a_non_streaming_client_gets_nothing_before_its_body(kind: str) -> None:
    """stream: false is never padded (ollama-python would fail to parse an error body
    that followed padding), so a client timeout shorter than the prefill still fires."""
    with served_proxy(slow_prefill(), heartbeat_s=0.2) as proxy, pytest.raises(TIMEOUTS):
        CLIENTS[kind](proxy.url, False)


@pytest.mark.slow
def test_what_a_raw_client_sees_during_the_prefill() -> None:
    """On the wire, through prefixpin: status and headers at once; on /api/chat a space
    at once and one per heartbeat, then Ollama's lines; on /v1 an SSE comment at once
    and one per heartbeat (": waiting for the engine"), then Ollama's events."""
    with served_proxy(slow_prefill(), heartbeat_s=0.2) as proxy:
        with httpx.stream("POST", f"{proxy.url}/api/chat", timeout=READ_TIMEOUT,
                          json={"model": MODEL, "messages": LONG}) as native:
            assert native.headers["content-type"] == "application/x-ndjson"
            body = b"".join(native.iter_raw())
        other = [{"role": "user", "content": "other " * 25}]  # not cached by the first
        with httpx.stream("POST", f"{proxy.url}/v1/chat/completions", timeout=READ_TIMEOUT,
                          json={"model": MODEL, "messages": other, "stream": True}) as v1:
            assert v1.headers["content-type"].startswith("text/event-stream")
            events = b"".join(v1.iter_raw()).split(b"\n\n")
    padding = body[:len(body) - len(body.lstrip(b" "))]
    assert len(padding) >= 5
    assert body.lstrip(b" ").startswith(b'{"model":')
    comments = [e for e in events if e.startswith(b":")]
    assert comments[0] == b": prefixpin"
    assert len(comments) >= 5
    assert set(comments[1:]) == {b": waiting for the engine"}


def test_one_persons_keyless_ollama_client_and_keyed_openai_sdk_are_both_answered(
        proxy: Served) -> None:
    """No tenants configured (Ollama's wire format, recorded; not a real Ollama): the
    ``ollama`` client sends no key and the ``openai`` SDK a dummy one; they are one person's
    clients, and both are answered on the Ollama lane whose cache every request shares."""
    with ollama_client(proxy.url) as keyless:
        native = keyless.chat(model=MODEL, messages=USER)
    with openai_client(proxy.url) as keyed:
        chat = keyed.chat.completions.create(model=MODEL, messages=USER)
    assert native.message.content == REPLY
    assert chat.choices[0].message.content == REPLY
