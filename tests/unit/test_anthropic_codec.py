"""The Anthropic Messages codec (``/v1/messages``), without an engine.

The request conversion is llama-server's own (``server_chat_convert_anthropic_to_oai``), so
each rule of it is pinned here, with the three places the proxy differs on purpose
(``cache_control`` dropped, ``metadata`` and ``model`` kept). The answers are checked with
the real client: the encoder's bytes (from llama-server's OpenAI chat chunks, classified
into frames as the adapter does) are served to the official ``anthropic`` SDK through a
mock transport, and what the SDK makes of them is compared with what llama-server itself
answers on ``/v1/messages`` (recorded from the same build).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import anthropic
import httpx2
import pytest

from prefixpin.core.errors import (
    BadRequestError,
    ClientError,
    PayloadTooLargeError,
    ProxyError,
    QueueTimeoutError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamUnavailableError,
)
from prefixpin.core.frames import Frame, FrameKind
from prefixpin.core.sse import SSEDecoder
from prefixpin.proxy.codecs import ANTHROPIC_MESSAGES, codec_at, codec_of
from prefixpin.proxy.codecs.anthropic import PING, AnthropicCodec
from prefixpin.proxy.codecs.anthropic_convert import normalize_billing_header
from prefixpin.proxy.listen.isolation import ApiNotServedError
from prefixpin.proxy.pipeline.validation import ClientRequest
from prefixpin.proxy.session.history import digest
from prefixpin.proxy.session.identity import explicit_identity
from tests.unit.chat_stream import DONE, frames_of, generation, sse

CODEC = AnthropicCodec()
MODEL = "/root/.cache/prefixpin/models/SmolLM2-135M-Instruct.Q4_1.gguf"
CHUNK_ID = "chatcmpl-3TTv4arfNuV5NFgehUwac7a9wdN82bTl"
ENVELOPE = {"created": 1796128108, "id": CHUNK_ID, "model": MODEL,
            "system_fingerprint": "b1-0c1e570", "object": "chat.completion.chunk"}
ROLE = {"role": "assistant", "content": None}
BILLING = ("x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; "
           "cch=a5145;")


def chunk(delta: Mapping[str, Any] | None = None, finish: str | None = None,
          **extra: Any) -> bytes:
    return sse({"choices": [{"finish_reason": finish, "index": 0, "delta": delta or {}}],
                **ENVELOPE, **extra})


def usage_chunk(usage: Mapping[str, Any], timings: Mapping[str, Any] | None = None) -> bytes:
    return sse({"choices": [], **ENVELOPE, "usage": usage,
                **({"timings": timings} if timings is not None else {})})


TIMINGS = {"cache_n": 24, "prompt_n": 12, "prompt_ms": 2208.671,
           "prompt_per_token_ms": 184.05591666666666, "prompt_per_second": 5.433131507589859,
           "predicted_n": 8, "predicted_ms": 2271.806,
           "predicted_per_token_ms": 324.5437142857143,
           "predicted_per_second": 3.081249015100761}

# llama-server (this build) on /v1/chat/completions, "Say hello in three words.", greedy,
# max_tokens 8, with return_progress and include_usage (what the adapter asks for).
RECORDED = b"".join([
    chunk(ROLE, prompt_progress={"total": 36, "cache": 24, "processed": 24, "time_ms": 0}),
    chunk(ROLE, prompt_progress={"total": 36, "cache": 24, "processed": 36, "time_ms": 2208}),
    chunk(ROLE),
    *(chunk({"content": piece}) for piece in ("A", "le", "j", "andro", ",", " a", " wise",
                                              " and")),
    chunk(finish="length"),
    usage_chunk({"completion_tokens": 8, "prompt_tokens": 36, "total_tokens": 44,
                 "prompt_tokens_details": {"cached_tokens": 24}}, TIMINGS),
    DONE,
])
RECORDED_TEXT = "Alejandro, a wise and"


def _direct_events() -> list[tuple[str, dict[str, Any]]]:
    """The same request on llama-server's own /v1/messages (stream: true), as it answered."""
    start = {"type": "message_start", "message": {
        "id": "chatcmpl-ahNQK6nTnR7SkZofrtdkHdWNbWkReROS", "type": "message",
        "role": "assistant", "content": [], "model": MODEL, "stop_reason": None,
        "stop_sequence": None,
        "usage": {"cache_read_input_tokens": 35, "input_tokens": 1, "output_tokens": 0}}}
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", start),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}})]
    events += [("content_block_delta", {"type": "content_block_delta", "index": 0,
                                        "delta": {"type": "text_delta", "text": piece}})
               for piece in ("A", "le", "j", "andro", ",", " a", " wise", " and")]
    return [*events,
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta",
                               "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                               "usage": {"output_tokens": 8}}),
            ("message_stop", {"type": "message_stop"})]


# An answer with every kind of block, in llama-server's chat chunks (its
# ``server_chat_msg_diff_to_json_oaicompat``): reasoning, text, two tool calls (the second
# without arguments).
BLOCKS = b"".join([
    chunk(ROLE, prompt_progress={"total": 50, "cache": 0, "processed": 50, "time_ms": 9}),
    chunk(ROLE),
    chunk({"reasoning_content": "The user wants"}),
    chunk({"reasoning_content": " the weather."}),
    chunk({"content": "Let me check."}),
    chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                           "function": {"name": "get_weather", "arguments": '{"location":'}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": ' "Paris"}'}}]}),
    chunk({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                           "function": {"name": "get_time"}}]}),
    chunk(finish="tool_calls"),
    usage_chunk({"completion_tokens": 30, "prompt_tokens": 50, "total_tokens": 80,
                 "prompt_tokens_details": {"cached_tokens": 0}}),
    DONE,
])


