"""The Ollama wire, sans IO: NDJSON framing, frame classification, figures and folds, run
over the recorded Ollama fixtures (``tests/fixtures/ollama/``; Ollama cannot be installed
here, each fixture cites the Ollama source, doc or recording it comes from)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ollama
import pytest

from prefixpin.adapters.base import Frame, FrameKind
from prefixpin.adapters.ollama import (
    classify_native,
    classify_openai,
    reports_cached_count,
    version_tuple,
)
from prefixpin.core.figures import figures_from
from prefixpin.core.ndjson import (
    KEEPALIVE,
    NDJSONDecoder,
    encode_line,
    error_line,
    fold_chat,
    fold_generate,
    reply_message,
)
from prefixpin.core.sse import SSEDecoder

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ollama"


def fixture(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return loaded


def wire_bytes(name: str) -> bytes:
    """The response bytes: the recorded ones when known, else built from the body list."""
    response = fixture(name)["response"]
    if "raw" in response:
        return str(response["raw"]).encode()
    if response["framing"] == "ndjson":
        return b"".join(json.dumps(line, separators=(",", ":")).encode() + b"\n"
                        for line in response["body"])
    return b"".join(b"data: " + (item if isinstance(item, str) else json.dumps(item)).encode()
                    + b"\n\n" for item in response["body"])


def native_frames(data: bytes, step: int = 7) -> list[Frame]:
    decoder = NDJSONDecoder()
    lines = [line for i in range(0, len(data), step) for line in decoder.feed(data[i:i + step])]
    return [classify_native(line) for line in [*lines, *decoder.flush()]]


def sse_frames(data: bytes) -> list[Frame]:
    decoder = SSEDecoder()
    return [classify_openai(event) for event in [*decoder.feed(data), *decoder.flush()]]


# ---------------------------------------------------------------------------- framing

def test_lines_keep_their_bytes_whatever_the_chunking() -> None:
    data = wire_bytes("native/chat_stream_new.json")
    for step in (1, 5, 64, len(data)):
        frames = native_frames(data, step)
        assert b"".join(f.raw for f in frames) == data
        assert [f.kind for f in frames] == [FrameKind.CHUNK] * 6 + [FrameKind.DONE]


def test_blank_lines_are_skipped_and_a_last_line_without_newline_is_kept() -> None:
    decoder = NDJSONDecoder()
    lines = decoder.feed(b'\n  \n{"a":1}\r\n   {"b":2}\n{"c"')
    lines += decoder.feed(b':3}')
    lines += decoder.flush()
    assert [line.text for line in lines] == ['{"a":1}', '   {"b":2}', '{"c":3}']
    assert lines[-1].raw == b'{"c":3}\n'


def test_a_runaway_line_is_refused() -> None:
    decoder = NDJSONDecoder(max_line_bytes=10)
    with pytest.raises(ValueError, match="longer than 10 bytes"):
        decoder.feed(b"x" * 11)


def test_encoded_lines_never_split_for_ollama_python() -> None:
    """Characters str.splitlines breaks on (NEL, U+2028, ...) are written escaped: the line
    ollama-python reads back with iter_lines is the whole object."""
    value = {"error": "a\x85b\u2028c\u2029d\x0be\x1cf<g>"}
    line = encode_line(value)
    assert line.endswith(b"\n")
    assert line.count(b"\n") == 1
    assert len(line.decode().splitlines()) == 1
    assert json.loads(line) == value
    assert json.loads(error_line("boom")) == {"error": "boom"}


def test_keepalive_is_json_whitespace_before_the_next_object() -> None:
    """Spaces before a line leave it one JSON object for every client."""
    line = KEEPALIVE * 40 + encode_line({"done": False})
    assert json.loads(line) == {"done": False}
    assert len(line.decode().splitlines()) == 1


# ----------------------------------------------------------------------- classification

@pytest.mark.parametrize("name", ["native/chat_stream_new.json", "native/chat_stream_old.json",
                                  "native/chat_stream_thinking_new.json",
                                  "native/chat_stream_tools_new.json",
                                  "native/generate_stream_new.json"])
def test_native_streams_end_in_one_done_frame_and_output_is_output(name: str) -> None:
    frames = native_frames(wire_bytes(name))
    assert [f.kind for f in frames].count(FrameKind.DONE) == 1
    assert frames[-1].kind is FrameKind.DONE
    assert any(f.has_output for f in frames)
    for frame in frames:
        data = frame.data or {}
        message = data.get("message") or {}
        visible = message.get("content") or message.get("thinking") or message.get(
            "tool_calls") or data.get("response") or data.get("thinking")
        assert frame.has_output == bool(visible)


def test_a_native_error_line_is_an_error_frame() -> None:
    frames = native_frames(wire_bytes("native/error_midstream.json"))
    assert frames[-1].kind is FrameKind.ERROR
    assert frames[-1].data == {"error": fixture("native/error_midstream.json")[
        "response"]["body"][-1]["error"]}


def test_ollama_v1_reasoning_is_output() -> None:
    """Ollama's /v1 puts thinking in delta.reasoning; it stops the TTFT clock too."""
    frames = sse_frames(wire_bytes("openai/chat_stream_reasoning.json"))
    reasoning = [f for f in frames if f.data and any(
        c.get("delta", {}).get("reasoning") for c in f.data.get("choices", []))]
    assert reasoning
    assert all(f.has_output for f in reasoning)


