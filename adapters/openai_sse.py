"""Sans-IO classification of OpenAI-style SSE events into ``Frame``s.

llama-server, the embedded engine and Ollama's ``/v1`` API all stream OpenAI chunks; this
module turns one decoded SSE event into a typed frame. Every event is parsed here (a
malformed one ends the stream before a client sees it); a plain output chunk, the bulk of
a stream, then keeps only its text (``Frame.unparsed``: the OpenAI pass-through relays its
bytes and never reads it; what does read it parses it once more, then keeps it). A token
event of its stream's known shape (``SameShapeTokens``) has only its text parsed: the
bytes around it are the ones parsed, whole, before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import orjson

from prefixpin.adapters.base import Frame, FrameKind, Progress
from prefixpin.core.errors import UpstreamProtocolError
from prefixpin.core.figures import count_of
from prefixpin.core.frames import parse_json_object
from prefixpin.core.sse import SSEEvent, one_data_line

# The delta fields a plain text chunk carries its text in.
_TEXT_FIELDS = ("content", "reasoning_content")
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
    For a decoder that holds nothing (``adapters.http.push_decoded_frames``)."""
    parsed = _whole_object(chunk)
    return None if parsed is None else _classify_data(chunk, *parsed)


def _whole_object(chunk: bytes) -> tuple[bytes, dict[str, Any]] | None:
    """The data of a read that is one event of one data line, and the JSON object it
    parses into (orjson's reading of it); None for any other read."""
    payload = one_data_line(chunk)
    if payload is None or not payload.startswith(b"{"):
        return None
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return (payload, data) if type(data) is dict else None


# A text no engine's token is, put where a stream's token text was to check that those
# bytes are that text's and nothing else's (``_only_the_text_between``).
_PROBE = "\x00prefixpin probe\x01"
_PROBE_JSON = orjson.dumps(_PROBE)[1:-1]
# A delta's text field (of a plain chunk: ``_plain_text_chunk``) as its key and the
# opening quote of its value, compact JSON.
_KEYS = {field: b'"%s":"' % field.encode() for field in _TEXT_FIELDS}
# Plain tokens in a row, none like the one before, after which a stream stops comparing
# (its token events differ outside their text: a counter, per-token timings).
_UNALIKE_LIMIT = 8


