"""Fold a streamed generation into the one JSON object a non-streaming client expects.

The proxy always streams from the engine (so that it sees progress and so that streaming
and non-streaming clients can share one generation); a non-streaming client gets the
chunks folded the way the OpenAI SDK's own stream accumulator folds them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from adapters.base import Frame, FrameKind

# ``reasoning`` is where Ollama's OpenAI-compatible API puts the model's thinking.
_MESSAGE_TEXT_FIELDS = ("content", "reasoning_content", "reasoning")


def aggregate(frames: Sequence[Frame], *, chat: bool) -> dict[str, Any]:
    envelope: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    extras: dict[str, Any] = {}
    for frame in frames:
        if frame.kind not in (FrameKind.CHUNK, FrameKind.USAGE) or frame.data is None:
            continue
        data = frame.data
        for key in ("id", "created", "model", "system_fingerprint"):
            if key in data and key not in envelope:
                envelope[key] = data[key]
        for key in ("usage", "timings"):
            if isinstance(data.get(key), Mapping):
                extras[key] = data[key]
        for choice in data.get("choices") or []:
            if isinstance(choice, Mapping):
                _fold_choice(choices, choice, chat)
    result: dict[str, Any] = {
        "choices": [_finish_choice(choices[i], chat) for i in sorted(choices)],
        **envelope,
        "object": "chat.completion" if chat else "text_completion",
        **extras,
    }
    return result


def _fold_choice(choices: dict[int, dict[str, Any]], choice: Mapping[str, Any],
                 chat: bool) -> None:
    index = int(choice.get("index") or 0)
    state = choices.setdefault(index, {"index": index, "finish_reason": None, "parts": {},
                                       "tool_calls": {}, "role": "assistant"})
    if choice.get("finish_reason"):
        state["finish_reason"] = choice["finish_reason"]
    if not chat:
        _append_text(state["parts"], "text", choice.get("text"))
        if "logprobs" in choice:
            state["logprobs"] = choice["logprobs"]
        return
    delta = choice.get("delta")
    if not isinstance(delta, Mapping):
        return
    if isinstance(delta.get("role"), str):
        state["role"] = delta["role"]
    for name in _MESSAGE_TEXT_FIELDS:
        _append_text(state["parts"], name, delta.get(name))
    for call in delta.get("tool_calls") or []:
        if isinstance(call, Mapping):
            _fold_tool_call(state["tool_calls"], call)


def _append_text(parts: dict[str, list[str]], name: str, value: object) -> None:
    if isinstance(value, str):
        parts.setdefault(name, []).append(value)


def _fold_tool_call(calls: dict[int, dict[str, Any]], delta: Mapping[str, Any]) -> None:
    index = int(delta.get("index") or 0)
    call = calls.setdefault(index, {"type": "function", "function": {"name": "", "arguments": ""}})
    if delta.get("id"):
        call["id"] = delta["id"]
    if delta.get("type"):
        call["type"] = delta["type"]
    function = delta.get("function")
    if isinstance(function, Mapping):
        if function.get("name"):
            call["function"]["name"] += str(function["name"])
        if function.get("arguments"):
            call["function"]["arguments"] += str(function["arguments"])


def _finish_choice(state: dict[str, Any], chat: bool) -> dict[str, Any]:
    parts: dict[str, list[str]] = state["parts"]
    if not chat:
        return {"text": "".join(parts.get("text", [])), "index": state["index"],
                "logprobs": state.get("logprobs"), "finish_reason": state["finish_reason"]}
    message: dict[str, Any] = {"role": state["role"],
                               "content": "".join(parts["content"]) if "content" in parts else None}
    for name in _MESSAGE_TEXT_FIELDS[1:]:
        if name in parts:
            message[name] = "".join(parts[name])
    if state["tool_calls"]:
        message["tool_calls"] = [state["tool_calls"][i] for i in sorted(state["tool_calls"])]
    return {"finish_reason": state["finish_reason"], "index": state["index"], "message": message}
