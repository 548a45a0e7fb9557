"""The OpenAI Responses codec (``/v1/responses``), without an engine.

The request conversion is llama-server's own (``server_chat_convert_responses_to_chatcmpl``):
its output for a Codex-shaped body, recorded from the build the rig runs, is pinned here,
with the places the proxy differs on purpose (proxy/codecs/responses_convert.py). The
answers are checked with the real client: the encoder's bytes (from llama-server's OpenAI
chat chunks, classified into frames as the adapter does) are served to the official
``openai`` SDK through a mock transport, and what the SDK makes of them is compared with
what llama-server itself answers on ``/v1/responses`` (recorded from the same build).
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import httpx2
import openai
import pytest

from prefixpin.core.errors import (
    BadRequestError,
    ProxyError,
    UpstreamStatusError,
    UpstreamUnavailableError,
)
from prefixpin.core.frames import Frame, FrameKind
from prefixpin.core.sse import SSEDecoder
from prefixpin.proxy.codecs import OPENAI_RESPONSES, codec_at, codec_of
from prefixpin.proxy.codecs.responses import ResponsesCodec
from prefixpin.proxy.codecs.responses_convert import DROPPED, to_chat
from prefixpin.proxy.pipeline.validation import ClientRequest
from prefixpin.proxy.session.identity import explicit_identity
from tests.unit.chat_stream import DONE, frames_of, generation, sse

CODEC = ResponsesCodec()
MODEL = "/root/.cache/prefixpin/models/SmolLM2-135M-Instruct.Q4_1.gguf"
ENVELOPE = {"created": 1796128722, "id": "chatcmpl-Ty3LYjlvr6OPMr5BRK2i3NUYuhQkfCLg",
            "model": MODEL, "system_fingerprint": "b1-0c1e570",
            "object": "chat.completion.chunk"}
ROLE = {"role": "assistant", "content": None}


def chunk(delta: Mapping[str, Any] | None = None, finish: str | None = None,
          **extra: Any) -> bytes:
    return sse({"choices": [{"finish_reason": finish, "index": 0, "delta": delta or {}}],
                **ENVELOPE, **extra})


def usage_chunk(usage: Mapping[str, Any], timings: Mapping[str, Any] | None = None) -> bytes:
    return sse({"choices": [], **ENVELOPE, "usage": usage,
                **({"timings": timings} if timings is not None else {})})


TIMINGS = {"cache_n": 31, "prompt_n": 1, "prompt_ms": 371.607,
           "prompt_per_token_ms": 371.607, "prompt_per_second": 2.6910149701162784,
           "predicted_n": 8, "predicted_ms": 659.982,
           "predicted_per_token_ms": 94.28314285714285, "predicted_per_second": 10.606349870147973}
PIECES = ("I", "'m", " glad", " you", "'re", " enjoying", " the", " chat")
TEXT = "".join(PIECES)

# llama-server (this build) on /v1/chat/completions: the conversion of {"input": "Say hi"},
# greedy, max_tokens 8, with return_progress and include_usage (what the adapter asks for).
RECORDED = b"".join([
    chunk(ROLE, prompt_progress={"total": 32, "cache": 31, "processed": 31, "time_ms": 0}),
    chunk(ROLE, prompt_progress={"total": 32, "cache": 31, "processed": 32, "time_ms": 371}),
    chunk(ROLE),
    *(chunk({"content": piece}) for piece in PIECES),
    chunk(finish="length"),
    usage_chunk({"completion_tokens": 8, "prompt_tokens": 32, "total_tokens": 40,
                 "prompt_tokens_details": {"cached_tokens": 31}}, TIMINGS),
    DONE,
])
# The same request on llama-server's own /v1/responses (stream: true): its event types.
DIRECT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                 "response.content_part.added", *["response.output_text.delta"] * 8,
                 "response.output_text.done", "response.content_part.done",
                 "response.output_item.done", "response.completed"]
DIRECT_USAGE = {"input_tokens": 32, "output_tokens": 8, "total_tokens": 40,
                "input_tokens_details": {"cached_tokens": 31}}

# An answer with every kind of item, in llama-server's chat chunks (its
# ``server_chat_msg_diff_to_json_oaicompat``): reasoning, text, two tool calls (the second
# without arguments).
BLOCKS = b"".join([
    chunk(ROLE, prompt_progress={"total": 50, "cache": 0, "processed": 50, "time_ms": 9}),
    chunk(ROLE),
    chunk({"reasoning_content": "The user wants"}),
    chunk({"reasoning_content": " the weather."}),
    chunk({"content": "Let me check."}),
    chunk({"tool_calls": [{"index": 0, "id": "Xy12", "type": "function",
                           "function": {"name": "get_weather", "arguments": '{"location":'}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' "Paris"}'}}]}),
    chunk({"tool_calls": [{"index": 1, "id": "Zz34", "type": "function",
                           "function": {"name": "get_time"}}]}),
    chunk(finish="tool_calls"),
    usage_chunk({"completion_tokens": 30, "prompt_tokens": 50, "total_tokens": 80,
                 "prompt_tokens_details": {"cached_tokens": 0}}),
    DONE,
])
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a place",
          "parameters": {"type": "object", "properties": {"location": {"type": "string"}}}},
         {"type": "function", "name": "get_time", "parameters": {"type": "object",
                                                                  "properties": {}}}]


USER = {"model": "smol", "input": "Say hi", "max_output_tokens": 8, "temperature": 0}


def parse(body: Mapping[str, Any], max_messages: int = 100) -> ClientRequest:
    return CODEC.parse(json.dumps(body).encode(), "/v1/responses", max_messages=max_messages)


def live_stream(raw: bytes, *, fill_cached: bool = True, batch: int = 1,
                client: ClientRequest | None = None, fail: ProxyError | None = None) -> bytes:
    """What a streaming client receives: the opening, the frames encoded as they come (the
    generation's frame log growing as the engine sends them), the flush and, when the
    generation failed, the late error."""
    gen = generation(completed=False)
    encoder = CODEC.stream(client or parse(USER), gen, fill_cached=fill_cached)
    frames = frames_of(raw)
    out = [CODEC.opening]
    for at in range(0, len(frames), batch):
        part = frames[at:at + batch]
        gen.frames += part
        gen.progress = next((f.progress for f in reversed(gen.frames) if f.progress), None)
        gen.completed = any(f.kind is FrameKind.DONE for f in gen.frames)
        out.append(encoder.encode(part))
    gen.error = fail
    out.append(encoder.flush() or b"")
    if fail is not None:
        out.append(CODEC.late_error(fail))
    return b"".join(out)


def events_of(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    decoder = SSEDecoder()
    return [(e.event, json.loads(e.data)) for e in [*decoder.feed(raw), *decoder.flush()]
            if e.data]


def whole_body(raw: bytes, client: ClientRequest | None = None, *,
               fill_cached: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(bytes(CODEC.whole(
        client or parse(USER), generation(frames_of(raw)), fill_cached=fill_cached).body))
    return body


# -- the real client ---------------------------------------------------------------------

Handler = Callable[[httpx2.Request], httpx2.Response]


def sdk(handler: Handler) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://prefixpin/v1", api_key="test", max_retries=0,
                         http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))


def serving(body: bytes, *, status: int = 200,
            content_type: str = "text/event-stream") -> openai.OpenAI:
    return sdk(lambda request: httpx2.Response(status, content=body,
                                               headers={"content-type": content_type}))


def sdk_events(raw: bytes) -> list[Any]:
    return list(serving(raw).responses.create(model="smol", input="hi", stream=True))


def sdk_final(raw: bytes, **params: Any) -> openai.types.responses.Response:
    with serving(raw).responses.stream(model="smol", input="hi", **params) as stream:
        for _ in stream:
            pass
        return stream.get_final_response()


def sent_body(**params: Any) -> dict[str, Any]:
    """The body the SDK sends for ``responses.create(**params)``."""
    seen: list[bytes] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request.read())
        return httpx2.Response(200, content=json.dumps(whole_body(RECORDED)),
                               headers={"content-type": "application/json"})

    sdk(handler).responses.create(**params)
    body: dict[str, Any] = json.loads(seen[0])
    return body


# -- registry ----------------------------------------------------------------------------


def test_the_codec_is_registered_for_v1_responses() -> None:
    client = parse(USER)
    assert codec_at("/v1/responses") is OPENAI_RESPONSES
    assert codec_at("/responses") is OPENAI_RESPONSES  # llama-server's bare alias
    assert isinstance(OPENAI_RESPONSES, ResponsesCodec)
    assert codec_of(client) is OPENAI_RESPONSES
    assert (CODEC.api, CODEC.engine_api, CODEC.endpoint) == ("responses", "openai", "chat")
    assert (client.api, client.endpoint, client.path) == ("responses", "chat",
                                                          "/v1/chat/completions")
    assert client.source == USER
    assert client.body == {"model": "smol", "temperature": 0, "max_tokens": 8,
                           "messages": [{"role": "user", "content": "Say hi"}]}
    assert not client.stream
    assert parse({**USER, "stream": True}).stream
    assert CODEC.opening == b": prefixpin\n\n"
    assert CODEC.media_type == "text/event-stream"


def test_codex_session_key_reaches_identity() -> None:
    """Codex sets ``prompt_cache_key`` to its session id: kept, so identity reads it."""
    client = parse({**USER, "prompt_cache_key": "019a-thread", "store": False})
    identity = explicit_identity(client.body, {})
    assert identity is not None
    assert (identity.key, identity.source) == ("019a-thread", "body.prompt_cache_key")


# -- the conversion ----------------------------------------------------------------------

# A Codex-shaped body (two developer parts, an AGENTS.md + environment context message,
# an echoed turn: reasoning, message, function call and its output, a message echoed by
# the SDK with its id), and what llama-server's own converter made of it (its debug log,
# "converted request", this build).
CODEX_BODY: dict[str, Any] = {
    "model": "gpt-5-codex", "instructions": "You are Codex.",
    "input": [
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "<permissions instructions>sandbox</permissions "
                                           "instructions>"},
            {"type": "input_text", "text": "<collaboration_mode>default</collaboration_mode>"}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "# AGENTS.md\nBe terse."},
            {"type": "input_text", "text": "<environment_context>\n  <cwd>/w</cwd>\n"
                                           "</environment_context>"}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "List the files."}]},
        {"type": "reasoning", "summary": [], "encrypted_content": "",
         "content": [{"type": "reasoning_text", "text": "Run ls."}]},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Listing."}]},
        {"type": "function_call", "name": "shell", "arguments": '{"command":["ls"]}',
         "call_id": "call_abc"},
        {"type": "function_call_output", "call_id": "call_abc", "output": "a.txt\nb.txt"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Two files.", "annotations": [],
                      "logprobs": []}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Thanks"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA",
             "detail": "auto"}]}],
    "tools": [{"type": "function", "name": "shell", "description": "Runs a shell command",
               "strict": False, "parameters": {
                   "type": "object", "properties": {"command": {
                       "type": "array", "items": {"type": "string"}}},
                   "required": ["command"]}},
              {"type": "function", "name": "update_plan",
               "parameters": {"type": "object", "properties": {}}},
              {"type": "web_search"}, {"type": "custom", "name": "apply_patch"}],
    "tool_choice": "auto", "parallel_tool_calls": False,
    "reasoning": {"effort": "medium", "summary": "auto"}, "store": False, "stream": True,
    "include": ["reasoning.encrypted_content"], "prompt_cache_key": "019a-session",
    "text": {"verbosity": "medium"}, "client_metadata": {"x": "y"}, "max_output_tokens": 1,
    "temperature": 0,
}
LLAMA_CONVERTED: dict[str, Any] = {
    "model": "gpt-5-codex", "tool_choice": "auto", "parallel_tool_calls": False,
    "store": False, "stream": True, "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "019a-session", "text": {"verbosity": "medium"},
    "client_metadata": {"x": "y"}, "temperature": 0,
    "messages": [
        {"role": "system", "content": "You are Codex."},
        {"role": "developer", "content": [
            {"text": "<permissions instructions>sandbox</permissions instructions>",
             "type": "text"},
            {"text": "<collaboration_mode>default</collaboration_mode>", "type": "text"}]},
        {"role": "user", "content": [
            {"text": "# AGENTS.md\nBe terse.", "type": "text"},
            {"text": "<environment_context>\n  <cwd>/w</cwd>\n</environment_context>",
             "type": "text"}]},
        {"role": "user", "content": [{"text": "List the files.", "type": "text"}]},
        {"role": "assistant", "content": [{"text": "Listing.", "type": "text"}],
         "reasoning_content": "Run ls.",
         "tool_calls": [{"function": {"arguments": '{"command":["ls"]}', "name": "shell"},
                         "id": "call_abc", "type": "function"}]},
        {"content": "a.txt\nb.txt", "role": "tool", "tool_call_id": "call_abc"},
        {"role": "assistant", "id": "msg_1", "content": [{"text": "Two files.",
                                                          "type": "text"}]},
        {"role": "user", "content": [
            {"text": "Thanks", "type": "text"},
            {"image_url": {"url": "data:image/png;base64,AAAA"}, "type": "image_url"}]}],
    "tools": [
        {"type": "function", "function": {
            "name": "shell", "description": "Runs a shell command", "strict": False,
            "parameters": {"type": "object", "properties": {"command": {
                "type": "array", "items": {"type": "string"}}}, "required": ["command"]}}},
        {"type": "function", "function": {
            "name": "update_plan", "parameters": {"type": "object", "properties": {}},
            "strict": True}}],
    "max_tokens": 1, "reasoning_effort": "medium",
}


def test_the_conversion_is_llama_servers_own_with_the_documented_differences() -> None:
    """Every message, tool and field as llama-server converts them, except: the fields it
    ignores are dropped (``DROPPED``), a message keeps only what llama.cpp renders (the
    SDK's ``id`` goes), and an assistant's text parts are one string (what llama.cpp
    renders a list of them as)."""
    expected = copy.deepcopy(LLAMA_CONVERTED)
    for name in DROPPED:
        expected.pop(name, None)
    for message in expected["messages"]:
        message.pop("id", None)
        if message["role"] == "assistant":
            message["content"] = "\n".join(part["text"] for part in message["content"])
    assert to_chat(CODEX_BODY) == expected
    assert parse(CODEX_BODY).body == expected
    assert not set(DROPPED) & set(parse(CODEX_BODY).body)


def test_string_input_and_instructions() -> None:
    assert to_chat({"input": "hi", "instructions": "Be brief."})["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    # llama-server reads a null ``instructions`` as "" (an empty system message).
    assert to_chat({"input": "hi", "instructions": None})["messages"][0] == {
        "role": "system", "content": ""}
    assert to_chat({"input": [{"role": "user", "content": "hi"}]})["messages"] == [
        {"role": "user", "content": [{"text": "hi", "type": "text"}]}]


def test_output_items_merge_into_one_assistant_message() -> None:
    """reasoning, message and function calls of one turn are one assistant message; a
    function call without an assistant before it opens one; two messages join with a
    newline (llama.cpp's join)."""
    messages = to_chat({"input": [
        {"role": "user", "content": "q"},
        {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c1"},
        {"type": "function_call", "name": "g", "arguments": "{}", "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "one"}]},
        {"type": "function_call_output", "call_id": "c2", "output": "two"},
        {"role": "assistant", "content": "typeless"},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "second"}]},
        {"type": "reasoning", "summary": [], "content": [
            {"type": "reasoning_text", "text": "late"}]},
    ]})["messages"]
    assert messages[1:] == [
        {"role": "assistant", "tool_calls": [
            {"function": {"arguments": "{}", "name": "f"}, "id": "c1", "type": "function"},
            {"function": {"arguments": "{}", "name": "g"}, "id": "c2", "type": "function"}]},
        {"content": [{"type": "text", "text": "one"}], "role": "tool", "tool_call_id": "c1"},
        {"content": "two", "role": "tool", "tool_call_id": "c2"},
        {"role": "assistant", "content": "typeless\nsecond", "reasoning_content": "late"},
    ]


@pytest.mark.parametrize("reasoning", [
    {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAB..."},
    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}], "content": None,
     "encrypted_content": None},
    {"type": "reasoning", "summary": [], "content": []},
    {"type": "reasoning", "id": "rs_1"},
])
def test_reasoning_without_text_contributes_nothing(reasoning: dict[str, Any]) -> None:
    """Encrypted or summary-only reasoning (OpenAI's, Codex echoing it) has no text the
    engine could render: nothing, where llama-server refuses the request."""
    turn = [{"role": "user", "content": "q"}, reasoning,
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "a"}]}]
    assert to_chat({"input": turn})["messages"][1:] == [{"role": "assistant", "content": "a"}]
    alone = to_chat({"input": [{"role": "user", "content": "q"}, reasoning]})
    assert alone["messages"] == [{"role": "user", "content": [{"text": "q", "type": "text"}]}]


