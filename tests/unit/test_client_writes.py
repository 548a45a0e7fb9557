"""The tenant listener's client writes (``proxy.speed.client_writes``): kept for the end of the
loop's turn, in order, nothing lost at a close; and a body chunk written as uvicorn's own
``send`` writes it, or not at all when ``send`` must decide."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import MutableMapping
from typing import Any

import httpx
import pytest
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from prefixpin.proxy.speed.client_writes import BatchedTransport, ChunkedBodyWriter, WriteBatch
from tests.collector import collector_off


class RecordingTransport(asyncio.Transport):
    """The socket's transport: what reached it, in order, and what was done to it."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.calls: list[str] = []
        self.closing = False
        self.buffered = 0

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))
        self.calls.append("write")

    def close(self) -> None:
        self.closing = True
        self.calls.append("close")

    def abort(self) -> None:
        self.closing = True
        self.calls.append("abort")

    def write_eof(self) -> None:
        self.calls.append("write_eof")

    def can_write_eof(self) -> bool:
        return True

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 9)}.get(name, default)


def batched() -> tuple[BatchedTransport, RecordingTransport, WriteBatch]:
    socket = RecordingTransport()
    batch = WriteBatch(asyncio.get_running_loop())
    return BatchedTransport(socket, batch), socket, batch


def test_writes_of_a_turn_leave_together_at_its_end_in_order() -> None:
    async def run() -> None:
        transport, socket, _ = batched()
        other, other_socket, _ = batched()
        transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
        transport.write(bytearray(b"a"))
        other.write(b"x")
        transport.write(memoryview(b"b"))
        assert socket.writes == []
        assert other_socket.writes == []
        assert transport.get_write_buffer_size() == 21
        await asyncio.sleep(0)  # the end of the turn
        assert socket.writes == [b"HTTP/1.1 200 OK\r\n\r\nab"]  # one syscall
        assert other_socket.writes == [b"x"]
        assert transport.get_write_buffer_size() == 0
        transport.write(b"c")
        await asyncio.sleep(0)
        assert socket.writes[-1] == b"c"

    asyncio.run(run())


def test_a_close_or_half_close_sends_what_was_kept_first_and_an_abort_drops_it() -> None:
    async def run() -> None:
        transport, socket, _ = batched()
        transport.write(b"last")
        transport.close()
        assert (socket.writes, socket.calls) == ([b"last"], ["write", "close"])
        transport, socket, _ = batched()
        transport.write(b"last")
        transport.write_eof()
        assert (socket.writes, socket.calls) == ([b"last"], ["write", "write_eof"])
        transport, socket, _ = batched()
        transport.write(b"dropped")
        transport.abort()
        await asyncio.sleep(0)
        assert (socket.writes, socket.calls) == ([], ["abort"])

    asyncio.run(run())


def test_a_write_to_a_closing_socket_is_the_socket_s_to_answer() -> None:
    async def run() -> None:
        transport, socket, _ = batched()
        socket.closing = True
        transport.write(b"late")
        assert socket.writes == [b"late"]

    asyncio.run(run())


def test_the_rest_is_the_socket_s() -> None:
    async def run() -> None:
        transport, socket, _ = batched()
        socket.buffered = 7
        transport.write(b"abc")
        assert transport.get_write_buffer_size() == 10
        assert transport.get_extra_info("peername") == ("127.0.0.1", 9)
        assert transport.can_write_eof()
        socket.closing = True
        assert transport.is_closing()

    asyncio.run(run())


# ------------------------------------------------------------------ the body writer

def cycle_on(transport: RecordingTransport, method: str = "POST") -> RequestResponseCycle:
    return RequestResponseCycle(
        {"type": "http", "method": method},  # type: ignore[typeddict-item]
        transport, FlowControl(transport), logging.getLogger("t"), logging.getLogger("a"),
        False, [], asyncio.Event(), False, True, lambda: None)


