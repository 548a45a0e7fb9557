"""OpenAI Responses (``POST /v1/responses``: the Codex CLI, the openai SDK's
``client.responses``) over an engine's chat completions.

Parse: the client's Responses body (``ClientRequest.source``) is converted into a chat
completions body (``ClientRequest.body``, asked on ``/v1/chat/completions``) by
``proxy.codecs.responses_convert.to_chat``, llama-server's own conversion ported, so that
identity, repair, fingerprints, pinning, parking and join all work on ``messages`` and the
engine renders and samples as its own ``/v1/responses`` would. The same structural rules
as every format (size, nesting, surrogates, NaN) apply first, then the Responses field
types, then the converted messages go through the chat message checks. A follow-up that
resends the ``input`` converts and checks only the items from its last final message on
(``ResponsesCodec.parse``, ``responses_convert.convert_input``).

What is not stored, and so refused or said: this proxy and the engine keep no responses.
``previous_response_id``, ``conversation`` and ``prompt`` (stored state) are 400s naming
the field. ``store: true`` is accepted, as llama-server accepts it, but the answer says
``"store": false``: nothing was stored, nothing can be retrieved or continued by id
(Codex sends ``store: false`` and the whole conversation each turn anyway).

Streamed: the headers and a ``: prefixpin`` comment at once, ``: <what the proxy waits
for>`` comments while the engine is silent (SSE comments: the openai SDK's and Codex's
decoders skip them), then the engine's chat chunks translated into Responses events with
llama-server's event order and fields (``to_json_oaicompat_resp_stream`` and the partial
``to_json_oaicompat_resp``), completed to the OpenAI schema the SDK's stream accumulator
reads (``output_index``, ``content_index``, ``sequence_number``, a whole Response object
in each lifecycle event):

    response.created, response.in_progress                   (with the first output)
    response.output_item.added (reasoning), response.reasoning_text.delta...
    response.output_item.added (message), response.content_part.added,
        response.output_text.delta...
    response.output_item.added (function_call), response.function_call_arguments.delta...
    at the end, for each item in output order: its ...done events
        (reasoning_text.done, output_text.done, content_part.done,
        function_call_arguments.done), response.output_item.done
    response.completed                                       (usage, the engine's timings)

``sequence_number`` counts every event of the stream from 0, consecutively, per client
(each client's encoder numbers its own; clients of one generation see the same events). A
client that sent ``return_progress`` also gets llama-server's ``response.in_progress``
events with ``prompt_progress``; no other client sees a byte for the engine's progress or
pings (the proxy sends its own heartbeats). Function calls carry the engine's tool call id
as ``call_id`` unchanged (llama-server prefixes ``call_``): the client sends it back, and a
template that renders tool call ids then renders the model's own.

If the engine fails after the headers went out: ``response.failed`` (the Response with
the output so far and ``error: {code, message}``; Codex retries on it, the SDK's stream
helper ends on it), then the ``error`` event (``{"type": "error", "code", "message",
"param", "sequence_number"}``, ``openai.types.responses.ResponseErrorEvent``) and a clean
end. Before any byte: the OpenAI error shape (an engine's own JSON error body as it came).

Whole (``stream: false``): the Response object llama-server's ``to_json_oaicompat_resp``
writes (reasoning, message and function call items), with the same echoed fields.

Usage, in ``response.completed`` and the whole Response: ``input_tokens``,
``input_tokens_details.cached_tokens``, ``output_tokens``,
``output_tokens_details.reasoning_tokens``, ``total_tokens``, from the engine's usage
chunk (the proxy always asks for it). ``cached_tokens`` the engine left out is filled
from the engine's figures when it measures them (``fill_cached``), else left out (an
estimate is never presented as measured). ``reasoning_tokens``: the engine's
``completion_tokens_details.reasoning_tokens``, else the number of its chunks that carried
reasoning text (llama-server streams one per sampled token; the think tags themselves
carry none), 0 without reasoning. ``status`` is ``completed`` for every answer the engine
finished, also one cut at ``max_output_tokens``, as llama-server says.

Reply: the output items of the answer, as the client echoes them next turn, converted by
the same code (one assistant message: reasoning_content, content parts, tool_calls), so
the committed history is byte for byte what the next request's conversion contains.
"""

from __future__ import annotations