def test_tools_fields_and_what_is_dropped() -> None:
    body = to_chat({
        "input": "hi", "tools": [{"type": "web_search"}, {"type": "local_shell"}],
        "max_output_tokens": None, "reasoning": {"summary": "auto"}, "store": True,
        "include": [], "client_metadata": {"a": "b"}, "service_tier": "auto",
        "truncation": "auto", "safety_identifier": "u", "background": False,
        "parallel_tool_calls": True, "metadata": {"k": "v"}, "user": "me", "top_k": 1})
    assert body == {"messages": [{"role": "user", "content": "hi"}],
                    "parallel_tool_calls": True, "metadata": {"k": "v"}, "user": "me",
                    "top_k": 1}
    assert to_chat({"input": "hi", "tools": None}) == {
        "messages": [{"role": "user", "content": "hi"}]}
    strict = to_chat({"input": "hi", "tools": TOOLS[:1]})["tools"]
    assert strict == [{"type": "function", "function": {**{k: v for k, v in TOOLS[0].items()
                                                           if k != "type"}, "strict": True}}]
    assert to_chat({"input": "hi", "reasoning": None}) == {
        "messages": [{"role": "user", "content": "hi"}]}


def _error(body: Mapping[str, Any], max_messages: int = 100) -> BadRequestError:
    with pytest.raises(BadRequestError) as caught:
        parse(body, max_messages)
    return caught.value


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m"}, "input"),
    ({"input": 3}, "input"),
    ({"input": []}, "input"),
    ({"input": ["hi"]}, "input[0]"),
    ({"input": "hi", "previous_response_id": "resp_123"}, "previous_response_id"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "conversation": {"id": "conv_1"}}, "conversation"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "hi", "instructions": ["x"]}, "instructions"),
    ({"input": "hi", "tools": {"type": "function"}}, "tools"),
    ({"input": "hi", "tools": ["shell"]}, "tools[0]"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "hi", "max_output_tokens": "8"}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 8.5}, "max_output_tokens"),
    ({"input": "hi", "stream": "yes"}, "stream"),
    ({"input": "hi", "temperature": "hot"}, "temperature"),
    ({"input": "hi", "top_p": True}, "top_p"),
    ({"input": "hi", "reasoning": "high"}, "reasoning"),
    ({"input": "hi", "reasoning": {"effort": 3}}, "reasoning.effort"),
    ({"input": "hi", "seed": "x"}, "seed"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "t"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "input[0].content[0].text"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]},
     "input[0].content[0].text"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
     "input[0].content[0].image_url"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": [{"type": "function_call", "name": "f", "call_id": "c"}]},
     "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 1}]},
     "input[0].output"),
    ({"input": [{"type": "reasoning", "summary": [], "content": [{"type": "x"}]}]},
     "input[0].content[0].text"),
    ({"input": [{"role": "assistant", "content": [{"type": "image"}]}]},
     "input[0].content[0].type"),
])
def test_refused_bodies_name_the_field(body: dict[str, Any], param: str) -> None:
    error = _error(body)
    assert error.param == param
    assert error.status_code == 400
    assert param.split("[")[0].split(".")[0] in error.message


