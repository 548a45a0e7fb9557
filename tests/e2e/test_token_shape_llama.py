"""A real llama-server's token events are of one shape (``SameShapeTokens``): the bytes
around each token's text are the same from one token to the next, so the proxy classifies
them without parsing them whole, and gets the frames it got by parsing them."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from prefixpin.adapters.openai_sse import classify_whole
from tests.rig.llama_process import LlamaServerProcess
from tests.unit.test_same_shape_tokens import counted_frames


def stream_events(llama: LlamaServerProcess, body: dict[str, Any]) -> list[bytes]:
    """The engine's SSE events, each as the one read it would be (``data: ...\\n\\n``)."""
    response = httpx.post(f"{llama.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return [event + b"\n\n" for event in response.content.split(b"\n\n") if event]


@pytest.mark.parametrize("extra", [
    {"reasoning_format": "none"},
    {"return_progress": True, "stream_options": {"include_usage": True}},
])
def test_a_real_streams_tokens_take_the_shortcut_to_the_same_frames(
        llama: LlamaServerProcess, monkeypatch: pytest.MonkeyPatch,
        extra: dict[str, Any]) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me about the sea."}],
            "stream": True, "max_tokens": 40, "temperature": 0, **extra}
    reads = stream_events(llama, body)
    tokens = sum(1 for read in reads
                 if (frame := classify_whole(read)) is not None and frame.delta_text)
    assert tokens >= 30, reads[:5]  # a stream of plain token events to read
    counted = counted_frames(reads, monkeypatch)  # each read's frame: classify_whole's
    # Two tokens parsed to learn the shape, again for each second "created" moved on;
    # the role, progress, finish and usage events parsed; every other token not.
    assert counted.parsed <= len(reads) - tokens + 2 + 2 * 3, (counted.parsed, len(reads),
                                                                tokens)
