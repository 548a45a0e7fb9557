"""An httpx transport that calls an ASGI app in process and streams its response.

httpx's own ``ASGITransport`` collects the whole body before returning, which would hide
every streaming behaviour (first byte, heartbeats, disconnects). This one returns as soon
as the app sends its response start, yields body chunks as the app sends them, and tells
the app ``http.disconnect`` when the response is closed early. The suite reaches the
proxy's app and its fake engines through it, in process.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import httpx
from starlette.types import ASGIApp

Message = MutableMapping[str, Any]


class StreamingASGITransport(httpx.AsyncBaseTransport):
    def __init__(self, app: ASGIApp, client: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        self.app = app
        self.client = client

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        exchange = _Exchange(body)
        task = asyncio.create_task(self._run(request, exchange))
        started = asyncio.ensure_future(exchange.started)
        waiters: set[asyncio.Future[Any]] = {task, started}
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            # The caller gave up before the response started: like a closed socket, the
            # app hears http.disconnect (a queued request must not run to completion).
            exchange.disconnected.set()
            started.cancel()
            raise
        if not started.done():
            started.cancel()
            task.result()  # re-raise the app's exception
            raise httpx.RemoteProtocolError("ASGI app returned without a response",
                                            request=request)
        message = started.result()
        headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
        return httpx.Response(message["status"], headers=headers,
                              stream=_BodyStream(exchange, task), request=request)

    async def _run(self, request: httpx.Request, exchange: _Exchange) -> None:
        scope = _scope(request, self.client)
        try:
            await self.app(scope, exchange.receive, exchange.send)
        finally:
            exchange.end()


class _Exchange:
    def __init__(self, body: bytes) -> None:
        self._body: bytes | None = body
        self.started: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self.chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.disconnected = asyncio.Event()

    async def receive(self) -> Message:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            if not self.started.done():
                self.started.set_result(message)
        elif message["type"] == "http.response.body":
            chunk = message.get("body", b"")
            if chunk:
                self.chunks.put_nowait(chunk)
            if not message.get("more_body", False):
                self.chunks.put_nowait(None)

    def end(self) -> None:
        self.chunks.put_nowait(None)


class _BodyStream(httpx.AsyncByteStream):
    def __init__(self, exchange: _Exchange, task: asyncio.Task[None]) -> None:
        self._exchange = exchange
        self._task = task

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (chunk := await self._exchange.chunks.get()) is not None:
            yield chunk
        if self._task.done() and not self._task.cancelled() and self._task.exception():
            raise httpx.RemoteProtocolError(f"ASGI app failed: {self._task.exception()!r}")

    async def aclose(self) -> None:
        # Like a socket closing: the app sees http.disconnect and gets a moment to clean up.
        self._exchange.disconnected.set()
        if not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 5.0)
            except TimeoutError:
                self._task.cancel()
            except Exception:
                pass


def _scope(request: httpx.Request, client: tuple[str, int]) -> dict[str, Any]:
    url = request.url
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "headers": [(k.lower(), v) for k, v in request.headers.raw],
        "scheme": url.scheme,
        "path": url.path,
        "raw_path": url.raw_path.split(b"?")[0],
        "query_string": url.query,
        "server": (url.host, url.port or 80),
        "client": client,
        "root_path": "",
    }
