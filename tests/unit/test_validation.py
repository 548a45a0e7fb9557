"""Request validation: every bad input is a 4xx naming its field."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import AsyncIterator

import pytest

from prefixpin.core.errors import BadRequestError, PayloadTooLargeError
from prefixpin.proxy.pipeline.validation import TooManyValuesError, parse_request, read_body


def chat(body: object) -> bytes:
    return json.dumps(body).encode()


GOOD = {"messages": [{"role": "user", "content": "hi"}]}


def test_a_minimal_chat_body_parses() -> None:
    """The smallest valid chat request is accepted with its stream/usage/progress flags."""
    request = parse_request(chat({**GOOD, "stream": True,
                                  "stream_options": {"include_usage": True}}),
                            "chat", "/v1/chat/completions", max_messages=10)
    assert request.stream
    assert request.wants_usage
    assert not request.wants_progress


@pytest.mark.parametrize(("raw", "fragment"), [
    (b"", "empty"),
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe{}", "UTF-8"),
    (b"[1,2]", "JSON object"),
    (chat({}), "'messages' is required"),
    (chat({"messages": "hi"}), "'messages' is required"),
    (chat({"messages": [1]}), "messages[0]' must be an object"),
    (chat({"messages": [{"role": "wizard", "content": "x"}]}), "messages[0].role"),
    (chat({"messages": [{"content": "x"}]}), "messages[0].role"),
    (chat({"messages": [{"role": "user", "content": 5}]}), "messages[0].content"),
    (chat({"messages": [{"role": "user", "content": [1]}]}), "parts must be objects"),
    (chat({"messages": [{"role": "assistant", "tool_calls": {}}]}), "tool_calls"),
    (chat({**GOOD, "stream": "yes"}), "'stream' must be a boolean"),
    (chat({**GOOD, "stream_options": 3}), "stream_options"),
    (chat({**GOOD, "n": 2}), "'n' must be 1"),  # llama-server runs n_cmpl on other slots
    (b"[" * 100_000 + b"]" * 100_000, "too deeply"),
])
def test_bad_chat_bodies_are_rejected_with_a_reason(raw: bytes, fragment: str) -> None:
    """Each malformed body raises a 400 whose message says what is wrong."""
    with pytest.raises(BadRequestError) as caught:
        parse_request(raw, "chat", "/v1/chat/completions", max_messages=10)
    assert fragment in caught.value.message
    assert caught.value.status_code == 400


def test_an_empty_message_list_is_the_engine_s_to_judge() -> None:
    """llama-server generates from an empty list (its template's empty prompt); Ollama
    answers 400: the proxy forwards it and relays what the engine says."""
    request = parse_request(chat({"messages": []}), "chat", "/v1/chat/completions",
                            max_messages=10)
    assert request.body["messages"] == []


def test_too_many_messages_is_rejected() -> None:
    """The message-count limit protects the tokenizer and fingerprint from floods."""
    body = chat({"messages": [{"role": "user", "content": "x"}] * 11})
    with pytest.raises(BadRequestError, match="limit is 10"):
        parse_request(body, "chat", "/v1/chat/completions", max_messages=10)


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], ["a", 5]])
def test_completion_prompts_accept_strings_and_token_ids(prompt: object) -> None:
    """A completions prompt may be a string or an array of strings / token ids."""
    parse_request(chat({"prompt": prompt}), "completions", "/v1/completions", max_messages=1)


@pytest.mark.parametrize("prompt", [None, 5, [], [True], [{"x": 1}]])
def test_bad_completion_prompts_are_rejected(prompt: object) -> None:
    """Anything else is a 400 naming 'prompt'."""
    with pytest.raises(BadRequestError, match="'prompt'"):
        parse_request(chat({"prompt": prompt}), "completions", "/v1/completions", max_messages=1)


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


@pytest.mark.anyio
async def test_declared_length_over_the_limit_is_refused_before_reading() -> None:
    """A Content-Length over the limit is a 413 without reading the body."""
    with pytest.raises(PayloadTooLargeError):
        await read_body(_chunks(b"x"), "2048", max_bytes=1024)


@pytest.mark.anyio
async def test_streamed_body_over_the_limit_is_refused() -> None:
    """A body without Content-Length is cut off as soon as it passes the limit."""
    with pytest.raises(PayloadTooLargeError):
        await read_body(_chunks(b"x" * 600, b"x" * 600), None, max_bytes=1024)
    assert await read_body(_chunks(b"ab", b"cd"), None, max_bytes=1024) == b"abcd"


@pytest.mark.anyio
async def test_a_refused_body_lets_go_of_its_bytes_while_its_error_is_held() -> None:
    """The error's traceback holds the reading frame (in a cycle only the collector
    frees): the bytes read so far must not stay with it."""

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(200):
            yield bytes(64 * 1024)

    tracemalloc.start()
    try:
        with pytest.raises(PayloadTooLargeError) as refused:
            await read_body(chunks(), None, max_bytes=12 << 20)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused.value.__traceback__ is not None
    assert held < 1 << 20, held


@pytest.mark.anyio
async def test_a_body_of_too_many_values_is_refused_before_it_is_all_read() -> None:
    """Counted chunk by chunk: the chunks after the count passes are never read."""
    read: list[int] = []

    async def chunks() -> AsyncIterator[bytes]:
        for index in range(100):
            read.append(index)
            yield b"0," * 500

    with pytest.raises(TooManyValuesError):
        await read_body(chunks(), None, max_bytes=1 << 20, max_values=2_000)
    assert read == [0, 1, 2, 3, 4]
    body = b'{"a": [1, 2, 3]}'
    assert await read_body(_chunks(body), None, max_bytes=1024, max_values=4) == body


@pytest.mark.parametrize("value", [
    2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -(2**63), -(2**63) - 1, 10**30,
    1e20, 1.5, -0.0, 5e-324, "😀 \\u00e9 \u2028", None, True,
])
def test_values_parse_exactly_as_the_standard_library_reads_them(value: object) -> None:
    """The fast parser (orjson) reads integers past 64 bits as floats: such a body is read
    again by the standard library, so a client's number reaches the engine unchanged."""
    raw = chat({**GOOD, "metadata": {"x": value, "list": [value, {"y": value}]}})
    request = parse_request(raw, "chat", "/v1/chat/completions", max_messages=10)
    assert request.body == json.loads(raw)
    parsed = request.body["metadata"]["x"]
    assert type(parsed) is type(value)
    assert parsed == value
