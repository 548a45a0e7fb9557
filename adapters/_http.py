"""Translation of httpx failures into the proxy's exception tree, at the adapter boundary."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import httpx

from proxy.errors import (
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


async def get_json(http: httpx.AsyncClient, path: str, what: str) -> Any:
    with map_httpx_errors(what):
        response = await http.get(path)
    return _json_body(response, what)


async def post_json(http: httpx.AsyncClient, path: str, body: Mapping[str, Any], what: str,
                    params: Mapping[str, str] | None = None) -> Any:
    with map_httpx_errors(what):
        response = await http.post(path, json=dict(body), params=params)
    return _json_body(response, what)


def _json_body(response: httpx.Response, what: str) -> Any:
    if response.status_code >= 400:
        raise UpstreamStatusError(response.status_code, response.content,
                                  response.headers.get("content-type"))
    try:
        return response.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UpstreamProtocolError(f"{what}: engine sent invalid JSON") from exc
