"""Adapter for llama.cpp's llama-server (and anything speaking its dialect, such as the
embedded engine).

Facts this relies on (see shared/research/llama-server.md): ``return_progress`` makes the
first event arrive when the slot starts the prompt, before prefill, with the cache hit;
``id_slot`` pins a slot; ``/slots`` answers even during a decode; save/restore/erase need
``--slot-save-path``; ``/metrics`` carries ``Process-Start-Time-Unix``. Its native
completion API (``/completion``, ``/completions``, ``/infill``) streams its own events, not
OpenAI chunks, and ends with a ``"stop": true`` event instead of ``[DONE]``
(``adapters.llama_native``): the stream's classifier is chosen by the request's path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx

from prefixpin.adapters.base import (
    Capabilities,
    EngineInfo,
    Frame,
    FrameSink,
    SlotFileResult,
    SlotState,
    UpstreamCall,
)
from prefixpin.adapters.http import (
    EngineClient,
    MessagesEncoder,
    decoded_frames,
    expect_media_type,
    get_json,
    map_httpx_errors,
    post_json,
    push_decoded_frames,
    send_with_stale_retry,
)
from prefixpin.adapters.llama_native import NATIVE_PATHS, NativeClassifier, prompt_count
from prefixpin.adapters.openai_sse import SameShapeTokens, classify
from prefixpin.core.errors import UpstreamError
from prefixpin.core.sse import SSEDecoder, SSEEvent

# Architectures whose attention is (partly) a sliding window: a rewind deeper than the
# window needs a context checkpoint, and a restored slot has none (research note §1, §3).
SWA_ARCHITECTURES = frozenset({"gemma2", "gemma3", "gemma3n", "cohere2", "gpt-oss", "llama4"})


class LlamaServerAdapter:
    name = "llama-server"
    capabilities = Capabilities(
        slots=True, slot_files=True, progress=True, measured_cache=True, render=True,
    )

    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        # Absolute URLs per path: httpx re-parses and merges a relative URL on every request
        # (a measurable share of the proxy's per-request cost); the paths are a handful.
        self._urls: dict[str, httpx.URL] = {}
        # The last full probe's answer, whose start time (``/metrics``) names the engine's
        # process: the same process says the same of itself.
        self._known: EngineInfo | None = None
        self._encode = MessagesEncoder()

    def _url(self, path: str) -> httpx.URL:
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = self.http.build_request("POST", path).url
        return url

    async def probe(self) -> EngineInfo:
        """The engine's info. While its process start time (``/metrics``) is the one the
        last probe read, that probe's answer stands and nothing else is asked: the watch
        probes every few seconds, and four requests and a ``/props`` of kilobytes were most
        of an idle proxy's CPU. An engine without ``--metrics`` is asked in full."""
        start_time = await self._start_time()
        known = self._known
        if known is not None and start_time is not None and known.start_time == start_time:
            return known
        props = await get_json(self.http, "/props", "GET /props")
        models = await self._models_meta()
        settings = props.get("default_generation_settings") or {}
        arch = str(models.get("architecture") or "")
        self._known = EngineInfo(
            engine=self.name,
            model=_model_name(props),
            n_slots=int(props.get("total_slots") or 1),
            n_ctx_slot=int(settings.get("n_ctx") or 0),
            build=str(props.get("build_info") or ""),
            start_time=start_time,
            slot_save_path=await self._has_slot_save_path(),
            n_swa=1 if arch in SWA_ARCHITECTURES else 0,
            chat_template=props.get("chat_template"),
            props=props,
        )
        return self._known

    def prepare(self, path: str, body: Mapping[str, Any], *, slot: int | None) -> UpstreamCall:
        upstream = dict(body)
        upstream["stream"] = True
        # The first progress event arrives before prefill and carries the cache hit; the
        # usage chunk carries the final figures. The relay hides both unless asked for.
        upstream["return_progress"] = True
        if path in NATIVE_PATHS:
            # The native API has no usage chunk: its final event carries the figures, and
            # the proxy reads that event whole (it ends the stream). ``response_fields``
            # would strip it (even of ``"stop"``), so the codec applies it for the client.
            upstream.pop("response_fields", None)
        else:
            options = dict(upstream.get("stream_options") or {})
            options["include_usage"] = True
            upstream["stream_options"] = options
        if slot is not None:
            upstream["id_slot"] = slot
        return UpstreamCall(path=path, body=upstream)

    @asynccontextmanager
    async def open_stream(self, call: UpstreamCall) -> AsyncIterator[_LlamaStream]:
        what = f"POST {call.path}"
        with map_httpx_errors(what):
            url, content = self._url(call.path), self._encode(call.body)
            headers = _header_bytes({**call.headers, "content-type": "application/json"})
            if isinstance(self.http, EngineClient):
                response = await self.http.open("POST", url, content=content, headers=headers,
                                                on_head=call.on_head)
            else:
                request = self.http.build_request("POST", url, content=content, headers=headers)
                response = await send_with_stale_retry(self.http, request)
        classify_event = (NativeClassifier(prompt_count(call.path, call.body))
                          if call.path in NATIVE_PATHS else classify)
        try:
            yield _LlamaStream(response, what, classify_event)
        finally:
            await response.aclose()

    async def list_slots(self) -> list[SlotState]:
        slots = await get_json(self.http, "/slots", "GET /slots")
        return [_slot_state(item) for item in slots if isinstance(item, Mapping)]

    async def save_slot(self, slot: int, filename: str) -> SlotFileResult:
        result = await post_json(self.http, f"/slots/{slot}", {"filename": filename},
                                 "slot save", params={"action": "save"})
        timings = result.get("timings") or {}
        return SlotFileResult(slot, filename, int(result.get("n_saved", 0)),
                              int(result.get("n_written", 0)), float(timings.get("save_ms", 0)))

    async def restore_slot(self, slot: int, filename: str) -> SlotFileResult:
        result = await post_json(self.http, f"/slots/{slot}", {"filename": filename},
                                 "slot restore", params={"action": "restore"})
        timings = result.get("timings") or {}
        return SlotFileResult(slot, filename, int(result.get("n_restored", 0)),
                              int(result.get("n_read", 0)), float(timings.get("restore_ms", 0)))

    async def erase_slot(self, slot: int) -> None:
        await post_json(self.http, f"/slots/{slot}", {}, "slot erase", params={"action": "erase"})

    async def prefill(self, slot: int, tokens: Sequence[int]) -> int:
        # n_predict 0: llama-server evaluates the prompt into the slot and samples one token
        # it never evaluates, so the slot holds exactly ``tokens``.
        result = await post_json(self.http, "/completion", {
            "prompt": list(tokens), "n_predict": 0, "id_slot": slot, "cache_prompt": True,
            "temperature": 0}, "prefill")
        timings = result.get("timings") or {}
        return int(timings.get("cache_n", 0)) + int(timings.get("prompt_n", 0))

    async def apply_template(self, body: Mapping[str, Any]) -> str:
        result = await post_json(self.http, "/apply-template", body, "POST /apply-template")
        return str(result.get("prompt", ""))

    async def tokenize(self, text: str, *, add_special: bool,
                       parse_special: bool = True) -> list[int]:
        # The chat path tokenizes with add_special and parse_special on (research note §7).
        result = await post_json(self.http, "/tokenize",
                                 {"content": text, "add_special": add_special,
                                  "parse_special": parse_special}, "POST /tokenize")
        return [int(t) for t in result.get("tokens", [])]

    def fault(self) -> str | None:
        """Only what the engine's own process says; the proxy's watch tells a lost engine."""
        return None

    async def aclose(self) -> None:
        await self.http.aclose()

    async def _models_meta(self) -> Mapping[str, Any]:
        try:
            models = await get_json(self.http, "/v1/models", "GET /v1/models")
        except UpstreamError:
            return {}
        data = models.get("data") if isinstance(models, Mapping) else None
        if isinstance(data, list) and data and isinstance(data[0], Mapping):
            meta = data[0].get("meta") or {}
            return {**meta, "architecture": data[0].get("architecture") or meta.get("architecture")}
        return {}

    async def _start_time(self) -> float | None:
        """llama-server's process start, from /metrics (needs --metrics); None otherwise."""
        with map_httpx_errors("GET /metrics"):
            response = await self.http.get("/metrics")
        value = response.headers.get("process-start-time-unix")
        try:
            return float(value) if value is not None and response.status_code == 200 else None
        except ValueError:
            return None

    async def _has_slot_save_path(self) -> bool:
        """Erase needs --slot-save-path too; erasing a nonexistent slot index probes it cheaply."""
        with map_httpx_errors("slot probe"):
            response = await self.http.post("/slots/0", params={"action": "unknown-probe"}, json={})
        text = response.text
        return "slot-save-path" not in text and "not supported" not in text.lower()


