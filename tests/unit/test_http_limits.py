"""The bounded request head, at the protocol: uvicorn's own httptools protocol (subclassed by
``proxy.listen.http_limits``) fed exactly the chunks a socket read would give it.

Which bytes arrive in one read is up to the kernel; feeding the protocol directly makes the
case that broke in the field (a whole agent request, head and a 150 kB body, in one read)
happen every time instead of now and then.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from prefixpin.proxy.listen.http_limits import (
    LINGER_MAX_BYTES,
    LINGER_S,
    MAX_HEAD_BYTES,
    ConnectionLimits,
    http_options,
)


class Transport(asyncio.Transport):
    """What the protocol writes, kept; the socket details uvicorn asks for, answered."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False
        self.reading = True

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
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

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


def connected(app: Any, limits: ConnectionLimits | None = None) -> tuple[Any, Transport]:
    """A connection to ``app`` on the bounded protocol, and the transport it writes to."""
    config = uvicorn.Config(app, log_level="error", **http_options(limits=limits))
    config.load()
    protocol_class: Any = config.http_protocol_class  # typed as asyncio.Protocol
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
    transport = Transport()
    protocol.connection_made(transport)
    return protocol, transport


async def answer_of(transport: Transport) -> bytes:
    """What was written once the app (a task) has answered, or within a second."""
    for _ in range(100):
        if transport.out:
            break
        await asyncio.sleep(0.01)
    return bytes(transport.out)


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


@pytest.mark.anyio
@pytest.mark.parametrize("sent", [b"", b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"])
async def test_a_head_that_does_not_come_is_a_408(sent: bytes) -> None:
    """A connection that sends nothing, or a head a little at a time (slowloris), is
    answered 408 and closed at the head deadline."""
    seen: list[str] = []
    config = uvicorn.Config(body_length_app, log_level="warning", **http_options(
        limits=ConnectionLimits(head_timeout_s=0.2, refused=seen.append)))
    config.load()
    protocol_class: Any = config.http_protocol_class
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
    transport = Transport()
    protocol.connection_made(transport)
    protocol.data_received(sent)
    await asyncio.sleep(0.4)
    assert status_of(bytes(transport.out)) == 408
    assert b"request_timeout" in transport.out
    assert seen == ["head_timeout"]  # counted once, by its limit (the metric's label)
    await asyncio.sleep(LINGER_S + 0.1)
    assert transport.closed


@pytest.mark.anyio
async def test_a_body_that_does_not_come_is_a_408_and_a_quick_one_is_served() -> None:
    config = uvicorn.Config(body_length_app, log_level="warning",
                            **http_options(limits=ConnectionLimits(body_timeout_s=0.2)))
    config.load()
    protocol_class: Any = config.http_protocol_class
    slow = protocol_class(config=config, server_state=ServerState(), app_state={})
    transport = Transport()
    slow.connection_made(transport)
    slow.data_received(request(b"{}" * 50)[:-10])  # its last 10 bytes never come
    await asyncio.sleep(0.4)
    assert status_of(bytes(transport.out)) == 408
    quick = await exchange([request(b"{}" * 50)])
    assert status_of(quick) == 200


@pytest.mark.anyio
async def test_connections_past_the_limit_are_a_503_and_closed() -> None:
    seen: list[str] = []
    config = uvicorn.Config(body_length_app, log_level="warning", **http_options(
        limits=ConnectionLimits(max_connections=2, refused=seen.append)))
    config.load()
    protocol_class: Any = config.http_protocol_class
    state = ServerState()
    transports = []
    for _ in range(3):
        protocol = protocol_class(config=config, server_state=state, app_state={})
        transports.append(Transport())
        protocol.connection_made(transports[-1])
    await asyncio.sleep(0.05)
    assert [bytes(t.out) for t in transports[:2]] == [b"", b""]
    assert status_of(bytes(transports[2].out)) == 503
    assert transports[2].closed
    assert seen == ["connections"]


def chunked(pieces: list[bytes]) -> bytes:
    """A POST whose body is ``pieces``, each one chunk (Transfer-Encoding: chunked)."""
    body = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces)
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked"
            b"\r\n\r\n" + body + b"0\r\n\r\n")


@pytest.mark.anyio
async def test_a_chunked_body_within_max_body_chunks_is_served_and_one_past_it_is_a_413(
        ) -> None:
    seen: list[str] = []
    limits = ConnectionLimits(max_body_chunks=8, refused=seen.append)
    answers = []
    for pieces in (8, 9):
        protocol, transport = connected(body_length_app, limits)
        protocol.data_received(chunked([b"{}"] * pieces))
        answers.append(await answer_of(transport))
        protocol.connection_lost(None)
    assert status_of(answers[0]) == 200, answers[0][:300]
    assert answers[0].endswith(b"\r\n2\r\n16\r\n0\r\n\r\n")  # its 16 bytes, read whole
    assert status_of(answers[1]) == 413
    assert b"too_many_chunks" in answers[1]
    assert seen == ["body_chunks"]