def test_stateful_fields_are_refused_with_a_clear_message() -> None:
    error = _error({"input": "hi", "previous_response_id": "resp_123"})
    assert "previous_response_id" in error.message
    assert "whole conversation" in error.message
    # unset, null or "" (what some clients send for "none") is accepted, as llama-server does
    for empty in (None, ""):
        assert parse({"input": "hi", "previous_response_id": empty}).body == {
            "messages": [{"role": "user", "content": "hi"}]}


def test_the_structural_rules_of_every_format_apply() -> None:
    """Size, nesting, NaN and surrogates are refused as for chat bodies; the message count
    limit counts converted messages."""
    for raw in (b"", b"[]", b'{"input": NaN}', b'{"input": "\\ud800"}',
                b'{"input": ' + b"[" * 120 + b"]" * 120 + b"}"):
        with pytest.raises(BadRequestError):
            CODEC.parse(raw, "/v1/responses", max_messages=10)
    many = {"input": [{"role": "user", "content": str(i)} for i in range(5)]}
    assert _error(many, max_messages=4).param == "input"
    assert len(parse(many, max_messages=5).body["messages"]) == 5
    assert not math.isnan(parse({"input": "hi", "temperature": 0.5}).body["temperature"])


# -- streamed ----------------------------------------------------------------------------


