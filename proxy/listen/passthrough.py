"""Engine paths the proxy does not own go to the engine unchanged, streaming both ways.

Which paths: on the tenants' port only ``TENANT_PATHS`` (read-only, no slot or cache
touched); every other engine path (``/slots``, ``/completion``, Ollama's ``/api/delete``,
...) only on the operator listener (``proxy.listen.app``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse

from prefixpin.adapters.http import FORWARDED, OPERATOR, map_httpx_errors
from prefixpin.proxy.listen.paths import PathRejected, is_canonical

# Hop-by-hop headers (RFC 9110 §7.6.1) belong to one connection, never forwarded.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
})


# The engine paths a tenant may reach, by method: they read the model, its tokenizer and
# template, never a slot or a cache. llama-server's, then Ollama's.
TENANT_PATHS: dict[str, str] = {
    "/v1/models": "GET", "/models": "GET", "/health": "GET", "/props": "GET",
    "/tokenize": "POST", "/detokenize": "POST", "/apply-template": "POST",
    # Token counters (llama-server renders and tokenizes; nothing is generated): Anthropic's,
    # and its chat and Responses ones with their bare aliases
    "/v1/messages/count_tokens": "POST",
    "/v1/chat/completions/input_tokens": "POST", "/chat/completions/input_tokens": "POST",
    "/v1/responses/input_tokens": "POST", "/responses/input_tokens": "POST",
    "/api/tags": "GET", "/api/show": "POST", "/api/ps": "GET", "/api/version": "GET",
}


async def forward(request: Request, http: httpx.AsyncClient,
                  content: bytes | None = None, *, path: str | None = None,
                  drop_headers: Iterable[str] = (), operator: bool = False
                  ) -> StreamingResponse:
    """The request as it came (its body streamed, or ``content`` when the caller already
    read it), and the engine's answer streamed back as it comes. ``path``: the engine path
    to send it to (default the request's); ``drop_headers``: request headers (lower case)
    not forwarded besides the hop-by-hop ones; ``operator``: the operator listener's
    request, which carries the engine key (``--engine-api-key``) when it brings no
    credentials of its own."""
    dropped = HOP_BY_HOP.union(drop_headers)
    # The raw header bytes: a non-ASCII value (which httpx would refuse as str) goes through.
    headers = [(k, v) for k, v in request.headers.raw
               if k.decode("latin-1").lower() not in dropped]
    # The path the router matched (canonical after ``proxy.listen.paths.canonical_paths``), never
    # the raw bytes; one that is not canonical is refused, not normalised by httpx into
    # another route (``/./v1/chat/completions``) or turned into a 500 (``//v1/...``).
    target = request.scope["path"] if path is None else path
    if not is_canonical(target):
        raise PathRejected("not in canonical form (it is not forwarded)")
    # Its credentials are the client's own (Authorization, X-Api-Key: headers above), never
    # the engine key prefixpin's own requests carry (``FORWARDED``).
    upstream_request = http.build_request(
        request.method, httpx.URL(path=target, query=request.url.query.encode()),
        headers=headers, content=_body(request) if content is None else content,
        extensions={OPERATOR: True} if operator else {FORWARDED: True},
    )
    if not upstream_request.url.raw_path.partition(b"?")[0].endswith(target.encode()):
        raise PathRejected("it would not reach the engine as it was routed")
    with map_httpx_errors(f"{request.method} {target}"):
        response = await http.send(upstream_request, stream=True)
    return StreamingResponse(
        _raw(response), status_code=response.status_code,
        headers={k: v for k, v in response.headers.items() if passed_back(k)},
        background=BackgroundTask(response.aclose),
    )


def passed_back(name: str) -> bool:
    """Whether an engine's response header reaches the client: not a hop-by-hop one, and
    not the engine's CORS answer (the listener gives its own: ``proxy.listen.cors``; the
    engine's would let pages in that prefixpin keeps out)."""
    lowered = name.lower()
    return lowered not in HOP_BY_HOP and not lowered.startswith("access-control-")


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
