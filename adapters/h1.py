"""An httpx transport for plain-HTTP/1.1 engines on httptools' C parser (llhttp).

httpx's own transport reads a response through httpcore: h11, a pure-Python parser, and
an anyio cancel scope around every socket read. On a streamed answer that is one parse
and one scope per engine event, the largest share of what relaying an event cost the
proxy (``bench/results/load/PROFILE.md``). Here a connection is an asyncio protocol that
reads into its own buffer (``READ_SIZE``: a bound on one read's work) and feeds what
arrives to ``httptools.HttpResponseParser``; the body's chunks wait in a
list until the reader takes them (all those that arrived, in one piece), and a read
timeout is one timer per connection, re-armed only when it fires early, not a timer per
read.

Only what the proxy sends takes this path: ``http://`` requests whose body is already
bytes (the generation requests, probes, slot actions). Everything else (a streamed
request body, ``https``, ``HEAD``, an upgrade) goes to the ``fallback`` transport,
httpx's own. Errors are httpx's, as its transport raises them: a connection closed
before any response byte is ``RemoteProtocolError("Server disconnected without sending
a response.")`` (``adapters.http.send_with_stale_retry`` retries it), a reset is
``ReadError``, a body cut short is ``RemoteProtocolError`` ("incomplete"), a read past
the timeout ``ReadTimeout``. Without httptools the proxy keeps httpx's transport
(``engine_transport``); ``PREFIXPIN_ENGINE_HTTP=httpx`` chooses it anyway.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import httpx

from prefixpin.core.defaults import HEAD_WITHIN_S as HEAD_WITHIN_S
from prefixpin.core.defaults import MAX_HEAD_BYTES as MAX_HEAD_BYTES
from prefixpin.core.defaults import MAX_INTERIM_RESPONSES as MAX_INTERIM_RESPONSES
from prefixpin.core.defaults import MIN_READ as MIN_READ
from prefixpin.core.defaults import TURN_READ_BUDGET as TURN_READ_BUDGET

try:
    import httptools
except ImportError:  # pragma: no cover - a platform without the wheel
    httptools = None  # type: ignore[assignment]

PUSHED_BODY = "prefixpin.pushed_body"  # the response extension holding a ``_Body``
HIGH_WATER = 1 << 20  # unread body bytes past which the socket stops being read
# An engine that writes faster than the proxy relays must not keep the loop (every other
# stream) in its reads. A pushed body's read that fills the buffer offered (more is
# waiting: the engine floods) is its connection's last of the turn; it reads again in the
# next one. The connections flooding at once split ``EngineBounds.read_share``
# (``ReadShare``), so ten floods cost the other streams no more per turn than one. A
# streamed token is a few hundred bytes, and an engine generating hundreds of tokens a
# second writes a few kilobytes a turn: only a flood fills even ``MIN_READ``.
READ_SIZE = 16 * 1024
RELAYED_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE"})
_NO_BODY_STATUS = frozenset({204, 304})


@dataclass(frozen=True, slots=True)
class EngineBounds:
    """What one engine connection may make the proxy hold or wait for (the settings
    ``--engine-head-bytes``, ``--engine-interim-responses``, ``--engine-head-timeout``,
    ``--engine-read-share``)."""

    head_bytes: int = MAX_HEAD_BYTES
    interim_responses: int = MAX_INTERIM_RESPONSES
    head_within_s: float = HEAD_WITHIN_S
    read_share: int = TURN_READ_BUDGET  # per turn of the loop, the flooding ones together


def engine_transport(limits: httpx.Limits, *, http: str = "httptools",
                     bounds: EngineBounds | None = None) -> httpx.AsyncBaseTransport | None:
    """The transport for an engine URL: this one when httptools is there and ``http``
    (``Settings.engine_http``) asks for it, else None (httpx's own)."""
    if httptools is None or http == "httpx":
        return None
    return H1Transport(limits, bounds=bounds)


class ReadShare:
    """The read each flooding engine connection of one transport is offered per turn:
    ``budget`` split between those flooding now, within [``MIN_READ``, ``READ_SIZE``]."""

    def __init__(self, budget: int = TURN_READ_BUDGET) -> None:
        self._flooding: set[_Connection] = set()
        self._budget = budget
        self.size = READ_SIZE

    def flooding(self, connection: _Connection) -> None:
        self._flooding.add(connection)
        self._resize()

    def calm(self, connection: _Connection) -> None:
        if connection in self._flooding:
            self._flooding.discard(connection)
            self._resize()

    @property
    def floods(self) -> int:
        return len(self._flooding)

    def _resize(self) -> None:
        if not self._flooding:
            self.size = READ_SIZE
            return
        share = self._budget // len(self._flooding)
        self.size = max(MIN_READ, min(READ_SIZE, share))


class H1Transport(httpx.AsyncBaseTransport):
    def __init__(self, limits: httpx.Limits | None = None,
                 fallback: httpx.AsyncBaseTransport | None = None, *,
                 bounds: EngineBounds | None = None, keep_when_quiet: bool = False) -> None:
        """``keep_when_quiet``: keep a connection for the next request also when it ended
        the only exchange running with its engine (httpx's rule). Off, such a connection
        closes (see ``_release``)."""
        limits = limits or httpx.Limits()
        self.bounds = bounds = bounds or EngineBounds()
        self.reads = ReadShare(bounds.read_share)
        self._max_idle = limits.max_keepalive_connections
        self._expiry = limits.keepalive_expiry
        self._fallback = fallback or httpx.AsyncHTTPTransport(limits=limits)
        # Per engine address, oldest first (a request takes the newest).
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._n_idle = 0
        # Per engine address, the exchanges begun and not yet ended.
        self._running: dict[tuple[str, int], int] = {}
        self._keep_when_quiet = keep_when_quiet
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    def _serves(self, request: httpx.Request) -> bool:
        return (request.url.scheme == "http" and request.method in RELAYED_METHODS
                and isinstance(request.stream, httpx.ByteStream)
                and "upgrade" not in request.headers)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not self._serves(request):
            return await self._fallback.handle_async_request(request)
        timeouts: dict[str, float | None] = request.extensions.get("timeout") or {}
        return await self.exchange(request.method, request.url, request.headers.raw,
                                   request.content, timeouts, request)

    async def exchange(self, method: str, url: httpx.URL, headers: list[tuple[bytes, bytes]],
                       content: bytes, timeouts: dict[str, float | None],
                       request: httpx.Request | None = None, *,
                       on_head: Callable[[int], None] | None = None) -> httpx.Response:
        """The request from its parts (a plain-HTTP URL; ``headers`` as they go on the
        wire, Host and Content-Length included), its response with the body to stream.
        ``request``: the httpx request it is, named by the errors (none for
        ``adapters.http.EngineClient.open``, which sends without one); ``on_head``: told a
        final status below 400 from the read of the head (``UpstreamCall.on_head``)."""
        if self._closed:
            raise RuntimeError("the transport is closed")
        key = (url.host, url.port or 80)
        connection = self._take_idle(key)
        if connection is None:
            connection = await _connect(key, timeouts.get("connect"), request, self.reads,
                                        self.bounds)
        self._running[key] = self._running.get(key, 0) + 1
        try:
            connection.send(method, url.raw_path, headers, content, request)
            connection.on_head = on_head
            if connection.write_paused:
                await connection.drain(timeouts.get("write"), request)
            await connection.head(timeouts.get("read"))
        except BaseException:
            self._ended(key)
            connection.close()
            raise
        body = _Body(self, key, connection, timeouts.get("read"))
        # The body under the name ``adapters.http.pushed_body`` finds it by: httpx wraps
        # ``stream`` in its own (a generator per read) before anyone reads it.
        return httpx.Response(
            connection.status, headers=connection.headers, stream=body,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": connection.reason,
                        PUSHED_BODY: body})

    def _take_idle(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            self._n_idle -= 1
            if connection.reusable(now, self._expiry):
                return connection
            connection.close()
        return None

    def _ended(self, key: tuple[str, int]) -> None:
        self._running[key] -= 1

    def _release(self, key: tuple[str, int], connection: _Connection) -> None:
        """Keep ``connection`` for the next request, or close it. It is kept when it ends
        while another exchange with the engine runs (where a connection is what the next
        one saves), then until taken or ``keepalive_expiry`` (``_close_expired``); one that
        ends the only exchange closes, so sequential requests each open their own. Why: a
        CPU llama-server sharing its cores prefilled prompts more slowly when the proxy kept
        its connections between sequential requests (docs/benchmarks.md, ``bench/long.py``),
        and a new loopback connection is a fraction of a millisecond."""
        quiet = not self._running.get(key) and not self._keep_when_quiet
        if quiet or self._closed or not connection.reusable(time.monotonic(), None) or (
                self._max_idle is not None and self._n_idle >= self._max_idle):
            connection.close()
            return
        connection.idle_since = time.monotonic()
        self._idle.setdefault(key, []).append(connection)
        self._n_idle += 1
        if self._sweep is None and self._expiry is not None:
            self._sweep = asyncio.get_running_loop().call_later(self._expiry,
                                                                 self._close_expired)

    def _close_expired(self) -> None:
        """Close the connections idle for ``keepalive_expiry``, not only skip them when one
        is next taken: the engine's side of an idle connection is not free (llama-server
        checks each one every 10 ms until its own keep-alive timeout)."""
        self._sweep = None
        assert self._expiry is not None
        now = time.monotonic()
        next_due: float | None = None
        for idle in self._idle.values():
            while idle and now - idle[0].idle_since >= self._expiry:
                idle.pop(0).close()
                self._n_idle -= 1
            if idle:
                due = idle[0].idle_since + self._expiry - now
                next_due = due if next_due is None else min(next_due, due)
        if next_due is not None:
            self._sweep = asyncio.get_running_loop().call_later(next_due, self._close_expired)

    async def aclose(self) -> None:
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
        self._n_idle = 0
        await self._fallback.aclose()
        await asyncio.sleep(0)  # a turn of the loop: the closed sockets close now


async def _connect(key: tuple[str, int], timeout_s: float | None,
                   request: httpx.Request | None, reads: ReadShare,
                   bounds: EngineBounds) -> _Connection:
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout_s):
            _, connection = await loop.create_connection(
                lambda: _Connection(loop, reads, bounds), *key)
    except TimeoutError as exc:
        raise httpx.ConnectTimeout("connect timed out", request=request) from exc
    except OSError as exc:
        raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from exc
    return connection