def test_stream_has_llama_servers_events_and_the_sdk_reads_them() -> None:
    raw = live_stream(RECORDED)
    assert raw.startswith(b": prefixpin\n\n")
    events = events_of(raw)
    assert [kind for kind, _ in events] == DIRECT_EVENTS
    assert [data["type"] for _, data in events] == DIRECT_EVENTS
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    deltas = [data["delta"] for kind, data in events if kind == "response.output_text.delta"]
    assert deltas == list(PIECES)
    completed = events[-1][1]
    assert completed["response"]["usage"] == {**DIRECT_USAGE,
                                              "output_tokens_details": {"reasoning_tokens": 0}}
    assert completed["timings"] == TIMINGS
    assert completed["response"]["status"] == "completed"
    ids = {data["response"]["id"] for kind, data in events if "response" in data}
    assert len(ids) == 1
    assert next(iter(ids)).startswith("resp_")
    parsed = sdk_events(raw)
    assert [event.type for event in parsed] == DIRECT_EVENTS
    assert "".join(e.delta for e in parsed if e.type == "response.output_text.delta") == TEXT
    final = sdk_final(raw)
    assert final.output_text == TEXT
    assert final.status == "completed"
    assert final.usage is not None
    assert final.usage.input_tokens_details.cached_tokens == 31
    assert final.usage.output_tokens_details.reasoning_tokens == 0
    message = final.output[0]
    assert message.type == "message"
    assert message.id is not None
    assert message.id.startswith("msg_")


