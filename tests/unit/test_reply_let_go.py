"""A long reply's log lets go of what its clients read (``Generation._let_go``): past
``keep_events`` the read frames fold into the reply's text, so the log, and the proxy's
memory, stop growing with the reply, while the reply the session commits and the figures
stay what the whole log gives. Frames as the llama-server adapter makes them of its wire
bytes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from prefixpin.adapters.base import UpstreamStream
from prefixpin.core.figures import figures_from
from prefixpin.core.frames import Frame
from prefixpin.proxy.pipeline.aggregate import aggregate, assistant_message, fold_read
from prefixpin.proxy.pipeline.generation import Generation
from prefixpin.proxy.pipeline.inflight import joinable
from tests.unit.chat_stream import DONE, frames_of, sse

pytestmark = pytest.mark.anyio

ENVELOPE = {"id": "c1", "created": 1, "model": "m", "object": "chat.completion.chunk"}
KEEP = 256


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    return sse({**ENVELOPE, "choices": [{"index": 0, "delta": delta,
                                         "finish_reason": finish}], **extra})


def reply_frames(tokens: int, *, tools: bool = False) -> list[Frame]:
    """A reply of ``tokens`` token events (reasoning first, then text, or a tool call's
    arguments), its finish with timings, the usage chunk and [DONE]."""
    raw = [chunk({"role": "assistant", "content": None},
                 prompt_progress={"total": 9, "cache": 4, "processed": 9, "time_ms": 1.0})]
    if tools:
        raw.append(chunk({"tool_calls": [{"index": 0, "id": "t1", "type": "function",
                                          "function": {"name": "write", "arguments": ""}}]}))
    for i in range(tokens):
        if tools:
            raw.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": f"a{i} "}}]}))
        elif i < tokens // 4:
            raw.append(chunk({"reasoning_content": f"r{i} "}))
        else:
            raw.append(chunk({"content": f"w{i} "}))
    raw.append(chunk({}, "tool_calls" if tools else "stop",
                     timings={"cache_n": 4, "prompt_n": 5, "prompt_ms": 2.0}))
    raw.append(sse({**ENVELOPE, "choices": [],
                    "usage": {"prompt_tokens": 9, "completion_tokens": tokens,
                              "prompt_tokens_details": {"cached_tokens": 4}}}))
    raw.append(DONE)
    return frames_of(b"".join(raw))


@contextlib.asynccontextmanager
async def never_opened(generation: Generation) -> AsyncIterator[UpstreamStream]:
    """These generations are fed by hand: never started."""
    if not generation.finished:
        raise AssertionError("these generations are fed by hand")
    yield cast(UpstreamStream, None)  # pragma: no cover


def fed(generation: Generation, frames: list[Frame], readers: list[Any], *,
        batch: int = 7) -> int:
    """``frames`` into the log a read at a time, each reader reading all after each; the
    log's largest length."""
    longest = 0
    for at in range(0, len(frames), batch):
        generation.take_frames(frames[at:at + batch])
        for reader in readers:
            reader.take_ready(len(generation.frames))
        longest = max(longest, len(generation.frames))
    return longest


async def test_a_long_replys_log_stays_short_and_folds_to_the_same_reply() -> None:
    frames = reply_frames(20 * KEEP)
    generation = Generation(never_opened, grace_s=0, keep_events=KEEP)
    reader = generation.subscribe()
    longest = fed(generation, frames, [reader])
    assert generation.completed
    assert longest <= KEEP + KEEP // 8 + 7, longest
    assert len(generation.frames) < KEEP // 4
    assert not generation.whole
    assert generation.reply_kept
    assert not joinable(generation)
    with pytest.raises(RuntimeError, match="cannot be joined"):
        generation.subscribe()
    # What the session commits and what the metrics read, as from the whole log.
    assert assistant_message(generation.frames) == assistant_message(frames)
    assert (aggregate(generation.frames, chat=True)["choices"]
            == aggregate(frames, chat=True)["choices"])
    assert figures_from(generation.frames, None) == figures_from(frames, None)
    assert figures_from(frames, None).cached_tokens == 4