class _LlamaStream:
    """``classify``: OpenAI's events (``adapters.openai_sse``) or, on the native paths,
    llama-server's own (``adapters.llama_native``), as the request's path says."""

    def __init__(self, response: httpx.Response, what: str,
                 classify: Callable[[SSEEvent], Frame] = classify) -> None:
        self._response = response
        self._what = what
        self._classify = classify
        self.status_code = response.status_code
        self.content_type = response.headers.get("content-type")

    async def aread_error(self) -> bytes:
        with map_httpx_errors(self._what):
            return await self._response.aread()

    def aiter_frames(self) -> AsyncIterator[Frame]:
        expect_media_type(self._what, self.content_type, "text/event-stream", "an event stream")
        return decoded_frames(self._response, self._what, SSEDecoder(), self._classify)

    @property
    def pusher(self) -> Callable[[FrameSink], Awaitable[None]]:
        return self.push_frames

    async def push_frames(self, sink: FrameSink) -> None:
        expect_media_type(self._what, self.content_type, "text/event-stream", "an event stream")
        # OpenAI's events: a read that is one whole token event is classified from its
        # bytes (``SameShapeTokens``, this stream's); the native API's take the decoder.
        whole = SameShapeTokens() if self._classify is classify else None
        await push_decoded_frames(self._response, self._what, SSEDecoder(), self._classify,
                                  sink, whole=whole)


def _header_bytes(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """Header values as the client sent them: HTTP servers decode them as latin-1, so this
    gives back the same bytes (httpx refuses a non-ASCII ``str``)."""
    return [(name.encode("latin-1"), value.encode("latin-1", "replace"))
            for name, value in headers.items()]


def _model_name(props: Mapping[str, Any]) -> str:
    alias = props.get("model_alias")
    if isinstance(alias, str) and alias:
        return alias
    path = str(props.get("model_path") or "model")
    return path.rsplit("/", 1)[-1]


def _slot_state(item: Mapping[str, Any]) -> SlotState:
    return SlotState(
        id=int(item.get("id", -1)),
        is_processing=bool(item.get("is_processing")),
        n_ctx=int(item.get("n_ctx") or 0),
        n_prompt_tokens=int(item.get("n_prompt_tokens") or 0),
        id_task=int(item.get("id_task", -1) if item.get("id_task") is not None else -1),
    )
