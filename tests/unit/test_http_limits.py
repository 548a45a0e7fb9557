"""The bounded request head, at the protocol: uvicorn's own httptools protocol (subclassed by
``proxy.http_limits``) fed exactly the chunks a socket read would give it.

Which bytes arrive in one read is up to the kernel; feeding the protocol directly makes the
case that broke in the field (a whole agent request, head and a 150 kB body, in one read)
happen every time instead of now and then.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from proxy.http_limits import MAX_HEAD_BYTES, http_options


class Transport(asyncio.Transport):
    """What the protocol writes, kept; the socket details uvicorn asks for, answered."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8088), "peername": ("127.0.0.1", 50000)}.get(
            name, default)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass


async def body_length_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers with the length of the body it read."""
    if scope["type"] != "http":
        return
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(size).encode()})


async def exchange(chunks: list[bytes]) -> bytes:
    config = uvicorn.Config(body_length_app, log_level="warning", **http_options())
    config.load()
    protocol_class: Any = config.http_protocol_class  # typed as asyncio.Protocol
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
    transport = Transport()
    protocol.connection_made(transport)
    for chunk in chunks:
        protocol.data_received(chunk)
        await asyncio.sleep(0)
    for _ in range(100):  # the app runs as a task: let it answer
        if transport.out:
            break
        await asyncio.sleep(0.01)
    protocol.connection_lost(None)
    return bytes(transport.out)


def request(body: bytes, path: bytes = b"/v1/chat/completions") -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


BIG_BODY = b"{" + b" " * 150_000 + b"}"  # a long agent history is this size


@pytest.mark.anyio
async def test_a_whole_large_request_in_one_read_is_not_a_large_head() -> None:
    answer = await exchange([request(BIG_BODY)])
    assert status_of(answer) == 200, answer[:300]
    assert answer.endswith(b"\r\n" + str(len(BIG_BODY)).encode() + b"\r\n0\r\n\r\n")


@pytest.mark.anyio
async def test_a_large_request_in_many_reads_is_served() -> None:
    raw = request(BIG_BODY)
    answer = await exchange([raw[i:i + 16_384] for i in range(0, len(raw), 16_384)])
    assert status_of(answer) == 200, answer[:300]


@pytest.mark.anyio
@pytest.mark.parametrize("split", [1, 2, 3])
async def test_a_head_whose_end_straddles_two_reads_counts_no_body(split: int) -> None:
    """The head's blank line cut across reads, the second read mostly body."""
    raw = request(BIG_BODY)
    end = raw.index(b"\r\n\r\n") + 4
    answer = await exchange([raw[:end - split], raw[end - split:]])
    assert status_of(answer) == 200, answer[:300]


@pytest.mark.anyio
async def test_a_head_just_under_the_limit_with_a_large_body_in_one_read_is_served() -> None:
    path = b"/v1/chat/completions?pad=" + b"a" * (MAX_HEAD_BYTES - 200)
    answer = await exchange([request(BIG_BODY, path=path)])
    assert status_of(answer) != 431, answer[:300]


@pytest.mark.anyio
@pytest.mark.parametrize("piece", [1_000, 16_384, 100_000, 1_000_000])
@pytest.mark.parametrize("finished", [False, True], ids=["head unfinished", "whole request"])
async def test_a_head_over_the_limit_is_a_431_in_any_reads(piece: int, finished: bool) -> None:
    raw = request(b"{}", path=b"/" + b"a" * (MAX_HEAD_BYTES + 10))
    raw = raw if finished else raw[:raw.index(b"\r\n\r\n")]
    answer = await exchange([raw[i:i + piece] for i in range(0, len(raw), piece)])
    assert status_of(answer) == 431, answer[:300]
    assert b"headers_too_large" in answer
