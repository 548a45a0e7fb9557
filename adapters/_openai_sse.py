"""Sans-IO classification of OpenAI-style SSE events into ``Frame``s.

llama-server, the embedded engine and Ollama's ``/v1`` API all stream OpenAI chunks; this
module turns one decoded SSE event into a typed frame. Every event is parsed here (a
malformed one ends the stream before a client sees it); a plain output chunk, the bulk of
a stream, then keeps only its text (``Frame.unparsed``: the OpenAI pass-through relays its
bytes and never reads it; what does read it parses it once more, then keeps it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import orjson

from adapters.base import Frame, FrameKind, Progress
from core.errors import UpstreamProtocolError
from core.figures import count_of
from core.frames import parse_json_object
from core.sse import SSEEvent, one_data_line

# Read per event: a module global costs a fraction of an attribute of the enum class.
_PING, _DONE, _ERROR, _USAGE, _PROGRESS, _CHUNK = (
    FrameKind.PING, FrameKind.DONE, FrameKind.ERROR, FrameKind.USAGE, FrameKind.PROGRESS,
    FrameKind.CHUNK)


def classify(event: SSEEvent) -> Frame:
    text = event.data
    if not text and not event.event:
        return Frame(_PING, event.raw)
    if text == "[DONE]" or text.strip() == "[DONE]":
        return Frame(_DONE, event.raw)
    try:  # orjson inline (once per event)
        data = orjson.loads(text)
    except orjson.JSONDecodeError:
        data = None
    if type(data) is not dict:  # refused, or not an object: the general path and its errors
        data = _parse_object(text)
    return _classify_data(event.raw, text, data)


def classify_whole(chunk: bytes) -> Frame | None:
    """The frame of a read that is exactly one event of one data line holding a JSON
    object (a streamed token, the bulk of a stream): what ``classify`` makes of the event
    ``core.sse.SSEDecoder`` would decode from it, without that event, and without decoding
    the data (orjson reads the bytes; the frame keeps them). None for any other read (an
    object orjson refuses included): the decoder and ``classify`` take it, errors and all.
    For a decoder that holds nothing (``adapters._http.push_decoded_frames``)."""
    payload = one_data_line(chunk)
    if payload is None or not payload.startswith(b"{"):
        return None
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if type(data) is not dict:
        return None
    return _classify_data(chunk, payload, data)


def _classify_data(raw: bytes, text: str | bytes, data: dict[str, Any]) -> Frame:
    """An event whose data parsed into the object ``data`` (``text``: that data)."""
    if "error" in data:
        return Frame(_ERROR, raw, data)
    if (plain := _plain_text_chunk(raw, text, data)) is not None:
        return plain
    return _classify_object(raw, text, data)


def _plain_text_chunk(raw: bytes, text: str | bytes, data: dict[str, Any]) -> Frame | None:
    """The bulk of a chat stream in one look: one choice (index 0), no finish, no
    progress, a delta of one non-empty text field. Exactly the frame ``_classify_object``
    makes of it (tested), without its passes over the choices; None for anything else."""
    choices = data.get("choices")
    if type(choices) is not list or len(choices) != 1 or "prompt_progress" in data:
        return None
    choice = choices[0]
    if type(choice) is not dict or choice.get("finish_reason") or choice.get("text"):
        return None
    index = choice.get("index", 0)
    delta = choice.get("delta")
    if index != 0 or index is False or type(delta) is not dict or len(delta) != 1:
        return None
    ((field, value),) = delta.items()
    if type(value) is not str or not value or field not in ("content", "reasoning_content"):
        return None
    frame = Frame.unparsed(_CHUNK, raw, text, None, True, False)
    frame.figured = "timings" in data or "usage" in data
    frame.delta_field, frame.delta_text = field, value
    return frame


def _classify_object(raw: bytes, text: str | bytes, data: dict[str, Any]) -> Frame:
    """Any event that parsed into an object and is not an error."""
    progress = data.get("prompt_progress")
    if progress is not None:
        progress = parse_progress(progress)
    choices = data.get("choices")
    if choices == [] and "usage" in data:
        return Frame(_USAGE, raw, data, progress)
    has_output, finish = _output_and_finish(choices)
    if progress is not None and not has_output and not finish:
        return Frame(_PROGRESS, raw, data, progress)
    if has_output and progress is None and not finish:
        # A plain output chunk, the bulk of a stream: relayed as its bytes, the objects it
        # parsed into let go, made again only if something reads them (``Frame.unparsed``).
        frame = Frame.unparsed(_CHUNK, raw, text, None, True, False)
        frame.figured = "timings" in data or "usage" in data  # (llama-server's per token)
        _note_plain_delta(frame, choices)
        return frame
    return Frame(_CHUNK, raw, data, progress, has_output, finish)


def _note_plain_delta(frame: Frame, choices: object) -> None:
    """A chat chunk of one choice (index 0) whose delta is one text field: that field and
    its text, so the reply folded at the end needs no parse of it (``assistant_message``)."""
    if type(choices) is not list or len(choices) != 1:
        return
    choice = choices[0]
    if type(choice) is not dict or choice.get("index", 0) != 0 or choice.get("index") is False:
        return
    delta = choice.get("delta")
    if type(delta) is not dict or len(delta) != 1:
        return
    for field, value in delta.items():
        if type(value) is str and field in ("content", "reasoning_content"):
            frame.delta_field, frame.delta_text = field, value


def parse_progress(value: object) -> Progress | None:
    """llama-server's ``prompt_progress``; None unless its counts are counts. The counts
    are kept within the prompt (an engine's slip must not show "prefill 9/5")."""
    if not isinstance(value, Mapping):
        return None
    total, cache, processed = (count_of(value.get(k)) for k in ("total", "cache", "processed"))
    if total is None or cache is None or processed is None:
        return None
    time_ms = value.get("time_ms", 0.0)
    if isinstance(time_ms, bool) or not isinstance(time_ms, int | float) or not math.isfinite(
            time_ms):
        time_ms = 0.0
    return Progress(total=total, cache=min(cache, total), processed=min(processed, total),
                    time_ms=max(0.0, float(time_ms)))


def chunk_has_output(choices: object) -> bool:
    if not isinstance(choices, list):
        return False
    for choice in choices:
        # dict first: what orjson makes (the Mapping check is an ABC's, slower per event)
        if not isinstance(choice, dict | Mapping):
            continue
        if choice.get("text"):  # /v1/completions
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict | Mapping) and (
            delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
        ):
            return True
    return False


def _output_and_finish(choices: object) -> tuple[bool, bool]:
    """``chunk_has_output``, and whether a choice has a ``finish_reason``, in one pass (per
    event: no generator)."""
    if not isinstance(choices, list):
        return False, False
    output = finish = False
    for choice in choices:
        if not isinstance(choice, dict | Mapping):
            continue
        if choice.get("finish_reason"):
            finish = True
        if not output:
            if choice.get("text"):  # /v1/completions
                output = True
            else:
                delta = choice.get("delta")
                output = isinstance(delta, dict | Mapping) and bool(
                    delta.get("content") or delta.get("reasoning_content")
                    or delta.get("tool_calls"))
    return output, finish


def _parse_object(text: str) -> dict[str, Any]:
    try:
        # orjson first (every event of every stream goes through here), then the standard
        # library for what orjson refuses but is still an engine's JSON (NaN, huge integers).
        value = parse_json_object(text)
    except ValueError as exc:
        raise UpstreamProtocolError(f"engine sent an SSE event that is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise UpstreamProtocolError("engine sent an SSE event that is not a JSON object")
    return value
