"""The streamed response under a real uvicorn over TCP: it ends with its body, and a client
that leaves ends it at once (the body closed, the app returning normally), even while the
body is silent (a long prefill), when there is no write to fail."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncGenerator, MutableMapping
from typing import Any

import httpx

from prefixpin.core.streaming import StreamResponse
from prefixpin.proxy.listen.http_limits import http_options
from tests.fakes.servers import serve_in_thread


class Recorder:
    """What the app saw: the body's end, and how its ASGI call ended."""

    def __init__(self) -> None:
        self.body_closed = threading.Event()
        self.app_returned = threading.Event()
        self.app_raised: list[BaseException] = []


def streaming_app(recorder: Recorder, *, silent_after: int | None) -> Any:
    async def body() -> AsyncGenerator[bytes, None]:
        try:
            for index in range(3):
                if silent_after is not None and index == silent_after:
                    await asyncio.sleep(3600)  # a prefill that outlasts the client
                yield f"data: {index}\n\n".encode()
        finally:
            recorder.body_closed.set()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        response = StreamResponse(body(), media_type="text/event-stream")
        try:
            await response(scope, receive, send)
        except BaseException as exc:
            recorder.app_raised.append(exc)
            raise
        recorder.app_returned.set()

    return app


def test_the_response_ends_with_its_body() -> None:
    recorder = Recorder()
    with serve_in_thread(streaming_app(recorder, silent_after=None), **http_options()) as url:
        response = httpx.get(url, timeout=10)
        assert recorder.app_returned.wait(5)
    assert response.text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert recorder.body_closed.is_set()
    assert recorder.app_raised == []


def test_a_client_leaving_a_silent_stream_ends_it_at_once() -> None:
    recorder = Recorder()
    with serve_in_thread(streaming_app(recorder, silent_after=1), **http_options()) as url:
        with httpx.stream("GET", url, timeout=10) as response:
            first = next(response.iter_lines())
            left = time.monotonic()
        assert recorder.body_closed.wait(5), "the body was never closed"
        closed_after = time.monotonic() - left
        assert recorder.app_returned.wait(5)
    assert first == "data: 0"
    assert closed_after < 1.0, f"the body was closed {closed_after:.2f} s after the client left"
    assert recorder.app_raised == []  # a client leaving is the end of a response, no error


def test_a_cancelled_server_task_is_still_cancelled() -> None:
    """Only the client leaving is taken as an end: any other cancellation goes on up."""

    async def run() -> bool:
        body_closed = asyncio.Event()

        async def body() -> AsyncGenerator[bytes, None]:
            try:
                await asyncio.sleep(3600)
                yield b""
            finally:
                body_closed.set()

        async def receive() -> dict[str, Any]:
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            return None

        task = asyncio.create_task(StreamResponse(body(), media_type="text/plain")(
            {"type": "http"}, receive, send))
        await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return task.cancelled() and body_closed.is_set()

    assert asyncio.run(run())
