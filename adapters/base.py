"""The narrow protocol every engine adapter implements, and the types it speaks.

An adapter knows one engine's wire format and endpoints; it holds no policy. The proxy
asks it to probe the engine, to open a streaming generation (yielding normalized
``Frame``s), and, where ``Capabilities`` say so, to list, save, restore and erase slots and
to render and tokenize prompts exactly as the engine would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from prefixpin.core.frames import Frame, FrameKind, Progress

__all__ = ["Adapter", "Capabilities", "EngineInfo", "Frame", "FrameKind", "Progress",
           "SlotFileResult", "SlotState", "UpstreamCall", "UpstreamStream"]


@dataclass(frozen=True, slots=True)
class Capabilities:
    slots: bool = False  # requests can be pinned to a slot (id_slot) and /slots is readable
    slot_files: bool = False  # a slot's tokens + KV can be saved to and restored from a file
    progress: bool = False  # the engine reports prompt progress, the first report before prefill
    measured_cache: bool = False  # the engine reports cached prompt tokens itself
    render: bool = False  # the engine renders its chat template and tokenizes on request


@dataclass(frozen=True, slots=True)
class EngineInfo:
    engine: str
    model: str
    n_slots: int
    n_ctx_slot: int
    build: str = ""
    start_time: float | None = None  # engine process start (a change means a restart)
    slot_save_path: bool = False
    n_swa: int = 0  # sliding-window size; 0 for full attention (any prefix is reusable)
    chat_template: str | None = None
    props: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SlotState:
    id: int
    is_processing: bool
    n_ctx: int
    n_prompt_tokens: int  # tokens the slot holds now
    id_task: int = -1


@dataclass(frozen=True, slots=True)
class SlotFileResult:
    slot: int
    filename: str
    n_tokens: int
    n_bytes: int
    ms: float


@dataclass(frozen=True, slots=True)
class UpstreamCall:
    path: str
    body: Mapping[str, Any]
    headers: Mapping[str, str] = field(default_factory=dict)
    # Told the engine's status (a final one, below 400) the moment its response head is
    # read, from the read itself, where the transport can (``adapters.h1``): the opener
    # returns a turn of the loop later. It must not raise.
    on_head: Callable[[int], None] | None = None


class FrameSink(Protocol):
    """Where pushed frames go (``proxy.pipeline.generation.Generation``): every frame of one engine
    read, in order."""

    def take_frames(self, frames: list[Frame]) -> None:
        """The frames of one read, as one list."""
        ...

    def take_frame(self, frame: Frame) -> None:
        """What ``take_frames([frame])`` does, for a read of one frame: the common read (a
        streamed token), handed over without a list."""
        ...


class UpstreamStream(Protocol):
    """An open engine response: status first, then frames (or the error body)."""

    status_code: int
    content_type: str | None

    async def aread_error(self) -> bytes: ...

    def aiter_frames(self) -> AsyncIterator[Frame]: ...

    @property
    def pusher(self) -> Callable[[FrameSink], Awaitable[None]] | None:
        """How to have the frames pushed, where the stream can: each read's frames handed
        to the sink from the engine connection's read itself, not one task wake-up per
        read (``adapters.http.push_decoded_frames``); returns at the end of the body,
        raises what the sink raises and an engine failure as ``UpstreamError``. None:
        only ``aiter_frames`` reads them."""
        ...


class Adapter(Protocol):
    name: str
    capabilities: Capabilities
    http: httpx.AsyncClient  # bound to the engine's base URL; used for pass-through

    async def probe(self) -> EngineInfo: ...

    def prepare(self, path: str, body: Mapping[str, Any], *, slot: int | None) -> UpstreamCall:
        """The engine request for a client body: streaming, progress and usage always on."""
        ...

    def open_stream(self, call: UpstreamCall) -> AbstractAsyncContextManager[UpstreamStream]: ...

    async def list_slots(self) -> list[SlotState]: ...

    async def save_slot(self, slot: int, filename: str) -> SlotFileResult: ...

    async def restore_slot(self, slot: int, filename: str) -> SlotFileResult: ...

    async def erase_slot(self, slot: int) -> None: ...

    async def prefill(self, slot: int, tokens: Sequence[int]) -> int:
        """Evaluate ``tokens`` into ``slot`` (reusing what it holds) and generate nothing;
        how many tokens the slot then holds."""
        ...

    async def apply_template(self, body: Mapping[str, Any]) -> str: ...

    async def tokenize(self, text: str, *, add_special: bool,
                       parse_special: bool = True) -> list[int]:
        """``text``'s tokens; ``parse_special``: a special token's text is that token (as
        on the chat path), else plain text."""
        ...

    def fault(self) -> str | None:
        """What is wrong with the engine's process now, where the adapter runs it (the
        embedded engine's crash and restart), in a line; None otherwise."""
        ...

    async def aclose(self) -> None: ...
