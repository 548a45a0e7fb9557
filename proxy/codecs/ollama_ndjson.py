"""Ollama's native API, ``/api/chat`` and ``/api/generate``, over NDJSON: one codec class,
parameterised by endpoint.

NDJSON has no comments: the keep-alive is a space written before the next JSON object (the
only bytes ollama-python, Ollama's Go client and ollama-js all parse and never see; see
``core.ndjson``). A streaming client gets the headers and one space at once, a space every
``--heartbeat`` seconds while Ollama is silent (queue, model load, prefill), then Ollama's
lines unchanged; a failure after the headers is Ollama's own late-error line
``{"error": "..."}``. A ``stream: false`` client gets nothing until the one JSON body, as
from Ollama itself (padding would break ollama-python's parse of an error body): the
chunks folded as Ollama's ``writeChatResponse`` does (``core.ndjson.fold_chat`` /
``fold_generate``). Errors before any byte: Ollama's status and ``{"error": "..."}``
(Ollama's own error body passed on as it came).

Usage lives in the done chunk's metrics (``prompt_eval_count``, ``prompt_eval_cached_count``
from Ollama 0.33.3, ...), passed on as Ollama sent them: nothing is filled in (an estimate
is never presented to a client as measured).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from starlette.responses import Response

from prefixpin.core.errors import ProxyError, UpstreamStatusError, error_response
from prefixpin.core.frames import Frame, FrameKind
from prefixpin.core.ndjson import (
    GO_JSON_MEDIA_TYPE,
    KEEPALIVE,
    NDJSON_MEDIA_TYPE,
    encode_json,
    error_line,
    fold_chat,
    fold_generate,
    reply_message,
)
from prefixpin.proxy.pipeline.body_memo import BodyMemo
from prefixpin.proxy.pipeline.generation import Generation
from prefixpin.proxy.pipeline.validation import Api, ClientRequest, Endpoint, parse_native_request

NDJSON_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_RELAYED = (FrameKind.CHUNK, FrameKind.DONE)  # Ollama's own lines; the rest is the proxy's


class OllamaCodec:
    """Ollama NDJSON, for ``endpoint`` "chat" (``/api/chat``) or "completions"
    (``/api/generate``). Stateless: its own stream encoder, shared by every client."""

    raw_chunks = False  # (``StreamEncoder``): not every chunk as its own bytes

    api: Api = "ollama"
    engine_api: Api = "ollama"
    media_type = NDJSON_MEDIA_TYPE
    headers: Mapping[str, str] = NDJSON_HEADERS
    opening = KEEPALIVE

    def __init__(self, endpoint: Endpoint, routes: tuple[str, ...]) -> None:
        self.name: str = f"ollama-{endpoint}"
        self.endpoint: Endpoint = endpoint
        self.routes = routes
        self._chat = endpoint == "chat"
        self._fold = fold_chat if self._chat else fold_generate

    def __repr__(self) -> str:
        return f"OllamaCodec({self.endpoint!r})"

    def parse(self, raw: bytes, path: str, *, max_messages: int,
              memo: BodyMemo | None = None) -> ClientRequest:
        return parse_native_request(raw, self.endpoint, path, max_messages=max_messages)

    def stream(self, client: ClientRequest, generation: Generation, *,
               fill_cached: bool) -> OllamaCodec:
        return self

    def encode(self, frames: Sequence[Frame]) -> bytes:
        """Ollama's lines as they came (the proxy sends its own keep-alives)."""
        return b"".join(f.raw for f in frames if f.kind in _RELAYED)

    def flush(self) -> bytes | None:
        return None  # nothing is ever held back

    def heartbeat(self, text: str) -> bytes:
        return KEEPALIVE

    def late_error(self, exc: ProxyError) -> bytes:
        return error_line(exc.message)

    def whole(self, client: ClientRequest, generation: Generation, *,
              fill_cached: bool) -> Response:
        folded = self._fold(_chunks(generation.frames))
        return Response(encode_json(folded), media_type=GO_JSON_MEDIA_TYPE)

    def error_response(self, exc: ProxyError) -> Response:
        if isinstance(exc, UpstreamStatusError) and _is_json_object(exc.raw_body):
            return error_response(exc)
        return Response(encode_json({"error": exc.message}), status_code=exc.status_code,
                        media_type=GO_JSON_MEDIA_TYPE, headers=exc.headers())

    def reply(self, frames: Sequence[Frame]) -> Mapping[str, Any] | None:
        return reply_message(_chunks(frames)) if self._chat else None


def _chunks(frames: Sequence[Frame]) -> list[Mapping[str, Any]]:
    return [f.data for f in frames if f.data is not None and f.kind in _RELAYED]


def _is_json_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except (ValueError, UnicodeDecodeError):
        return False
