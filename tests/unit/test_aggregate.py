"""Folding a stream into a non-streaming response, the way the OpenAI SDK folds deltas."""

from __future__ import annotations

import json
from typing import Any

from adapters._openai_sse import classify
from adapters.base import Frame
from core.sse import SSEDecoder
from proxy.aggregate import aggregate


def frames(*payloads: dict[str, Any] | str) -> list[Frame]:
    raw = b"".join(
        b"data: " + (p.encode() if isinstance(p, str) else json.dumps(p).encode()) + b"\n\n"
        for p in payloads
    )
    return [classify(e) for e in SSEDecoder().feed(raw)]


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "created": 5, "model": "m", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_text_reasoning_and_usage_fold_into_one_message() -> None:
    """Content and reasoning deltas concatenate; usage and timings are kept."""
    body = aggregate(frames(
        {**chunk({"role": "assistant", "content": None}), "prompt_progress": {
            "total": 3, "cache": 0, "processed": 0, "time_ms": 0}},
        chunk({"reasoning_content": "think "}),
        chunk({"reasoning_content": "more"}),
        chunk({"content": "Hel"}),
        chunk({"content": "lo"}),
        {**chunk({}, "stop"), "timings": {"cache_n": 1}},
        {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 3}},
        "[DONE]",
    ), chat=True)
    assert body["object"] == "chat.completion"
    assert body["id"] == "chatcmpl-1"
    assert body["choices"] == [{"finish_reason": "stop", "index": 0, "message": {
        "role": "assistant", "content": "Hello", "reasoning_content": "think more"}}]
    assert body["usage"] == {"prompt_tokens": 3}
    assert body["timings"] == {"cache_n": 1}


def test_tool_call_fragments_merge_by_index() -> None:
    """Tool-call ids, names and argument fragments merge per index, in order."""
    body = aggregate(frames(
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "read", "arguments": '{"pa'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'th": "a"}'}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_2",
                               "function": {"name": "ls", "arguments": "{}"}}]}),
        chunk({}, "tool_calls"),
    ), chat=True)
    message = body["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "read",
                                                          "arguments": '{"path": "a"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "ls", "arguments": "{}"}},
    ]
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def test_completions_fold_text() -> None:
    """/v1/completions chunks fold into a text_completion."""
    body = aggregate(frames(
        {"id": "cmpl-1", "object": "text_completion",
         "choices": [{"text": "a", "index": 0, "logprobs": None, "finish_reason": None}]},
        {"id": "cmpl-1", "object": "text_completion",
         "choices": [{"text": "b", "index": 0, "logprobs": None, "finish_reason": "length"}]},
    ), chat=False)
    assert body["object"] == "text_completion"
    assert body["choices"] == [{"text": "ab", "index": 0, "logprobs": None,
                                "finish_reason": "length"}]
