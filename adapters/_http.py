"""Translation of httpx failures into the proxy's exception tree, at the adapter boundary."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

import httpx
import orjson

from adapters.base import Frame
from core.errors import (
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeoutError,
    UpstreamUnavailableError,
)


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


def encode_json(body: Mapping[str, Any]) -> bytes:
    """Request bodies as JSON bytes; orjson (a large history is re-encoded on every
    request), the standard library for what orjson refuses (integers past 64 bits)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body, ensure_ascii=False).encode()


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
    try:
        return await http.send(request, stream=stream)
    except httpx.RemoteProtocolError as exc:
        if "without sending a response" not in str(exc):
            raise
    except httpx.ReadError:
        if not stream and request.method != "GET":
            raise
    return await http.send(request, stream=stream)


async def get_json(http: httpx.AsyncClient, path: str, what: str) -> Any:
    with map_httpx_errors(what):
        response = await send_with_stale_retry(http, http.build_request("GET", path),
                                               stream=False)
    return _json_body(response, what)


async def post_json(http: httpx.AsyncClient, path: str, body: Mapping[str, Any], what: str,
                    params: Mapping[str, str] | None = None) -> Any:
    with map_httpx_errors(what):
        request = http.build_request("POST", path, json=dict(body), params=params)
        response = await send_with_stale_retry(http, request, stream=False)
    return _json_body(response, what)


def _json_body(response: httpx.Response, what: str) -> Any:
    if response.status_code >= 400:
        raise UpstreamStatusError(response.status_code, response.content,
                                  response.headers.get("content-type"))
    try:
        return response.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UpstreamProtocolError(f"{what}: engine sent invalid JSON") from exc


T = TypeVar("T")


class StreamDecoder(Protocol[T]):
    """A sans-IO decoder of a streamed body (``core.sse.SSEDecoder``,
    ``core.ndjson.NDJSONDecoder``): bytes in, whole items out."""

    def feed(self, chunk: bytes) -> list[T]: ...

    def flush(self) -> list[T]: ...


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
        async for chunk in response.aiter_bytes():
            try:
                items = decoder.feed(chunk)
            except ValueError as exc:  # an item past the decoder's size limit
                raise UpstreamProtocolError(f"{what}: {exc}") from exc
            for item in items:
                yield classify(item)
        for item in decoder.flush():
            yield classify(item)