async def test_a_short_reply_and_an_unread_one_are_kept_whole() -> None:
    """Within ``keep_events`` nothing goes; a client that reads only at the end (a
    non-streaming one) holds every frame, however long: it reads them all then."""
    short = reply_frames(KEEP - 10)
    generation = Generation(never_opened, grace_s=0, keep_events=KEEP)
    fed(generation, short, [generation.subscribe()])
    assert generation.whole
    assert generation.frames == short
    long = reply_frames(4 * KEEP)
    generation = Generation(never_opened, grace_s=0, keep_events=KEEP)
    streaming, whole = generation.subscribe(), generation.subscribe()
    whole.position = 0
    fed(generation, long, [streaming])
    assert generation.whole
    assert generation.frames == long
    assert joinable(generation) is False  # complete: never replayed
    assert whole.take_ready(len(long)) == long


async def test_tool_call_deltas_that_do_not_fold_keep_only_the_figures() -> None:
    """A flood of tool-call deltas (no text field to fold) is let go all the same: the
    log stays short and the figures stay right, and the reply is not committed."""
    frames = reply_frames(20 * KEEP, tools=True)
    generation = Generation(never_opened, grace_s=0, keep_events=KEEP)
    longest = fed(generation, frames, [generation.subscribe()])
    assert longest <= KEEP + KEEP // 8 + 7, longest
    assert not generation.reply_kept
    assert figures_from(generation.frames, None) == figures_from(frames, None)


async def test_every_client_reads_every_frame_once_in_order_across_let_goes() -> None:
    """Two streaming clients at different paces: each reads the whole reply, in order,
    while the log lets go beneath them."""
    frames = reply_frames(10 * KEEP)
    generation = Generation(never_opened, grace_s=0, keep_events=KEEP)
    fast, slow = generation.subscribe(), generation.subscribe()
    got_fast: list[Frame] = []
    got_slow: list[Frame] = []
    for at in range(0, len(frames), 5):
        generation.take_frames(frames[at:at + 5])
        got_fast += fast.take_ready(len(generation.frames))
        got_slow += slow.take_ready(3)
    got_slow += slow.take_ready(len(generation.frames))
    assert not generation.whole
    assert [f.raw for f in got_fast] == [f.raw for f in frames]
    assert [f.raw for f in got_slow] == [f.raw for f in frames]


async def test_a_let_go_reply_is_cancelled_as_soon_as_its_last_client_leaves() -> None:
    """Nobody can join it any more: no grace period for a retry."""
    started = asyncio.Event()

    @contextlib.asynccontextmanager
    async def held(generation: Generation) -> AsyncIterator[UpstreamStream]:
        started.set()
        await asyncio.Event().wait()
        yield cast(UpstreamStream, None)  # pragma: no cover

    generation = Generation(held, grace_s=30, keep_events=KEEP)
    reader = generation.subscribe()
    generation.start()
    await started.wait()
    fed(generation, reply_frames(4 * KEEP)[:-3], [reader])
    assert not generation.whole
    reader.close()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert generation.finished


def test_fold_read_joins_runs_of_one_field_and_keeps_the_rest() -> None:
    frames = reply_frames(12)
    folded = fold_read(frames)
    texts = [(f.delta_field, f.delta_text) for f in folded if f.delta_field is not None]
    assert texts == [("reasoning_content", "r0 r1 r2 "),
                     ("content", "w3 w4 w5 w6 w7 w8 w9 w10 w11 ")]
    # the finish (timings), the usage and [DONE] stay; the first chunk, a progress report
    # (the generation keeps its progress itself), goes
    assert len(folded) == 2 + 3
    assert assistant_message(folded) == assistant_message(frames)
