"""The relay's per-event path: output chunks kept as bytes and parsed only when read
(``Frame.unparsed``), classified exactly as when every event was parsed; the generation's
change event; the OpenAI encoder's fast path. (A client's stream: ``test_live_stream``.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from prefixpin.adapters.base import UpstreamStream
from prefixpin.adapters.llama_native import NativeClassifier
from prefixpin.adapters.openai_sse import classify, classify_whole
from prefixpin.core.errors import ProxyError, UpstreamProtocolError
from prefixpin.core.figures import figures_from
from prefixpin.core.frames import Frame, FrameKind
from prefixpin.core.sse import SSEDecoder
from prefixpin.proxy.codecs.openai_sse import ClientView
from prefixpin.proxy.pipeline.generation import Generation
from prefixpin.proxy.pipeline.relay import _early_error
from prefixpin.proxy.pipeline.validation import parse_request

ENVELOPE = {"id": "c1", "created": 1, "model": "m", "object": "chat.completion.chunk"}


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    return event({**ENVELOPE, "choices": [{"index": 0, "delta": delta,
                                           "finish_reason": finish}], **extra})


STREAM = [
    chunk({"role": "assistant", "content": None},
          prompt_progress={"total": 4, "cache": 1, "processed": 4, "time_ms": 1.5}),
    chunk({"role": "assistant", "content": None}),
    chunk({"content": ""}),  # empty: not output
    chunk({"content": None}),
    chunk({"content": "Hel"}),
    chunk({"reasoning_content": "hmm"}),
    chunk({"tool_calls": [{"index": 0, "id": "t", "function": {"name": "f"}}]}),
    chunk({"content": "lo"}, timings={"cache_n": 1, "prompt_n": 3, "prompt_ms": 2.0}),
    chunk({}, "stop"),
    event({**ENVELOPE, "choices": [],
           "usage": {"prompt_tokens": 4, "completion_tokens": 2,
                     "prompt_tokens_details": {"cached_tokens": 1}},
           "timings": {"cache_n": 1, "prompt_n": 3, "prompt_ms": 2.0}}),
    b"data: [DONE]\n\n",
]


def frames_of(raw: list[bytes]) -> list[Frame]:
    decoder = SSEDecoder()
    return [classify(e) for r in raw for e in decoder.feed(r)]


def test_plain_output_chunks_are_parsed_only_when_read() -> None:
    frames = frames_of(STREAM)
    kinds = [f.kind for f in frames]
    assert kinds == [FrameKind.PROGRESS] + [FrameKind.CHUNK] * 8 + [FrameKind.USAGE,
                                                                      FrameKind.DONE]
    assert [f.has_output for f in frames] == [False, False, False, False, True, True, True,
                                              True, False, False, False]
    # Only the plain output chunks wait unparsed (timings or not: the figures find those in
    # the bytes); every other frame is read while it streams.
    assert [f.parsed for f in frames] == [True, True, True, True, False, False, False, False,
                                          True, True, True]
    assert [f.finish for f in frames] == [False] * 8 + [True, False, False]
    for raw, frame in zip(STREAM, frames, strict=True):
        expected = None if raw.startswith(b"data: [") else json.loads(raw[6:])
        assert frame.data == expected
        assert frame.raw == raw
    assert all(f.parsed for f in frames)  # read once, kept


def test_a_plain_chunk_says_its_one_text_field_and_whether_it_has_figures() -> None:
    """What the reply fold and the figures read of a chunk without parsing it again: the
    one text field of choice 0's delta, only when that is all the delta holds."""
    frames = frames_of(STREAM)
    said = [(f.delta_field, f.delta_text, f.figured) for f in frames]
    assert said[4] == ("content", "Hel", False)
    assert said[5] == ("reasoning_content", "hmm", False)
    assert said[6] == (None, None, False)  # a tool call: parsed when the reply is folded
    assert said[7] == ("content", "lo", True)  # llama-server's timings on a delta
    two = frames_of([chunk({"content": "a", "reasoning_content": "b"}),
                     event({**ENVELOPE, "choices": [{"index": 1, "delta": {"content": "x"}}]}),
                     event({**ENVELOPE, "choices": [{"index": 0, "delta": {"content": "y"}},
                                                    {"index": 1, "delta": {"content": "z"}}]})])
    assert [(f.delta_field, f.delta_text) for f in two] == [(None, None)] * 3


def test_an_unparsed_frame_equals_its_parsed_twin() -> None:
    (lazy,) = frames_of([chunk({"content": "x"})])
    assert not lazy.parsed
    eager = Frame(FrameKind.CHUNK, lazy.raw, json.loads(lazy.raw[6:]), None, True)
    assert lazy == eager
    assert "content" in repr(lazy)


def test_a_malformed_event_is_refused_when_classified_not_when_read() -> None:
    """What is relayed has parsed: a broken event never reaches a client first."""
    with pytest.raises(UpstreamProtocolError, match="not JSON"):
        frames_of([b'data: {"choices":[{"delta":{"content":"x"}}\n\n'])
    with pytest.raises(UpstreamProtocolError, match="not a JSON object"):
        frames_of([b"data: [1, 2]\n\n"])