class _Gone:
    """The parser callbacks of a connection that is gone: none."""


class _Connection(asyncio.BufferedProtocol):
    """One keep-alive connection to the engine, one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, reads: ReadShare,
                 bounds: EngineBounds) -> None:
        self._loop = loop
        self._read_buffer = memoryview(bytearray(READ_SIZE))
        self._reads = reads
        self._bounds = bounds
        self._offered = READ_SIZE  # the last read's buffer size
        self._filled = False  # the last read filled it
        self._flooding = False  # counted in ``reads``
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._drain_waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._deadline = 0.0
        self._timeout_s: float | None = None
        # While set (``_Body.push``: its reader's ``feed``), the body's bytes go to it from
        # the parser's callback as they are read, and nobody is woken until the response ends.
        self.sink: Callable[[bytes], None] | None = None
        self._in_request = False
        self._lost = False
        self._reading_paused = False
        self._turn_paused = False  # a flooding read was this turn's last
        self._request: httpx.Request | None = None
        self.write_paused = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self._buffered = 0
        self._received = 0
        self._head_done = False
        self._head_bytes = 0
        self._head_started = 0.0  # loop time of the head's first byte; 0: none yet
        self._interim = 0
        self._informational = False
        self._framed = False  # content-length or chunked: the body's end is known
        self.complete = False
        self.keep_alive = False
        self.error: Exception | None = None
        self.sink_error: Exception | None = None
        self.on_head: Callable[[int], None] | None = None  # (``H1Transport.exchange``)
        self._calm()

    # ---------------------------------------------------------------- the request

    def reusable(self, now: float, expiry: float | None) -> bool:
        return (not self._lost and self.error is None and self._transport is not None
                and not self._transport.is_closing()
                and (expiry is None or now - self.idle_since < expiry))

    def send(self, method: str, raw_path: bytes, headers: list[tuple[bytes, bytes]],
             content: bytes, request: httpx.Request | None) -> None:
        assert self._transport is not None
        self._reset()
        self._in_request = True
        self._request = request
        parts = [method.encode(), b" ", raw_path, b" HTTP/1.1\r\n"]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts.append(b"\r\n")
        if content:
            parts.append(content)
        self._transport.write(b"".join(parts))

    async def drain(self, timeout_s: float | None, request: httpx.Request | None) -> None:
        while self.write_paused and not self._lost:
            waiter = self._drain_waiter = self._loop.create_future()
            try:
                async with asyncio.timeout(timeout_s):
                    await waiter
            except TimeoutError as exc:
                raise httpx.WriteTimeout("write timed out", request=request) from exc
        if self._lost and self.error is not None and not self._received:
            raise self.error

    async def head(self, timeout_s: float | None) -> None:
        while not self._head_done:
            if self.error is not None:
                raise self.error
            within_s = self._bounds.head_within_s
            if self._head_started and self._loop.time() - self._head_started > within_s:
                slow = httpx.ReadTimeout(f"the engine's response head took over "
                                         f"{within_s:g} s from its first byte",
                                         request=self._request_or_none())
                self._fail(slow)
                raise slow
            await self.wait(timeout_s)

    # ---------------------------------------------------------------- reading

    async def wait(self, timeout_s: float | None) -> None:
        """Until something arrives (or the connection ends); ``ReadTimeout`` after
        ``timeout_s`` seconds of nothing."""
        waiter = self._waiter = self._loop.create_future()
        self._timeout_s = timeout_s
        if timeout_s is not None:
            self._deadline = deadline = self._loop.time() + timeout_s
            if self._timer is None or self._timer_at > deadline:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer_at = deadline
                self._timer = self._loop.call_at(deadline, self._on_timer)
        else:
            self._deadline = float("inf")
        try:
            await waiter
        finally:
            self._waiter = None

    def _on_timer(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # nobody waits: the next wait arms it again
        if self._loop.time() >= self._deadline:
            waiter.set_exception(httpx.ReadTimeout("read timed out",
                                                   request=self._request_or_none()))
        elif self._deadline != float("inf"):
            self._timer_at = self._deadline
            self._timer = self._loop.call_at(self._deadline, self._on_timer)

    def take(self) -> bytes:
        """Every body chunk that arrived since the last take, in one piece."""
        chunks, self.chunks = self.chunks, []
        self._buffered = 0
        if self._reading_paused and not self._lost:
            assert self._transport is not None
            self._transport.resume_reading()
        self._reading_paused = False
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def close(self) -> None:
        self._in_request = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._transport is not None and not self._lost:
            self._transport.close()
        self._lost = True

    def finish(self) -> None:
        """The response was read to its end: the connection may serve the next one."""
        self._in_request = False
        self._request = None  # an idle connection holds no request body
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    # ---------------------------------------------------------------- asyncio.BufferedProtocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def get_buffer(self, sizehint: int) -> memoryview:
        size = self._reads.size if self._flooding else READ_SIZE
        self._offered = size
        return self._read_buffer if size == READ_SIZE else self._read_buffer[:size]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled = nbytes >= self._offered
        # The parser reads a view of the buffer as it reads bytes (what it hands on, a
        # body chunk, a header, is its own copy): no copy of the read is made for it.
        self.data_received(self._read_buffer[:nbytes])

    def data_received(self, data: bytes | memoryview) -> None:
        if not self._in_request or self.complete:
            self._broken()  # bytes nobody asked for: never reuse this connection
            return
        self._received += len(data)
        if not self._head_done:
            if not self._head_started:
                self._head_started = self._loop.time()
            self._head_bytes += len(data)  # a body read with the head's end counts: one read
            if self._head_bytes > self._bounds.head_bytes:
                self._fail(httpx.RemoteProtocolError(
                    f"the engine's response head is over {self._bounds.head_bytes} bytes",
                    request=self._request_or_none()))
                self._wake()
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(httpx.RemoteProtocolError("engine switched protocols",
                                                 request=self._request_or_none()))
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"invalid HTTP response: {exc}",
                                                 request=self._request_or_none()))
        if self.sink is not None and not self.complete and self.error is None:
            # The body went to the sink from the parser's callback (``on_body``: once per
            # relayed event); the reader wakes only when the response ended or failed, or
            # the sink raised (its error is the reader's: the sink is gone then).
            if self._timeout_s is not None:  # the silence the timeout measures restarts
                self._deadline = self._loop.time() + self._timeout_s
            if self._filled:
                self._flooded()
            elif self._flooding:
                self._calm()
            return
        if self._buffered > HIGH_WATER and not self._reading_paused and not self._lost:
            assert self._transport is not None
            self._transport.pause_reading()
            self._reading_paused = True
        self._wake()

    def _flooded(self) -> None:
        """A read that filled its buffer: this connection's last of the turn."""
        if not self._flooding:
            self._flooding = True
            self._reads.flooding(self)
        if not self._turn_paused and not self._lost:
            assert self._transport is not None
            self._transport.pause_reading()
            self._turn_paused = True
            self._loop.call_soon(self._next_turn)

    def _calm(self) -> None:
        if self._flooding:
            self._flooding = False
            self._reads.calm(self)

    def _next_turn(self) -> None:
        if not self._turn_paused:
            return
        self._turn_paused = False
        # Not while the reader is behind: it resumes it when it is done.
        if not self._lost and self._transport is not None and not self._reading_paused:
            self._transport.resume_reading()

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._calm()
        if self._in_request and not self.complete and self.error is None:
            request = self._request_or_none()
            if exc is not None and not self._received:
                self.error = httpx.ReadError(str(exc) or type(exc).__name__, request=request)
            elif not self._received:
                self.error = httpx.RemoteProtocolError(
                    "Server disconnected without sending a response.", request=request)
            elif self._head_done and not self._framed and self.status not in _NO_BODY_STATUS:
                self.complete = True  # a body that ends with the connection
                self.keep_alive = False
            elif exc is not None:
                self.error = httpx.ReadError(str(exc) or type(exc).__name__, request=request)
            else:
                self.error = httpx.RemoteProtocolError(
                    "peer closed connection without sending complete message body: "
                    "incomplete response", request=request)
        self._wake()
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)
        # The parser calls back into this connection, which holds it: a reference cycle per
        # connection (its read buffer too) left to the collector, and a request of a single
        # session opens and closes one. Nothing feeds it once the connection is gone.
        self._parser = httptools.HttpResponseParser(_Gone())

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    # ---------------------------------------------------------------- parser callbacks

    def on_status(self, status: bytes) -> None:
        if not self.complete:
            self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._informational or self.complete:
            return
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.complete or self.error is not None:  # (refused: a head that follows in the
            return  # same read is not the answer)
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # 100 Continue and the like: the answer follows
            self._informational = True
            self.headers = []
            self.reason = b""
            self._interim += 1
            if self._interim > self._bounds.interim_responses:
                self._fail(httpx.RemoteProtocolError(
                    f"the engine sent over {self._bounds.interim_responses} interim (1xx) "
                    "responses",
                    request=self._request_or_none()))
            return
        self.status = status
        self._head_done = True
        for name, value in self.headers:
            lower = name.lower()
            if lower == b"content-length" or (
                    lower == b"transfer-encoding" and b"chunked" in value.lower()):
                self._framed = True
        if self.status in _NO_BODY_STATUS:
            self._framed = True
        if (on_head := self.on_head) is not None and status < 400:
            on_head(status)

    def on_body(self, body: bytes) -> None:
        if self.complete:
            return  # a second response nobody asked for (closed below)
        if (sink := self.sink) is not None:
            try:
                sink(body)
            except Exception as exc:  # the reader's to raise; nothing more goes to it
                self.sink, self.sink_error = None, exc
            return
        self.chunks.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        if self.complete:
            self.keep_alive = False  # a second response nobody asked for
            return
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()
        self._calm()

    # ---------------------------------------------------------------- helpers

    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        self._broken()

    def _broken(self) -> None:
        if self.error is None and self._in_request and not self.complete:
            self.error = httpx.RemoteProtocolError("engine sent bytes after its response",
                                                   request=self._request_or_none())
        if self._transport is not None and not self._lost:
            self._transport.close()
        self._lost = True

    def _request_or_none(self) -> Any:
        return self._request