def test_the_stream_does_not_depend_on_how_frames_are_batched() -> None:
    def shape(raw: bytes) -> list[tuple[str, Any, Any]]:
        return [(kind, data.get("delta"), data["sequence_number"])
                for kind, data in events_of(raw)]

    one = shape(live_stream(BLOCKS, batch=1))
    assert shape(live_stream(BLOCKS, batch=4)) == one
    assert shape(live_stream(BLOCKS, batch=1000)) == one


def test_reasoning_text_and_tool_calls_stream_as_items() -> None:
    raw = live_stream(BLOCKS, client=parse({**USER, "tools": TOOLS}))
    events = events_of(raw)
    kinds = [kind for kind, _ in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.output_item.added",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    added = [data["item"] for kind, data in events if kind == "response.output_item.added"]
    assert [(item["type"], item["status"]) for item in added] == [
        ("reasoning", "in_progress"), ("message", "in_progress"),
        ("function_call", "in_progress"), ("function_call", "in_progress")]
    assert [data["output_index"] for kind, data in events
            if kind == "response.output_item.done"] == [0, 1, 2, 3]
    final = sdk_final(raw, tools=TOOLS)
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call",
                                                    "function_call"]
    reasoning, _, weather, time_call = final.output
    assert reasoning.type == "reasoning"
    assert reasoning.content is not None
    assert reasoning.content[0].text == "The user wants the weather."
    assert final.output_text == "Let me check."
    assert weather.type == "function_call"
    assert time_call.type == "function_call"
    # The engine's tool call id, unchanged, is the call id the client sends back.
    assert (weather.call_id, weather.id, weather.name) == ("Xy12", "fc_Xy12", "get_weather")
    assert json.loads(weather.arguments) == {"location": "Paris"}
    assert (time_call.call_id, time_call.name, time_call.arguments) == ("Zz34", "get_time", "")
    assert final.usage is not None
    assert final.usage.output_tokens_details.reasoning_tokens == 2
    assert [getattr(tool, "name", None) for tool in final.tools] == ["get_weather",
                                                                    "get_time"]  # echoed


