"""Translation of httpx failures into the proxy's exception tree, at the adapter boundary."""

from __future__ import annotations

import json
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Iterator,
    Mapping,
)
from contextlib import contextmanager
from typing import Any, Generic, Protocol, TypeVar, cast

import httpx
import orjson

from prefixpin.adapters.base import Frame, FrameSink
from prefixpin.adapters.h1 import PUSHED_BODY, BodyReader, H1Transport
from prefixpin.core.errors import (
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeoutError,
    UpstreamUnavailableError,
)
from prefixpin.core.frames import parse_json_object

# A request extension marking a client's request forwarded as it came
# (``proxy.listen.passthrough``):
# it carries the client's own credentials, never the engine key.
FORWARDED = "prefixpin.forwarded"
# A request extension marking an operator's request forwarded by the operator listener: the
# operator is trusted with the engine, so it carries the engine key when it brings none.
OPERATOR = "prefixpin.operator"
# The headers an engine authenticates a request with: llama-server's --api-key takes
# ``Authorization: Bearer <key>``, else ``X-Api-Key: <key>`` (Anthropic's header).
CREDENTIAL_HEADERS = ("authorization", "x-api-key")
# The engine paths the proxy asks on its own behalf (probes, /healthz, the tokenizer and
# template, slot files): only these carry the engine key. A generation goes to the engine
# for a client, with the client's own credentials: a client without a key gets the
# engine's 401, however prefixpin reaches the engine. A new own request on another path
# goes without the key (refused by an engine with a key, never a client let through).
OWN_PATHS = frozenset({
    "/health", "/props", "/metrics", "/v1/models", "/models", "/slots", "/tokenize",
    "/detokenize", "/apply-template", "/api/version", "/api/tags", "/api/ps", "/api/show",
})
OWN_PREFIXES = ("/slots/",)


class EngineKey(httpx.Auth):
    """``Authorization: Bearer <key>`` on the proxy's own requests to an engine started
    with an API key (``--engine-api-key``): those to ``OWN_PATHS`` that carry no
    credentials and are not a client's (``FORWARDED``). ``base_path``: the path of the
    engine's base URL, which every request path starts with."""

    def __init__(self, key: str, base_path: str = "/") -> None:
        self._value = f"Bearer {key}"
        self._base = base_path.rstrip("/")

    def is_own(self, request: httpx.Request) -> bool:
        if request.extensions.get(OPERATOR):
            return True
        if request.extensions.get(FORWARDED):
            return False
        return self.is_own_path(request.url.path)

    def is_own_path(self, path: str) -> bool:
        """A path the proxy asks on its own behalf (under the base path)."""
        if self._base:
            if not path.startswith(self._base + "/"):
                return False
            path = path[len(self._base):]
        return path in OWN_PATHS or path.startswith(OWN_PREFIXES)

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response,
                                                             None]:
        if self.is_own(request) and not any(h in request.headers for h in CREDENTIAL_HEADERS):
            request.headers["Authorization"] = self._value
        yield request


class _NoCookies(httpx.Cookies):
    """A jar that keeps nothing: what an engine sets is nobody's to send back."""

    def extract_cookies(self, response: httpx.Response) -> None:
        return None


