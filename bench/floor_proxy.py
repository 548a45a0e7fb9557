"""The floor of the overhead bench: the least a starlette + httpx streaming relay adds.

No parsing, no policy, no metrics: the request body goes to the engine as it came and the
engine's bytes come back as they are, on the same server stack prefixpin runs on (uvicorn
with httptools and uvloop, starlette, an ``httpx.AsyncClient`` with keep-alive). Whatever
prefixpin adds beyond this arm is its own work; this arm's own cost is the stack's.

    python bench/floor_proxy.py UPSTREAM_URL PORT
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prefixpin.proxy.listen.http_limits import (
    http_options,  # the server options prefixpin itself runs with
)


def create_app(upstream: str) -> Starlette:
    client = httpx.AsyncClient(base_url=upstream, timeout=None)

    async def chat(request: Request) -> Response:
        body = await request.body()
        outgoing = client.build_request("POST", "/v1/chat/completions", content=body,
                                        headers={"content-type": "application/json"})
        response = await client.send(outgoing, stream=True)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        return StreamingResponse(relay(), status_code=response.status_code,
                                 media_type="text/event-stream")

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with client:
            yield

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/health", health)], lifespan=lifespan)


def main() -> None:
    upstream, port = sys.argv[1], int(sys.argv[2])
    uvicorn.run(create_app(upstream), host="127.0.0.1", port=port, log_level="warning",
                access_log=False, **http_options())


if __name__ == "__main__":
    main()