def test_progress_and_pings_are_silent_unless_asked() -> None:
    gen = generation(completed=False)
    frames = frames_of(RECORDED)
    progress = [f for f in frames if f.kind is FrameKind.PROGRESS]
    assert len(progress) == 2  # the role chunks that carry prompt progress
    role = frames[2]  # the role chunk without progress: an output chunk with no output
    encoder = CODEC.stream(parse(USER), gen, fill_cached=True)
    assert encoder.encode([*progress, Frame(FrameKind.PING, b":\n\n"), role]) == b""
    asked = CODEC.stream(parse({**USER, "return_progress": True}), gen, fill_cached=True)
    events = events_of(asked.encode([*progress, role]))
    assert [kind for kind, _ in events] == ["response.created", "response.in_progress",
                                            "response.in_progress"]
    assert "prompt_progress" not in events[0][1]
    assert events[1][1]["prompt_progress"] == {"total": 32, "cache": 31, "processed": 31,
                                               "time_ms": 0}
    assert events[2][1]["prompt_progress"]["processed"] == 32
    assert {data["response"]["status"] for _, data in events} == {"in_progress"}


def test_per_token_timings_ride_on_the_delta_events_when_asked() -> None:
    """llama-server's ``timings_per_token`` puts the engine's timings on every chunk; its
    own /v1/responses copies them onto each delta event, and so does this codec (found by
    llama.cpp's test_responses_stream_with_llama_telemetry). Unasked, no delta has them."""
    raw = chunk({"content": "Hi"}, timings=TIMINGS) + chunk({"content": "!"}, timings=TIMINGS) \
        + chunk(finish="stop") + usage_chunk({"prompt_tokens": 3, "completion_tokens": 2,
                                               "total_tokens": 5}, TIMINGS) + DONE
    asked = [data for kind, data in events_of(live_stream(
        raw, client=parse({**USER, "timings_per_token": True})))
        if kind == "response.output_text.delta"]
    assert [d["delta"] for d in asked] == ["Hi", "!"]
    assert all(d["timings"] == TIMINGS for d in asked)
    plain = [data for kind, data in events_of(live_stream(raw))
             if kind == "response.output_text.delta"]
    assert [d["delta"] for d in plain] == ["Hi", "!"]
    assert not any("timings" in d for d in plain)