class SameShapeTokens:
    """``classify_whole`` for one stream, with a shortcut for its token events.

    An engine's token events in one stream are the same bytes around a different text:
    llama-server's carry the completion's ``id``, ``model``, ``system_fingerprint`` and
    ``created`` (whole seconds), so only the text changes from one token to the next.
    Once two plain token events in a row (``_plain_text_chunk``) have the same bytes
    before their text and after it, and a text put there is shown to be the delta's and
    nothing else's, those bytes are the stream's shape. A read that starts and ends with
    them, with between them a valid JSON string body (orjson decodes it, UTF-8 checked; a
    quote, a control character or a bad escape there fails), is the same JSON object with
    that text in its place: the JSON tokenizer is in the same state at the end of the
    same leading bytes, the string closes at the same quote, the same trailing bytes
    follow. So its frame is the plain chunk's with the new text, made without parsing the
    rest (a third of ``classify_whole``'s time). Any other read takes ``classify_whole``'s
    path; a stream whose token events differ outside their text (a counter, per-token
    timings) stops comparing them after ``_UNALIKE_LIMIT`` in a row.
    """

    __slots__ = ("_field", "_figured", "_head", "_learning", "_seen", "_tail", "_unalike")

    def __init__(self) -> None:
        self._head = b""  # the bytes up to and with the text's opening quote; b"": none
        self._tail = b""  # the bytes from the text's closing quote to the read's end
        self._field: str | None = None
        self._figured: bool | None = None
        # The last plain token the shape did not take: its field and the bytes around
        # its text (the next one's are compared with them).
        self._seen: tuple[str, bytes, bytes] | None = None
        self._unalike = 0  # plain tokens in a row unlike the one before
        self._learning = True  # False: no more comparing (see ``_compare``)

    def __call__(self, chunk: bytes) -> Frame | None:
        head = self._head
        if head and chunk.startswith(head) and chunk.endswith(tail := self._tail):
            start, end = len(head) - 1, len(chunk) - len(tail)  # the two quotes
            if end > start + 1:  # a text of one character or more, the shapes apart
                try:
                    text = orjson.loads(chunk[start:end + 1])
                except orjson.JSONDecodeError:
                    text = None
                if type(text) is str:  # a plain chunk whose one delta field holds ``text``
                    return Frame.text_chunk(chunk, chunk[6:-2], self._field, text,
                                            self._figured)
        if not self._learning:
            return classify_whole(chunk)
        parsed = _whole_object(chunk)
        if parsed is None:
            return None
        payload, data = parsed
        if "error" in data:
            return _classify_data(chunk, payload, data)
        if (plain := _plain_text_chunk(chunk, payload, data)) is None:
            return _classify_object(chunk, payload, data)
        self._compare(chunk, data, plain)
        return plain

    @property
    def learned(self) -> bool:
        """The stream's token shape is known (its reads of one token take the shortcut)."""
        return bool(self._head) and self._field is not None

    def _compare(self, chunk: bytes, data: dict[str, Any], frame: Frame) -> None:
        """A plain token the shape did not take: its bytes around its text become the
        shape when the last such token's were the same, and the check says so. Bytes
        alike that fail the check, or too many tokens in a row unalike, end the tries."""
        field = frame.delta_field
        if (field is None or (key := _KEYS.get(field)) is None
                or (at := chunk.find(key)) == -1):
            self._seen = None  # not written as a compact key: nothing to compare
            return
        start = at + len(key)
        end = _closing_quote(chunk, start)
        seen = (field, chunk[:start], chunk[end:])
        if seen != self._seen:
            self._seen = seen
            self._unalike += 1
            if self._unalike > _UNALIKE_LIMIT:
                self._learning = False
            return
        if _only_the_text_between(chunk, start, end, data, field):
            self._head, self._tail = seen[1], seen[2]
            self._field, self._figured = field, frame.figured
            self._unalike = 0
        else:
            self._head = self._tail = b""
            self._learning = False


def _only_the_text_between(chunk: bytes, start: int, end: int, data: dict[str, Any],
                           field: str) -> bool:
    """Whether ``chunk[start:end]`` is exactly the JSON string body of the delta's
    ``field`` in the object ``data`` that ``chunk`` parsed into: a probe text in their
    place changes that field, to the probe, and nothing else. (Bytes that were only a
    part of that string would leave the rest of it around the probe.)"""
    try:
        probed = orjson.loads(chunk[6:start] + _PROBE_JSON + chunk[end:-2])
    except orjson.JSONDecodeError:
        return False
    return bool(probed == _with_delta_text(data, field, _PROBE))


def _closing_quote(chunk: bytes, start: int) -> int:
    """The index of the quote that closes the JSON string whose text starts at ``start``
    (one that no odd run of backslashes escapes); ``len(chunk)`` when there is none."""
    at = start
    while (at := chunk.find(b'"', at)) != -1:
        escapes = 0
        while chunk[at - 1 - escapes] == 0x5C:  # a backslash
            escapes += 1
        if escapes % 2 == 0:
            return at
        at += 1
    return len(chunk)


def _with_delta_text(data: dict[str, Any], field: str, text: str) -> dict[str, Any]:
    """``data`` (a plain chunk: one choice, a delta of one field) with that field's text."""
    (choice,) = data["choices"]
    return {**data, "choices": [{**choice, "delta": {field: text}}]}


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
    if type(value) is not str or not value or field not in _TEXT_FIELDS:
        return None
    return Frame.text_chunk(raw, text, field, value, "timings" in data or "usage" in data)


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
        if type(value) is str and field in _TEXT_FIELDS:
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


def _output_and_finish(choices: object) -> tuple[bool, bool]:
    """Whether a choice carries output (text, content, reasoning or tool calls), and whether
    one has a ``finish_reason``, in one pass (per event: no generator)."""
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
