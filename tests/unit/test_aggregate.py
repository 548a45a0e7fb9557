"""Folding a stream into a non-streaming response, the way the OpenAI SDK folds deltas."""

from __future__ import annotations

import json
from typing import Any

from prefixpin.adapters.base import Frame
from prefixpin.adapters.openai_sse import classify
from prefixpin.core.sse import SSEDecoder
from prefixpin.proxy.pipeline.aggregate import aggregate, assistant_message


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


# ---------------------------------------------------------------- the generic rules
# Chunk shapes as llama-server streams them (tools/server/server-task.cpp).

def token(text: str, logprob: float) -> dict[str, Any]:
    """One entry of llama-server's ``logprobs.content`` (top_logprobs: 1)."""
    entry = {"id": len(text), "token": text, "bytes": list(text.encode()), "logprob": logprob}
    return {**entry, "top_logprobs": [entry]}


def lp_chunk(text: str, logprob: float) -> dict[str, Any]:
    body = chunk({"content": text})
    body["choices"][0]["logprobs"] = {"content": [token(text, logprob)]}
    return body


def test_chat_logprobs_concatenate_across_chunks() -> None:
    """Each chunk carries its token's logprobs; the whole answer lists them all, in order,
    under the choice (where llama-server's non-streamed answer has them)."""
    body = aggregate(frames(
        chunk({"role": "assistant", "content": None}),
        lp_chunk("I", -2.5), lp_chunk("'m", -0.2), chunk({}), lp_chunk(" glad", -1.5),
        chunk({}, "length"),
        {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 3}},
    ), chat=True)
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "I'm glad"}
    assert choice["logprobs"] == {"content": [token("I", -2.5), token("'m", -0.2),
                                              token(" glad", -1.5)]}


def test_chat_without_logprobs_has_no_logprobs_key_and_null_stays_null() -> None:
    """llama-server leaves ``logprobs`` out when it was not asked for (so does the folded
    answer); an engine that streams ``logprobs: null`` (OpenAI) gets null."""
    plain = aggregate(frames(chunk({"content": "a"}), chunk({}, "stop")), chat=True)
    assert "logprobs" not in plain["choices"][0]
    nulls = [chunk({"content": "a"}), chunk({}, "stop")]
    for payload in nulls:
        payload["choices"][0]["logprobs"] = None
    assert aggregate(frames(*nulls), chat=True)["choices"][0]["logprobs"] is None


def test_completions_logprobs_concatenate_not_just_the_last() -> None:
    """/v1/completions: every token's logprobs, not the last chunk's (its finish chunk has
    ``logprobs: null``); the legacy per-key lists concatenate the same way."""
    def cmpl(text: str, logprobs: Any, finish: str | None = None) -> dict[str, Any]:
        return {"id": "cmpl-1", "object": "text_completion", "choices": [
            {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}]}

    body = aggregate(frames(
        cmpl("", None), cmpl(" a", {"content": [token(" a", -1.0)]}),
        cmpl(" b", {"content": [token(" b", -2.0)]}), cmpl("", None, "length"),
    ), chat=False)
    assert body["choices"] == [{"text": " a b", "index": 0, "finish_reason": "length",
                                "logprobs": {"content": [token(" a", -1.0),
                                                         token(" b", -2.0)]}}]
    legacy = aggregate(frames(
        cmpl("x", {"tokens": ["x"], "token_logprobs": [-1.0], "text_offset": [0]}),
        cmpl("y", {"tokens": ["y"], "token_logprobs": [-2.0], "text_offset": [1]}, "stop"),
    ), chat=False)
    assert legacy["choices"][0]["logprobs"] == {"tokens": ["x", "y"],
                                                "token_logprobs": [-1.0, -2.0],
                                                "text_offset": [0, 1]}


def test_fields_without_a_rule_are_kept() -> None:
    """Unknown top-level and choice fields: the last value that is not null; unknown delta
    fields: strings concatenated, objects merged, lists extended; role replaced."""
    first = {**chunk({"role": "assistant", "refusal": None, "extra": {"a": "x", "n": [1]}}),
             "system_fingerprint": "b1", "service_tier": None, "engine_note": "one"}
    first["choices"][0]["stop_reason"] = None
    second = {**chunk({"role": "assistant", "content": "hi", "extra": {"a": "y", "n": [2]},
                       "annotation": "p"}), "engine_note": None}
    last = {**chunk({"annotation": "q"}, "stop"), "engine_note": "two"}
    last["choices"][0]["stop_reason"] = 7
    body = aggregate(frames(first, second, last), chat=True)
    assert body["system_fingerprint"] == "b1"
    assert body["engine_note"] == "two"
    assert body["service_tier"] is None  # the key is kept
    assert body["choices"][0]["stop_reason"] == 7
    assert body["choices"][0]["message"] == {
        "role": "assistant", "content": "hi", "refusal": None,
        "extra": {"a": "xy", "n": [1, 2]}, "annotation": "pq"}