async def started(cycle: RequestResponseCycle, headers: list[tuple[bytes, bytes]]) -> None:
    await cycle.send({"type": "http.response.start", "status": 200, "headers": headers})


SSE = [(b"content-type", b"text/event-stream")]


def test_a_chunk_is_written_as_uvicorn_s_send_writes_it() -> None:
    async def run() -> None:
        by_send, by_writer = RecordingTransport(), RecordingTransport()
        sending, writing = cycle_on(by_send), cycle_on(by_writer)
        await started(sending, SSE)
        await started(writing, SSE)
        write = ChunkedBodyWriter(writing).write
        for body in (b"data: {}\n\n", b"x" * 5000, b": ping\n\n"):
            await sending.send({"type": "http.response.body", "body": body, "more_body": True})
            assert write(body) is True
        await sending.send({"type": "http.response.body", "body": b"", "more_body": False})
        await writing.send({"type": "http.response.body", "body": b"", "more_body": False})
        assert b"".join(by_writer.writes) == b"".join(by_send.writes)
        assert b"transfer-encoding: chunked" in by_send.writes[0]

    asyncio.run(run())


class Lingering:
    """A protocol that holds its transport and closes the socket itself, later."""

    def __init__(self, socket: RecordingTransport, batch: WriteBatch) -> None:
        self.transport = BatchedTransport(socket, batch, closes_later=self.closes_later)

    def closes_later(self) -> bool:
        return True


def test_a_protocol_that_closes_later_is_asked_and_freed_without_the_collector() -> None:
    async def run() -> None:
        socket = RecordingTransport()
        protocol = Lingering(socket, WriteBatch(asyncio.get_running_loop()))
        transport = protocol.transport
        transport.close()
        assert "close" not in socket.calls  # the protocol closes it, later
        freed = weakref.ref(protocol)
        with collector_off():
            del protocol
            assert freed() is None
        transport.close()  # its protocol gone: nobody closes it later
        assert "close" in socket.calls

    asyncio.run(run())


def test_a_request_s_cycle_is_freed_when_its_response_ends_not_by_the_collector() -> None:
    """The scope offers the writer, the writer reads the cycle: held strongly, that is a
    reference cycle per request, kept until the collector's older generations run."""
    cycle = cycle_on(RecordingTransport())
    scope: dict[str, Any] = cycle.scope  # type: ignore[assignment]
    scope["extensions"] = {"writer": ChunkedBodyWriter(cycle).write}
    freed = weakref.ref(cycle)
    with collector_off():
        del cycle
        assert freed() is None


@pytest.mark.parametrize("case", ["not started", "content-length", "HEAD", "complete",
                                  "client gone", "write paused", "empty body"])
def test_the_writer_leaves_to_send_what_send_must_decide(case: str) -> None:
    async def run() -> None:
        transport = RecordingTransport()
        cycle = cycle_on(transport, "HEAD" if case == "HEAD" else "POST")
        if case != "not started":
            headers = [(b"content-length", b"4")] if case == "content-length" else SSE
            await started(cycle, headers)
        if case == "complete":
            await cycle.send({"type": "http.response.body", "body": b"", "more_body": False})
        if case == "client gone":
            cycle.disconnected = True
        if case == "write paused":
            cycle.flow.pause_writing()
        written = list(transport.writes)
        assert ChunkedBodyWriter(cycle).write(b"" if case == "empty body" else b"data") is False
        assert transport.writes == written

    asyncio.run(run())


# ------------------------------------------------------------------ on the server's protocol