def parse(body: Mapping[str, Any], max_messages: int = 100) -> ClientRequest:
    return CODEC.parse(json.dumps(body).encode(), "/v1/messages", max_messages=max_messages)


def converted(body: Mapping[str, Any]) -> dict[str, Any]:
    return parse({"max_tokens": 10, **body}).body


def live_stream(raw: bytes, *, fill_cached: bool = True, batch: int = 1,
                client: ClientRequest | None = None, beats: int = 0) -> bytes:
    """What a streaming client receives: the opening, then the frames encoded as they come
    (the generation's frame log growing as the engine sends them), then the flush;
    ``beats``: the stream's heartbeats (``prefill 10/100 cached 0``) before each batch."""
    gen = generation(completed=False)
    encoder = CODEC.stream(client or parse(USER), gen, fill_cached=fill_cached)
    frames = frames_of(raw)
    out = [CODEC.opening]
    for at in range(0, len(frames), batch):
        out += [encoder.heartbeat("prefill 10/100 cached 0")] * beats
        part = frames[at:at + batch]
        gen.frames += part
        gen.progress = next((f.progress for f in reversed(gen.frames) if f.progress), None)
        gen.completed = any(f.kind is FrameKind.DONE for f in gen.frames)
        out.append(encoder.encode(part))
    out.append(encoder.flush() or b"")
    return b"".join(out)


def events_of(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    decoder = SSEDecoder()
    return [(e.event, json.loads(e.data)) for e in [*decoder.feed(raw), *decoder.flush()]
            if e.data]


USER = {"model": "smol", "max_tokens": 8,
        "messages": [{"role": "user", "content": "Say hello in three words."}]}


# -- the real client ---------------------------------------------------------------------


Handler = Callable[[httpx2.Request], httpx2.Response]


def sdk(handler: Handler) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url="http://prefixpin", api_key="test", max_retries=0,
                               http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))


def serving(body: bytes, *, status: int = 200, content_type: str = "text/event-stream",
            headers: Mapping[str, str] | None = None) -> anthropic.Anthropic:
    return sdk(lambda request: httpx2.Response(status, content=body, headers={
        "content-type": content_type, **(headers or {})}))


def sdk_stream_events(raw: bytes) -> list[Any]:
    with serving(raw).messages.create(model="smol", max_tokens=8, stream=True,
                                      messages=[{"role": "user", "content": "hi"}]) as events:
        return list(events)


def sdk_final(raw: bytes) -> anthropic.types.Message:
    with serving(raw).messages.stream(model="smol", max_tokens=8,
                                      messages=[{"role": "user", "content": "hi"}]) as stream:
        return stream.get_final_message()


def sdk_whole(body: bytes) -> anthropic.types.Message:
    return serving(body, content_type="application/json").messages.create(
        model="smol", max_tokens=8, messages=[{"role": "user", "content": "hi"}])


def sent_body(**params: Any) -> bytes:
    """The body the SDK sends for ``messages.create(**params)``."""
    seen: list[bytes] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request.read())
        return httpx2.Response(200, content=json.dumps(json.loads(whole_body(BLOCKS))),
                               headers={"content-type": "application/json"})

    sdk(handler).messages.create(**params)
    return seen[0]


def whole_body(raw: bytes, *, fill_cached: bool = True) -> bytes:
    return bytes(CODEC.whole(parse(USER), generation(frames_of(raw)),
                             fill_cached=fill_cached).body)


# -- registry ----------------------------------------------------------------------------


def test_the_codec_is_registered_for_v1_messages() -> None:
    client = parse(USER)
    assert codec_at("/v1/messages") is ANTHROPIC_MESSAGES
    assert isinstance(ANTHROPIC_MESSAGES, AnthropicCodec)
    assert codec_of(client) is ANTHROPIC_MESSAGES
    assert (CODEC.api, CODEC.engine_api, CODEC.endpoint) == ("anthropic", "openai", "chat")
    assert (client.api, client.endpoint, client.path) == ("anthropic", "chat",
                                                          "/v1/chat/completions")
    assert client.source == USER
    assert not client.stream
    assert parse({**USER, "stream": True}).stream


# -- the request -------------------------------------------------------------------------


def test_system_blocks_are_concatenated_with_the_billing_stamp_normalized() -> None:
    body = converted({"system": [
        {"type": "text", "text": BILLING},
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "\nBe terse."}],
        "messages": [{"role": "user", "content": "hi"}]})
    assert body["messages"][0] == {"role": "system", "content": (
        "x-anthropic-billing-header: cc_version=2.1.101.fff; cc_entrypoint=cli; cch=fffff;"
        "You are Claude Code.\nBe terse.")}
    as_string = converted({"system": BILLING + "You are Claude Code.",
                           "messages": [{"role": "user", "content": "hi"}]})
    assert as_string["messages"][0]["content"] == (
        "x-anthropic-billing-header: cc_version=2.1.101.fff; cc_entrypoint=cli; cch=fffff;"
        "You are Claude Code.")


