"""Adapter for Ollama: its OpenAI-compatible API (``/v1``, SSE) and its native API
(``/api/chat``, ``/api/generate``, NDJSON).

Facts this relies on (``docs/ollama-wire.md``, read from Ollama's source; Ollama cannot be
installed on the build machines, so the tests run against ``tests.fakes.fake_ollama``,
which replays its recorded wire formats):

* Ollama chooses llama-server slots itself and never sends ``id_slot``: no slot pinning, no
  ``/slots``, no slot files, no prompt progress, no template rendering on request.
* During queue wait, model load and prefill, Ollama sends nothing at all, not even headers.
* ``prompt_eval_count`` is the whole prompt since 0.30.1; the cached count exists since
  0.33.3 (native ``prompt_eval_cached_count``, ``/v1`` ``usage.prompt_tokens_details``).
  ``measured_cache`` starts from the version and then follows what responses carry.
* ``GET /api/version`` identifies Ollama. llama-server answers it 404 once loaded and 503
  while loading, so a 503 there means "llama-server, not ready yet".
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal

import httpx

from prefixpin.adapters.base import (
    Capabilities,
    EngineInfo,
    Frame,
    FrameKind,
    FrameSink,
    SlotFileResult,
    SlotState,
    UpstreamCall,
)
from prefixpin.adapters.http import (
    MessagesEncoder,
    decoded_frames,
    expect_media_type,
    map_httpx_errors,
    push_decoded_frames,
    send_with_stale_retry,
)
from prefixpin.adapters.openai_sse import classify as classify_sse
from prefixpin.core.errors import UpstreamError, UpstreamProtocolError
from prefixpin.core.ndjson import Line, NDJSONDecoder
from prefixpin.core.sse import SSEDecoder

CACHED_COUNT_SINCE = (0, 33, 3)  # ollama/ollama#17943: prompt_eval_cached_count
NATIVE_PATHS = frozenset({"/api/chat", "/api/generate"})
# The proxy also serves the OpenAI routes without /v1; Ollama has them only under /v1.
OPENAI_PATHS = {"/chat/completions": "/v1/chat/completions"}

EngineKind = Literal["ollama", "llama-server"]


def version_tuple(version: str) -> tuple[int, ...] | None:
    """``"0.35.1"`` as (0, 35, 1); None for a source build's ``"0.0.0"`` or junk."""
    numbers = re.findall(r"\d+", version.split("-")[0].split("+")[0])
    parsed = tuple(int(n) for n in numbers[:3])
    return parsed if len(parsed) == 3 and parsed != (0, 0, 0) else None


def reports_cached_count(version: str) -> bool:
    parsed = version_tuple(version)
    return parsed is not None and parsed >= CACHED_COUNT_SINCE


