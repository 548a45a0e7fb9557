"""What the codec unit tests build llama-server's chat streams from: its SSE events as
bytes, the frames the llama-server adapter makes of them, and a generation holding them
(the codecs read only its frames, progress, completed flag and error)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any, cast

from prefixpin.adapters.openai_sse import classify
from prefixpin.core.errors import ProxyError
from prefixpin.core.frames import Frame
from prefixpin.core.sse import SSEDecoder
from prefixpin.proxy.pipeline.generation import Generation

DONE = b"data: [DONE]\n\n"


def sse(payload: Mapping[str, Any]) -> bytes:
    """One event as llama-server writes it (compact JSON, its keys in insertion order)."""
    return b"data: " + json.dumps(payload, separators=(",", ":"),
                                  ensure_ascii=False).encode() + b"\n\n"


def frames_of(raw: bytes) -> list[Frame]:
    """The frames the llama-server adapter makes of these bytes."""
    decoder = SSEDecoder()
    return [classify(event) for event in [*decoder.feed(raw), *decoder.flush()]]


class FakeGeneration(SimpleNamespace):
    frames: list[Frame]
    progress: Any
    completed: bool
    error: ProxyError | None


def generation(frames: Sequence[Frame] = (), *, completed: bool = True,
               error: ProxyError | None = None) -> Generation:
    progress = next((f.progress for f in reversed(frames) if f.progress is not None), None)
    return cast(Generation, FakeGeneration(frames=list(frames), progress=progress,
                                           completed=completed, error=error))
