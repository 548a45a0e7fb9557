"""A listener (``proxy.listen.server._Listener``) sleeps until it is told to stop: no tick wakes
it (each one is paid for every second a request waits on a long prefill), and the Date
header is stamped when a response reads it."""

from __future__ import annotations

import asyncio
import email.utils
import socket
import time
from typing import Any

import httpx
import pytest
import uvicorn

from prefixpin.proxy.listen.server import _Follower

pytestmark = pytest.mark.anyio


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hello"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def test_the_date_is_stamped_when_read_and_should_exit_stops_the_listener() -> None:
    port = free_port()
    server = _Follower(uvicorn.Config(hello, host="127.0.0.1", port=port, lifespan="off",
                                      log_level="warning"))
    serving = asyncio.create_task(server.serve())
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            for _ in range(100):
                if server.started:
                    break
                await asyncio.sleep(0.05)
            dates = []
            for _ in range(2):
                response = await client.get("/")
                assert response.text == "hello"
                stamped = email.utils.parsedate_to_datetime(response.headers["date"])
                dates.append(stamped.timestamp())
                assert abs(stamped.timestamp() - time.time()) <= 1.5
                await asyncio.sleep(1.1)
            assert dates[1] > dates[0]  # a new second, a new stamp, with no tick between
        server.should_exit = True  # uvicorn's way: it wakes the listener
        async with asyncio.timeout(5):
            await serving
    finally:
        serving.cancel()
