"""Anthropic Messages (``/v1/messages``: Claude Code, the ``anthropic`` SDK) through prefixpin
in front of Ollama: the same path as in front of llama-server. The codec converts the body
to chat completions and the lane asks Ollama on its OpenAI-compatible ``/v1/chat/completions``;
the answer comes back as Anthropic's stream or message, with the session kept.

Ollama cannot be installed here: the engine is the recorded-format fake
(``tests.fakes.fake_ollama``), served in process behind prefixpin on a loopback port, and
the client is the real ``anthropic`` SDK.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from .conftest import MODEL, MODELS, REPLY, THINKER, Served, served_proxy

KEY = "sk-ant-ollama"
BILLING = "x-anthropic-billing-header: cc_version=2.1.328.b7f; cc_entrypoint=sdk-cli;"
SYSTEM: list[dict[str, Any]] = [
    {"type": "text", "text": BILLING},
    {"type": "text", "text": "You are a terse assistant.",
           "cache_control": {"type": "ephemeral"}}]
QUESTION = {"role": "user", "content": [{"type": "text", "text": "Say hello.",
                                         "cache_control": {"type": "ephemeral"}}]}
WEATHER = {"name": "get_weather", "description": "Get the weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture
def proxy() -> Iterator[Served]:
    with served_proxy() as served:
        yield served


def sdk(served: Served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.url, api_key=KEY, max_retries=0, timeout=30)


def create(client: anthropic.Anthropic, **fields: Any) -> anthropic.types.Message:
    """``messages.create`` with plain dicts (the SDK's TypedDicts add nothing here)."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 64, **fields}
    message: anthropic.types.Message = client.messages.create(**body)
    return message


def forwarded(served: Served) -> list[tuple[str, dict[str, Any]]]:
    return [(path, body) for path, body in served.recorder.bodies if path.startswith("/v1/")]


@pytest.mark.parametrize("stream", [False, True])
def test_a_message_is_answered_from_ollamas_chat_api(proxy: Served, stream: bool) -> None:
    """The SDK's message, streamed or whole, carries Ollama's answer and its usage; Ollama
    was asked on /v1/chat/completions with the system blocks joined and the billing line's
    bytes as sent (Ollama has no slots: nothing to pin)."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "system": SYSTEM,
                            "messages": [QUESTION]}
    with sdk(proxy) as client:
        message: anthropic.types.Message
        if stream:
            with client.messages.stream(**body) as events:
                message = events.get_final_message()
        else:
            message = create(client, **body)
    assert message.type == "message"
    assert message.role == "assistant"
    assert "".join(b.text for b in message.content if b.type == "text") == REPLY
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens > 0
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) > 0
    [(path, sent)] = forwarded(proxy)
    assert path == "/v1/chat/completions"
    assert sent["model"] == MODEL
    # The billing line's per-conversation version suffix made constant.
    billing = SYSTEM[0]["text"].replace("2.1.328.b7f", "2.1.328.fff")
    assert sent["messages"][0] == {"role": "system", "content": billing + SYSTEM[1]["text"]}
    assert "cache_control" not in str(sent["messages"])


def test_a_tool_call_round_trip(proxy: Served) -> None:
    """Ollama's tool call comes back as a tool_use block; the tool_result sent back is
    Ollama's tool message, after the assistant's call."""
    with sdk(proxy) as client:
        first = create(client, messages=[QUESTION], tools=[WEATHER])
        [call] = [b for b in first.content if b.type == "tool_use"]
        assert first.stop_reason == "tool_use"
        assert call.name == "get_weather"
        assert call.input == dict(MODELS[0].tool_arguments)
        second = create(
            client, tools=[WEATHER],
            messages=[QUESTION, {"role": "assistant", "content": first.content},
                      {"role": "user", "content": [{"type": "tool_result",
                                                    "tool_use_id": call.id,
                                                    "content": "Sunny, 21 C"}]}])
    assert second.stop_reason == "end_turn"
    _, sent = forwarded(proxy)[-1]
    roles = [m["role"] for m in sent["messages"]]
    assert roles == ["user", "assistant", "tool"]
    assert sent["messages"][2] == {"role": "tool", "tool_call_id": call.id,
                                   "content": "Sunny, 21 C"}


def test_thinking_comes_back_as_a_thinking_block(proxy: Served) -> None:
    """A thinking model's reasoning (Ollama's ``reasoning`` on /v1) is the message's
    thinking block, before its text."""
    with sdk(proxy) as client:
        message = create(client, model=THINKER, messages=[QUESTION])
    thinking, text = message.content
    assert thinking.type == "thinking"
    assert thinking.thinking == MODELS[1].thinking
    assert text.type == "text"
    assert text.text == MODELS[1].reply


def test_a_second_turn_resumes_the_session_named_by_claude_codes_metadata(
        proxy: Served) -> None:
    """Claude Code names its session in ``metadata.user_id`` (a JSON string): the second
    turn, echoing the first answer with cache_control moved, resumes that session."""
    user_id = '{"device_id":"d1","account_uuid":"","session_id":"cc-session-1"}'
    with sdk(proxy) as client:
        first = create(client, system=SYSTEM, messages=[QUESTION],
                       metadata={"user_id": user_id})
        echoed = {"role": "user", "content": [{"type": "text", "text": "Say hello."}]}
        create(
            client, system=SYSTEM, metadata={"user_id": user_id},
            messages=[echoed, {"role": "assistant", "content": first.content},
                      {"role": "user", "content": [{"type": "text", "text": "Again.",
                                                    "cache_control": {"type": "ephemeral"}}]}])
    sessions = httpx.get(f"{proxy.admin_url}/sessions", timeout=10).json()
    [session] = [s for group in sessions["namespaces"].values() for s in group]
    assert session["key"] == "cc-session-1"
    assert session["api"] == "anthropic"
    assert session["last_decision"] == "resumed", session["last_reason"]


def test_a_bad_body_is_refused_in_anthropics_error_shape(proxy: Served) -> None:
    with sdk(proxy) as client, pytest.raises(anthropic.BadRequestError) as refused:
        create(client, messages=[{"role": "tool", "content": "x"}])
    assert refused.value.status_code == 400
    body = refused.value.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert forwarded(proxy) == []


def test_an_empty_conversation_gets_ollamas_own_400_in_anthropics_shape(
        proxy: Served) -> None:
    """The engine judges an empty ``messages`` list (llama-server generates from it);
    Ollama's chat API refuses it (``[] is too short``), said in Anthropic's shape."""
    with sdk(proxy) as client, pytest.raises(anthropic.BadRequestError) as refused:
        create(client, messages=[])
    body = refused.value.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    assert "too short" in body["error"]["message"]
    assert [path for path, _ in forwarded(proxy)] == ["/v1/chat/completions"]