class BodyReader(Protocol):
    """What a pushed body hands its reads to (``_Body.push``), from the read itself."""

    def feed(self, chunk: bytes) -> None:
        """The body's bytes of one read (one parser callback), in order."""
        ...


class _Body(httpx.AsyncByteStream):
    """A response's body: every chunk that arrived since the last read, in one piece."""

    def __init__(self, pool: H1Transport, key: tuple[str, int], connection: _Connection,
                 timeout_s: float | None) -> None:
        self._pool = pool
        self._key = key
        self._connection: _Connection | None = connection
        self._timeout = timeout_s

    async def __aiter__(self) -> AsyncIterator[bytes]:
        connection = self._connection
        if connection is None:
            return
        while True:
            if connection.chunks:
                yield connection.take()
                continue
            if connection.complete:
                return
            if connection.error is not None:
                raise connection.error
            await connection.wait(self._timeout)

    async def push(self, reader: BodyReader) -> None:
        """Every chunk of the body to ``reader`` as it arrives, called from the connection's
        read itself: no task wakes up per read (``__aiter__`` wakes its reader for each),
        only at the end. Raises what the connection or ``reader`` raised; ``ReadTimeout``
        after the timeout with nothing read."""
        connection = self._connection
        if connection is None:
            return
        if connection.chunks:  # what arrived before the reader was there
            reader.feed(connection.take())
        connection.sink = reader.feed
        try:
            while True:
                if connection.sink_error is not None:
                    raise connection.sink_error
                if connection.complete:
                    return
                if connection.error is not None:
                    raise connection.error
                await connection.wait(self._timeout)
        finally:
            connection.sink = None

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is None:
            return
        self._pool._ended(self._key)
        if connection.complete and connection.keep_alive and not connection.chunks:
            connection.finish()
            self._pool._release(self._key, connection)
        else:
            connection.close()
            await asyncio.sleep(0)  # a turn of the loop: its socket closes now
