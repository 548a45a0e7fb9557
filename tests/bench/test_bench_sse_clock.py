"""The TTFT clock: stops at the first generated output, never at comments or progress.

The recorded streams in ``data/`` are real llama-server responses (see each file's first
comment line for the request); they are replayed here byte by byte with a synthetic
clock, so each event gets a known arrival time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sse_clock import FirstTokenClock, SSEDecoder, StreamObservation

DATA = Path(__file__).parent / "data"


def replay(stream: bytes, chunk_size: int) -> StreamObservation:
    """Feed ``stream`` in chunks; the time of a chunk is the offset of its last byte."""
    clock = FirstTokenClock(started_at=0.0)
    for start in range(0, len(stream), chunk_size):
        chunk = stream[start:start + chunk_size]
        clock.feed(chunk, now=float(start + len(chunk)))
    return clock.close(now=float(len(stream)))


def first_output_offset(stream: bytes) -> int:
    """Independent of the clock: byte offset where the first output event ends."""
    offset = 0
    for block in stream.split(b"\n\n"):
        offset += len(block) + 2
        for line in block.split(b"\n"):
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            delta = (json.loads(line[6:]).get("choices") or [{}])[0].get("delta") or {}
            if delta.get("content") or delta.get("tool_calls") or delta.get(
                    "reasoning_content"):
                return offset
    raise AssertionError("stream has no output event")


@pytest.fixture(scope="module")
def progress_stream() -> bytes:
    return (DATA / "llama_server_progress.sse").read_bytes()


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 7, 64, 1 << 20])
def test_recorded_stream_stops_at_first_content(progress_stream: bytes,
                                                chunk_size: int) -> None:
    """Whatever the chunking, the clock stops when the first content event is complete."""
    observation = replay(progress_stream, chunk_size)
    expected = first_output_offset(progress_stream)
    assert observation.first_token_s is not None
    assert expected <= observation.first_token_s < expected + chunk_size
    assert observation.progress_chunks >= 2  # progress events came first and were ignored
    assert observation.comments >= 1
    assert observation.done


def test_recorded_stream_reports_usage_and_timings(progress_stream: bytes) -> None:
    """The final usage chunk and the timings are kept for the row."""
    observation = replay(progress_stream, 1 << 20)
    assert observation.usage is not None
    assert observation.usage["prompt_tokens"] > 0
    assert "cached_tokens" in observation.usage["prompt_tokens_details"]
    assert observation.timings is not None
    assert observation.timings["prompt_ms"] > 0
    assert "".join(observation.text)


def _event(payload: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _delta(delta: dict[str, object]) -> bytes:
    return _event({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})


def test_comments_role_and_progress_chunks_do_not_stop_the_clock() -> None:
    """Pings, heartbeats, the role chunk and content:null progress chunks are not tokens."""
    clock = FirstTokenClock(started_at=10.0)
    clock.feed(b": ping\n\n", now=11.0)
    clock.feed(b":\n\n", now=12.0)
    clock.feed(_delta({"role": "assistant", "content": None}), now=13.0)
    clock.feed(_event({"choices": [{"delta": {"content": None}}],
                       "prompt_progress": {"total": 9, "cache": 0, "processed": 9}}), now=14.0)
    clock.feed(_delta({"content": ""}), now=15.0)
    assert not clock.stopped
    clock.feed(_delta({"content": "Hi"}), now=16.5)
    observation = clock.close(now=17.0)
    assert observation.first_token_s == pytest.approx(6.5)
    assert (observation.comments, observation.progress_chunks) == (2, 1)
    assert observation.first_event_s == pytest.approx(3.0)


@pytest.mark.parametrize("delta", [
    {"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "read"}}]},
    {"reasoning_content": "Let me"},
], ids=["tool-call", "reasoning"])
def test_tool_call_and_reasoning_deltas_stop_the_clock(delta: dict[str, object]) -> None:
    """A tool-call delta or a reasoning delta is the model's first output too."""
    clock = FirstTokenClock(started_at=0.0)
    clock.feed(_delta({"role": "assistant", "content": None}), now=1.0)
    clock.feed(_delta(delta), now=2.0)
    assert clock.close(now=3.0).first_token_s == 2.0


def test_no_output_leaves_the_clock_running() -> None:
    """A stream that ends with no output has no first token (the caller falls back)."""
    clock = FirstTokenClock(started_at=0.0)
    clock.feed(_event({"choices": [{"delta": {}, "finish_reason": "stop"}]}), now=1.0)
    clock.feed(b"data: [DONE]\n\n", now=1.5)
    observation = clock.close(now=2.0)
    assert observation.first_token_s is None
    assert observation.last_event_s == 1.5


def test_decoder_handles_crlf_cr_and_split_utf8() -> None:
    """Line endings of all three kinds and a UTF-8 character split across chunks."""
    stream = ('data: {"a": "é"}\r\n\r\n: c\r\rdata: 1\ndata: 2\n\n').encode()
    split = stream.index("é".encode()) + 1  # in the middle of the two-byte character
    decoder = SSEDecoder()
    events = decoder.feed(stream[:split]) + decoder.feed(stream[split:]) + decoder.flush()
    assert [(e.data, e.comment_only) for e in events] == [
        ('{"a": "é"}', False), ("", True), ("1\n2", False)]


def test_decoder_waits_for_the_lf_after_a_trailing_cr() -> None:
    """A chunk ending in \\r must not dispatch twice when the \\n arrives next."""
    decoder = SSEDecoder()
    events = decoder.feed(b"data: x\r") + decoder.feed(b"\n\r") + decoder.feed(b"\n")
    assert [e.data for e in events] == ["x"]