import json
import secrets
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from starlette.responses import JSONResponse, Response

from prefixpin.core.errors import BadRequestError, ProxyError, error_response
from prefixpin.core.figures import count_of, figures_from, mapping_of
from prefixpin.core.frames import Frame, FrameKind
from prefixpin.core.sse import encode_comment
from prefixpin.proxy.codecs.openai_sse import OPENING, SSE_HEADERS, SSE_MEDIA_TYPE
from prefixpin.proxy.codecs.responses_convert import (
    convert,
    fallback_call_id,
    function_call_item,
    message_item,
    output_items,
    output_text_part,
    reasoning_item,
    reply_message,
)
from prefixpin.proxy.pipeline.aggregate import aggregate, assistant_message
from prefixpin.proxy.pipeline.body_memo import BodyMemo, Wire
from prefixpin.proxy.pipeline.generation import Generation
from prefixpin.proxy.pipeline.validation import (
    FIELD_TYPES,
    JSON_ARRAY,
    JSON_BOOL,
    JSON_INT,
    JSON_NUMBER,
    JSON_OBJECT,
    JSON_STR,
    Api,
    ClientRequest,
    Endpoint,
    check_converted,
    check_field_types,
    optional_bool,
    parse_resent,
)

ENGINE_PATH = "/v1/chat/completions"
RESPONSES = Wire("responses", "input")  # its bodies, as the memo of resent ones holds them
# The Responses request fields the proxy checks; null always passes. ``input`` and
# ``tools`` are checked by the conversion, item by item.
FIELD_TYPES_RESPONSES: dict[str, tuple[str, ...]] = {
    "model": (JSON_STR,), "instructions": (JSON_STR,), "max_output_tokens": (JSON_INT,),
    "temperature": (JSON_NUMBER,), "top_p": (JSON_NUMBER,), "top_logprobs": (JSON_INT,),
    "max_tool_calls": (JSON_INT,), "tool_choice": (JSON_STR, JSON_OBJECT),
    "parallel_tool_calls": (JSON_BOOL,),
    "reasoning": (JSON_OBJECT,), "text": (JSON_OBJECT,), "metadata": (JSON_OBJECT,),
    "stream_options": (JSON_OBJECT,), "include": (JSON_ARRAY,), "user": (JSON_STR,),
    "prompt_cache_key": (JSON_STR,), "store": (JSON_BOOL,), "background": (JSON_BOOL,),
    "service_tier": (JSON_STR,), "truncation": (JSON_STR,), "safety_identifier": (JSON_STR,),
    "tools": (JSON_ARRAY,),
}
_REASONING_FIELDS = {"effort": (JSON_STR,), "summary": (JSON_STR,)}

_CHUNK, _USAGE, _PROGRESS, _DONE = (FrameKind.CHUNK, FrameKind.USAGE, FrameKind.PROGRESS,
                                    FrameKind.DONE)
# The sequence number the ``error`` event after a failed stream carries, per error: set by
# the encoder that wrote ``response.failed`` (every client of one generation numbers the
# same events, so they agree), read by ``late_error``.
_NEXT_SEQUENCE: weakref.WeakKeyDictionary[ProxyError, int] = weakref.WeakKeyDictionary()


def new_id(prefix: str) -> str:
    """An id like llama-server's: the prefix and 32 random letters and digits."""
    return prefix + secrets.token_hex(16)


