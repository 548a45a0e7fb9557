"""Anthropic Messages (``POST /v1/messages``: Claude Code, the ``anthropic`` SDK) in front
of an engine's OpenAI chat completions.

Read: the body is checked (``anthropic_convert.check_request``, after the structural rules
every format has) and converted into an OpenAI chat body at once, the way llama-server
converts it when it serves ``/v1/messages`` itself (``anthropic_convert.convert_request``),
so identity, repair, fingerprints, pinning, parking and join work unchanged on
``body["messages"]``; the engine is asked on ``/v1/chat/completions``. A follow-up that
resends the history parses, checks and converts only what it adds (``parse_messages``).

Streamed: the headers and a ``: prefixpin`` comment at once, while the engine is silent a
keep-alive (an SSE comment with the progress before ``message_start``, which comes first in
every Anthropic stream; Anthropic's own ``event: ping`` after it), and the engine's chat
chunks as the events llama-server writes for ``/v1/messages`` (``to_json_anthropic_stream``
and the partial ``to_json_anthropic``, ``format_anthropic_sse``): ``message_start`` at the
first chunk (usage from the engine's prompt progress), ``content_block_start``/``_delta``
for thinking, text and tool_use blocks (a tool_use block starts with ``"input": {}``, as
Anthropic's own do), numbered as they first appear (thinking comes first: 0, then text,
then one per tool call, as llama-server numbers them); at the end, every block closed in
that order (a thinking block after an empty ``signature_delta``), then ``message_delta``
(stop reason and ``stop_sequence``, the usage from the engine's usage chunk) and
``message_stop``. llama-server keeps every block open until the end; so does this. If the
engine fails after the headers went out: an Anthropic ``event: error`` (its type by the
error's status: ``api_error`` for an engine failure) and a clean end of stream, no
``message_stop``. Whole: the same answer folded into one ``message``
(``to_json_anthropic``).

Stop reasons are llama-server's: ``max_tokens`` when the length ran out, ``tool_use`` when
the answer calls a tool, else ``end_turn``, a stop sequence included (named in
``stop_sequence``: the converted body asks llama-server for it, see
``anthropic_convert.ask_stopping_word``).

Usage: ``input_tokens`` are the prompt tokens the engine did not have cached (llama-server:
``n_prompt_tokens - n_prompt_tokens_cache``), ``cache_read_input_tokens`` the cached ones,
``output_tokens`` the generated ones. Cached tokens the engine left out are filled in from
its figures when it measures them (``fill_cached``).

Errors: ``{"type": "error", "error": {"type", "message"}}`` with the error's status (and
its ``Retry-After``); an engine's own JSON error body is translated into that shape.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from starlette.responses import JSONResponse, Response

from prefixpin.core.errors import BadRequestError, ProxyError
from prefixpin.core.figures import Figures, count_of, figures_from, mapping_of
from prefixpin.core.frames import Frame, FrameKind
from prefixpin.core.sse import encode_comment
from prefixpin.proxy.codecs.anthropic_convert import (
    answer_blocks,
    check_request,
    convert_message,
    convert_messages,
    convert_request,
)
from prefixpin.proxy.codecs.openai_sse import OPENING, SSE_HEADERS, SSE_MEDIA_TYPE
from prefixpin.proxy.pipeline.aggregate import aggregate, assistant_message
from prefixpin.proxy.pipeline.body_memo import BodyMemo, Wire
from prefixpin.proxy.pipeline.generation import Generation
from prefixpin.proxy.pipeline.validation import (
    FIELD_TYPES,
    Api,
    ClientRequest,
    Endpoint,
    check_converted,
    check_field_types,
    parse_resent,
)

PING = b'event: ping\ndata: {"type": "ping"}\n\n'
ANTHROPIC = Wire("anthropic", "messages")  # its bodies, as the memo of resent ones holds them
ENGINE_PATH = "/v1/chat/completions"

# Anthropic's error types, by status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES: Mapping[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
    504: "timeout_error", 529: "overloaded_error",
}

_CHUNK, _USAGE, _DONE = FrameKind.CHUNK, FrameKind.USAGE, FrameKind.DONE


def _event(name: str) -> bytes:
    return b"event: " + name.encode() + b"\ndata: "


_MESSAGE_START = _event("message_start")
_BLOCK_START = _event("content_block_start")
_BLOCK_DELTA = _event("content_block_delta")
_BLOCK_STOP = _event("content_block_stop")
_MESSAGE_DELTA = _event("message_delta")
_MESSAGE_STOP = _event("message_stop") + b'{"type":"message_stop"}\n\n'
_ERROR = _event("error")
_END = b"\n\n"


class AnthropicCodec:
    """Anthropic Messages over SSE, converted to and from OpenAI chat completions."""

    name = "anthropic"
    api: Api = "anthropic"
    engine_api: Api = "openai"
    endpoint: Endpoint = "chat"
    routes: tuple[str, ...] = ("/v1/messages",)
    media_type = SSE_MEDIA_TYPE
    headers: Mapping[str, str] = SSE_HEADERS
    opening = OPENING

    def __repr__(self) -> str:
        return "AnthropicCodec()"

    def parse(self, raw: bytes, path: str, *, max_messages: int,
              memo: BodyMemo | None = None) -> ClientRequest:
        return parse_messages(raw, max_messages=max_messages, memo=memo)

    def stream(self, client: ClientRequest, generation: Generation, *,
               fill_cached: bool) -> AnthropicStream:
        return AnthropicStream(client, generation, fill_cached=fill_cached)

    def heartbeat(self, text: str) -> bytes:
        return PING  # once the stream has begun (``AnthropicStream.heartbeat``)

    def late_error(self, exc: ProxyError) -> bytes:
        return _ERROR + orjson.dumps(error_body(exc)) + _END

    def whole(self, client: ClientRequest, generation: Generation, *,
              fill_cached: bool) -> Response:
        return JSONResponse(whole_message(client, generation, fill_cached=fill_cached))

    def error_response(self, exc: ProxyError) -> Response:
        return JSONResponse(error_body(exc), status_code=exc.status_code,
                            headers=exc.headers())

    def reply(self, frames: Sequence[Frame]) -> Mapping[str, Any] | None:
        """The answer as the client sends it back next turn (its content blocks), read
        through the same conversion as that next request."""
        message = assistant_message(frames)
        if message is None:
            return None
        converted = convert_message({"role": "assistant", "content": answer_blocks(message)})
        return converted[0] if len(converted) == 1 else None


def parse_messages(raw: bytes, *, max_messages: int,
                   memo: BodyMemo | None = None) -> ClientRequest:
    """The client's Anthropic body, checked, and the chat body it converts to.

    ``memo``: the parses of earlier bodies. A resent history keeps the earlier body's
    message objects and what each converted to (the same chat message objects, whose
    digests are then found by identity: ``DigestMemo``); only the messages it adds are
    checked and converted (a message's checks and conversion read that message alone).
    This body joins them once every check passed."""
    body, resent = parse_resent(raw, memo, ANTHROPIC, converts=True)
    earlier = (resent.converted or ()) if resent is not None else ()
    check_request(body, max_messages, start=len(earlier))
    each = convert_messages(body["messages"], earlier)
    converted = convert_request(body, each)
    messages = converted["messages"]  # (perhaps none: the engine judges, as llama-server)
    if len(messages) > max_messages:
        raise BadRequestError(f"'messages' converts to {len(messages)} chat messages (each "
                              f"tool result is one); the limit is {max_messages}",
                              param="messages")
    check_converted(messages, max_messages, opening=len(messages) - sum(map(len, each)),
                    reused=sum(map(len, earlier)))
    check_field_types(converted, FIELD_TYPES["chat"])
    if memo is not None:
        memo.keep(raw, resent if resent is not None else body, ANTHROPIC, converted=each)
    return ClientRequest("chat", ENGINE_PATH, converted, body.get("stream") is True,
                         False, False, "anthropic", source=body)


# -- errors ------------------------------------------------------------------------------


def error_type(status: int) -> str:
    """Anthropic's error type for a status."""
    known = ERROR_TYPES.get(status)
    if known is not None:
        return known
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(exc: ProxyError) -> dict[str, Any]:
    """The Anthropic error object of a proxy or engine error (an engine's own body gives
    its message: ``UpstreamStatusError`` reads it)."""
    return {"type": "error", "error": {"type": error_type(exc.status_code),
                                       "message": exc.message}}


# -- usage -------------------------------------------------------------------------------


def anthropic_usage(usage: Mapping[str, Any], figures: Figures, *,
                    fill_cached: bool) -> dict[str, int]:
    """An engine's OpenAI usage in Anthropic's fields, what it left out taken from its
    figures; cached tokens only as measured (``fill_cached``) or as the engine sent them."""
    prompt = count_of(usage.get("prompt_tokens"))
    if prompt is None:
        prompt = figures.prompt_tokens
    completion = count_of(usage.get("completion_tokens"))
    if completion is None:
        completion = figures.completion_tokens
    cached = count_of(mapping_of(usage.get("prompt_tokens_details")).get("cached_tokens"))
    if cached is None and fill_cached:
        cached = figures.cached_tokens or 0
    out: dict[str, int] = {}
    if cached is not None:
        if prompt is not None:
            cached = min(cached, prompt)
        out["cache_read_input_tokens"] = cached
    out["input_tokens"] = max(0, (prompt or 0) - (cached or 0))
    out["output_tokens"] = completion or 0
    return out


def stop_reason(finish_reason: object, tool_calls: bool) -> str:
    """llama-server's: ``max_tokens`` when the length ran out, else ``tool_use`` when the
    answer calls a tool, else ``end_turn`` (a stop sequence too: it is named in
    ``stop_sequence``)."""
    if finish_reason == "length":
        return "max_tokens"
    return "tool_use" if tool_calls else "end_turn"


def stopping_word(data: Mapping[str, Any]) -> str | None:
    """The stop string that ended the answer, from llama-server's final chunk (asked for
    with ``anthropic_convert.ask_stopping_word``); None when there is none or it is not said."""
    verbose = data.get("__verbose")
    if isinstance(verbose, Mapping):
        word = verbose.get("stopping_word")
        if isinstance(word, str) and word:
            return word
    return None


# -- the whole answer --------------------------------------------------------------------


def _answer(folded: Mapping[str, Any]) -> Mapping[str, Any] | None:
    choices = folded.get("choices") or []
    if not choices or not isinstance(choices[0].get("message"), Mapping):
        return None
    message: Mapping[str, Any] = choices[0]["message"]
    return message


def whole_message(client: ClientRequest, generation: Generation, *,
                  fill_cached: bool) -> dict[str, Any]:
    """The ``message`` of a ``stream: false`` client (llama-server's ``to_json_anthropic``)."""
    folded = aggregate(generation.frames, chat=True)
    message = _answer(folded) or {}
    choices = folded.get("choices") or [{}]
    blocks = answer_blocks(message)
    figures = figures_from(generation.frames, generation.progress)
    return {
        "id": _message_id(folded.get("id")),
        "type": "message",
        "role": "assistant",
        "content": blocks,
        "model": _model(folded.get("model"), client),
        "stop_reason": stop_reason(choices[0].get("finish_reason"),
                                   any(b["type"] == "tool_use" for b in blocks)),
        "stop_sequence": next((word for frame in generation.frames if frame.data
                               and (word := stopping_word(frame.data))), None),
        "usage": anthropic_usage(mapping_of(folded.get("usage")), figures,
                                 fill_cached=fill_cached),
    }


def _message_id(engine_id: object) -> str:
    return engine_id if isinstance(engine_id, str) and engine_id else \
        f"msg_{uuid.uuid4().hex}"


def _model(engine_model: object, client: ClientRequest) -> str:
    if isinstance(engine_model, str):
        return engine_model
    asked = (client.source or {}).get("model")
    return asked if isinstance(asked, str) else ""


# -- the stream --------------------------------------------------------------------------


class AnthropicStream:
    """One streaming client's Anthropic events, translated from the engine's chat chunks.

    Keeps its place: whether ``message_start`` went out, the index of each block (thinking,
    text, one per tool call) in the order they first appeared, the finish reason. Blocks
    stay open until the end, as llama-server keeps them, and are closed there in its order
    (thinking, text, tools).
    """

    raw_chunks = False  # (``StreamEncoder``): not every chunk as its own bytes

    def heartbeat(self, text: str) -> bytes:
        """Anthropic's ``ping`` once ``message_start`` went out; before it (a queued or
        prefilling request) an SSE comment, as the opening is: an Anthropic stream never
        has an event before ``message_start``, and a client may hold it to that."""
        return PING if self._started else encode_comment(text)

    __slots__ = ("_client", "_ended", "_fill_cached", "_finish", "_generation", "_next",
                 "_started", "_stop_sequence", "_text", "_thinking", "_tools")

    def __init__(self, client: ClientRequest, generation: Generation, *,
                 fill_cached: bool = True) -> None:
        self._client = client
        self._generation = generation
        self._fill_cached = fill_cached
        self._started = False
        self._ended = False
        self._next = 0  # the index of the next block to open
        self._thinking: int | None = None
        self._text: int | None = None
        self._tools: dict[int, int] = {}  # the engine's tool call index: the block's
        self._finish: object = None
        self._stop_sequence: str | None = None

    def encode(self, frames: Sequence[Frame]) -> bytes:
        out: list[bytes] = []
        for frame in frames:
            kind = frame.kind
            if self._ended:
                break
            if kind is _CHUNK:
                self._chunk(frame, out)
            elif kind is _USAGE or kind is _DONE:
                self._end(frame if kind is _USAGE else None, out)
            # PROGRESS and PING: nothing (the proxy sends its own heartbeats)
        return b"".join(out)

    def flush(self) -> bytes | None:
        if self._ended or not self._generation.completed:
            return None  # ended, or failed: the late error follows
        out: list[bytes] = []
        self._end(None, out)
        return b"".join(out)

    def _chunk(self, frame: Frame, out: list[bytes]) -> None:
        data = frame.data or {}
        if not self._started:
            self._start(data, out)
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices:
            return
        choice = choices[0]
        if not isinstance(choice, Mapping):
            return
        if choice.get("finish_reason"):
            self._finish = choice["finish_reason"]
        if "__verbose" in data:  # on the first chunk of llama-server's final result
            self._stop_sequence = stopping_word(data)
        delta = choice.get("delta")
        if not isinstance(delta, Mapping):
            return
        thinking = delta.get("reasoning_content") or delta.get("reasoning")
        if thinking and isinstance(thinking, str):
            if self._thinking is None:
                self._thinking = self._open({"type": "thinking", "thinking": ""}, out)
            out.append(_delta(self._thinking, {"type": "thinking_delta",
                                               "thinking": thinking}))
        text = delta.get("content")
        if text and isinstance(text, str):
            if self._text is None:
                self._text = self._open({"type": "text", "text": ""}, out)
            out.append(_delta(self._text, {"type": "text_delta", "text": text}))
        calls = delta.get("tool_calls")
        if calls and isinstance(calls, list):
            for call in calls:
                if isinstance(call, Mapping):
                    self._tool_call(call, out)

    def _tool_call(self, call: Mapping[str, Any], out: list[bytes]) -> None:
        position = call.get("index")
        position = position if isinstance(position, int) else 0
        function = mapping_of(call.get("function"))
        index = self._tools.get(position)
        if index is None:
            name, call_id = function.get("name"), call.get("id")
            self._tools[position] = index = self._open({
                "type": "tool_use", "id": call_id if isinstance(call_id, str) else "",
                "name": name if isinstance(name, str) else "", "input": {}}, out)
        arguments = function.get("arguments")
        if arguments and isinstance(arguments, str):
            out.append(_delta(index, {"type": "input_json_delta", "partial_json": arguments}))

    def _open(self, block: dict[str, Any], out: list[bytes]) -> int:
        index = self._next
        self._next += 1
        out.append(_BLOCK_START + orjson.dumps({"type": "content_block_start", "index": index,
                                                "content_block": block}) + _END)
        return index

    def _start(self, data: Mapping[str, Any], out: list[bytes]) -> None:
        self._started = True
        generation = self._generation
        usage = anthropic_usage({}, figures_from(generation.frames, generation.progress),
                                fill_cached=self._fill_cached)
        usage["output_tokens"] = 0
        message: dict[str, Any] = {
            "id": _message_id(data.get("id")), "type": "message", "role": "assistant",
            "content": [], "model": _model(data.get("model"), self._client),
            "stop_reason": None, "stop_sequence": None, "usage": usage}
        out.append(_MESSAGE_START + orjson.dumps({"type": "message_start",
                                                  "message": message}) + _END)

    def _end(self, usage_frame: Frame | None, out: list[bytes]) -> None:
        if not self._started:
            self._start((usage_frame.data if usage_frame else None) or {}, out)
        self._ended = True
        if self._thinking is not None:
            out.append(_delta(self._thinking, {"type": "signature_delta", "signature": ""}))
        for index in (self._thinking, self._text, *self._tools.values()):
            if index is not None:
                out.append(_BLOCK_STOP + orjson.dumps({"type": "content_block_stop",
                                                       "index": index}) + _END)
        generation = self._generation
        engine = (usage_frame.data or {}) if usage_frame is not None else {}
        usage = anthropic_usage(mapping_of(engine.get("usage")),
                                figures_from(generation.frames, generation.progress),
                                fill_cached=self._fill_cached)
        out.append(_MESSAGE_DELTA + orjson.dumps({
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(self._finish, bool(self._tools)),
                      "stop_sequence": self._stop_sequence},
            "usage": usage}) + _END)
        out.append(_MESSAGE_STOP)


def _delta(index: int, delta: Mapping[str, Any]) -> bytes:
    return _BLOCK_DELTA + orjson.dumps({"type": "content_block_delta", "index": index,
                                        "delta": delta}) + _END