class OllamaAdapter:
    name = "ollama"

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.version: str | None = None
        self._encode = MessagesEncoder()
        self.capabilities = Capabilities(slots=False, slot_files=False, progress=False,
                                         measured_cache=False, render=False)

    async def probe(self) -> EngineInfo:
        with map_httpx_errors("GET /api/version"):
            response = await send_with_stale_retry(
                self.http, self.http.build_request("GET", "/api/version"), stream=False)
        version = _version_of(response)
        if self.version != version:  # a new version: its fields decide again
            self.version = version
            self._set_measured(reports_cached_count(version))
        return EngineInfo(engine=self.name, model="", n_slots=0, n_ctx_slot=0,
                          build=f"ollama {version}", props={"version": version})

    def prepare(self, path: str, body: Mapping[str, Any], *, slot: int | None) -> UpstreamCall:
        """Always streaming; on ``/v1``, usage always included (the relay hides it from a
        client that did not ask). The native API streams by default; it is set anyway."""
        if slot is not None:
            raise ValueError("Ollama chooses its own slots: no request can be pinned")
        upstream = dict(body)
        upstream["stream"] = True
        path = OPENAI_PATHS.get(path, path)
        if path not in NATIVE_PATHS:
            options = dict(upstream.get("stream_options") or {})
            options["include_usage"] = True
            upstream["stream_options"] = options
        return UpstreamCall(path=path, body=upstream)

    @asynccontextmanager
    async def open_stream(self, call: UpstreamCall) -> AsyncIterator[_OllamaStream]:
        what = f"POST {call.path}"
        with map_httpx_errors(what):
            request = self.http.build_request(
                "POST", call.path, content=self._encode(call.body),
                headers=[(name.encode("latin-1"), value.encode("latin-1", "replace"))
                         for name, value in {**call.headers,
                                             "content-type": "application/json"}.items()])
            response = await send_with_stale_retry(self.http, request)
        try:
            yield _OllamaStream(response, what, native=call.path in NATIVE_PATHS,
                                on_cached_field=self._set_measured)
        finally:
            await response.aclose()

    async def list_slots(self) -> list[SlotState]:
        return []  # Ollama has no /slots; its llama-server runners are not reachable

    async def save_slot(self, slot: int, filename: str) -> SlotFileResult:
        raise _unsupported("slot files")

    async def restore_slot(self, slot: int, filename: str) -> SlotFileResult:
        raise _unsupported("slot files")

    async def erase_slot(self, slot: int) -> None:
        raise _unsupported("slot files")

    async def prefill(self, slot: int, tokens: Sequence[int]) -> int:
        raise _unsupported("slot prefills")

    async def apply_template(self, body: Mapping[str, Any]) -> str:
        raise _unsupported("template rendering")

    async def tokenize(self, text: str, *, add_special: bool,
                       parse_special: bool = True) -> list[int]:
        raise _unsupported("tokenization")

    def fault(self) -> str | None:
        """Only what the engine's own process says; the proxy's watch tells a lost engine."""
        return None

    async def aclose(self) -> None:
        await self.http.aclose()

    def _set_measured(self, measured: bool) -> None:
        if self.capabilities.measured_cache != measured:
            self.capabilities = dataclasses.replace(self.capabilities, measured_cache=measured)


def _unsupported(what: str) -> UpstreamError:
    return UpstreamError(f"Ollama offers no {what}")


def _version_of(response: httpx.Response) -> str:
    if response.status_code != 200:
        raise UpstreamError(f"GET /api/version: status {response.status_code} "
                            "(not Ollama, or not ready)")
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UpstreamProtocolError("GET /api/version: not JSON") from exc
    version = body.get("version") if isinstance(body, Mapping) else None
    if not isinstance(version, str):
        raise UpstreamProtocolError("GET /api/version: no version string")
    return version


class _OllamaStream:
    def __init__(self, response: httpx.Response, what: str, *, native: bool,
                 on_cached_field: Callable[[bool], None]) -> None:
        self._response = response
        self._what = what
        self._native = native
        self._on_cached_field = on_cached_field
        self.status_code = response.status_code
        self.content_type = response.headers.get("content-type")

    async def aread_error(self) -> bytes:
        with map_httpx_errors(self._what):
            return await self._response.aread()

    async def aiter_frames(self) -> AsyncIterator[Frame]:
        frames = self._native_frames() if self._native else self._sse_frames()
        async for frame in frames:
            self._note_cached_field(frame)
            yield frame

    @property
    def pusher(self) -> Callable[[FrameSink], Awaitable[None]]:
        return self.push_frames

    async def push_frames(self, sink: FrameSink) -> None:
        noted = _Noting(self._note_cached_field, sink)
        if self._native:
            expect_media_type(self._what, self.content_type, "application/x-ndjson",
                              "an NDJSON stream")
            await push_decoded_frames(self._response, self._what, NDJSONDecoder(),
                                      classify_native, noted)
        else:
            expect_media_type(self._what, self.content_type, "text/event-stream",
                              "an event stream")
            await push_decoded_frames(self._response, self._what, SSEDecoder(),
                                      classify_openai, noted)

    def _native_frames(self) -> AsyncIterator[Frame]:
        expect_media_type(self._what, self.content_type, "application/x-ndjson",
                          "an NDJSON stream")
        return decoded_frames(self._response, self._what, NDJSONDecoder(), classify_native)

    def _sse_frames(self) -> AsyncIterator[Frame]:
        expect_media_type(self._what, self.content_type, "text/event-stream", "an event stream")
        return decoded_frames(self._response, self._what, SSEDecoder(), classify_openai)

    def _note_cached_field(self, frame: Frame) -> None:
        """The cached-count fields decide ``measured_cache`` (a source build reports
        ``0.0.0``; MLX or cloud models may leave the field out on a new version)."""
        data = frame.data or {}
        if frame.kind is FrameKind.DONE and self._native and "prompt_eval_count" in data:
            self._on_cached_field("prompt_eval_cached_count" in data)
        elif frame.kind is FrameKind.USAGE and isinstance(data.get("usage"), Mapping):
            details = data["usage"].get("prompt_tokens_details")
            self._on_cached_field(isinstance(details, Mapping) and "cached_tokens" in details)


