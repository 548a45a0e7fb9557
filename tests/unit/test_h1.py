"""The engine transport on httptools (``adapters.h1``): bodies framed every way HTTP/1.1
frames them, keep-alive reuse, and each failure raised as httpx's own transport raises it
(what ``adapters.http`` maps and retries), against a raw asyncio server that answers
exactly the bytes each test gives it."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from prefixpin.adapters.h1 import (
    HIGH_WATER,
    MAX_HEAD_BYTES,
    MAX_INTERIM_RESPONSES,
    READ_SIZE,
    TURN_READ_BUDGET,
    EngineBounds,
    H1Transport,
    engine_transport,
)
from prefixpin.adapters.http import EngineClient, pushed_body, send_with_stale_retry
from prefixpin.proxy.settings import Settings
from tests.collector import collector_off

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")


def chunk(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + (await reader.readexactly(length) if length else b"")


@contextlib.asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A server on a free port; yields its URL and the peer port of every connection."""
    peers: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peers.append(writer.get_extra_info("peername")[1])
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", peers
    finally:
        srv.close()
        await srv.wait_closed()


def client(url: str, bounds: EngineBounds | None = None, *, keep_when_quiet: bool = False,
           **timeouts: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url,
                             transport=H1Transport(bounds=bounds, keep_when_quiet=keep_when_quiet),
                             timeout=httpx.Timeout(timeouts.get("read", 5.0), **timeouts))


async def stream_chunks(http: httpx.AsyncClient, body: bytes = b"{}") -> list[bytes]:
    request = http.build_request("POST", "/v1/chat/completions", content=body)
    response = await http.send(request, stream=True)
    try:
        return [c async for c in response.aiter_raw()]
    finally:
        await response.aclose()


async def stream_events(writer: asyncio.StreamWriter, events: list[bytes], gap_s: float,
                        *, end: bool = True) -> None:
    """A chunked event stream's head, its events ``gap_s`` apart (each flushed), and its
    end unless ``end`` is False (the engine goes silent instead)."""
    writer.write(SSE_HEAD)
    for event in events:
        writer.write(chunk(event))
        await writer.drain()
        await asyncio.sleep(gap_s)
    if end:
        writer.write(b"0\r\n\r\n")


async def read_into(response: httpx.Response, parts: list[bytes]) -> None:
    async for part in response.aiter_raw():
        parts.append(part)


def test_a_chunked_event_stream_arrives_as_sent_and_the_connection_is_reused() -> None:
    events = [b"data: %d\n\n" % i for i in range(5)]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            request = await read_request(reader)
            assert request.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
            assert b"\r\ncontent-length: 2\r\n" in request.lower()
            assert request.endswith(b"{}")
            await stream_events(writer, events, 0.01)

    async def run() -> tuple[list[bytes], list[bytes], list[int]]:
        async with server(handler) as (url, peers), client(url, keep_when_quiet=True) as http:
            first = await stream_chunks(http)
            second = await stream_chunks(http)
        return first, second, peers

    first, second, peers = asyncio.run(run())
    assert b"".join(first) == b"".join(second) == b"".join(events)
    assert len(first) == len(events)  # each read as it came, not buffered to the end
    assert len(peers) == 1  # the second request went over the first one's connection


def test_an_idle_connection_is_closed_at_its_expiry_and_one_in_use_is_not() -> None:
    """The engine sees the close: llama-server checks every idle connection every 10 ms
    until its own keep-alive timeout, so one left open costs it wake-ups."""
    closed_after: list[float] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        answered = loop.time()
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                closed_after.append(loop.time() - answered)
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            answered = loop.time()

    async def run() -> tuple[list[int], int]:
        limits = httpx.Limits(keepalive_expiry=0.3)
        async with server(handler) as (url, peers), httpx.AsyncClient(
                base_url=url, transport=H1Transport(limits, keep_when_quiet=True)) as http:
            for _ in range(3):  # within the expiry: one connection, kept
                assert (await http.get("/health")).text == "ok"
                await asyncio.sleep(0.1)
            still_open = len(closed_after)
            await asyncio.sleep(1.5)  # idle past it: closed by the proxy's side
        return peers, still_open

    peers, still_open = asyncio.run(run())
    assert len(peers) == 1
    assert still_open == 0
    assert len(closed_after) == 1
    assert 0.25 < closed_after[0] < 1.4  # due at 0.3 s; the margin is for a busy loop