# ------------------------------------------------------------------------------ figures

@pytest.mark.parametrize(("name", "cached"), [
    ("native/chat_stream_tools_new.json", 18),
    ("native/chat_stream_tools_old.json", None),
    ("native/chat_stream_new.json", 0),
    ("native/chat_stream_old.json", None),
])
def test_native_figures_come_from_the_done_chunk(name: str, cached: int | None) -> None:
    """Prompt, cached (absent before 0.33.3: unknown, never 0), prompt time and load time
    from Ollama's own metrics (nanoseconds)."""
    frames = native_frames(wire_bytes(name))
    done = frames[-1].data or {}
    figures = figures_from(frames, None)
    assert figures.prompt_tokens == done["prompt_eval_count"]
    assert figures.cached_tokens == cached
    assert figures.completion_tokens == done["eval_count"]
    assert figures.prompt_ms == pytest.approx(done["prompt_eval_duration"] / 1e6)
    assert figures.load_ms == pytest.approx(done["load_duration"] / 1e6)


@pytest.mark.parametrize(("name", "cached"), [("openai/chat_stream_new.json", True),
                                              ("openai/chat_stream_old.json", False)])
def test_v1_figures_come_from_usage(name: str, cached: bool) -> None:
    frames = sse_frames(wire_bytes(name))
    usage = next(f for f in frames if f.kind is FrameKind.USAGE).data or {}
    figures = figures_from(frames, None)
    assert figures.prompt_tokens == usage["usage"]["prompt_tokens"]
    assert (figures.cached_tokens is not None) == cached
    assert figures.load_ms is None


def test_versions_with_the_cached_count() -> None:
    assert reports_cached_count("0.33.3")
    assert reports_cached_count("0.35.1")
    assert not reports_cached_count("0.33.2")
    assert not reports_cached_count("0.30.1")
    assert not reports_cached_count("0.0.0")  # a source build: the fields decide
    assert version_tuple("0.34.0-rc2") == (0, 34, 0)
    assert version_tuple("junk") is None


# -------------------------------------------------------------------------------- folds

@pytest.mark.parametrize(("stream", "whole"), [
    ("native/chat_stream_tools_new.json", "native/chat_nonstream_tools_new.json"),
    ("native/chat_stream_new.json", None),
])
def test_a_folded_chat_is_what_ollama_answers_stream_false(stream: str, whole: str | None
                                                            ) -> None:
    """writeChatResponse: the done chunk with content and thinking joined, tool calls
    collected; ollama-python parses it as a ChatResponse."""
    chunks = [f.data for f in native_frames(wire_bytes(stream)) if f.data]
    folded = fold_chat(chunks)
    if whole is not None:
        assert folded == fixture(whole)["response"]["body"]
    text = "".join(c["message"]["content"] for c in chunks)
    assert folded["message"]["content"] == text
    assert ollama.ChatResponse.model_validate(folded).done
    assert reply_message(chunks) == folded["message"]


def test_a_folded_thinking_chat_keeps_the_thinking() -> None:
    chunks = [f.data for f in native_frames(wire_bytes("native/chat_stream_thinking_new.json"))
              if f.data]
    folded = fold_chat(chunks)
    assert folded["message"]["thinking"] == "".join(
        c["message"].get("thinking", "") for c in chunks)
    assert list(folded["message"]) == ["role", "content", "thinking"]


def test_a_folded_generate_is_what_ollama_answers_stream_false() -> None:
    chunks = [f.data for f in native_frames(wire_bytes("native/generate_stream_new.json"))
              if f.data]
    expected = fixture("native/generate_nonstream_new.json")["response"]["body"]
    folded = fold_generate(chunks)
    assert list(folded) == list(expected)
    assert folded["response"] == "".join(c["response"] for c in chunks)
    assert ollama.GenerateResponse.model_validate(folded).done