def test_stream_only_fields_are_dropped_and_objects_kept_only_as_objects() -> None:
    """``prompt_progress`` (the proxy asks for it) never reaches a whole answer; the
    ``object`` is the non-streamed one; a usage that is not an object is not kept."""
    body = aggregate(frames(
        {**chunk({"content": "a"}), "prompt_progress": {"total": 3, "cache": 0,
                                                        "processed": 3, "time_ms": 1}},
        {**chunk({}, "stop"), "usage": 1, "timings": {"cache_n": 0}},
    ), chat=True)
    assert "prompt_progress" not in body
    assert body["object"] == "chat.completion"
    assert "usage" not in body
    assert body["timings"] == {"cache_n": 0}


def verbose_final(content: str = "", stream: bool = True) -> dict[str, Any]:
    """The ``__verbose`` of llama-server's final result (``to_json_non_oaicompat``)."""
    return {"index": 0, "content": content, "tokens": [], "id_slot": 1, "stop": True,
            "generation_settings": {"n_probs": 1, "stream": stream}, "prompt": "p",
            "stop_type": "limit", "stopping_word": "", "tokens_cached": 9,
            "timings": {"cache_n": 0}}


def test_verbose_is_completed_as_the_non_streamed_answer_has_it() -> None:
    """llama-server streams ``__verbose`` on its finish chunk with no text and no
    probabilities; the whole answer's has the text, the logprobs and ``stream: false``."""
    body = aggregate(frames(
        lp_chunk("I", -2.5), lp_chunk("'m", -0.2),
        {**chunk({}, "length"), "__verbose": verbose_final()},
        {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 3}},
    ), chat=True)
    assert body["__verbose"] == {
        **verbose_final("I'm", stream=False),
        "completion_probabilities": [token("I", -2.5), token("'m", -0.2)]}


def test_completions_verbose_is_the_final_one_completed() -> None:
    """/v1/completions streams a partial ``__verbose`` on every chunk; the final result's
    is the one kept, with the whole text; no logprobs asked: no probabilities."""
    def cmpl(text: str, verbose: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": "cmpl-1", "choices": [{"text": text, "index": 0, "logprobs": None,
                                             "finish_reason": finish}], "__verbose": verbose}

    partial = {"index": 0, "content": " a", "tokens": [253], "stop": False, "id_slot": -1}
    body = aggregate(frames(cmpl(" a", partial), cmpl(" b", {**partial, "content": " b"}),
                            cmpl("", verbose_final(), "length")), chat=False)
    assert body["__verbose"] == verbose_final(" a b", stream=False)
    assert "completion_probabilities" not in body["__verbose"]


def test_a_text_field_grown_piece_by_piece_then_merged_by_the_rules() -> None:
    """A delta's text field concatenates however many pieces come; a value of another
    kind afterwards is merged by the same rules as before (here: replaces it)."""
    pieces = [chunk({"reasoning_content": f"r{i} "}) for i in range(500)]
    body = aggregate(frames(*pieces, chunk({"content": "ok"}, "stop")), chat=True)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "".join(f"r{i} " for i in range(500))
    assert type(message["reasoning_content"]) is str
    mixed = aggregate(frames(chunk({"extra": "a"}), chunk({"extra": "b"}),
                             chunk({"extra": {"k": 1}}), chunk({"extra": {"j": 2}})), chat=True)
    assert mixed["choices"][0]["message"]["extra"] == {"k": 1, "j": 2}


def test_the_committed_message_is_the_folded_answer_s() -> None:
    """``assistant_message`` (what a turn commits) equals the whole answer's message for
    text, reasoning, tool calls, fields without a rule and logprobs alike."""
    streams = [
        frames(chunk({"role": "assistant", "content": None}), chunk({"reasoning_content": "t"}),
               chunk({"content": "He"}), chunk({"content": "llo"}), chunk({}, "stop"),
               {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 3}}, "[DONE]"),
        frames(chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                      "function": {"name": "read", "arguments": '{"p'}}]}),
               chunk({"tool_calls": [{"index": 0, "function": {"arguments": '": 1}'}}]}),
               chunk({"annotation": "p", "extra": {"a": "x"}}), chunk({"extra": {"a": "y"}}),
               chunk({}, "tool_calls")),
        frames(*[lp_chunk(t, -1.0) for t in ("a", "b", "c")], chunk({}, "length")),
        frames({"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 3}}),
    ]
    for stream in streams:
        folded = aggregate(stream, chat=True)["choices"]
        expected = folded[0]["message"] if folded else None
        assert assistant_message(stream) == expected
    assert assistant_message(streams[-1]) is None
