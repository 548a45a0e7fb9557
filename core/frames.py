"""The normalized events of an engine's output stream: what every adapter yields and the
proxy relays, counts and commits."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Progress:
    total: int
    cache: int
    processed: int
    time_ms: float


class FrameKind(enum.Enum):
    PROGRESS = "progress"  # prompt progress only, no output
    CHUNK = "chunk"  # an output chunk (text, tool-call delta, role, finish)
    USAGE = "usage"  # the final usage-only chunk (choices: [])
    DONE = "done"  # data: [DONE]
    ERROR = "error"  # an error event from the engine mid-stream
    PING = "ping"  # the engine's own keep-alive comment


@dataclass(frozen=True, slots=True)
class Frame:
    """One event of an engine's output stream, parsed once and kept with its exact bytes."""

    kind: FrameKind
    raw: bytes
    data: Mapping[str, Any] | None = None
    progress: Progress | None = None
    has_output: bool = False  # carries generated text or a tool-call delta (stops the TTFT clock)