@pytest.mark.anyio
async def test_a_read_of_one_byte_chunks_stops_at_the_bound() -> None:
    """One read holding 40,000 one-byte chunks: the parser stops at the chunk past the
    bound (its callbacks are what held the loop), so what reaches the app is the bound's
    worth of bytes, and the client gets a 413."""
    received: list[int] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (message := await receive())["type"] == "http.request":
            received.append(len(message["body"]))
            if not message.get("more_body"):
                break

    protocol, transport = connected(app, ConnectionLimits(max_body_chunks=1000))
    raw = chunked([b"x"] * 40_000)
    protocol.data_received(raw[:-5])  # all but the body's end
    for _ in range(100):
        if received:
            break
        await asyncio.sleep(0.01)
    assert status_of(bytes(transport.out)) == 413
    assert 1000 <= sum(received) <= 1001  # (the last chunk's header is one more allowed)
    protocol.connection_lost(None)


@pytest.mark.anyio
async def test_a_chunk_bound_refusal_is_logged_once_not_also_as_an_invalid_request(
        caplog: pytest.LogCaptureFixture) -> None:
    """The refusal stops the parser with an exception from its callback, which uvicorn
    would log as an invalid request besides the refusal's own line: one line, and uvicorn's
    other warnings on the connection still reach its logger."""
    server_log = logging.getLogger("uvicorn.error")
    protocol, transport = connected(body_length_app, ConnectionLimits(max_body_chunks=8))
    other, _ = connected(body_length_app)  # (each sets uvicorn's log level: first)
    server_log.addHandler(caplog.handler)  # (uvicorn's loggers do not propagate to root)
    try:
        with caplog.at_level(logging.WARNING, logger="uvicorn.error"):
            protocol.data_received(chunked([b"{}"] * 20))
            await answer_of(transport)
            other.data_received(b"NOT HTTP\r\n\r\n")
    finally:
        server_log.removeHandler(caplog.handler)
        protocol.connection_lost(None)
        other.connection_lost(None)
    lines = [record.getMessage() for record in caplog.records]
    assert status_of(bytes(transport.out)) == 413
    assert lines == ["request body in over 8 chunks refused", "Invalid HTTP request received."]


@pytest.mark.anyio
async def test_a_refused_client_that_keeps_sending_is_not_read_past_the_linger_bound() -> None:
    """After a refusal the rest of the request is read and dropped for the linger (so the
    client can read its answer before the close), but only ``LINGER_MAX_BYTES`` of it: a
    client blasting on is not read again, instead of taking the loop at line rate."""
    protocol, transport = connected(body_length_app, ConnectionLimits(max_body_chunks=8))
    protocol.data_received(chunked([b"{}"] * 10)[:-5])  # refused at its tenth chunk
    assert status_of(bytes(transport.out)) == 413
    blast = b"x" * 65536
    for _ in range(LINGER_MAX_BYTES // len(blast)):
        protocol.data_received(blast)
    assert transport.is_reading()  # within the bound: read (and dropped)
    protocol.data_received(blast)
    assert not transport.is_reading()
    protocol.connection_lost(None)


@pytest.mark.anyio
async def test_an_answer_before_the_body_ends_closes_the_connection_after_a_linger() -> None:
    """An app that answers before it read the whole body (a 413 past ``--max-body``):
    the rest of the body is not read on for a next request (an endless chunked one kept
    the loop reading at line rate), only dropped up to ``LINGER_MAX_BYTES``, and the
    connection closes after the linger."""
    async def early(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()  # the body's first bytes, then the answer
        await send({"type": "http.response.start", "status": 413, "headers": []})
        await send({"type": "http.response.body", "body": b"too large"})

    protocol, transport = connected(early)
    piece = b"%x\r\n%s\r\n" % (65536, b" " * 65536)
    protocol.data_received(chunked([])[:-5] + piece)
    assert status_of(await answer_of(transport)) == 413
    for _ in range(LINGER_MAX_BYTES // len(piece) + 2):
        protocol.data_received(piece)
    assert not transport.is_reading()
    await asyncio.sleep(LINGER_S + 0.1)
    assert transport.closed
    protocol.connection_lost(None)


def head_of(answer: bytes) -> bytes:
    return answer.split(b"\r\n\r\n", 1)[0].lower()


@pytest.mark.anyio
async def test_an_answer_before_the_body_ends_says_the_connection_closes() -> None:
    """The answer itself says ``connection: close``: a client that has sent its whole body
    and read the answer before the connection's close reached it would otherwise send its
    next request on this connection, and get no answer at all."""
    async def early(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 413, "headers": []})
        await send({"type": "http.response.body", "body": b"too large"})

    protocol, transport = connected(early)
    protocol.data_received(request(BIG_BODY)[:-1000])
    answer = await answer_of(transport)
    assert status_of(answer) == 413
    assert b"\r\nconnection: close" in head_of(answer)
    protocol.data_received(request(BIG_BODY)[-1000:])  # the body's end: read and dropped
    await asyncio.sleep(0.05)
    assert not transport.closed  # it lingers: the client still sending reads its answer
    protocol.connection_lost(None)


@pytest.mark.anyio
async def test_an_answer_after_the_whole_body_keeps_the_connection() -> None:
    protocol, transport = connected(body_length_app)
    for _ in range(2):
        transport.out.clear()
        protocol.data_received(request(BIG_BODY))
        answer = await answer_of(transport)
        assert status_of(answer) == 200
        assert b"connection: close" not in head_of(answer)
        assert b"\r\n%d\r\n" % len(BIG_BODY) in answer
    assert not transport.closed
    protocol.connection_lost(None)