def classify_openai(event: Any) -> Frame:
    """Ollama's ``/v1`` events as llama-server's, except that reasoning arrives in
    ``delta.reasoning`` (not ``reasoning_content``) and is output all the same."""
    frame = classify_sse(event)
    if frame.kind is FrameKind.CHUNK and not frame.has_output and _has_reasoning(frame.data):
        return Frame(frame.kind, frame.raw, frame.data, frame.progress, True, frame.finish)
    return frame


def _has_reasoning(data: Mapping[str, Any] | None) -> bool:
    choices = (data or {}).get("choices")
    return isinstance(choices, list) and any(
        isinstance(c, Mapping) and isinstance(c.get("delta"), Mapping)
        and bool(c["delta"].get("reasoning")) for c in choices)


def classify_native(line: Line) -> Frame:
    """One NDJSON line of ``/api/chat`` or ``/api/generate`` as a ``Frame`` (sans-IO).

    A chunk is CHUNK; the done chunk (``"done": true``, with the metrics) is DONE and is
    forwarded like any chunk; an ``{"error": ...}`` line is ERROR.
    """
    try:
        data = json.loads(line.text)
    except ValueError as exc:
        raise UpstreamProtocolError(f"engine sent an NDJSON line that is not JSON: {exc}"
                                    ) from exc
    if not isinstance(data, dict):
        raise UpstreamProtocolError("engine sent an NDJSON line that is not a JSON object")
    if "error" in data:
        return Frame(FrameKind.ERROR, line.raw, data)
    kind = FrameKind.DONE if data.get("done") is True else FrameKind.CHUNK
    return Frame(kind, line.raw, data, has_output=native_has_output(data))


def native_has_output(data: Mapping[str, Any]) -> bool:
    message = data.get("message")
    if isinstance(message, Mapping):
        return bool(message.get("content") or message.get("thinking")
                    or message.get("tool_calls"))
    return bool(data.get("response") or data.get("thinking"))


async def detect_engine(http: httpx.AsyncClient) -> EngineKind | None:
    """Which engine answers at ``http``'s base URL; None when nothing answers.

    ``/api/version`` first (Ollama answers it at once, loaded model or not); llama-server
    answers it 404 once loaded and 503 while loading, and ``/props`` confirms it.
    """
    try:
        with map_httpx_errors("GET /api/version"):
            response = await http.get("/api/version")
    except UpstreamError:
        return None
    if response.status_code == 200:
        try:
            body = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        if isinstance(body, Mapping) and isinstance(body.get("version"), str):
            return "ollama"
    if response.status_code == 503:
        return "llama-server"  # llama-server loading its model
    try:
        with map_httpx_errors("GET /props"):
            props = await http.get("/props")
    except UpstreamError:
        return None
    return "llama-server" if props.status_code in (200, 503) else None


class _Noting:
    """A frame sink that has ``note`` read each frame on its way to ``sink``."""

    __slots__ = ("_note", "_sink")

    def __init__(self, note: Callable[[Frame], None], sink: FrameSink) -> None:
        self._note = note
        self._sink = sink

    def take_frames(self, frames: list[Frame]) -> None:
        for frame in frames:
            self._note(frame)
        self._sink.take_frames(frames)

    def take_frame(self, frame: Frame) -> None:
        self._note(frame)
        self._sink.take_frame(frame)