def test_cached_tokens_are_filled_only_where_the_engine_measures_them() -> None:
    bare = RECORDED.replace(b',"prompt_tokens_details":{"cached_tokens":31}', b"")
    filled = events_of(live_stream(bare))[-1][1]["response"]["usage"]
    assert filled["input_tokens_details"] == {"cached_tokens": 31}  # from timings.cache_n
    unmeasured = events_of(live_stream(bare, fill_cached=False))[-1][1]["response"]["usage"]
    assert "input_tokens_details" not in unmeasured
    assert unmeasured["input_tokens"] == 32
    assert whole_body(bare)["usage"]["input_tokens_details"] == {"cached_tokens": 31}
    assert "input_tokens_details" not in whole_body(bare, fill_cached=False)["usage"]


def test_heartbeats_are_comments_the_sdk_skips() -> None:
    assert CODEC.heartbeat("prefill 10/20 cached 5") == b": prefill 10/20 cached 5\n\n"
    frames = frames_of(RECORDED)
    raw = live_stream(RECORDED)
    at = raw.index(b"event: response.output_item.added")
    padded = raw[:at] + CODEC.heartbeat("generating") * 3 + raw[at:]
    assert [e.type for e in sdk_events(padded)] == DIRECT_EVENTS
    assert sdk_final(padded).output_text == TEXT
    assert len(frames) == 14


def test_a_late_error_is_response_failed_then_an_error_event() -> None:
    """The engine fails after some text: the items so far, ``response.failed`` naming the
    error (Codex retries on it), an ``error`` event numbered next, and the end."""
    cut = b"".join(RECORDED.split(b"\n\n")[i] + b"\n\n" for i in range(6))
    failure = UpstreamUnavailableError("engine connection reset")
    raw = live_stream(cut, fail=failure)
    events = events_of(raw)
    kinds = [kind for kind, _ in events]
    assert kinds[-4:] == ["response.content_part.done", "response.output_item.done",
                          "response.failed", "error"]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    failed = events[-2][1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "upstream_unavailable",
                               "message": "engine connection reset"}
    assert failed["output"][0]["status"] == "incomplete"
    assert failed["output"][0]["content"][0]["text"] == "I'm glad"
    assert events[-1][1] == {"type": "error", "code": "upstream_unavailable",
                             "message": "engine connection reset", "param": None,
                             "sequence_number": len(events) - 1}
    parsed = sdk_events(raw)
    assert [e.type for e in parsed][-2:] == ["response.failed", "error"]
    assert parsed[-1].message == "engine connection reset"
    assert parsed[-2].response.error.message == "engine connection reset"
    with serving(raw).responses.stream(model="smol", input="hi") as stream:
        seen = [event.type for event in stream]
        with pytest.raises(RuntimeError, match=r"response\.completed"):
            stream.get_final_response()
    assert seen[-2:] == ["response.failed", "error"]


def test_a_failure_before_any_output_still_opens_and_fails_the_response() -> None:
    failure = UpstreamStatusError(500, b'{"error":{"code":500,"message":"slot crashed",'
                                       b'"type":"server_error"}}', "application/json")
    events = events_of(live_stream(b"", fail=failure))
    assert [kind for kind, _ in events] == ["response.created", "response.in_progress",
                                            "response.failed", "error"]
    assert events[2][1]["response"]["error"]["message"] == "slot crashed"
    assert events[3][1]["sequence_number"] == 3
    assert events[3][1]["code"] == "500"


def test_errors_before_any_byte_are_openai_shaped() -> None:
    refused = BadRequestError("'input' is required", param="input")
    response = CODEC.error_response(refused)
    assert response.status_code == 400
    assert json.loads(bytes(response.body)) == {"error": {
        "message": "'input' is required", "type": "invalid_request_error", "param": "input",
        "code": None}}
    engine = UpstreamStatusError(400, b'{"error":{"code":400,"message":"too long",'
                                      b'"type":"exceed_context_size_error"}}',
                                 "application/json")
    assert CODEC.error_response(engine).body == engine.raw_body
    client = serving(bytes(response.body), status=400, content_type="application/json")
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="smol", input="hi")
    assert caught.value.param == "input"


# -- whole -------------------------------------------------------------------------------