@pytest.mark.parametrize(("text", "normalized"), [
    ("x-anthropic-billing-header: a; cch=12345;rest",
     "x-anthropic-billing-header: a; cch=fffff;rest"),
    ("x-anthropic-billing-header: cch=00000;", "x-anthropic-billing-header: cch=fffff;"),
    ("x-anthropic-billing-header: cch=00000", "x-anthropic-billing-header: cch=00000"),  # no ;
    ("x-anthropic-billing-header: cch=1234;x", "x-anthropic-billing-header: cch=1234;x"),  # 4
    ("x-anthropic-billing-header: no stamp;", "x-anthropic-billing-header: no stamp;"),
    ("You are x. x-anthropic-billing-header: cch=12345;",  # not where the text starts
     "You are x. x-anthropic-billing-header: cch=12345;"),
    # the version's per-conversation suffix (no stamp in Claude Code's offline -p)
    ("x-anthropic-billing-header: cc_version=2.1.328.b7f; cc_entrypoint=sdk-cli;",
     "x-anthropic-billing-header: cc_version=2.1.328.fff; cc_entrypoint=sdk-cli;"),
    ("x-anthropic-billing-header: cc_version=2.1.328; cc_entrypoint=cli;",  # none
     "x-anthropic-billing-header: cc_version=2.1.328; cc_entrypoint=cli;"),
])
def test_the_billing_line_is_normalized_only_where_llama_server_does(
        text: str, normalized: str) -> None:
    assert normalize_billing_header(text) == normalized


def test_two_requests_differing_in_the_stamp_convert_to_one_body() -> None:
    first = converted({"system": BILLING + "Hi.", "messages": [{"role": "user", "content": "a"}]})
    second = converted({"system": BILLING.replace("a5145", "9e0c2") + "Hi.",
                        "messages": [{"role": "user", "content": "a"}]})
    assert first == second


def test_messages_convert_as_llama_server_converts_them() -> None:
    """String content as it came (a system role inside messages included), text parts,
    thinking as reasoning_content, tool_use as tool calls (compact, the client's key
    order), one tool message per tool_result, images as image_url parts."""
    body = converted({"messages": [
        {"role": "system", "content": "Claude Code 2.1 puts one here."},
        {"role": "user", "content": [{"type": "text", "text": "Fix it."},
                                     {"type": "image", "source": {
                                         "type": "base64", "media_type": "image/png",
                                         "data": "iVBOR"}},
                                     {"type": "image", "source": {"type": "url",
                                                                  "url": "https://x/y.png"}},
                                     {"type": "image", "source": {"type": "file", "id": "f"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Look first.", "signature": "sig"},
            {"type": "thinking", "thinking": " Then act.", "signature": "sig"},
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "t1", "name": "read",
             "input": {"z": 1, "a": ["é", 2.5], "n": None}},
            {"type": "tool_use", "id": "t2", "name": "ls"}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "file body"},
            {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
             "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"type": "text", "text": "Go on."}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t3",
             "content": [{"type": "text", "text": "shot:"},
                         {"type": "image", "source": {"type": "base64", "data": "AAA"}}]},
            {"type": "tool_result", "tool_use_id": "t4"}]},
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
        {"role": "assistant", "content": "Done."},
    ]})
    assert body["messages"] == [
        {"role": "system", "content": "Claude Code 2.1 puts one here."},
        {"role": "user", "content": [
            {"type": "text", "text": "Fix it."},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR"}},
            {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
        {"role": "assistant", "content": "Looking.",
         "tool_calls": [
             {"id": "t1", "type": "function", "function": {
                 "name": "read", "arguments": '{"z":1,"a":["é",2.5],"n":null}'}},
             {"id": "t2", "type": "function", "function": {"name": "ls", "arguments": "{}"}}],
         "reasoning_content": "Look first. Then act."},
        {"role": "user", "content": "Go on."},
        {"role": "tool", "tool_call_id": "t1", "content": "file body"},
        {"role": "tool", "tool_call_id": "t2", "content": "ab"},
        {"role": "tool", "tool_call_id": "t3", "content": [
            {"type": "text", "text": "shot:"},
            {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AAA"}}]},
        {"role": "tool", "tool_call_id": "t4", "content": ""},
        {"role": "assistant", "content": "Done."},
    ]


def test_an_answer_with_only_tool_calls_or_thinking_has_empty_content() -> None:
    body = converted({"messages": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}]},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "1", "name": "f",
                                           "input": {}}]}]})
    assert body["messages"][1] == {"role": "assistant", "content": "",
                                   "reasoning_content": "hm"}
    assert body["messages"][3] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_cache_control_is_dropped_so_a_moved_marker_changes_no_message() -> None:
    """Claude Code marks the latest message; next turn the mark has moved on. The earlier
    messages must convert to the same bytes either way."""
    marked = {"type": "ephemeral"}
    turn_one = converted({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "one", "cache_control": marked}]}]})
    turn_two = converted({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "one"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
        {"role": "user", "content": [{"type": "text", "text": "two", "cache_control": marked}]}]})
    turn_three = converted({"messages": [{"role": "user", "content": "one"}]})
    # one text block is its text: Claude Code sends an earlier message as a block in one
    # turn and as a string in the next
    assert turn_one["messages"][0] == turn_two["messages"][0] == turn_three["messages"][0] == {
        "role": "user", "content": "one"}
    assert digest(turn_one["messages"][0]) == digest(turn_two["messages"][0])
    two_parts = converted({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>r</system-reminder>"},
        {"type": "text", "text": "one", "cache_control": marked}]}]})
    assert two_parts["messages"][0]["content"] == [
        {"type": "text", "text": "<system-reminder>r</system-reminder>"},
        {"type": "text", "text": "one"}]
    assert "cache_control" not in json.dumps(turn_two)