class EngineClient(httpx.AsyncClient):
    """httpx's client without a cookie jar. A cookie an engine (or a gateway in front of
    it) sets would otherwise go out on every later request, every tenant's; and reading
    each answer's headers for cookies, then writing a request's, was a fifth of httpx's
    cost per request (``bench/results/load/PROFILE.md``)."""

    @property
    def cookies(self) -> httpx.Cookies:
        return _NO_COOKIES

    @cookies.setter
    def cookies(self, cookies: Any) -> None:
        if cookies:
            raise ValueError("an engine's client keeps no cookies")

    def _merge_cookies(self, cookies: Any = None) -> Any:
        return cookies  # a request's own, if any; never the jar's (there is none)

    def _merge_headers(self, headers: Any = None) -> Any:
        """A request's headers given as raw byte pairs (every generation's: the client's
        own, ``adapters.llama_server._header_bytes``) after the client's defaults that
        they do not name, as httpx merges them, without the two ``Headers`` copies and the
        update httpx makes of them on every request."""
        if not isinstance(headers, list) or not all(
                type(name) is bytes and type(value) is bytes for name, value in headers):
            return super()._merge_headers(headers)
        named = {name.lower() for name, _ in headers}
        return [(name, value) for name, value in self.headers.raw
                if name.lower() not in named] + headers

    async def open(self, method: str, url: httpx.URL, *, content: bytes,
                   headers: list[tuple[bytes, bytes]],
                   on_head: Callable[[int], None] | None = None) -> httpx.Response:
        """``send_with_stale_retry(self, self.build_request(method, url, content=content,
        headers=headers))``, streamed: the same request on the wire. Where the transport
        is ``adapters.h1``'s and nothing of the client acts on the request (no hook, no
        credential of its own for the path), it is written from its parts, without
        httpx's request and response machinery (building the request, its headers merged
        and normalised three times, the auth and redirect flows, the response's wrapper:
        a twentieth of the proxy's CPU at 256 streams of 100 tokens); the response has
        no ``request`` then, and ``on_head`` (``UpstreamCall.on_head``) is told the status
        from the read of the head. ``url``: absolute, as ``build_request`` makes it."""
        transport = self._transport_for_url(url)
        if (not isinstance(transport, H1Transport) or url.scheme != "http"
                or method not in _WRITTEN_METHODS or self._has_hooks() or self._acts_on(url)):
            return await send_with_stale_retry(
                self, self.build_request(method, url, content=content, headers=headers))
        wire = self._wire_headers(url, headers, len(content))
        timeouts = self.timeout.as_dict()
        return await retry_stale(
            lambda: transport.exchange(method, url, wire, content, timeouts, on_head=on_head),
            retry_read_error=True)

    def _wire_headers(self, url: httpx.URL, headers: list[tuple[bytes, bytes]],
                      length: int) -> list[tuple[bytes, bytes]]:
        """The headers ``httpx.Request`` would send: Host first unless given, the
        client's defaults the request does not name, the request's, a Content-Length
        unless the request gives one or a Transfer-Encoding (tested against httpx)."""
        merged: list[tuple[bytes, bytes]] = self._merge_headers(headers)
        names = {name.lower() for name, _ in merged}
        if b"content-length" not in names and b"transfer-encoding" not in names:
            merged = [*merged, (b"Content-Length", str(length).encode())]
        if b"host" not in names:
            merged = [(b"Host", url.netloc), *merged]
        return merged

    def _has_hooks(self) -> bool:
        hooks = self.event_hooks
        return bool(hooks.get("request") or hooks.get("response"))

    def _acts_on(self, url: httpx.URL) -> bool:
        """The client's auth would add its credentials to a request to ``url``."""
        auth = self._auth
        if auth is None:
            return False
        if not isinstance(auth, EngineKey):
            return True
        return auth.is_own_path(url.path)


_WRITTEN_METHODS = frozenset({"POST"})  # what ``EngineClient.open`` writes itself
_NO_COOKIES = _NoCookies()


@contextmanager
def map_httpx_errors(what: str) -> Iterator[None]:
    try:
        yield
    except httpx.TimeoutException as exc:
        kind = type(exc).__name__
        raise UpstreamTimeoutError(f"{what}: engine did not answer in time ({kind})") from exc
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError,
            httpx.CloseError) as exc:
        raise UpstreamUnavailableError(f"{what}: {_describe(exc)}") from exc
    except httpx.TransportError as exc:
        raise UpstreamUnavailableError(f"{what}: {_describe(exc)}") from exc
    except httpx.DecodingError as exc:
        raise UpstreamProtocolError(f"{what}: undecodable response ({exc})") from exc