def test_figures_are_the_same_with_unparsed_chunks() -> None:
    lazy = frames_of(STREAM)
    eager = [Frame(f.kind, f.raw, f.data, f.progress, f.has_output) for f in frames_of(STREAM)]
    assert figures_from(lazy, None) == figures_from(eager, None)
    assert figures_from(lazy, None).cached_tokens == 1
    assert not lazy[4].parsed  # nothing in a plain chunk's bytes names a figure
    assert lazy[7].parsed  # its timings do


def test_native_text_events_wait_unparsed() -> None:
    classify_native = NativeClassifier()
    decoder = SSEDecoder()
    raw = [event({"index": 0, "content": "", "stop": False,
                  "prompt_progress": {"total": 2, "cache": 0, "processed": 2, "time_ms": 1}}),
           event({"index": 0, "content": " Paris", "stop": False}),
           event({"index": 0, "content": "", "stop": True, "timings": {"cache_n": 0}})]
    frames = [classify_native(e) for r in raw for e in decoder.feed(r)]
    assert [f.kind for f in frames] == [FrameKind.PROGRESS, FrameKind.CHUNK, FrameKind.DONE]
    assert [f.parsed for f in frames] == [True, False, True]
    assert frames[1].data == {"index": 0, "content": " Paris", "stop": False}


def test_the_sse_fast_path_and_the_buffered_path_agree() -> None:
    whole = b"".join(STREAM)
    for size in (1, 7, 64, len(whole)):
        decoder = SSEDecoder()
        events = [e for i in range(0, len(whole), size) for e in decoder.feed(whole[i:i + size])]
        assert [e.raw for e in events] == STREAM


def client_of(**body: Any) -> Any:
    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True,
                      **body}).encode()
    return parse_request(raw, "chat", "/v1/chat/completions", max_messages=100)


def opener_of(generation: Generation) -> Any:
    raise AssertionError("never opened")


@pytest.mark.parametrize("usage", [True, False])
def test_the_encoder_relays_the_same_bytes_in_batches_or_one_by_one(usage: bool) -> None:
    async def run() -> tuple[bytes, bytes]:
        generation = Generation(opener_of, grace_s=0)
        client = client_of(**({"stream_options": {"include_usage": True}} if usage else {}))
        frames = frames_of(STREAM)
        whole = ClientView(client, generation).encode(frames)
        one_by_one = ClientView(client, generation)
        parts = b"".join(one_by_one.encode([f]) for f in frames) + (one_by_one.flush() or b"")
        return whole, parts

    whole, parts = asyncio.run(run())
    assert whole == parts
    if usage:
        assert whole == b"".join(STREAM[1:])  # progress not asked for; the rest as it came
    else:  # no usage chunk; the finish chunk carries its timings, as the engine would
        assert b'"usage"' not in whole
        assert b'"finish_reason":"stop"' in whole
        assert b'"timings"' in whole.split(b"\n\n")[-3]


def test_changed_is_set_at_the_next_change_only() -> None:
    async def run() -> None:
        generation = Generation(opener_of, grace_s=0)
        changed = generation.changed()
        assert generation.changed() is changed  # the same event until the change
        generation.take_frames(frames_of(STREAM[1:2]))
        assert changed.is_set()
        assert not generation.changed().is_set()

    asyncio.run(run())


class SilentStream:
    """An engine's answer whose head came and whose events never do."""

    status_code = 200
    content_type = "text/event-stream"
    pusher = None

    async def aread_error(self) -> bytes:
        return b""

    async def aiter_frames(self) -> AsyncIterator[Frame]:
        await asyncio.Event().wait()
        yield Frame(FrameKind.PING, b"")  # pragma: no cover


def test_the_first_byte_wait_wakes_a_turn_of_the_loop_after_the_head() -> None:
    """The stream's response waits for the engine's head (or its error) up to the first
    byte's budget: woken by the head's arrival itself, one turn of the loop later, where
    the future's callbacks took two (under load, each turn is milliseconds of the first
    event's)."""
    async def run() -> tuple[int, int, ProxyError | None]:
        turns = 0

        async def count_turns() -> None:
            nonlocal turns
            while True:
                await asyncio.sleep(0)
                turns += 1

        @contextlib.asynccontextmanager
        async def opener(generation: Generation) -> AsyncIterator[UpstreamStream]:
            yield cast(UpstreamStream, SilentStream())

        async def wait_for_head() -> tuple[int, ProxyError | None]:
            error = await _early_error(generation, time.monotonic(), 10.0)
            return turns, error

        generation = Generation(opener, grace_s=0)
        headed: list[int] = []
        generation.listen_for_head(lambda: headed.append(turns))
        counter = asyncio.create_task(count_turns())
        waiting = asyncio.create_task(wait_for_head())
        await asyncio.sleep(0)
        generation.start()
        woke, error = await waiting
        counter.cancel()
        await generation.aclose()
        return headed[0], woke, error

    headed, woke, error = asyncio.run(run())
    assert error is None
    assert woke - headed <= 1, (headed, woke)