class ResponsesCodec:
    """OpenAI Responses, converted to and from the engine's chat completions."""

    name = "responses"
    api: Api = "responses"
    engine_api: Api = "openai"
    endpoint: Endpoint = "chat"
    routes: tuple[str, ...] = ("/v1/responses", "/responses")  # (llama-server's alias)
    media_type = SSE_MEDIA_TYPE
    headers: Mapping[str, str] = SSE_HEADERS
    opening = OPENING

    def __repr__(self) -> str:
        return "ResponsesCodec()"

    def parse(self, raw: bytes, path: str, *, max_messages: int,
              memo: BodyMemo | None = None) -> ClientRequest:
        """``memo``: the parses of earlier bodies. A resent ``input`` keeps the earlier
        body's items and the chat messages they made that are final (``convert_input``),
        the same objects (their digests are then found by identity: ``DigestMemo``); the
        rest is checked and converted. This body joins them once every check passed."""
        source, resent = parse_resent(raw, memo, RESPONSES, converts=True)
        earlier = (resent.converted or ()) if resent is not None else ()
        check_field_types(source, FIELD_TYPES_RESPONSES)
        reasoning = source.get("reasoning")
        if isinstance(reasoning, Mapping):
            check_field_types({f"reasoning.{k}": v for k, v in reasoning.items()},
                               {f"reasoning.{k}": t for k, t in _REASONING_FIELDS.items()})
        stream = optional_bool(source, "stream")
        converted = convert(source, earlier)
        body = converted.body
        messages = body["messages"]
        if not messages:
            raise BadRequestError("'input' must contain at least one item", param="input")
        if len(messages) > max_messages:
            raise BadRequestError(f"'input' makes {len(messages)} messages; the limit is "
                                  f"{max_messages}", param="input")
        check_converted(messages, max_messages, opening=converted.opening,
                        reused=converted.reused)
        check_field_types(body, FIELD_TYPES["chat"])
        if memo is not None:
            memo.keep(raw, resent if resent is not None else source, RESPONSES,
                      converted=converted.opened)
        return ClientRequest("chat", ENGINE_PATH, body, stream, True,
                             optional_bool(source, "return_progress"), "responses",
                             source=source)

    def stream(self, client: ClientRequest, generation: Generation, *,
               fill_cached: bool) -> ResponsesStream:
        return ResponsesStream(client, generation, fill_cached=fill_cached)

    def heartbeat(self, text: str) -> bytes:
        return encode_comment(text)

    def late_error(self, exc: ProxyError) -> bytes:
        code, message, param = error_fields(exc)
        return event_bytes("error", {"type": "error", "code": code, "message": message,
                                     "param": param,
                                     "sequence_number": _NEXT_SEQUENCE.get(exc, 0)})

    def whole(self, client: ClientRequest, generation: Generation, *,
              fill_cached: bool) -> Response:
        folded = aggregate(generation.frames, chat=True)
        choices = folded.get("choices") or []
        message = choices[0].get("message") if choices else None
        items = output_items(_with_reasoning(message) if isinstance(message, Mapping) else {},
                             ids={"reasoning": new_id("rs_"), "message": new_id("msg_")})
        now = int(time.time())
        response = response_object(client, new_id("resp_"), now, "completed", items,
                                   model=folded.get("model"), completed_at=now)
        response["usage"] = responses_usage(generation, fill_cached=fill_cached,
                                            reasoning_tokens=_reasoning_chunks(
                                                generation.frames))
        return JSONResponse(response)

    def error_response(self, exc: ProxyError) -> Response:
        return error_response(exc)

    def reply(self, frames: Sequence[Frame]) -> Mapping[str, Any] | None:
        message = assistant_message(frames)
        if message is None:
            return None
        return reply_message(output_items(_with_reasoning(message)))


class _Item:
    """One output item of a stream while it is open."""

    __slots__ = ("arguments", "call_id", "id", "index", "kind", "name", "text")

    def __init__(self, kind: str, index: int, item_id: str, *, call_id: str = "",
                 name: str = "") -> None:
        self.kind, self.index, self.id = kind, index, item_id
        self.call_id, self.name = call_id, name
        self.text: list[str] = []
        self.arguments: list[str] = []

    def done(self, status: str = "completed") -> dict[str, Any]:
        if self.kind == "reasoning":
            return reasoning_item(self.id, "".join(self.text), status)
        if self.kind == "message":
            return message_item(self.id, "".join(self.text), status)
        return function_call_item(self.call_id, self.name, "".join(self.arguments), status)