def _describe(exc: httpx.HTTPError) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def encode_json(body: object) -> bytes:
    """Request bodies as JSON bytes; orjson, the standard library for what orjson refuses
    (integers past 64 bits)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body, ensure_ascii=False).encode()


class MessagesEncoder:
    """Request bodies as JSON bytes, each message of a ``messages`` array encoded once for
    as long as it is the same object. A follow-up resends its whole history, and the
    proxy hands the engine the same message objects turn after turn (the body memo keeps
    them: ``proxy.pipeline.body_memo``), so only the turn's new messages are encoded; the
    rest is a join. Messages are never changed in place once parsed. The bytes held are
    bounded (``max_bytes``): the oldest go first."""

    def __init__(self, max_bytes: int = 32 << 20) -> None:
        self._max_bytes = max_bytes
        self._bytes = 0
        # id(message) -> (message, its bytes): the message held, so its id stays its own.
        self._held: dict[int, tuple[object, bytes]] = {}

    def __call__(self, body: Mapping[str, Any]) -> bytes:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return encode_json(body)
        parts = [self._encoded(message) for message in messages]
        rest = encode_json({key: value for key, value in body.items() if key != "messages"})
        self._bound()
        # The array first: key order means nothing to the engine's JSON reader.
        close = b"]," + rest[1:] if len(rest) > 2 else b"]}"
        return b'{"messages":[' + b",".join(parts) + close

    def _encoded(self, message: object) -> bytes:
        held = self._held.get(id(message))
        if held is not None and held[0] is message:
            return held[1]
        encoded = encode_json(message)
        self._held[id(message)] = (message, encoded)
        self._bytes += len(encoded)
        return encoded

    def _bound(self) -> None:
        while self._bytes > self._max_bytes and self._held:
            _, encoded = self._held.pop(next(iter(self._held)))
            self._bytes -= len(encoded)


async def send_with_stale_retry(http: httpx.AsyncClient, request: httpx.Request, *,
                                stream: bool = True) -> httpx.Response:
    """Send; retry once when a pooled keep-alive connection turns out closed.

    llama-server sometimes closes a connection after a streamed response although it
    advertised keep-alive; reusing it fails before any response byte with "Server
    disconnected without sending a response". A server closing an idle connection just as
    it is reused (its keep-alive timeout, 5 s for llama-server and uvicorn) resets it
    instead: a ``ReadError`` before any response byte. The request never reached the
    engine, so one retry on a fresh connection is safe. (With ``stream=False`` a read
    error may come from the body, after the engine acted: only a GET is retried then.)
    """
    return await retry_stale(lambda: http.send(request, stream=stream),
                             retry_read_error=stream or request.method == "GET")


async def retry_stale(send: Callable[[], Awaitable[httpx.Response]], *,
                      retry_read_error: bool) -> httpx.Response:
    """``send()``, once more when the first try failed before any response byte on a
    pooled connection the engine had closed (``send_with_stale_retry`` says when that is
    safe): "Server disconnected without sending a response", or a ``ReadError`` where
    ``retry_read_error``."""
    try:
        return await send()
    except httpx.RemoteProtocolError as exc:
        if "without sending a response" not in str(exc):
            raise
    except httpx.ReadError:
        if not retry_read_error:
            raise
    return await send()


async def get_json(http: httpx.AsyncClient, path: str, what: str) -> Any:
    with map_httpx_errors(what):
        response = await send_with_stale_retry(http, http.build_request("GET", path),
                                               stream=False)
    return _json_body(response, what)


async def post_json(http: httpx.AsyncClient, path: str, body: Mapping[str, Any], what: str,
                    params: Mapping[str, str] | None = None) -> Any:
    with map_httpx_errors(what):
        # orjson: the proxy's own requests carry whole conversations (a template to
        # render, a prompt to tokenize, an anchor's token ids).
        request = http.build_request("POST", path, content=encode_json(body), params=params,
                                     headers={"content-type": "application/json"})
        response = await send_with_stale_retry(http, request, stream=False)
    return _json_body(response, what)


def _json_body(response: httpx.Response, what: str) -> Any:
    if response.status_code >= 400:
        raise UpstreamStatusError(response.status_code, response.content,
                                  response.headers.get("content-type"))
    try:
        return parse_json_object(response.content)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UpstreamProtocolError(f"{what}: engine sent invalid JSON") from exc


T = TypeVar("T")


class StreamDecoder(Protocol[T]):
    """A sans-IO decoder of a streamed body (``core.sse.SSEDecoder``,
    ``core.ndjson.NDJSONDecoder``): bytes in, whole items out."""

    def feed(self, chunk: bytes) -> list[T]: ...

    def flush(self) -> list[T]: ...

    @property
    def idle(self) -> bool:
        """Nothing of an unfinished item is held: the next byte starts a new one."""
        ...


def expect_media_type(what: str, content_type: str | None, media_type: str,
                      description: str) -> None:
    """A 200 that is not the stream asked for (an HTML error page from something in between,
    a JSON body from an engine that ignored ``stream``) is named as such, not parsed."""
    if content_type is not None and not content_type.startswith(media_type):
        raise UpstreamProtocolError(f"{what}: engine answered {content_type!r}, "
                                    f"not {description} ({media_type})")


async def decoded_frames(response: httpx.Response, what: str, decoder: StreamDecoder[T],
                         classify: Callable[[T], Frame]) -> AsyncIterator[Frame]:
    """An engine's streamed body as frames: decoded item by item, each item classified."""
    with map_httpx_errors(what):
        async for chunk in body_chunks(response):
            for item in _decoded(decoder, chunk, what):
                yield classify(item)
        for item in decoder.flush():
            yield classify(item)


