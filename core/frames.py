"""The normalized events of an engine's output stream: what every adapter yields and the
proxy relays, counts and commits."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson


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


_UNPARSED: Any = object()  # a frame's data not parsed yet (``Frame.unparsed``)
_CHUNK = FrameKind.CHUNK  # read per token (``Frame.text_chunk``): a global, not an enum lookup


class Frame:
    """One event of an engine's output stream, kept with its exact bytes; shared by every
    client of a generation and never changed once made.

    ``data``: the event's JSON object. A frame made by ``Frame.unparsed`` holds only the
    JSON text, which its adapter parsed once to classify it (so it is valid) and then let
    go: ``data`` parses it again on first read and keeps it. That is how an output chunk
    lives while it streams: the OpenAI pass-through relays its bytes and never reads it,
    and a stream in flight holds one object per event for the garbage collector to scan,
    not five (the dict, the choices list, a choice, its delta, the frame); what reads
    every chunk (another wire format's encoder, the reply folded at the end) still can.

    ``finish``: an output chunk that ends a choice (it carries a ``finish_reason``), as
    the adapter found it; read from ``data`` when the adapter did not say.
    """

    __slots__ = ("_data", "_finish", "_payload", "delta_field", "delta_text", "figured",
                 "has_output", "kind", "progress", "raw")

    def __init__(self, kind: FrameKind, raw: bytes, data: Mapping[str, Any] | None = None,
                 progress: Progress | None = None, has_output: bool = False,
                 finish: bool | None = None) -> None:
        self.kind = kind
        self.raw = raw
        self._data = data
        self.progress = progress
        self.has_output = has_output  # generated text or a tool-call delta (the TTFT clock)
        self._finish = finish
        self._payload: str | bytes | None = None
        # What an unparsed chunk's adapter read of it before letting its objects go:
        # ``delta_field``/``delta_text``: the one text field of its one choice's delta (a
        # chat chunk that carries only ``content`` or ``reasoning_content``), for the reply
        # folded at the end; ``figured``: whether it has a field figures are read from
        # (None: not said, the bytes are searched).
        self.delta_field: str | None = None
        self.delta_text: str | None = None
        self.figured: bool | None = None

    @classmethod
    def unparsed(cls, kind: FrameKind, raw: bytes, payload: str | bytes,
                 progress: Progress | None = None, has_output: bool = False,
                 finish: bool | None = None) -> Frame:
        """A frame whose ``data`` is the JSON object ``payload`` (already known to parse
        into one), parsed when first read. (Made once per streamed token: its fields set
        here, not through ``__init__``, one call fewer.)"""
        frame = cls.__new__(cls)
        frame.kind, frame.raw, frame._data, frame._payload = kind, raw, _UNPARSED, payload
        frame.progress, frame.has_output, frame._finish = progress, has_output, finish
        frame.delta_field = frame.delta_text = frame.figured = None
        return frame

    @classmethod
    def text_chunk(cls, raw: bytes, payload: str | bytes, field: str | None,
                   text: str | None, figured: bool | None) -> Frame:
        """``unparsed`` for a plain output chunk whose delta's one text field is known:
        the bulk of a chat stream, one frame per token, so made in one call with each
        field set once."""
        frame = cls.__new__(cls)
        frame.kind, frame.raw, frame._data, frame._payload = _CHUNK, raw, _UNPARSED, payload
        frame.progress, frame.has_output, frame._finish = None, True, False
        frame.delta_field, frame.delta_text, frame.figured = field, text, figured
        return frame

    @property
    def data(self) -> Mapping[str, Any] | None:
        data = self._data
        if data is _UNPARSED:
            data = self._data = parse_json_object(self._payload or b"")
            self._payload = None
        return data

    @property
    def parsed(self) -> bool:
        """``data`` is at hand (reading it costs no parse)."""
        return self._data is not _UNPARSED

    @property
    def finish(self) -> bool:
        if self._finish is None:
            choices = (self.data or {}).get("choices")
            self._finish = isinstance(choices, list) and any(
                isinstance(c, Mapping) and bool(c.get("finish_reason")) for c in choices)
        return self._finish

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Frame):
            return NotImplemented
        return (self.kind, self.raw, self.data, self.progress, self.has_output) == (
            other.kind, other.raw, other.data, other.progress, other.has_output)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        data = self.data if self.parsed else "<unparsed>"
        return (f"Frame(kind={self.kind!r}, raw={self.raw!r}, data={data!r}, "
                f"progress={self.progress!r}, has_output={self.has_output!r})")


def parse_json_object(text: str | bytes) -> Any:
    """JSON as an engine sends it: orjson (every event goes through here), the standard
    library for what orjson refuses (NaN, integers past 64 bits). Raises ``ValueError``."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)