class ResponsesStream:
    """One streaming client's Responses events of a generation's chat frames."""

    raw_chunks = False  # (``StreamEncoder``): not every chunk as its own bytes

    def heartbeat(self, text: str) -> bytes:
        return encode_comment(text)  # anywhere in the stream

    def __init__(self, client: ClientRequest, generation: Generation, *,
                 fill_cached: bool = True) -> None:
        self._client = client
        self._generation = generation
        self._fill_cached = fill_cached
        self._id = new_id("resp_")
        self._reasoning_id = new_id("rs_")
        self._message_id = new_id("msg_")
        self._created_at = int(time.time())
        self._sequence = 0
        self._started = False
        self._finished = False
        self._model: object = None
        self._items: list[_Item] = []
        self._reasoning: _Item | None = None
        self._message: _Item | None = None
        self._calls: dict[int, _Item] = {}
        self._reasoning_chunks = 0
        self._timings: Mapping[str, Any] | None = None
        # llama-server's per-token telemetry, on each delta event, for a client that asked
        # (``timings_per_token``): the timings of the chunk being translated
        self._per_token = bool((client.source or {}).get("timings_per_token"))
        self._chunk_timings: dict[str, Any] = {}

    # --- the hot path -----------------------------------------------------------------

    def encode(self, frames: Sequence[Frame]) -> bytes:
        out: list[bytes] = []
        for frame in frames:
            kind = frame.kind
            if kind is _CHUNK:
                self._chunk(frame, out)
            elif kind is _USAGE:
                self._note(frame)
            elif kind is _DONE:
                self._complete(out)
            elif kind is _PROGRESS and self._client.wants_progress and not self._finished:
                self._progress(frame, out)
        return b"".join(out)

    def flush(self) -> bytes | None:
        if self._finished:
            return None
        out: list[bytes] = []
        generation = self._generation
        if generation.completed:
            self._complete(out)
        elif generation.error is not None:
            self._fail(generation.error, out)
        return b"".join(out) or None

    # --- frames -----------------------------------------------------------------------

    def _chunk(self, frame: Frame, out: list[bytes]) -> None:
        data = frame.data
        if data is None or self._finished:
            return
        self._note(frame)
        if self._per_token:
            timings = data.get("timings")
            self._chunk_timings = {"timings": timings} if isinstance(timings, Mapping) else {}
        choices = data.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, Mapping) or (choice.get("index") or 0) != 0:
                continue  # one answer per response (n > 1 has no Responses shape)
            delta = choice.get("delta")
            if isinstance(delta, Mapping):
                self._delta(delta, out)

    def _delta(self, delta: Mapping[str, Any], out: list[bytes]) -> None:
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            self._reasoning_delta(reasoning, out)
        content = delta.get("content")
        if isinstance(content, str) and content:
            self._text_delta(content, out)
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            for call in calls:
                if isinstance(call, Mapping):
                    self._call_delta(call, out)

    def _reasoning_delta(self, text: str, out: list[bytes]) -> None:
        self._start(out)
        item = self._reasoning
        if item is None:
            item = self._reasoning = self._open("reasoning", self._reasoning_id)
            self._emit(out, "response.output_item.added", {
                "output_index": item.index,
                "item": reasoning_item(item.id, None, "in_progress")})
        self._reasoning_chunks += 1
        item.text.append(text)
        self._emit(out, "response.reasoning_text.delta", {
            "item_id": item.id, "output_index": item.index, "content_index": 0,
            "delta": text, **self._chunk_timings})

    def _text_delta(self, text: str, out: list[bytes]) -> None:
        self._start(out)
        item = self._message
        if item is None:
            item = self._message = self._open("message", self._message_id)
            self._emit(out, "response.output_item.added", {
                "output_index": item.index, "item": message_item(item.id, None, "in_progress")})
            self._emit(out, "response.content_part.added", {
                "item_id": item.id, "output_index": item.index, "content_index": 0,
                "part": output_text_part("")})
        item.text.append(text)
        self._emit(out, "response.output_text.delta", {
            "item_id": item.id, "output_index": item.index, "content_index": 0,
            "delta": text, "logprobs": [], **self._chunk_timings})

    def _call_delta(self, call: Mapping[str, Any], out: list[bytes]) -> None:
        self._start(out)
        index = call.get("index")
        position = index if isinstance(index, int) and not isinstance(index, bool) else 0
        function = mapping_of(call.get("function"))
        item = self._calls.get(position)
        if item is None:
            given = call.get("id")
            call_id = given if isinstance(given, str) and given else fallback_call_id(position)
            name = function.get("name")
            item = self._calls[position] = self._open(
                "function_call", f"fc_{call_id}", call_id=call_id,
                name=name if isinstance(name, str) else "")
            self._emit(out, "response.output_item.added", {
                "output_index": item.index,
                "item": function_call_item(item.call_id, item.name, "", "in_progress")})
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            item.arguments.append(arguments)
            self._emit(out, "response.function_call_arguments.delta", {
                "item_id": item.id, "output_index": item.index, "delta": arguments})

    def _progress(self, frame: Frame, out: list[bytes]) -> None:
        """llama-server's telemetry, for a client that asked (``return_progress``): the
        first report opens the response, each one is a ``response.in_progress``."""
        progress = (frame.data or {}).get("prompt_progress")
        self._start(out, progress)

    def _note(self, frame: Frame) -> None:
        data = frame.data or {}
        if self._model is None and isinstance(data.get("model"), str):
            self._model = data["model"]
        if isinstance(data.get("timings"), Mapping):
            self._timings = data["timings"]

    # --- events -----------------------------------------------------------------------

    def _start(self, out: list[bytes], progress: object = None) -> None:
        """``response.created`` and ``response.in_progress`` before the first output; with
        ``progress``, an ``in_progress`` event carrying it (again, if already started)."""
        extra = {"prompt_progress": progress} if progress is not None else {}
        if self._started:
            if extra:
                self._emit(out, "response.in_progress",
                           {"response": self._response("in_progress"), **extra})
            return
        self._started = True
        response = self._response("in_progress")
        self._emit(out, "response.created", {"response": response})
        self._emit(out, "response.in_progress", {"response": response, **extra})

    def _open(self, kind: str, item_id: str, *, call_id: str = "", name: str = "") -> _Item:
        item = _Item(kind, len(self._items), item_id, call_id=call_id, name=name)
        self._items.append(item)
        return item

    def _close_items(self, out: list[bytes], status: str) -> list[dict[str, Any]]:
        output: list[dict[str, Any]] = []
        for item in self._items:
            done = item.done(status)
            if item.kind == "reasoning":
                self._emit(out, "response.reasoning_text.done", {
                    "item_id": item.id, "output_index": item.index, "content_index": 0,
                    "text": done["content"][0]["text"]})
            elif item.kind == "message":
                part = done["content"][0]
                self._emit(out, "response.output_text.done", {
                    "item_id": item.id, "output_index": item.index, "content_index": 0,
                    "text": part["text"], "logprobs": []})
                self._emit(out, "response.content_part.done", {
                    "item_id": item.id, "output_index": item.index, "content_index": 0,
                    "part": part})
            else:
                self._emit(out, "response.function_call_arguments.done", {
                    "item_id": item.id, "output_index": item.index, "name": item.name,
                    "arguments": done["arguments"]})
            self._emit(out, "response.output_item.done", {
                "output_index": item.index, "item": done})
            output.append(done)
        return output

    def _complete(self, out: list[bytes]) -> None:
        if self._finished:
            return
        self._start(out)
        self._finished = True
        output = self._close_items(out, "completed")
        response = self._response("completed", output, completed_at=int(time.time()))
        response["usage"] = responses_usage(self._generation, fill_cached=self._fill_cached,
                                            reasoning_tokens=self._reasoning_chunks)
        extra = {"timings": self._timings} if self._timings is not None else {}
        self._emit(out, "response.completed", {"response": response, **extra})

    def _fail(self, exc: ProxyError, out: list[bytes]) -> None:
        self._start(out)
        self._finished = True
        output = self._close_items(out, "incomplete")
        code, message, _ = error_fields(exc)
        response = self._response("failed", output)
        response["error"] = {"code": code, "message": message}
        self._emit(out, "response.failed", {"response": response})
        _NEXT_SEQUENCE[exc] = self._sequence

    def _response(self, status: str, output: list[dict[str, Any]] | None = None, *,
                  completed_at: int | None = None) -> dict[str, Any]:
        return response_object(self._client, self._id, self._created_at, status,
                               output or [], model=self._model, completed_at=completed_at)

    def _emit(self, out: list[bytes], kind: str, fields: Mapping[str, Any]) -> None:
        out.append(event_bytes(kind, {"type": kind, **fields,
                                      "sequence_number": self._sequence}))
        self._sequence += 1


