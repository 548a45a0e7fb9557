"""OpenAI's chat completions (``/v1/chat/completions``) and completions (``/v1/completions``)
over SSE: one codec class, parameterised by endpoint.

Streamed: the headers and a ``: prefixpin`` comment at once, ``: <what the proxy waits
for>`` comments while the engine is silent (the prefill progress in their text), the
engine's events unchanged and in order, and, if the engine fails after the headers went
out, an OpenAI-shaped error event (``data: {"error": {...}}``, llama-server's own mid-stream
shape) and a clean end of stream. Whole: the chunks folded as the OpenAI SDK's stream
accumulator folds them (``proxy.pipeline.aggregate``). Errors: ``{"error": {"message", "type",
"param", "code"}}``, an engine's own JSON error body passed on byte for byte.

Usage lives in the usage chunk (``choices: []``) and in the whole body's ``usage``. The
proxy always asks the engine for usage and progress; a client that did not ask gets
neither (``ClientView``). Where the engine measures cached tokens but left
``prompt_tokens_details.cached_tokens`` out, it is filled in from the engine's figures.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from starlette.responses import JSONResponse, Response

from prefixpin.core.errors import ProxyError, error_event, error_response
from prefixpin.core.figures import count_of, figures_from, mapping_of, with_cached_tokens
from prefixpin.core.frames import Frame, FrameKind
from prefixpin.core.sse import encode_comment, encode_data
from prefixpin.proxy.pipeline.aggregate import aggregate, assistant_message
from prefixpin.proxy.pipeline.body_memo import BodyMemo
from prefixpin.proxy.pipeline.generation import Generation
from prefixpin.proxy.pipeline.validation import Api, ClientRequest, Endpoint, parse_request

SSE_MEDIA_TYPE = "text/event-stream"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
OPENING = encode_comment("prefixpin")
# Read per frame: a module global costs a fraction of an attribute of the enum class.
_CHUNK, _USAGE, _PROGRESS, _PING = (FrameKind.CHUNK, FrameKind.USAGE, FrameKind.PROGRESS,
                                    FrameKind.PING)


class OpenAICodec:
    """OpenAI SSE, for ``endpoint`` "chat" (chat completions) or "completions"."""

    api: Api = "openai"
    engine_api: Api = "openai"
    media_type = SSE_MEDIA_TYPE
    headers: Mapping[str, str] = SSE_HEADERS
    opening = OPENING

    def __init__(self, endpoint: Endpoint, routes: tuple[str, ...]) -> None:
        self.name: str = endpoint  # the in-flight namespace the OpenAI routes always had
        self.endpoint: Endpoint = endpoint
        self.routes = routes
        self._chat = endpoint == "chat"

    def __repr__(self) -> str:
        return f"OpenAICodec({self.endpoint!r})"

    def parse(self, raw: bytes, path: str, *, max_messages: int,
              memo: BodyMemo | None = None) -> ClientRequest:
        # The engine is asked on its OpenAI path (the first route, /v1/...) whatever alias
        # the client used (/chat/completions); a bare /completions is not one of these
        # routes: on llama-server it is the native API (proxy.codecs.llama_native).
        return parse_request(raw, self.endpoint, self.routes[0], max_messages=max_messages,
                             memo=memo)

    def stream(self, client: ClientRequest, generation: Generation, *,
               fill_cached: bool) -> ClientView:
        return ClientView(client, generation, fill_cached=fill_cached)

    def heartbeat(self, text: str) -> bytes:
        return encode_comment(text)

    def late_error(self, exc: ProxyError) -> bytes:
        return error_event(exc)

    def whole(self, client: ClientRequest, generation: Generation, *,
              fill_cached: bool) -> Response:
        body = aggregate(generation.frames, chat=self._chat)
        ensure_usage(body, generation, fill_cached=fill_cached)
        return JSONResponse(body)

    def error_response(self, exc: ProxyError) -> Response:
        return error_response(exc)

    def reply(self, frames: Sequence[Frame]) -> Mapping[str, Any] | None:
        if not self._chat:
            return None  # a completion has no assistant message
        return assistant_message(frames)


class ClientView:
    """What one client sees of a generation's frames (the SSE stream encoder).

    The proxy always asks the engine for progress and usage; a client that did not ask
    gets neither. llama-server puts ``timings`` on the usage chunk when usage was asked for
    and on the finish chunk otherwise, so for a client that did not ask, the finish chunk
    is held back one frame and given the usage chunk's ``timings``: the client sees what
    the engine would have sent it directly.
    """

    def __init__(self, client: ClientRequest, generation: Generation, *,
                 fill_cached: bool = True) -> None:
        self._client = client
        self._generation = generation
        self._fill_cached = fill_cached
        self._held: Frame | None = None
        self._wants_usage = client.wants_usage
        # (``StreamEncoder``) nothing is ever held back for a client that asked for usage:
        # ``encode`` writes its chunks as their bytes, on this flag, which the relay reads.
        self.raw_chunks = self._wants_usage

    def heartbeat(self, text: str) -> bytes:
        return encode_comment(text)  # anywhere in the stream

    def encode(self, frames: Sequence[Frame]) -> bytes:
        # The common frame, an output chunk of a client that asked for usage (nothing is
        # ever held back for it), is its own bytes; the rest takes ``bytes_for``.
        out: list[bytes] = []
        append = out.append
        raw_chunks = self.raw_chunks
        for frame in frames:
            if raw_chunks and frame.kind is _CHUNK:
                append(frame.raw)
            elif part := self.bytes_for(frame):
                append(part)
        return b"".join(out)

    def bytes_for(self, frame: Frame) -> bytes | None:
        if frame.kind is _USAGE and not self._wants_usage:
            return self._release_with_timings(frame)
        out = self._release_with_timings(None) if self._held is not None else None
        own = self._own_bytes(frame)
        if own is not None and not self._wants_usage and _is_finish_chunk(frame):
            self._held = frame
            return out
        return (out or b"") + own if own is not None else out

    def flush(self) -> bytes | None:
        return self._release_with_timings(None)

    def _own_bytes(self, frame: Frame) -> bytes | None:
        if frame.kind is _PING:
            return None  # the proxy sends its own heartbeats
        if frame.kind is _PROGRESS:
            return frame.raw if self._client.wants_progress else None
        if frame.kind is _USAGE and self._fill_cached:
            generation = self._generation
            return with_cached_tokens(frame, generation.frames, generation.progress).raw
        return frame.raw

    def _release_with_timings(self, usage: Frame | None) -> bytes | None:
        held, self._held = self._held, None
        if held is None:
            return None
        timings = (usage.data or {}).get("timings") if usage is not None else None
        if timings is None or (held.data or {}).get("timings") is not None:
            return held.raw
        return encode_data(json.dumps({**(held.data or {}), "timings": timings},
                                      separators=(",", ":"), ensure_ascii=False))


def _is_finish_chunk(frame: Frame) -> bool:
    return frame.kind is _CHUNK and frame.finish


def ensure_usage(body: dict[str, Any], generation: Generation, *,
                 fill_cached: bool = True) -> None:
    """Fill in what the engine's usage left out, from the proxy's figures (the engine's
    own fields are kept as sent); cached tokens only from an engine that measures them."""
    figures = figures_from(generation.frames, generation.progress)
    usage = dict(mapping_of(body.get("usage")))
    if figures.prompt_tokens is not None:
        usage.setdefault("prompt_tokens", figures.prompt_tokens)
    if figures.completion_tokens is not None:
        usage.setdefault("completion_tokens", figures.completion_tokens)
    prompt, completion = count_of(usage.get("prompt_tokens")), count_of(
        usage.get("completion_tokens"))
    if prompt is not None and completion is not None:
        usage.setdefault("total_tokens", prompt + completion)
    if fill_cached:
        details = dict(mapping_of(usage.get("prompt_tokens_details")))
        details.setdefault("cached_tokens", figures.cached_tokens or 0)
        usage["prompt_tokens_details"] = details
    body["usage"] = usage