async def streaming_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Streams three chunks through the body writer the scope carries (``send`` where it
    declines), then ends the response."""
    from prefixpin.proxy.pipeline.relay import BODY_WRITER

    if scope["type"] != "http":
        return
    write = scope["extensions"][BODY_WRITER]
    await send({"type": "http.response.start", "status": 200, "headers": SSE})
    for body in (b"data: 1\n\n", b"data: 2\n\n", b"data: 3\n\n"):
        if not write(body):
            await send({"type": "http.response.body", "body": body, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def test_the_tenant_protocol_batches_and_carries_the_body_writer() -> None:
    import uvicorn
    from uvicorn.server import ServerState

    from prefixpin.proxy.listen.http_limits import http_options

    async def run() -> None:
        config = uvicorn.Config(streaming_app, log_level="warning", **http_options())
        config.load()
        protocol_class: Any = config.http_protocol_class
        protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
        socket = RecordingTransport()
        protocol.connection_made(socket)
        protocol.data_received(b"GET /s HTTP/1.1\r\nhost: x\r\n\r\n")
        for _ in range(20):
            await asyncio.sleep(0)
        wire = b"".join(socket.writes)
        head, _, body = wire.partition(b"\r\n\r\n")
        assert b"transfer-encoding: chunked" in head
        assert body == (b"9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n9\r\ndata: 3\n\n\r\n"
                        b"0\r\n\r\n")
        # The head and every chunk of the app's one run left in one write (one turn).
        assert len(socket.writes) == 1

    asyncio.run(run())


class RaisingTransport(RecordingTransport):
    """A socket whose write fails (what uvloop raises for a handle already closed)."""

    def write(self, data: Any) -> None:
        raise RuntimeError("unable to perform operation; the handler is closed")


def test_bytes_for_a_connection_lost_before_the_flush_are_dropped() -> None:
    async def run() -> None:
        transport, socket, _ = batched()
        transport.write(b"kept")
        socket.closing = True  # the peer went: the socket's transport closed itself
        transport.close()  # what uvicorn's connection_lost calls
        await asyncio.sleep(0)
        assert socket.writes == []
        assert socket.calls == ["close"]

    asyncio.run(run())


def test_one_failed_write_leaves_the_other_connections_theirs() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        reported: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _, context: reported.append(context))
        batch = WriteBatch(loop)
        broken = BatchedTransport(RaisingTransport(), batch)
        healthy_socket = RecordingTransport()
        healthy = BatchedTransport(healthy_socket, batch)
        broken.write(b"a")
        healthy.write(b"b")
        await asyncio.sleep(0)
        assert healthy_socket.writes == [b"b"]
        assert [type(c["exception"]) for c in reported] == [RuntimeError]
        healthy.write(b"c")  # the batch still flushes at the next turn's end
        await asyncio.sleep(0)
        assert healthy_socket.writes == [b"b", b"c"]

    asyncio.run(run())


def test_a_client_reset_mid_stream_leaves_the_other_streams_whole() -> None:
    """Over TCP on the tenant protocol (uvloop): clients reset their connections while
    their streams are written every turn; the stream beside them still gets every chunk
    (its bytes are flushed in the same batches as the lost connections')."""
    import socket
    import struct

    from prefixpin.proxy.listen.http_limits import http_options
    from prefixpin.proxy.pipeline.relay import BODY_WRITER
    from tests.fakes.servers import serve_in_thread

    chunks = 400

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        write = scope["extensions"][BODY_WRITER]
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        for index in range(chunks):
            body = b"data: %d\n\n" % index
            if not write(body):
                await send({"type": "http.response.body", "body": body, "more_body": True})
            await asyncio.sleep(0.001)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    with serve_in_thread(app, **http_options()) as url:
        port = int(url.rsplit(":", 1)[1])
        leaving = [socket.create_connection(("127.0.0.1", port)) for _ in range(32)]
        for connection in leaving:
            connection.sendall(b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n")
        with httpx.Client(timeout=30) as client, client.stream("GET", url + "/b") as response:
            received = 0
            for line in response.iter_lines():
                if line.startswith("data: "):
                    received += 1
                    if 20 <= received < 20 + len(leaving):  # one resets, every chunk
                        connection = leaving[received - 20]
                        assert connection.recv(1024)
                        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                              struct.pack("ii", 1, 0))
                        connection.close()
        assert received == chunks
