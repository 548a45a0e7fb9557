"""A recording relay: the agent CLI talks to it, it passes every request to the arm (the
engine itself, or prefixpin in front of it) and every response back byte for byte, and
records what both arms are measured by, identically.

Per request: when it arrived, when the first SSE event carrying generated text went back
(the TTFT clock: chat ``choices[].delta.content``, Anthropic ``content_block_delta``,
Responses ``response.output_text.delta``; never SSE comments, ``event: ping``, the role
chunk, progress chunks or the usage), and the answer's usage (chat's usage chunk
``prompt_tokens`` and ``prompt_tokens_details.cached_tokens``; Anthropic's ``message_start``
and ``message_delta`` usage, where ``input_tokens`` excludes the cached
``cache_read_input_tokens``; Responses' ``response.completed`` ``usage.input_tokens`` and
``input_tokens_details.cached_tokens``). Whole (non-streamed) answers are read the same way.

The relay runs under uvicorn in a thread of the bench process; its upstream is switched
between arms (``Relay.upstream``), so every arm's CLIs see the same base URL.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tests.fakes.servers import serve_in_thread

Api = Literal["chat", "anthropic", "responses"]
Json = dict[str, Any]

# Hop-by-hop and framing headers: the relay re-frames, so neither direction keeps them.
_DROP_REQUEST = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding"}
_DROP_RESPONSE = {"content-length", "connection", "transfer-encoding", "content-encoding",
                  "keep-alive"}


def api_of(path: str) -> Api | None:
    """The generation API a path belongs to (None: a side path, e.g. count_tokens)."""
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/messages"):
        return "anthropic"
    if path.endswith("/responses"):
        return "responses"
    return None


@dataclass(slots=True)
class Exchange:
    """One request through the relay, and what came back."""

    seq: int
    method: str
    path: str
    api: Api | None
    started: float  # time.monotonic() when the request arrived
    body_bytes: int = 0
    tools: int = 0  # tools declared in the request body
    messages: int = 0  # messages (or Responses input items) in the request body
    stream: bool | None = None
    status: int | None = None
    ttft_s: float | None = None  # to the first SSE event carrying generated text
    end_s: float | None = None  # to the end of the response body
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    timings: Json | None = None  # llama-server's chat `timings` (prompt_n, cache_n, ...)
    text: str = ""  # the generated text (first 200 characters)
    error: str | None = None
    done: bool = False

    def row(self) -> Json:
        out = asdict(self)
        out.pop("started")
        out.pop("done")
        return out


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(slots=True)
class UsageScanner:
    """Sans-IO: SSE bytes in (``feed``), the TTFT moment and the usage out."""

    api: Api | None
    buffer: bytes = b""
    seen_text: bool = False
    usage: Json = field(default_factory=dict)
    timings: Json | None = None
    text: str = ""
    error: str | None = None

    def feed(self, chunk: bytes) -> bool:
        """True when this chunk completes the first event that carries generated text."""
        self.buffer += chunk.replace(b"\r\n", b"\n")
        first = False
        while b"\n\n" in self.buffer:
            raw, self.buffer = self.buffer.split(b"\n\n", 1)
            if self._event(raw.decode("utf-8", "replace")) and not self.seen_text:
                self.seen_text = first = True
        return first

    def _event(self, raw: str) -> bool:
        data = [line[5:].lstrip() for line in raw.split("\n") if line.startswith("data:")]
        if not data:
            return False  # a comment (": ping", a heartbeat) or an event line alone
        payload = "\n".join(data)
        if payload == "[DONE]":
            return False
        try:
            event = json.loads(payload)
        except ValueError:
            return False
        return self.read(event) if isinstance(event, dict) else False

    def read(self, event: Json) -> bool:
        """Take the usage from ``event``; True when it carries generated text."""
        if "error" in event and event.get("type") in (None, "error"):
            self.error = str(event["error"])[:300]
        if self.api == "chat":
            return self._chat(event)
        if self.api == "anthropic":
            return self._anthropic(event)
        if self.api == "responses":
            return self._responses(event)
        return False

    def _chat(self, event: Json) -> bool:
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        if isinstance(event.get("timings"), dict):
            self.timings = event["timings"]
        text = ""
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or choice.get("message") or {}
            text += delta.get("content") or ""
        self.text += text
        return bool(text)

    def _anthropic(self, event: Json) -> bool:
        kind = event.get("type")
        if kind == "message_start":
            self.usage.update((event.get("message") or {}).get("usage") or {})
        elif kind == "message_delta":
            self.usage.update(event.get("usage") or {})
        elif kind == "content_block_delta":
            delta = event.get("delta") or {}
            text = delta.get("text") or delta.get("thinking") or delta.get("partial_json") or ""
            self.text += delta.get("text") or ""
            return bool(text)
        elif kind == "message":  # a whole answer
            self.usage.update(event.get("usage") or {})
            self.text += "".join(b.get("text") or "" for b in event.get("content") or [])
        return False

    def _responses(self, event: Json) -> bool:
        kind = event.get("type")
        if kind == "response.output_text.delta":
            text = event.get("delta") or ""
            self.text += text
            return bool(text)
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            self.usage = (event.get("response") or {}).get("usage") or self.usage
        elif event.get("object") == "response":  # a whole answer
            self.usage = event.get("usage") or self.usage
        return False

    def finish(self, whole: bytes | None) -> None:
        """End of the body: a whole JSON answer is read here."""
        if whole is not None:
            with contextlib.suppress(ValueError):
                event = json.loads(whole)
                if isinstance(event, dict):
                    self.read(event)

    def figures(self) -> tuple[int | None, int | None, int | None]:
        """(prompt tokens, cached tokens, completion tokens) as the answer reported them."""
        u = self.usage
        if self.api == "anthropic":
            fresh = _count(u.get("input_tokens"))
            cached = _count(u.get("cache_read_input_tokens"))
            created = _count(u.get("cache_creation_input_tokens")) or 0
            prompt = None if fresh is None else fresh + (cached or 0) + created
            return prompt, cached, _count(u.get("output_tokens"))
        if self.api == "responses":
            details = u.get("input_tokens_details") or {}
            return (_count(u.get("input_tokens")), _count(details.get("cached_tokens")),
                    _count(u.get("output_tokens")))
        details = u.get("prompt_tokens_details") or {}
        cached = _count(details.get("cached_tokens"))
        if cached is None and self.timings is not None:
            cached = _count(self.timings.get("cache_n"))
        return (_count(u.get("prompt_tokens")), cached, _count(u.get("completion_tokens")))


def _describe(exchange: Exchange, body: bytes) -> None:
    exchange.body_bytes = len(body)
    with contextlib.suppress(ValueError):
        parsed = json.loads(body) if body else None
        if isinstance(parsed, dict):
            tools = parsed.get("tools")
            exchange.tools = len(tools) if isinstance(tools, list) else 0
            items = parsed.get("messages", parsed.get("input"))
            exchange.messages = len(items) if isinstance(items, list) else int(bool(items))
            stream = parsed.get("stream")
            exchange.stream = stream if isinstance(stream, bool) else None


class Relay:
    """The ASGI pass-through and its record; ``upstream`` is the arm's base URL."""

    def __init__(self, upstream: str = "", bodies: Path | None = None) -> None:
        self.upstream = upstream.rstrip("/")
        self.bodies = bodies  # when set: every request body is written there, by seq
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._client: httpx.AsyncClient | None = None
        self.app = Starlette(routes=[Route("/{path:path}", self.handle,
                                           methods=["GET", "POST", "PUT", "DELETE", "HEAD",
                                                    "OPTIONS", "PATCH"])])

    def mark(self) -> int:
        with self._lock:
            return len(self.exchanges)

    def since(self, mark: int) -> list[Exchange]:
        with self._lock:
            return list(self.exchanges[mark:])

    def settle(self, mark: int, timeout: float = 10.0) -> list[Exchange]:
        """The exchanges since ``mark``, once every one of them has ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.since(mark)
            if all(e.done for e in found):
                return found
            time.sleep(0.05)
        return self.since(mark)

    def _record(self, method: str, path: str, started: float) -> Exchange:
        with self._lock:
            exchange = Exchange(len(self.exchanges), method, path, api_of(path), started)
            self.exchanges.append(exchange)
            return exchange

    async def handle(self, request: Request) -> Response:
        started = time.monotonic()
        path = request.url.path
        exchange = self._record(request.method, path, started)
        body = await request.body()
        _describe(exchange, body)
        if self.bodies is not None:
            self.bodies.mkdir(parents=True, exist_ok=True)
            (self.bodies / f"{exchange.seq:05d}{path.replace('/', '_')}").write_bytes(body)
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0))
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST]
        headers.append(("accept-encoding", "identity"))
        url = f"{self.upstream}{path}"
        if request.url.query:
            url += f"?{request.url.query}"
        upstream_request = self._client.build_request(request.method, url, content=body,
                                                      headers=headers)
        try:
            response = await self._client.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            exchange.error = f"{type(exc).__name__}: {exc}"
            exchange.status = 502
            exchange.end_s = time.monotonic() - started
            exchange.done = True
            return Response(json.dumps({"error": {"message": exchange.error}}), status_code=502,
                            media_type="application/json")
        exchange.status = response.status_code
        scanner = UsageScanner(exchange.api)
        sse = "text/event-stream" in response.headers.get("content-type", "")

        async def body_iterator() -> AsyncIterator[bytes]:
            whole = bytearray()
            try:
                async for chunk in response.aiter_raw():
                    if sse:
                        if scanner.feed(chunk) and exchange.ttft_s is None:
                            exchange.ttft_s = time.monotonic() - started
                    elif len(whole) < 8 << 20:
                        whole += chunk
                    yield chunk
            except httpx.HTTPError as exc:
                exchange.error = f"{type(exc).__name__}: {exc}"
            finally:
                await response.aclose()
                exchange.end_s = time.monotonic() - started
                scanner.finish(None if sse else bytes(whole))
                if exchange.ttft_s is None and not sse and scanner.text:
                    exchange.ttft_s = exchange.end_s  # a whole answer: its end is its first byte
                prompt, cached, completion = scanner.figures()
                exchange.prompt_tokens, exchange.cached_tokens = prompt, cached
                exchange.completion_tokens = completion
                exchange.timings = scanner.timings
                exchange.text = scanner.text[:200]
                exchange.error = exchange.error or scanner.error
                if exchange.status and exchange.status >= 400 and not exchange.error:
                    exchange.error = f"status {exchange.status}: {bytes(whole)[:300]!r}"
                exchange.done = True

        out_headers = {k: v for k, v in response.headers.items()
                       if k.lower() not in _DROP_RESPONSE}
        return StreamingResponse(body_iterator(), status_code=response.status_code,
                                 headers=out_headers)


@contextlib.contextmanager
def serve_relay(relay: Relay) -> Iterator[str]:
    """The relay's base URL, served until the block ends."""
    with serve_in_thread(relay.app) as url:
        yield url