def test_whole_response_is_a_response_the_sdk_parses() -> None:
    client = parse({**USER, "instructions": "Be brief.", "tools": TOOLS, "store": True,
                    "metadata": {"k": "v"}, "prompt_cache_key": "s1"})
    body = whole_body(RECORDED, client)
    assert body["object"] == "response"
    assert body["status"] == "completed"
    assert body["id"].startswith("resp_")
    assert body["model"] == "smol"  # the model asked for, as OpenAI echoes it
    assert body["store"] is False  # nothing is stored
    assert (body["instructions"], body["tools"], body["metadata"]) == (
        "Be brief.", TOOLS, {"k": "v"})
    assert body["usage"] == {**DIRECT_USAGE, "output_tokens_details": {"reasoning_tokens": 0}}
    parsed = serving(json.dumps(body).encode(), content_type="application/json"
                     ).responses.create(model="smol", input="hi")
    assert parsed.output_text == TEXT
    assert parsed.output[0].type == "message"
    assert parsed.usage is not None
    assert parsed.usage.total_tokens == 40
    blocks = whole_body(BLOCKS)
    assert [item["type"] for item in blocks["output"]] == ["reasoning", "message",
                                                           "function_call", "function_call"]
    assert blocks["output"][2]["call_id"] == "Xy12"
    assert blocks["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}
    no_model = whole_body(RECORDED, parse({"input": "hi"}))
    assert no_model["model"] == MODEL  # the engine's, when the client named none


# -- reply: the committed turn is the next request's -------------------------------------


def _sdk_echo(first: dict[str, Any], raw: bytes) -> dict[str, Any]:
    """The next request the SDK sends after the answer ``raw`` (streamed): the previous
    input, ``response.output`` as it is, a new user message."""
    previous = sdk_final(live_stream(raw))
    return sent_body(model="smol", input=[*first["input"], *previous.output,
                                          {"role": "user", "content": "and then?"}])


def _codex_echo(first: dict[str, Any], raw: bytes) -> dict[str, Any]:
    """The next request Codex sends: its ResponseItems of the answer's ``output_item.done``
    events (ids and statuses not serialized; reasoning with its reasoning_text content),
    each call's output, a new user message."""
    echoed: list[dict[str, Any]] = []
    for kind, data in events_of(live_stream(raw)):
        if kind != "response.output_item.done":
            continue
        item = data["item"]
        if item["type"] == "message":
            echoed.append({"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": part["text"]} for part in item["content"]]})
        elif item["type"] == "reasoning":
            echoed.append({"type": "reasoning", "summary": item["summary"],
                           "content": item["content"], "encrypted_content": ""})
        else:
            echoed.append({"type": "function_call", "name": item["name"],
                           "arguments": item["arguments"], "call_id": item["call_id"]})
    outputs = [{"type": "function_call_output", "call_id": i["call_id"], "output": "ok"}
               for i in echoed if i["type"] == "function_call"]
    follow = outputs or [{"type": "message", "role": "user",
                          "content": [{"type": "input_text", "text": "and then?"}]}]
    return {**first, "input": [*first["input"], *echoed, *follow]}


@pytest.mark.parametrize("raw", [RECORDED, BLOCKS], ids=["text", "reasoning+text+tools"])
@pytest.mark.parametrize("echo", [_sdk_echo, _codex_echo], ids=["sdk", "codex"])
def test_reply_is_the_turn_the_next_request_sends(
        raw: bytes, echo: Callable[[dict[str, Any], bytes], dict[str, Any]]) -> None:
    """What the planner commits (the forwarded messages, then ``reply``) is byte for byte
    the start of the next request's conversion, whichever client echoes the answer."""
    first = {"model": "smol", "tools": TOOLS,
             "input": [{"role": "developer", "content": "Be brief."},
                       {"role": "user", "content": "Weather in Paris?"}]}
    committed = parse(first).body["messages"]
    reply = CODEC.reply(frames_of(raw))
    assert reply is not None
    following = parse(echo(first, raw)).body["messages"]
    assert following[:len(committed)] == committed
    assert following[len(committed)] == reply
    assert json.dumps(following[len(committed)], sort_keys=True) == json.dumps(
        dict(reply), sort_keys=True)


def test_reply_shapes() -> None:
    assert CODEC.reply(frames_of(RECORDED)) == {"role": "assistant", "content": TEXT}
    assert CODEC.reply(frames_of(BLOCKS)) == {
        "role": "assistant", "content": "Let me check.",
        "reasoning_content": "The user wants the weather.",
        "tool_calls": [
            {"function": {"arguments": '{"location": "Paris"}', "name": "get_weather"},
             "id": "Xy12", "type": "function"},
            {"function": {"arguments": "", "name": "get_time"}, "id": "Zz34",
             "type": "function"}]}
    assert CODEC.reply(frames_of(chunk(ROLE) + chunk(finish="stop") + DONE)) is None
    assert CODEC.reply([]) is None