def test_request_fields_convert_as_llama_server_converts_them() -> None:
    body = converted({
        "model": "claude-sonnet-4-5", "max_tokens": 64, "temperature": 0, "top_p": 0.9,
        "top_k": 40, "stream": True, "stop_sequences": ["END"],
        "chat_template_kwargs": {"enable_thinking": False},
        "tools": [{"name": "get_weather", "description": "Weather.", "input_schema": {
            "type": "object", "properties": {"city": {"type": "string"}}}},
                  {"name": "bare", "cache_control": {"type": "ephemeral"}}],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "thinking": {"type": "enabled", "budget_tokens": 500},
        "metadata": {"user_id": '{"device_id":"d","session_id":"s-1"}'},
        "service_tier": "auto", "cache_control": {"type": "ephemeral"},
        "id_slot": 1, "cache_prompt": False,
        "messages": [{"role": "user", "content": "hi"}]})
    assert body == {
        "model": "claude-sonnet-4-5",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather.", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}}}}},
                  {"type": "function", "function": {"name": "bare", "description": "",
                                                    "parameters": {}}}],
        "tool_choice": "required", "stop": ["END"],
        "verbose": True, "response_fields": ["stopping_word"],  # which stop string ended it
        "max_tokens": 64, "temperature": 0,
        "top_p": 0.9, "top_k": 40, "stream": True,
        "chat_template_kwargs": {"enable_thinking": False},
        "thinking_budget_tokens": 500,
        "metadata": {"user_id": '{"device_id":"d","session_id":"s-1"}'},
    }


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, {"max_tokens": 4096}),
    ({"stop_sequences": []}, {"stop": [], "max_tokens": 4096}),
    ({"tool_choice": {"type": "auto"}}, {"max_tokens": 4096, "tool_choice": "auto"}),
    ({"tool_choice": {"type": "any"}}, {"max_tokens": 4096, "tool_choice": "required"}),
    ({"tool_choice": {"type": "none"}}, {"max_tokens": 4096}),
    ({"thinking": {"type": "enabled"}}, {"max_tokens": 4096, "thinking_budget_tokens": 10000}),
    ({"thinking": {"type": "disabled"}}, {"max_tokens": 4096}),
    ({"max_tokens": None}, {"max_tokens": None}),
])
def test_defaults_and_choices(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    body = parse({"messages": [{"role": "user", "content": "hi"}], **fields}).body
    assert body == {"messages": [{"role": "user", "content": "hi"}], **expected}


def test_claude_code_metadata_names_the_session() -> None:
    """``metadata`` stays where proxy.session.identity reads Claude Code's session id."""
    body = converted({"metadata": {"user_id": json.dumps({"device_id": "dev",
                                                           "session_id": "5f1e-aa"})},
                      "messages": [{"role": "user", "content": "hi"}]})
    identity = explicit_identity(body, {})
    assert identity is not None
    assert (identity.key, identity.source) == ("5f1e-aa", "body.metadata.user_id")
    assert "__metadata_user_id" not in body


# -- what is refused ---------------------------------------------------------------------


GOOD = {"max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("raw", "field", "says"), [
    (b"[]", None, "must be a JSON object"),
    (b"", None, "empty"),
    (b'{"messages": [{"role": "user", "content": NaN}]}', None, "not valid JSON"),
    (json.dumps({"max_tokens": 3}).encode(), "messages", "'messages' is required"),
    (json.dumps({"messages": "hi"}).encode(), "messages", "must be an array"),
    (json.dumps({"messages": ["hi"]}).encode(), "messages[0]", "must be an object"),
    (json.dumps({"messages": [{"role": "tool", "content": "x"}]}).encode(),
     "messages[0].role", "'tool'"),
    (json.dumps({"messages": [{"content": "x"}]}).encode(), "messages[0].role", "None"),
    (json.dumps({"messages": [{"role": "user"}]}).encode(), "messages[0].content",
     "a string or an array"),
    (json.dumps({"messages": [{"role": "user", "content": None}]}).encode(),
     "messages[0].content", "a string or an array"),
    (json.dumps({"messages": [{"role": "user", "content": ["hi"]}]}).encode(),
     "messages[0].content[0]", "must be an object"),
    (json.dumps({"messages": [{"role": "user", "content": [{"text": "hi"}]}]}).encode(),
     "messages[0].content[0].type", "must be a string"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "text"}]}]}).encode(),
     "messages[0].content[0].text", "must be a string"),
    (json.dumps({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": ["x"]}]}]}).encode(),
     "messages[0].content[0].content[0]", "string \"type\""),
    (json.dumps({**GOOD, "system": 3}).encode(), "system", "a string or an array"),
    (json.dumps({**GOOD, "system": [{"type": "image"}]}).encode(), "system[0]", "text block"),
    (json.dumps({**GOOD, "system": ["x"]}).encode(), "system[0]", "text block"),
    (json.dumps({**GOOD, "system": [{"type": "text", "text": 1}]}).encode(), "system[0].text",
     "must be a string"),
    (json.dumps({**GOOD, "max_tokens": "10"}).encode(), "max_tokens", "an integer"),
    (json.dumps({**GOOD, "max_tokens": 1.5}).encode(), "max_tokens", "an integer"),
    (json.dumps({**GOOD, "stream": "yes"}).encode(), "stream", "a boolean"),
    (json.dumps({**GOOD, "tools": {"name": "x"}}).encode(), "tools", "an array"),
    (json.dumps({**GOOD, "tools": ["x"]}).encode(), "tools[0]", "an object"),
    (json.dumps({**GOOD, "tool_choice": "auto"}).encode(), "tool_choice", "an object"),
    (json.dumps({**GOOD, "stop_sequences": "END"}).encode(), "stop_sequences", "an array"),
    (json.dumps({**GOOD, "stop_sequences": [1]}).encode(), "stop_sequences",
     "array of strings"),
    (json.dumps({**GOOD, "temperature": "hot"}).encode(), "temperature", "a number"),
    (json.dumps({**GOOD, "top_p": True}).encode(), "top_p", "a number"),
    (json.dumps({**GOOD, "top_k": 0.5}).encode(), "top_k", "an integer"),
    (json.dumps({**GOOD, "metadata": "me"}).encode(), "metadata", "an object"),
    (json.dumps({**GOOD, "model": 4}).encode(), "model", "a string"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', None, "surrogate"),
    (b'{"messages": ' + b"[" * 200 + b"]" * 200 + b"}", None, "nests JSON too deeply"),
])
def test_a_bad_body_is_refused_naming_the_field_in_anthropics_shape(
        raw: bytes, field: str | None, says: str) -> None:
    with pytest.raises(BadRequestError) as refused:
        CODEC.parse(raw, "/v1/messages", max_messages=100)
    assert says in refused.value.message
    assert refused.value.param == field
    if field is not None:
        assert f"'{field}'" in refused.value.message
    response = CODEC.error_response(refused.value)
    assert response.status_code == 400
    assert json.loads(bytes(response.body)) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": refused.value.message}}


def test_the_message_limit_counts_the_clients_messages_and_the_converted_ones() -> None:
    three = {"messages": [{"role": "user", "content": "a"}] * 3}
    with pytest.raises(BadRequestError, match="has 3 entries; the limit is 2"):
        parse(three, max_messages=2)
    results = {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": str(i), "content": "r"} for i in range(3)]}]}
    with pytest.raises(BadRequestError, match="converts to 3 chat messages"):
        parse(results, max_messages=2)
    assert len(parse(results, max_messages=3).body["messages"]) == 3


def test_the_sdk_raises_its_own_error_for_a_refused_body() -> None:
    with pytest.raises(BadRequestError) as refused:
        parse({"messages": [{"role": "tool", "content": "x"}]})
    response = CODEC.error_response(refused.value)
    client = serving(bytes(response.body), status=400, content_type="application/json")
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(model="smol", max_tokens=8, messages=[])
    assert raised.value.status_code == 400
    assert raised.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": refused.value.message}}


# -- errors ------------------------------------------------------------------------------


LLAMA_CONTEXT_ERROR = json.dumps({"error": {
    "code": 400, "message": "request (9000 tokens) exceeds the available context size "
                            "(8192 tokens), try increasing it",
    "type": "exceed_context_size_error", "n_prompt_tokens": 9000, "n_ctx": 8192}}).encode()


@pytest.mark.parametrize(("error", "status", "kind", "message"), [
    (BadRequestError("'x' is bad", param="x"), 400, "invalid_request_error", "'x' is bad"),
    (PayloadTooLargeError("too big"), 413, "request_too_large", "too big"),
    (ApiNotServedError("no engine"), 404, "not_found_error", "no engine"),
    (QueueTimeoutError("waited", retry_after_s=7), 503, "overloaded_error", "waited"),
    (UpstreamUnavailableError("engine gone"), 502, "api_error", "engine gone"),
    (UpstreamStatusError(400, LLAMA_CONTEXT_ERROR, "application/json"), 400,
     "invalid_request_error", "request (9000 tokens) exceeds the available context size "
                              "(8192 tokens), try increasing it"),
    (UpstreamStatusError(500, b"plain failure", "text/plain"), 500, "api_error",
     "plain failure"),
    (UpstreamStatusError(401, b'{"error": "no key"}', "application/json"), 401,
     "authentication_error", "no key"),
    (ClientError("teapot"), 400, "invalid_request_error", "teapot"),
])
def test_errors_before_any_byte_are_anthropic_errors_with_their_status(
        error: ProxyError, status: int, kind: str, message: str) -> None:
    response = CODEC.error_response(error)
    assert response.status_code == status
    assert json.loads(bytes(response.body)) == {"type": "error", "error": {
        "type": kind, "message": message}}
    if isinstance(error, QueueTimeoutError):
        assert response.headers["retry-after"] == "7"


def test_the_sdk_reads_an_engine_error_with_its_status() -> None:
    response = CODEC.error_response(UpstreamStatusError(400, LLAMA_CONTEXT_ERROR,
                                                        "application/json"))
    client = serving(bytes(response.body), status=400, content_type="application/json")
    with pytest.raises(anthropic.BadRequestError, match="exceeds the available context"):
        client.messages.create(model="smol", max_tokens=8,
                               messages=[{"role": "user", "content": "hi"}])
    busy = CODEC.error_response(QueueTimeoutError("no slot", retry_after_s=3))
    client = serving(bytes(busy.body), status=503, content_type="application/json",
                     headers=dict(busy.headers))
    with pytest.raises(anthropic.InternalServerError) as raised:
        client.messages.create(model="smol", max_tokens=8,
                               messages=[{"role": "user", "content": "hi"}])
    assert raised.value.status_code == 503
    assert raised.value.response.headers["retry-after"] == "3"


def test_a_late_error_is_an_error_event_the_sdk_raises() -> None:
    late = CODEC.late_error(UpstreamUnavailableError("engine unreachable: reset"))
    assert late == (b'event: error\ndata: {"type":"error","error":{"type":"api_error",'
                    b'"message":"engine unreachable: reset"}}\n\n')
    frames = RECORDED.split(b"\n\n")
    cut = b"\n\n".join(frames[:6]) + b"\n\n"  # the engine fails after three text deltas
    raw = live_stream(cut) + late
    assert raw.count(b"event: message_stop") == 0
    received: list[Any] = []
    with pytest.raises(anthropic.APIStatusError) as raised:  # noqa: PT012 (reads events until it fails)
        for event in serving(raw).messages.create(
                model="smol", max_tokens=8, stream=True,
                messages=[{"role": "user", "content": "hi"}]):
            received.append(event)
    assert [e.type for e in received] == ["message_start", "content_block_start",
                                          "content_block_delta", "content_block_delta",
                                          "content_block_delta"]
    assert raised.value.body == {"type": "error", "error": {
        "type": "api_error", "message": "engine unreachable: reset"}}


def test_a_failed_generation_flushes_nothing_before_its_error() -> None:
    gen = generation(frames_of(RECORDED.split(b"\n\n")[0] + b"\n\n" + chunk({"content": "A"})),
                     completed=False)
    encoder = CODEC.stream(parse(USER), gen, fill_cached=True)
    assert encoder.encode(gen.frames).count(b"event: ") == 3  # start, block start, delta
    assert encoder.flush() is None
    error = UpstreamProtocolError("engine error mid-stream: boom")
    assert b'"message":"engine error mid-stream: boom"' in CODEC.late_error(error)


# -- the stream --------------------------------------------------------------------------


def test_the_stream_is_llama_servers_own_anthropic_stream() -> None:
    """Event for event what llama-server answers on /v1/messages, but for the id and the
    usage: message_start's from this prompt's progress (the direct recording had other
    cache contents), and message_delta's carrying the engine's whole usage."""
    ours = events_of(live_stream(RECORDED))
    direct = _direct_events()
    assert [name for name, _ in ours] == [name for name, _ in direct]
    assert ours[0][1]["message"].pop("id") == CHUNK_ID
    direct[0][1]["message"].pop("id")
    direct[0][1]["message"]["usage"] = {"cache_read_input_tokens": 24, "input_tokens": 12,
                                        "output_tokens": 0}
    direct[-2][1]["usage"] = {"cache_read_input_tokens": 24, "input_tokens": 12,
                              "output_tokens": 8}
    assert ours == direct


def test_the_sdk_reads_the_stream_as_llama_servers_answer() -> None:
    raw = live_stream(RECORDED)
    final = sdk_final(raw)
    assert final.content[0].type == "text"
    assert final.content[0].text == RECORDED_TEXT
    assert final.stop_reason == "max_tokens"
    assert final.stop_sequence is None
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens,
            final.usage.output_tokens) == (12, 24, 8)
    assert final.id == CHUNK_ID
    assert final.model == MODEL
    assert [e.type for e in sdk_stream_events(raw)] == [n for n, _ in _direct_events()]


@pytest.mark.parametrize("batch", [1, 3, 1000])
def test_batches_do_not_change_the_bytes(batch: int) -> None:
    assert live_stream(RECORDED, batch=batch) == live_stream(RECORDED)
    assert live_stream(BLOCKS, batch=batch) == live_stream(BLOCKS)


def test_thinking_text_and_tool_blocks_are_numbered_and_closed_as_llama_server_does() -> None:
    events = events_of(live_stream(BLOCKS))
    kinds = [(name, data.get("index"), (data.get("delta") or data.get("content_block")
                                        or {}).get("type")) for name, data in events]
    assert kinds == [
        ("message_start", None, None),
        ("content_block_start", 0, "thinking"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_start", 1, "text"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_start", 3, "tool_use"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_stop", 1, None),
        ("content_block_stop", 2, None),
        ("content_block_stop", 3, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert events[6][1]["content_block"] == {"type": "tool_use", "id": "call_1",
                                             "name": "get_weather", "input": {}}
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_the_sdk_folds_every_block_and_the_whole_answer_is_the_same() -> None:
    final = sdk_final(live_stream(BLOCKS))
    whole = sdk_whole(whole_body(BLOCKS))
    expected = [
        {"type": "thinking", "thinking": "The user wants the weather.", "signature": ""},
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather",
         "input": {"location": "Paris"}},
        {"type": "tool_use", "id": "call_2", "name": "get_time", "input": {}}]
    for message in (final, whole):
        assert [b.model_dump(exclude_none=True, include={"type", "thinking", "signature",
                                                        "text", "id", "name", "input"})
                for b in message.content] == expected
        assert message.stop_reason == "tool_use"
        assert (message.usage.input_tokens, message.usage.cache_read_input_tokens,
                message.usage.output_tokens) == (50, 0, 30)


def test_the_whole_answer_is_llama_servers_to_json_anthropic() -> None:
    assert json.loads(whole_body(RECORDED)) == {
        "id": CHUNK_ID, "type": "message", "role": "assistant",
        "content": [{"type": "text", "text": RECORDED_TEXT}], "model": MODEL,
        "stop_reason": "max_tokens", "stop_sequence": None,
        "usage": {"cache_read_input_tokens": 24, "input_tokens": 12, "output_tokens": 8}}
    assert "timings" not in json.loads(whole_body(RECORDED))


@pytest.mark.parametrize(("finish", "tools", "reason"), [
    ("stop", False, "end_turn"), ("length", False, "max_tokens"),
    ("tool_calls", True, "tool_use"), ("stop", True, "tool_use"),
    ("length", True, "max_tokens"), (None, False, "end_turn"),
])
def test_stop_reasons(finish: str | None, tools: bool, reason: str) -> None:
    calls = [chunk({"tool_calls": [{"index": 0, "id": "c", "type": "function",
                                    "function": {"name": "f", "arguments": "{}"}}]})]
    raw = b"".join([chunk(ROLE), chunk({"content": "x"}), *(calls if tools else []),
                    chunk(finish=finish), usage_chunk({"prompt_tokens": 3,
                                                       "completion_tokens": 2}), DONE])
    assert json.loads(whole_body(raw))["stop_reason"] == reason
    assert events_of(live_stream(raw))[-2][1]["delta"]["stop_reason"] == reason


@pytest.mark.parametrize("on_finish", [True, False])
def test_the_stop_sequence_that_ended_the_answer_is_named(on_finish: bool) -> None:
    """llama-server (asked with verbose and response_fields) names the stop string on the
    first chunk of its final result: the finish chunk, or the last text delta."""
    said: dict[str, Any] = {"__verbose": {"stopping_word": "andro"}}
    raw = b"".join([
        chunk(ROLE), chunk({"content": "Al"}), chunk({"content": "ej"}, **({} if on_finish
                                                                          else said)),
        chunk(finish="stop", **(said if on_finish else {})),
        usage_chunk({"completion_tokens": 4, "prompt_tokens": 36,
                     "prompt_tokens_details": {"cached_tokens": 35}}), DONE])
    client = parse({**USER, "stop_sequences": ["andro"]})
    final = sdk_final(live_stream(raw, client=client))
    whole = json.loads(whole_body(raw))
    assert (final.stop_reason, final.stop_sequence) == ("end_turn", "andro")
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("end_turn", "andro")
    assert final.content[0].type == "text"
    assert final.content[0].text == whole["content"][0]["text"] == "Alej"
    plain = RECORDED.replace(b'"finish_reason":"length"', b'"finish_reason":"stop"')
    assert sdk_final(live_stream(plain)).stop_sequence is None
    assert json.loads(whole_body(plain))["stop_sequence"] is None


def test_progress_and_pings_make_no_bytes() -> None:
    encoder = CODEC.stream(parse(USER), generation(), fill_cached=True)
    progress = frames_of(RECORDED)[:2]
    assert [f.kind for f in progress] == [FrameKind.PROGRESS, FrameKind.PROGRESS]
    assert encoder.encode([*progress, Frame(FrameKind.PING, b": ping\n\n")]) == b""
    assert encoder.encode([]) == b""


def test_the_opening_and_heartbeats_are_skipped_by_the_sdk() -> None:
    """The heartbeat is the stream's own: before ``message_start`` (a queued or prefilling
    request) an SSE comment with the progress, as the opening is, never an event (an
    Anthropic stream opens with ``message_start``); after it, Anthropic's ``ping``. The
    SDK reads the same events and message with them as without."""
    assert CODEC.opening == b": prefixpin\n\n"
    assert CODEC.heartbeat("prefill 10/100 cached 0") == PING == (
        b'event: ping\ndata: {"type": "ping"}\n\n')
    assert CODEC.media_type == "text/event-stream"
    assert CODEC.headers["Cache-Control"] == "no-cache"
    raw = live_stream(RECORDED)
    assert raw.startswith(CODEC.opening)
    beating = live_stream(RECORDED, beats=2)  # two heartbeats before each frame's bytes
    start = beating.index(b"event: message_start\n")
    before = beating[:start].removeprefix(CODEC.opening)  # (the progress frames' beats)
    assert before == b": prefill 10/100 cached 0\n\n" * (before.count(b"\n\n"))
    assert before.count(b"\n\n") >= 2
    assert beating[start:].count(PING) >= 10
    assert beating.replace(PING, b"").replace(
        b": prefill 10/100 cached 0\n\n", b"") == raw
    assert sdk_final(beating) == sdk_final(raw)
    assert [e.type for e in sdk_stream_events(beating)] == [
        e.type for e in sdk_stream_events(raw)]


def test_the_engine_usage_chunk_gives_the_usage() -> None:
    """message_delta carries the usage chunk's counts, not the progress of message_start."""
    raw = RECORDED.replace(b'"prompt_tokens_details":{"cached_tokens":24}',
                           b'"prompt_tokens_details":{"cached_tokens":30}')
    final = sdk_final(live_stream(raw))
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (6, 30)
    start = events_of(live_stream(raw))[0][1]["message"]["usage"]
    assert start == {"cache_read_input_tokens": 24, "input_tokens": 12, "output_tokens": 0}


@pytest.mark.parametrize("fill_cached", [True, False])
def test_cached_tokens_left_out_are_filled_only_from_a_measuring_engine(
        fill_cached: bool) -> None:
    raw = RECORDED.replace(b',"prompt_tokens_details":{"cached_tokens":24}', b"")
    assert b"cached_tokens" not in raw
    whole = json.loads(whole_body(raw, fill_cached=fill_cached))["usage"]
    streamed = events_of(live_stream(raw, fill_cached=fill_cached))[-2][1]["usage"]
    start = events_of(live_stream(raw, fill_cached=fill_cached))[0][1]["message"]["usage"]
    if fill_cached:  # from the timings' cache_n, as the engine measured it
        assert whole == streamed == {"cache_read_input_tokens": 24, "input_tokens": 12,
                                     "output_tokens": 8}
        assert start == {"cache_read_input_tokens": 24, "input_tokens": 12,
                         "output_tokens": 0}
    else:
        assert whole == streamed == {"input_tokens": 36, "output_tokens": 8}
        assert start == {"input_tokens": 36, "output_tokens": 0}
    assert sdk_final(live_stream(raw, fill_cached=fill_cached)).usage.input_tokens == (
        12 if fill_cached else 36)


def test_an_engine_without_a_usage_chunk_ends_the_message_from_its_figures() -> None:
    raw = b"".join([chunk(ROLE), chunk({"content": "Hi"}),
                    chunk(finish="stop", timings={"cache_n": 3, "prompt_n": 4,
                                                  "predicted_n": 1}), DONE])
    final = sdk_final(live_stream(raw))
    assert final.content[0].type == "text"
    assert final.content[0].text == "Hi"
    assert final.stop_reason == "end_turn"
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens,
            final.usage.output_tokens) == (4, 3, 1)


def test_flush_ends_a_completed_message_once() -> None:
    frames = frames_of(RECORDED)[:-2]  # the usage chunk and [DONE] not read by this client
    gen = generation(frames, completed=True)
    encoder = CODEC.stream(parse(USER), gen, fill_cached=True)
    body = encoder.encode(frames)
    assert b"message_stop" not in body
    tail = encoder.flush()
    assert tail is not None
    assert tail.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    assert encoder.flush() is None
    assert encoder.encode(frames_of(RECORDED)[-2:]) == b""


def test_an_empty_answer_is_still_a_whole_message() -> None:
    raw = b"".join([chunk(ROLE), chunk(finish="stop"),
                    usage_chunk({"prompt_tokens": 5, "completion_tokens": 1,
                                 "prompt_tokens_details": {"cached_tokens": 0}}), DONE])
    final = sdk_final(live_stream(raw))
    assert final.content == []
    assert final.stop_reason == "end_turn"
    assert json.loads(whole_body(raw))["content"] == []
    assert CODEC.reply(frames_of(raw)) is None


# -- the reply the planner commits -------------------------------------------------------


def _echoed_request(assistant_content: Any) -> dict[str, Any]:
    return {"model": "smol", "max_tokens": 64, "messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": assistant_content},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "call_1", "content": "Sunny, 25°C"},
            {"type": "tool_result", "tool_use_id": "call_2", "content": "12:00"}]}]}