# --- shared pieces -------------------------------------------------------------------------

def event_bytes(kind: str, data: Mapping[str, Any]) -> bytes:
    """One SSE event as llama-server writes it (``format_oai_resp_sse``)."""
    return b"event: " + kind.encode() + b"\ndata: " + _json(data) + b"\n\n"


def _json(value: Mapping[str, Any]) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # an integer past 64 bits echoed from the client's body
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def response_object(client: ClientRequest, response_id: str, created_at: int, status: str,
                    output: list[dict[str, Any]], *, model: object = None,
                    completed_at: int | None = None) -> dict[str, Any]:
    """A Response object: this response's own fields, the request's echoed from the
    client's body (``client.source``)."""
    source = client.source or {}
    reasoning = mapping_of(source.get("reasoning"))
    text = mapping_of(source.get("text"))
    requested = source.get("model")
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "completed_at": completed_at,
        "error": None,
        "incomplete_details": None,
        "instructions": source.get("instructions"),
        "max_output_tokens": source.get("max_output_tokens"),
        "max_tool_calls": source.get("max_tool_calls"),
        "model": requested if isinstance(requested, str) else model,
        "output": output,
        "parallel_tool_calls": source.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "prompt_cache_key": source.get("prompt_cache_key"),
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "safety_identifier": source.get("safety_identifier"),
        "service_tier": source.get("service_tier") or "default",
        "store": False,  # nothing is stored: see the module docstring
        "temperature": source.get("temperature"),
        "text": {"format": {"type": "text"}, **text},
        "tool_choice": source.get("tool_choice") or "auto",
        "tools": source.get("tools") or [],
        "top_logprobs": source.get("top_logprobs"),
        "top_p": source.get("top_p"),
        "truncation": source.get("truncation") or "disabled",
        "usage": None,
        "user": source.get("user"),
        "metadata": source.get("metadata") or {},
    }