class WholeEvents(Protocol):
    """The frame of a read that is exactly one whole item, or None for any other read
    (``adapters.openai_sse.SameShapeTokens``: one per stream, it keeps what it learns of
    the stream's token events), and whether it has learned their shape."""

    def __call__(self, chunk: bytes, /) -> Frame | None: ...

    @property
    def learned(self) -> bool: ...


async def push_decoded_frames(response: httpx.Response, what: str, decoder: StreamDecoder[T],
                              classify: Callable[[T], Frame], sink: FrameSink, *,
                              whole: WholeEvents | None = None) -> None:
    """``decoded_frames``, pushed: the frames of each piece of the body to ``sink`` (one
    frame alone, several as one list), called from the engine connection's read where
    the transport can (``PushedBody``: no task wakes up per read), else as the body is
    iterated. Returns at the body's end; raises what ``sink`` raises, an engine error as
    ``UpstreamError``.

    ``whole``: asked only while the decoder holds nothing, it spares the common piece,
    one streamed token, the decoder's item and a call or two."""
    reader = _FrameFeed(what, decoder, classify, sink, whole)
    with map_httpx_errors(what):
        body = pushed_body(response)
        if body is not None:
            await body.push(reader)
        else:
            async for chunk in body_chunks(response):
                reader.feed(chunk)
        if tail := decoder.flush():
            sink.take_frames([classify(item) for item in tail])


class _FrameFeed(Generic[T]):
    """A pushed body's reads, decoded and classified into frames for a sink
    (``adapters.h1.BodyReader``)."""

    __slots__ = ("_classify", "_decoder", "_take_frame", "_take_frames", "_what", "_whole")

    def __init__(self, what: str, decoder: StreamDecoder[T], classify: Callable[[T], Frame],
                 sink: FrameSink, whole: WholeEvents | None) -> None:
        self._what = what
        self._decoder = decoder
        self._classify = classify
        self._take_frame, self._take_frames = sink.take_frame, sink.take_frames
        self._whole = whole

    def feed(self, chunk: bytes) -> None:
        whole = self._whole
        if whole is not None and self._decoder.idle and (frame := whole(chunk)) is not None:
            self._take_frame(frame)
            return
        items = _decoded(self._decoder, chunk, self._what)
        if len(items) == 1:  # one event per read: a token at a time
            self._take_frame(self._classify(items[0]))
        elif items:
            frames = [self._classify(item) for item in items]
            if whole is not None and not whole.learned:
                whole(frames[-1].raw)  # learns from several events a read too (not kept)
            self._take_frames(frames)

def _decoded(decoder: StreamDecoder[T], chunk: bytes, what: str) -> list[T]:
    try:
        return decoder.feed(chunk)
    except ValueError as exc:  # an item past the decoder's size limit
        raise UpstreamProtocolError(f"{what}: {exc}") from exc


def _identity_encoded(response: httpx.Response) -> bool:
    """No content encoding: the body's bytes are what the transport read."""
    encoding = response.headers.get("content-encoding")
    return encoding is None or encoding.strip().lower() == "identity"


class PushedBody(Protocol):
    """A body stream that hands each read to a reader from the read itself (``adapters.h1``)."""

    async def push(self, reader: BodyReader) -> None: ...


def pushed_body(response: httpx.Response) -> PushedBody | None:
    """The body a transport can push (``adapters.h1`` names it in the response's
    extensions: httpx wraps its stream) when nothing must decode it (no content
    encoding) and nobody read it yet, marked consumed; else None."""
    body = response.extensions.get(PUSHED_BODY)
    if body is not None and _identity_encoded(response) and not response.is_stream_consumed:
        response.is_stream_consumed = True
        return cast(PushedBody, body)
    return None


def body_chunks(response: httpx.Response) -> AsyncIterable[bytes]:
    """A streamed body as the transport gives it, every read in one piece: without a
    content encoding, straight from the response's stream (``aiter_bytes`` puts two more
    generators and a decoder and a chunker between them, per read)."""
    stream = response.stream
    if _identity_encoded(response) and isinstance(stream, httpx.AsyncByteStream) \
            and not response.is_stream_consumed:
        response.is_stream_consumed = True
        return stream
    return response.aiter_bytes()
