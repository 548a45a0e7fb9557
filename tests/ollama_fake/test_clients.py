"""The real ``ollama`` Python client and the ``openai`` SDK work against the fake served by
uvicorn on a loopback port: chat streaming and not, generate, tools, thinking, errors."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import httpx
import ollama
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from tests.fakes.fake_ollama import NEW_VERSION, OLD_VERSION, Fault, fake_ollama_state

from .conftest import MODELS, Serve, make_config

OllamaFor = Callable[[str], ollama.Client]
OpenAIFor = Callable[[str], openai.OpenAI]

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]
REPLY = MODELS[0].reply
TOOLS: list[ChatCompletionToolParam] = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture
def ollama_for() -> Iterator[OllamaFor]:
    with contextlib.ExitStack() as clients:
        yield lambda base: clients.enter_context(ollama.Client(host=base))


@pytest.fixture
def openai_for() -> Iterator[OpenAIFor]:
    with contextlib.ExitStack() as clients:
        yield lambda base: clients.enter_context(
            openai.OpenAI(base_url=f"{base}/v1", api_key="ollama", max_retries=0))


def consume(parts: Iterable[Any], seen: list[Any]) -> None:
    for part in parts:
        seen.append(part)


# ----------------------------------------------------------------------- ollama client

def test_ollama_chat_not_streaming(serve: Serve, ollama_for: OllamaFor) -> None:
    _, base = serve(make_config())
    response = ollama_for(base).chat(model="fake-smol", messages=USER)
    assert (response.message.role, response.message.content) == ("assistant", REPLY)
    assert (response.done, response.done_reason) == (True, "stop")
    assert response.eval_count
    assert response.prompt_eval_count
    assert response.load_duration


def test_ollama_chat_streaming(serve: Serve, ollama_for: OllamaFor) -> None:
    _, base = serve(make_config())
    parts = list(ollama_for(base).chat(model="fake-smol", messages=USER, stream=True))
    assert "".join(p.message.content or "" for p in parts) == REPLY
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].eval_count == len(parts) - 1


def test_ollama_generate_streaming_and_context(serve: Serve, ollama_for: OllamaFor) -> None:
    _, base = serve(make_config())
    client = ollama_for(base)
    parts = list(client.generate(model="fake-smol", prompt="Hi", stream=True))
    assert "".join(p.response or "" for p in parts) == REPLY
    assert parts[-1].context
    follow = client.generate(model="fake-smol", prompt="More", context=parts[-1].context)
    assert follow.response == REPLY


def test_ollama_tool_calls_have_object_arguments(serve: Serve, ollama_for: OllamaFor) -> None:
    _, base = serve(make_config())
    response = ollama_for(base).chat(model="fake-smol", messages=USER, tools=TOOLS)
    [call] = response.message.tool_calls or []
    assert call.function.name == "get_weather"
    assert call.function.arguments == {"city": "Paris"}


def test_ollama_thinking(serve: Serve, ollama_for: OllamaFor) -> None:
    _, base = serve(make_config())
    response = ollama_for(base).chat(model="fake-think", messages=USER, think=True)
    assert response.message.thinking == MODELS[1].thinking
    assert response.message.content == MODELS[1].reply


def test_ollama_keep_alive_and_lifecycle(serve: Serve, ollama_for: OllamaFor) -> None:
    app, base = serve(make_config())
    client = ollama_for(base)
    client.chat(model="fake-smol", messages=USER, keep_alive="10m")
    assert [m.model for m in client.ps().models] == ["fake-smol:latest"]
    client.chat(model="fake-smol", messages=[], keep_alive=0)
    assert client.ps().models == []
    assert not fake_ollama_state(app).is_loaded("fake-smol")


def test_ollama_list_show_and_version(serve: Serve, ollama_for: OllamaFor) -> None:
    _, base = serve(make_config())
    client = ollama_for(base)
    assert {m.model for m in client.list().models} == {m.name for m in MODELS}
    assert "thinking" in (client.show("fake-think").capabilities or [])
    assert httpx.get(f"{base}/api/version").json() == {"version": NEW_VERSION}


def test_ollama_errors_carry_ollamas_status(serve: Serve, ollama_for: OllamaFor) -> None:
    app, base = serve(make_config())
    client = ollama_for(base)
    with pytest.raises(ollama.ResponseError) as missing:
        client.chat(model="nope", messages=USER)
    assert (missing.value.status_code, missing.value.error) == (404, "model 'nope' not found")

    fake_ollama_state(app).inject(Fault("error_before_headers", status=500, message="crashed"))
    with pytest.raises(ollama.ResponseError) as early:
        list(client.chat(model="fake-smol", messages=USER, stream=True))
    assert (early.value.status_code, early.value.error) == (500, "crashed")

    fake_ollama_state(app).inject(Fault("error_mid_stream", after_chunks=2, message="died"))
    seen: list[Any] = []
    stream = client.chat(model="fake-smol", messages=USER, stream=True)
    with pytest.raises(ollama.ResponseError) as late:
        consume(stream, seen)
    assert len(seen) == 2
    assert (late.value.status_code, late.value.error) == (-1, "died")  # the status was 200


def test_a_dropped_connection_is_a_transport_error(serve: Serve, ollama_for: OllamaFor) -> None:
    app, base = serve(make_config())
    fake_ollama_state(app).inject(Fault("drop_mid_stream", after_chunks=2))
    stream = ollama_for(base).chat(model="fake-smol", messages=USER, stream=True)
    with pytest.raises(httpx.RemoteProtocolError):
        consume(stream, [])


# --------------------------------------------------------------------------- openai SDK

def test_openai_chat_not_streaming(serve: Serve, openai_for: OpenAIFor) -> None:
    _, base = serve(make_config(version=NEW_VERSION))
    client = openai_for(base)
    client.chat.completions.create(model="fake-smol", messages=USER)  # fills the cache
    completion = client.chat.completions.create(model="fake-smol", messages=USER)
    assert completion.choices[0].message.content == REPLY
    assert completion.choices[0].finish_reason == "stop"
    usage = completion.usage
    assert usage is not None
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


@pytest.mark.parametrize("version", [OLD_VERSION, NEW_VERSION])
def test_openai_chat_streaming_with_usage(serve: Serve, openai_for: OpenAIFor,
                                          version: str) -> None:
    _, base = serve(make_config(version=version))
    chunks = list(openai_for(base).chat.completions.create(
        model="fake-smol", messages=USER, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens_details is not None) == (version == NEW_VERSION)


def test_openai_tool_calls_have_string_arguments(serve: Serve, openai_for: OpenAIFor) -> None:
    _, base = serve(make_config())
    completion = openai_for(base).chat.completions.create(
        model="fake-smol", messages=USER, tools=TOOLS)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    assert call.type == "function"
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city":"Paris"}')


def test_openai_completions_and_models(serve: Serve, openai_for: OpenAIFor) -> None:
    _, base = serve(make_config())
    client = openai_for(base)
    stream = client.completions.create(model="fake-smol", prompt="Hi", stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == REPLY
    assert {m.id for m in client.models.list()} == {m.name for m in MODELS}
    assert client.models.retrieve("fake-smol").owned_by == "library"


def test_openai_errors(serve: Serve, openai_for: OpenAIFor) -> None:
    app, base = serve(make_config())
    client = openai_for(base)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=USER, stream=True)
    assert missing.value.body == {"message": "model 'nope' not found", "type": "not_found_error",
                                  "param": None, "code": None}

    fake_ollama_state(app).inject(Fault("error_mid_stream", after_chunks=2, message="died"))
    chunks = list(client.chat.completions.create(model="fake-smol", messages=USER, stream=True))
    # Ollama's /v1 middleware swallows a late error: the stream just stops, unfinished.
    assert all(c.choices[0].finish_reason is None for c in chunks)
    assert chunks[-1].model == ""