def responses_usage(generation: Generation, *, fill_cached: bool,
                    reasoning_tokens: int) -> dict[str, Any] | None:
    """The Responses usage of a finished generation: the engine's usage chunk, what it
    left out from the engine's figures (cached tokens only from an engine that measures
    them); None when the engine gave no token counts at all."""
    usage: Mapping[str, Any] = {}
    for frame in generation.frames:
        if frame.kind is _USAGE and frame.data is not None:
            usage = mapping_of(frame.data.get("usage"))
    figures = figures_from(generation.frames, generation.progress)
    prompt = count_of(usage.get("prompt_tokens"))
    completion = count_of(usage.get("completion_tokens"))
    prompt = figures.prompt_tokens if prompt is None else prompt
    completion = figures.completion_tokens if completion is None else completion
    if prompt is None or completion is None:
        return None
    out: dict[str, Any] = {"input_tokens": prompt}
    details = mapping_of(usage.get("prompt_tokens_details"))
    cached = count_of(details.get("cached_tokens"))
    if cached is None and fill_cached:
        cached = figures.cached_tokens or 0
    if cached is not None:
        out["input_tokens_details"] = {"cached_tokens": cached}
    out["output_tokens"] = completion
    engine_reasoning = count_of(mapping_of(usage.get("completion_tokens_details")).get(
        "reasoning_tokens"))
    out["output_tokens_details"] = {"reasoning_tokens": engine_reasoning if engine_reasoning
                                    is not None else reasoning_tokens}
    total = count_of(usage.get("total_tokens"))
    out["total_tokens"] = total if total is not None else prompt + completion
    return out


def error_fields(exc: ProxyError) -> tuple[str, str, str | None]:
    """The code, message and param of an error, as its OpenAI error body says them."""
    error = mapping_of(exc.body().get("error"))
    code = error.get("code") or error.get("type") or exc.code or exc.error_type
    message = error.get("message")
    param = error.get("param")
    return (str(code), message if isinstance(message, str) else exc.message,
            param if isinstance(param, str) else None)


def _with_reasoning(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """The message with Ollama's ``reasoning`` read as ``reasoning_content``."""
    if "reasoning_content" not in message and isinstance(message.get("reasoning"), str):
        return {**message, "reasoning_content": message["reasoning"]}
    return message


def _reasoning_chunks(frames: Sequence[Frame]) -> int:
    count = 0
    for frame in frames:
        if frame.kind is not _CHUNK or frame.data is None:
            continue
        for choice in frame.data.get("choices") or []:
            delta = choice.get("delta") if isinstance(choice, Mapping) else None
            if isinstance(delta, Mapping) and (delta.get("reasoning_content")
                                                or delta.get("reasoning")):
                count += 1
    return count