def test_a_connection_is_kept_only_while_another_exchange_with_its_engine_runs() -> None:
    """Sequential requests each open a connection, closed when its answer ends (kept
    between them, a CPU llama-server prefilled prompts slower); one that ends while
    another runs is kept, and the next request takes it."""
    closes: list[int] = []
    slow_arrived, slow_may_answer = asyncio.Event(), asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")[1]
        while True:
            try:
                request = await read_request(reader)
            except asyncio.IncompleteReadError:
                closes.append(peer)
                return
            if request.startswith(b"GET /slow "):
                slow_arrived.set()
                await slow_may_answer.wait()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    async def run() -> tuple[list[int], list[int], list[int]]:
        async with server(handler) as (url, peers), client(url) as http:
            for _ in range(2):
                assert (await http.get("/health")).text == "ok"
            for _ in range(200):  # until the closes reach the server (2 s at most)
                if len(closes) >= 2:
                    break
                await asyncio.sleep(0.01)
            sequential, closed_then = list(peers), list(closes)
            slow = asyncio.create_task(http.get("/slow"))
            await slow_arrived.wait()
            for _ in range(2):  # while /slow runs: the first one's connection is reused
                assert (await http.get("/health")).text == "ok"
            slow_may_answer.set()
            assert (await slow).text == "ok"
            return sequential, closed_then, peers[len(sequential):]

    sequential, closed_then, during = asyncio.run(run())
    assert len(sequential) == 2
    assert closed_then == sequential
    assert len(during) == 2  # /slow's and one for both /health requests