PLAIN_SHAPES: list[dict[str, Any]] = [
    {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]},
    {"choices": [{"delta": {"content": "Hel"}}]},  # no index: the first choice
    {"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]},
    {"choices": [{"index": 0, "delta": {"content": "lo"}}], "timings": {"cache_n": 1}},
    {"choices": [{"index": 0, "delta": {"content": "lo"}}], "usage": {"prompt_tokens": 1}},
    {"choices": [{"index": 0.0, "delta": {"content": "x"}}]},  # 0.0 == 0, both paths say
    # not plain, each in one way: the general path decides
    {"choices": [{"index": 1, "delta": {"content": "x"}}]},
    {"choices": [{"index": False, "delta": {"content": "x"}}]},
    {"choices": [{"index": 0, "delta": {"content": ""}}]},
    {"choices": [{"index": 0, "delta": {"content": None}}]},
    {"choices": [{"index": 0, "delta": {"content": 7}}]},
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "x"}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]},
    {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}]},
    {"choices": [{"index": 0, "delta": {"content": "x"}}],
     "prompt_progress": {"total": 4, "cache": 1, "processed": 4, "time_ms": 1.0}},
    {"choices": [{"index": 0, "delta": {"content": "x"}}], "prompt_progress": None},
    {"choices": [{"index": 0, "text": "x"}]},  # /v1/completions
    {"choices": [{"index": 0, "delta": {"content": "x"}},
                 {"index": 1, "delta": {"content": "y"}}]},
    {"choices": [{"index": 0, "delta": "x"}]},
    {"choices": [], "usage": {"prompt_tokens": 1}},
    {"choices": {"index": 0}},
]


@pytest.mark.parametrize(("shape", "payload"), list(enumerate(PLAIN_SHAPES)))
def test_the_plain_chunk_path_makes_the_frame_the_general_path_makes(
        shape: int, payload: dict[str, Any]) -> None:
    from prefixpin.adapters.openai_sse import _classify_object, _plain_text_chunk

    raw = event({**ENVELOPE, **payload})
    (sse,) = SSEDecoder().feed(raw)
    data = json.loads(sse.data)
    general = _classify_object(sse.raw, sse.data, data)
    fast = _plain_text_chunk(sse.raw, sse.data, data)
    chosen = classify(sse)
    whole = classify_whole(raw)  # the read, never decoded into an event
    assert whole is not None
    for frame in [f for f in (fast, chosen, whole) if f is not None]:
        assert (frame.kind, frame.raw, frame.data, frame.progress, frame.has_output,
                frame.finish, frame.parsed, frame.figured, frame.delta_field,
                frame.delta_text) == (
            general.kind, general.raw, general.data, general.progress, general.has_output,
            general.finish, general.parsed, general.figured, general.delta_field,
            general.delta_text)
    assert (fast is not None) == (shape < 6)  # (False == 0 == 0.0: compared by position)


WHOLE_READS = [
    *STREAM,
    chunk({"content": "caf\u00e9 \u2603"}),  # not ASCII: orjson reads the bytes
    b'data: {"error":{"message":"boom","code":500}}\n\n',
    b"data: [DONE]\n\n",
    b"data:  [DONE]  \n\n",
    b"data: \n\n",
    b": ping\n\n",
    b'event: error\ndata: {"error":"x"}\n\n',
    b'data: {"a":1}\r\n\r\n',  # CR endings
    b'data: {"a":1}\n\ndata: {"b":2}\n\n',  # two events
    b'data: {"a":1}\n',  # no end
    b'data: {"a":1}\ndata: {"b":2}\n\n',  # two data lines
    b"data: [1,2]\n\n",  # not an object
    b'data: {"a":NaN}\n\n',  # orjson refuses; the standard library reads it
    b'data: {"a":1\n\n',  # not JSON
    b'data: {"a":"\xff"}\n\n',  # not UTF-8
    b'data:{"a":1}\n\n',  # no space after the colon
]


@pytest.mark.parametrize("read", WHOLE_READS)
def test_a_whole_read_is_classified_as_the_decoder_and_classify_would(read: bytes) -> None:
    """``classify_whole`` either makes the frame the decoder's one event would give
    (``classify``), or declines (None) and leaves the read to that path."""
    def general() -> Frame | BaseException:
        try:
            (sse,) = SSEDecoder().feed(read)
            return classify(sse)
        except (ValueError, UpstreamProtocolError) as exc:
            return exc

    whole = classify_whole(read)
    if whole is None:
        return
    frame = general()
    assert isinstance(frame, Frame)
    assert (whole.kind, whole.raw, whole.data, whole.progress, whole.has_output,
            whole.finish, whole.parsed, whole.figured, whole.delta_field,
            whole.delta_text) == (
        frame.kind, frame.raw, frame.data, frame.progress, frame.has_output,
        frame.finish, frame.parsed, frame.figured, frame.delta_field, frame.delta_text)


def test_the_whole_read_path_takes_the_token_chunk() -> None:
    assert classify_whole(chunk({"content": "Hel"})) is not None
    assert classify_whole(b"data: [DONE]\n\n") is None
    assert classify_whole(b'data: {"a":1}\r\n\r\n') is None