@pytest.mark.parametrize("raw", [BLOCKS, RECORDED], ids=["blocks", "text"])
def test_reply_is_the_echoed_answer_after_conversion(raw: bytes) -> None:
    """The SDK sends the answer it received back as the next turn's assistant message;
    converted, it is the reply the planner committed, byte for byte."""
    reply = CODEC.reply(frames_of(raw))
    assert reply is not None
    final = sdk_final(live_stream(raw))
    sent = json.loads(sent_body(**_echoed_request(final.content)))
    assistant = parse(sent).body["messages"][1]
    assert assistant == reply
    assert digest(assistant) == digest(reply)
    # Echoed as the JSON it came in (Claude Code keeps the blocks it was sent), the same.
    blocks = json.loads(whole_body(raw))["content"]
    assert parse(_echoed_request(blocks)).body["messages"][1] == reply


def test_reply_of_blocks_is_one_assistant_message() -> None:
    assert CODEC.reply(frames_of(BLOCKS)) == {
        "role": "assistant", "content": "Let me check.",
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"location":"Paris"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_time", "arguments": "{}"}}],
        "reasoning_content": "The user wants the weather."}


def _all_frames() -> Iterator[Frame]:
    yield from frames_of(RECORDED)
    yield from frames_of(BLOCKS)


def test_frames_classify_as_the_adapter_classifies_them() -> None:
    kinds = {frame.kind for frame in _all_frames()}
    assert kinds == {FrameKind.PROGRESS, FrameKind.CHUNK, FrameKind.USAGE, FrameKind.DONE}


def test_an_empty_message_list_converts_to_an_empty_chat_one() -> None:
    """llama-server's own /v1/messages generates from it: the engine judges, not the codec."""
    assert parse({"max_tokens": 5, "messages": []}).body["messages"] == []
    assert parse({"max_tokens": 5, "system": "Be brief.", "messages": []}).body["messages"] == [
        {"role": "system", "content": "Be brief."}]