def test_a_closed_connection_is_freed_without_the_collector() -> None:
    """Its parser calls back into it: held past the connection, each closed connection
    (one per request of a single session) would be a cycle left to the collector."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    def connections() -> int:
        return sum(type(o).__name__ == "_Connection" for o in gc.get_objects())

    async def run() -> int:
        async with server(handler) as (url, _), client(url) as http:
            for _ in range(3):  # sequential: each opens its own, closed as its answer ends
                assert (await http.get("/health")).text == "ok"
            for _ in range(100):
                await asyncio.sleep(0.01)  # until each connection's loss has arrived
            return connections()

    with collector_off():
        assert asyncio.run(run()) == 0


def test_content_length_and_until_close_bodies() -> None:
    answers = [b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
               b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end"]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while answers:
            await read_request(reader)
            writer.write(answers.pop(0))
            await writer.drain()

    async def run() -> list[tuple[int, bytes, str]]:
        out = []
        async with server(handler) as (url, _), client(url) as http:
            for _ in range(2):
                response = await http.get("/props")
                out.append((response.status_code, response.content, response.reason_phrase))
        return out

    assert asyncio.run(run()) == [(200, b"hello", "OK"), (200, b"until the end", "OK")]


def test_an_informational_answer_is_skipped() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n"
                     b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\nx-a: 1\r\n\r\n{}")
        await writer.drain()
        await asyncio.sleep(1)

    async def run() -> httpx.Response:
        async with server(handler) as (url, _), client(url) as http:
            return await http.get("/nope")

    response = asyncio.run(run())
    assert (response.status_code, response.content, response.headers["x-a"]) == (404, b"{}", "1")


def test_a_connection_closed_before_any_byte_is_the_stale_keep_alive_error() -> None:
    """What ``send_with_stale_retry`` retries on a fresh connection."""
    calls = [0]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        calls[0] += 1
        if calls[0] == 1:
            return  # closed without an answer
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    async def run() -> tuple[str, bytes]:
        async with server(handler) as (url, _), client(url) as http:
            with pytest.raises(httpx.RemoteProtocolError) as caught:
                await http.get("/health")
            calls[0] = 0
            response = await send_with_stale_retry(http, http.build_request("POST", "/x"))
            body = await response.aread()
        return str(caught.value), body

    message, body = asyncio.run(run())
    assert "without sending a response" in message
    assert body == b"ok"


def test_a_body_cut_short_is_an_incomplete_response() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()

    async def run() -> list[bytes]:
        got: list[bytes] = []
        async with server(handler) as (url, _), client(url) as http:
            response = await http.send(http.build_request("POST", "/x"), stream=True)
            with pytest.raises(httpx.RemoteProtocolError, match="incomplete"):
                await read_into(response, got)
            await response.aclose()
        return got

    assert asyncio.run(run()) == [b"data: 1\n\n"]


def test_a_reset_is_a_read_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.transport.abort()  # RST, not FIN: SO_LINGER is not needed for a fresh socket

    async def run() -> None:
        async with server(handler) as (url, _), client(url) as http:
            with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
                await http.get("/health")

    asyncio.run(run())


def test_silence_past_the_read_timeout_is_a_read_timeout_each_time() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        # within the timeout each: the timer moves on with the data
        await stream_events(writer, [b"data: x\n\n"] * 3, 0.15, end=False)
        await asyncio.sleep(5)

    async def run() -> tuple[int, float]:
        got: list[bytes] = []
        async with server(handler) as (url, _), client(url, read=0.3) as http:
            response = await http.send(http.build_request("POST", "/x"), stream=True)
            started = asyncio.get_running_loop().time()
            with pytest.raises(httpx.ReadTimeout):
                await read_into(response, got)
            elapsed = asyncio.get_running_loop().time() - started
            await response.aclose()
        return len(got), elapsed

    got, elapsed = asyncio.run(run())
    assert got == 3
    assert 0.6 < elapsed < 2.0


def test_a_large_body_is_read_with_backpressure() -> None:
    payload = bytes(range(256)) * (3 * HIGH_WATER // 256)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(payload))
        writer.write(payload)
        await writer.drain()

    async def run() -> bytes:
        async with server(handler) as (url, _), client(url) as http:
            response = await http.send(http.build_request("GET", "/big"), stream=True)
            parts = []
            async for part in response.aiter_raw():
                parts.append(part)
                await asyncio.sleep(0.01)  # a slow reader: the socket is paused meanwhile
            await response.aclose()
        return b"".join(parts)

    assert asyncio.run(run()) == payload


def test_what_it_does_not_serve_goes_to_httpx_s_transport() -> None:
    """A streamed request body (a client's, forwarded) and HEAD take the fallback."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if b"transfer-encoding: chunked" in head.lower():
            while (size := int((await reader.readline()).strip(), 16)) != 0:
                await reader.readexactly(size + 2)
            await reader.readline()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    async def body() -> AsyncIterator[bytes]:
        yield b"part one "
        yield b"part two"

    async def run() -> tuple[bytes, int]:
        async with server(handler) as (url, _), client(url) as http:
            streamed = await http.post("/x", content=body())
            head = await http.head("/x")
        return streamed.content, head.status_code

    assert asyncio.run(run()) == (b"ok", 200)


def test_an_unreachable_engine_is_a_connect_error() -> None:
    async def run() -> None:
        async with client("http://127.0.0.1:9") as http:
            with pytest.raises(httpx.ConnectError):
                await http.get("/health")

    asyncio.run(run())


def test_httpx_s_transport_is_chosen_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(engine_transport(httpx.Limits()), H1Transport)
    assert engine_transport(httpx.Limits(), http="httpx") is None
    monkeypatch.setenv("PREFIXPIN_ENGINE_HTTP", "httpx")  # the setting's environment name
    assert Settings().engine_http == "httpx"


def test_the_engine_client_keeps_no_cookie() -> None:
    """A cookie an engine sets never goes out again (on another tenant's request)."""
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            seen.append(await read_request(reader))
            writer.write(b"HTTP/1.1 200 OK\r\nset-cookie: session=tenant-a\r\n"
                         b"content-length: 2\r\n\r\nok")
            await writer.drain()

    async def run() -> int:
        async with server(handler) as (url, _), EngineClient(
                base_url=url, transport=H1Transport()) as http:
            for _ in range(2):
                await http.get("/props")
            return len(http.cookies.jar)

    assert asyncio.run(run()) == 0
    assert not any(b"cookie:" in request.lower() for request in seen)


class ChunkReader:
    """A ``BodyReader`` that hands each read's bytes to ``on_chunk``."""

    def __init__(self, on_chunk: Callable[[bytes], None]) -> None:
        self.feed = on_chunk


async def push_all(http: httpx.AsyncClient, on_chunk: Callable[[bytes], None]) -> None:
    request = http.build_request("POST", "/v1/chat/completions", content=b"{}")
    response = await http.send(request, stream=True)
    try:
        body = pushed_body(response)
        assert body is not None  # the transport names its body: httpx wrapped the stream
        await body.push(ChunkReader(on_chunk))
    finally:
        await response.aclose()


def test_a_pushed_body_goes_to_the_sink_from_the_read_itself_and_the_connection_is_reused(
        ) -> None:
    events = [b"data: %d\n\n" % i for i in range(6)]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            await read_request(reader)
            await stream_events(writer, events, 0.01)

    async def run() -> tuple[list[bytes], list[object], list[int]]:
        got: list[bytes] = []
        tasks: list[object] = []

        def sink(data: bytes) -> None:
            got.append(data)
            tasks.append(asyncio.current_task())

        async with server(handler) as (url, peers), client(url, keep_when_quiet=True) as http:
            await push_all(http, sink)
            await push_all(http, sink)
        return got, tasks, peers

    got, tasks, peers = asyncio.run(run())
    assert b"".join(got) == b"".join(events) * 2
    # Every read after the head went to the sink from the connection's callback (no task
    # woke for it); at most what came with the head was handed over by the reader's task.
    assert sum(1 for task in tasks if task is not None) <= 2
    assert len(peers) == 1


def test_a_pushed_body_times_out_only_after_the_read_timeout_of_silence() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        # 0.4 s of events, 0.05 s apart: longer than the timeout; then silence
        await stream_events(writer, [b"data: %d\n\n" % i for i in range(8)], 0.05, end=False)
        await asyncio.sleep(5)

    async def run() -> tuple[int, float]:
        got: list[bytes] = []
        async with server(handler) as (url, _), client(url, read=0.2) as http:
            started = asyncio.get_running_loop().time()
            with pytest.raises(httpx.ReadTimeout):
                await push_all(http, got.append)
            return len(b"".join(got).split(b"\n\n")) - 1, (
                asyncio.get_running_loop().time() - started)

    events, elapsed = asyncio.run(run())
    assert events == 8
    assert 0.55 <= elapsed < 2.0  # the timeout counted from the last read, not the first


def test_what_the_sink_raises_is_the_reader_s_and_the_connection_is_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            await stream_events(writer, [b"data: %d\n\n" % i for i in range(4)], 0.01)

    class Refused(Exception):
        pass

    def sink(data: bytes) -> None:
        if b"data: 2" in data:
            raise Refused

    async def run() -> list[int]:
        async with server(handler) as (url, peers), client(url) as http:
            with pytest.raises(Refused):
                await push_all(http, sink)
            assert len(await stream_chunks(http)) >= 1  # the next request: a new connection
            return peers

    assert len(asyncio.run(run())) == 2


@pytest.mark.parametrize("given", [
    [(b"accept", b"c/d"), (b"X-Client", b"v"), (b"x-client", b"w")],
    {"accept": "c/d", "x-client": "v"},
    None,
])
def test_the_engine_client_merges_headers_as_httpx_does(given: object) -> None:
    defaults = {"X-Default": "1", "Accept": "a/b"}
    ours = EngineClient(base_url="http://engine", headers=defaults)
    theirs = httpx.AsyncClient(base_url="http://engine", headers=defaults)
    built = [c.build_request("POST", "/v1/chat/completions", content=b"{}",
                             headers=given)  # type: ignore[arg-type]
             for c in (ours, theirs)]
    assert built[0].headers.raw == built[1].headers.raw


# ------------------------------------------------------------------ EngineClient.open

OPEN_HEADERS = [
    [(b"content-type", b"application/json")],
    [(b"authorization", b"Bearer client-key"), (b"content-type", b"application/json"),
     (b"x-session-id", b"s1"), (b"user-agent", b"agent/1.0")],
    [(b"Accept", b"text/event-stream"), (b"content-type", b"application/json")],
    [(b"host", b"engine.example"), (b"content-type", b"application/json")],
    [(b"content-length", b"2"), (b"content-type", b"application/json")],
]


@pytest.mark.parametrize("headers", OPEN_HEADERS)
def test_open_writes_the_request_httpx_writes(headers: list[tuple[bytes, bytes]]) -> None:
    """The request ``EngineClient.open`` writes from its parts is byte for byte the one
    httpx's client builds and sends for the same call, and the answer reads the same."""
    async def run() -> None:
        seen: list[bytes] = []

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                seen.append(await read_request(reader))
                writer.write(SSE_HEAD + chunk(b"data: {}\n\n") + b"0\r\n\r\n")
                await writer.drain()

        async with server(answer) as (url, _), EngineClient(
                base_url=url, transport=H1Transport(), headers={"x-proxy": "p"}) as http:
            target = http.build_request("POST", "/v1/chat/completions").url
            bodies = []
            for lean in (True, False):
                if lean:
                    response = await http.open("POST", target, content=b"{}",
                                               headers=headers)
                else:
                    response = await send_with_stale_retry(http, http.build_request(
                        "POST", target, content=b"{}", headers=headers))
                try:
                    bodies.append((response.status_code, response.headers.raw,
                                   await response.aread()))
                finally:
                    await response.aclose()
        assert len(seen) == 2
        assert seen[0] == seen[1]
        assert bodies[0] == bodies[1]

    asyncio.run(run())


def test_open_leaves_to_httpx_what_its_client_acts_on() -> None:
    """A hook, or the engine key on one of the proxy's own paths: httpx's own send."""
    from prefixpin.adapters.http import EngineKey

    async def run() -> None:
        seen: list[bytes] = []

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                seen.append(await read_request(reader))
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()

        async with server(answer) as (url, _), EngineClient(
                base_url=url, transport=H1Transport(), auth=EngineKey("engine-key")) as http:
            own = http.build_request("POST", "/slots/0").url
            response = await http.open("POST", own, content=b"{}", headers=[])
            await response.aclose()
            assert response.request.url == own  # httpx's: it has its request
            chat = http.build_request("POST", "/v1/chat/completions").url
            response = await http.open("POST", chat, content=b"{}", headers=[])
            await response.aclose()
        assert b"Bearer engine-key" in seen[0]
        assert b"engine-key" not in seen[1]

    asyncio.run(run())


def test_open_retries_a_stale_keep_alive_connection_once() -> None:
    """A pooled connection the engine closes on the next request without answering it
    (its keep-alive ran out as the request arrived): one retry, on a new connection."""
    async def run() -> None:
        connections = 0
        answered = 0

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections, answered
            connections += 1
            first = connections == 1
            while True:
                await read_request(reader)
                if first and answered:
                    return  # closed with the second request unanswered
                answered += 1
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()

        async with server(answer) as (url, peers), EngineClient(
                base_url=url, transport=H1Transport()) as http:
            target = http.build_request("POST", "/v1/chat/completions").url
            for _ in range(2):
                response = await http.open("POST", target, content=b"{}", headers=[])
                assert await response.aread() == b"{}"
                await response.aclose()
        assert answered == 2
        assert len(peers) == 2  # the retry's connection

    asyncio.run(run())


def test_open_tells_the_final_head_below_400_from_its_read() -> None:
    """``on_head`` hears the status from the read of the head (before ``open`` returns,
    a turn of the loop later), after any interim answer, and not an error status, whose
    body the caller reads first."""
    async def run() -> list[tuple[int, bool]]:
        answers = [b"HTTP/1.1 100 Continue\r\n\r\n" + SSE_HEAD + chunk(b"data: x\n\n")
                   + b"0\r\n\r\n",
                   b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\n{}"]

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for each in answers:
                await read_request(reader)
                writer.write(each)
                await writer.drain()

        told: list[tuple[int, bool]] = []
        opened = [False]  # whether ``open`` had returned when the head was told

        def on_head(status: int) -> None:
            told.append((status, opened[0]))

        async with server(answer) as (url, _), EngineClient(
                base_url=url, transport=H1Transport(keep_when_quiet=True)) as http:
            target = http.build_request("POST", "/v1/chat/completions").url
            for _ in answers:
                response = await http.open("POST", target, content=b"{}", headers=[],
                                           on_head=on_head)
                opened[0] = True
                await response.aread()
                await response.aclose()
                opened[0] = False
        return told

    assert asyncio.run(run()) == [(200, False)]


def head_answer(head_bytes: Callable[[asyncio.StreamWriter], Awaitable[None]],
                bounds: EngineBounds | None = None) -> BaseException | httpx.Response:
    """What reading a response whose head ``head_bytes`` writes gives: the error raised,
    or the response."""
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await head_bytes(writer)

    async def run() -> BaseException | httpx.Response:
        async with server(handler) as (url, _), client(url, bounds, read=2.0) as http:
            try:
                return await http.get("/v1/models")
            except httpx.HTTPError as exc:
                return exc

    return asyncio.run(run())


def refused_head(head_bytes: Callable[[asyncio.StreamWriter], Awaitable[None]],
                 bounds: EngineBounds | None = None) -> BaseException:
    answer = head_answer(head_bytes, bounds)
    assert isinstance(answer, BaseException), answer
    return answer


def test_an_endless_header_value_is_refused_at_the_head_bound() -> None:
    async def endless(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nx-flood: ")
        for _ in range(MAX_HEAD_BYTES // 65536 + 4):  # past the bound, a read at a time
            writer.write(b"a" * 65536)
            await writer.drain()
        await asyncio.sleep(5)

    error = refused_head(endless)
    assert isinstance(error, httpx.RemoteProtocolError)
    assert "head is over" in str(error)


def test_endless_interim_responses_are_refused() -> None:
    async def interim(writer: asyncio.StreamWriter) -> None:
        for _ in range(MAX_INTERIM_RESPONSES + 5):
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)
        await asyncio.sleep(5)

    error = refused_head(interim)
    assert isinstance(error, httpx.RemoteProtocolError)
    assert "interim" in str(error)


def test_a_head_that_trickles_in_is_a_read_timeout() -> None:
    """A byte every 0.1 s never lets the read timeout (2 s) fire; the head's own deadline
    (``--engine-head-timeout``) does."""
    async def trickle(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nx-slow: ")
        for _ in range(100):
            writer.write(b"a")
            await writer.drain()
            await asyncio.sleep(0.1)

    error = refused_head(trickle, EngineBounds(head_within_s=0.5))
    assert isinstance(error, httpx.ReadTimeout)
    assert "response head took over" in str(error)


def test_the_head_bounds_are_the_settings() -> None:
    """``--engine-head-bytes`` and ``--engine-interim-responses``: a head of 8 KiB after
    three interim responses passes the defaults and is refused under either bound."""
    async def head(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" * 3)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-big: " + b"a" * 8192
                     + b"\r\n\r\n{}")
        await writer.drain()

    answer = head_answer(head)
    assert isinstance(answer, httpx.Response)
    assert answer.status_code == 200
    error = refused_head(head, EngineBounds(head_bytes=4096))
    assert "head is over 4096 bytes" in str(error)
    error = refused_head(head, EngineBounds(interim_responses=2))
    assert "over 2 interim" in str(error)


@pytest.mark.parametrize("budget", [TURN_READ_BUDGET, 8192])
def test_flooding_engines_share_one_read_budget_per_turn_of_the_loop(budget: int) -> None:
    """Engines that write faster than the proxy reads (each read fills the buffer offered)
    read once a turn, and together ``--engine-read-share`` a turn: four floods cost the loop's
    other work no more per turn than one. Once they end, a read is offered whole again."""
    payload = b"data: " + b"x" * 250 + b"\n\n"
    body = payload * 64
    flood = chunk(body) * 160  # about 2.6 MB, as fast as the socket takes it

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + flood + b"0\r\n\r\n")
        await writer.drain()

    async def run() -> tuple[list[int], H1Transport]:
        loop = asyncio.get_running_loop()
        turn = [0]
        stopped = False

        def tick() -> None:  # once per turn of the loop
            turn[0] += 1
            if not stopped:
                loop.call_soon(tick)

        per_turn: collections.Counter[int] = collections.Counter()

        def sink(data: bytes) -> None:
            per_turn[turn[0]] += len(data)

        transport = H1Transport(bounds=EngineBounds(read_share=budget))
        async with server(handler) as (url, _), httpx.AsyncClient(
                base_url=url, transport=transport) as http:
            loop.call_soon(tick)
            await asyncio.gather(*(push_all(http, sink) for _ in range(4)))
            stopped = True
        return [per_turn[t] for t in sorted(per_turn)], transport

    reads, transport = asyncio.run(run())
    assert sum(reads) == 4 * 160 * len(body)  # every flood read whole
    # What came before each body was pushed (with its head, buffered), and each first read
    # (offered whole: not known to flood before it fills its buffer) aside, the four
    # share the budget.
    settled = sorted(reads)[: len(reads) * 95 // 100]
    assert budget < 4 * READ_SIZE  # what four whole reads a turn would be
    assert max(settled) <= budget, (max(settled), len(reads))
    assert transport.reads.floods == 0
    assert transport.reads.size == READ_SIZE
