"""Every path the proxy does not own goes to the engine unchanged, streaming both ways.

llama-server's own endpoints (``/props``, ``/slots``, ``/tokenize``, ``/completion``, ...)
and Ollama's (``/api/tags``, ...) keep working through the proxy.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse

from adapters._http import map_httpx_errors

# Hop-by-hop headers (RFC 9110 §7.6.1) belong to one connection, never forwarded.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
})


async def forward(request: Request, http: httpx.AsyncClient,
                  content: bytes | None = None) -> StreamingResponse:
    """The request as it came (its body streamed, or ``content`` when the caller already
    read it), and the engine's answer streamed back as it comes."""
    # The raw header bytes: a non-ASCII value (which httpx would refuse as str) goes through.
    headers = [(k, v) for k, v in request.headers.raw
               if k.decode("latin-1").lower() not in HOP_BY_HOP]
    upstream_request = http.build_request(
        request.method, httpx.URL(path=request.url.path, query=request.url.query.encode()),
        headers=headers, content=_body(request) if content is None else content,
    )
    with map_httpx_errors(f"{request.method} {request.url.path}"):
        response = await http.send(upstream_request, stream=True)
    return StreamingResponse(
        _raw(response), status_code=response.status_code,
        headers={k: v for k, v in response.headers.items() if k.lower() not in HOP_BY_HOP},
        background=BackgroundTask(response.aclose),
    )


async def _body(request: Request) -> AsyncIterator[bytes]:
    async for chunk in request.stream():
        yield chunk


async def _raw(response: httpx.Response) -> AsyncIterator[bytes]:
    try:
        with map_httpx_errors("pass-through body"):
            async for chunk in response.aiter_raw():
                yield chunk
    finally:
        await response.aclose()
