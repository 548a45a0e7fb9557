"""The HTTP server's own limits: a bounded request head, a bounded number of connections,
deadlines for a request's head and body, and OpenAI-shaped errors for what uvicorn rejects
before the app sees it.

uvicorn's httptools parser buffers a request line and headers of any size (a header flood
grows the process without bound), and answers unparsable requests with a plain-text 400.
``BoundedHttpToolsProtocol`` refuses a head over ``MAX_HEAD_BYTES`` with a 431 and gives
both errors the body every OpenAI client can parse. Without httptools, uvicorn's h11
protocol applies the same bound (``h11_max_incomplete_event_size``).

uvicorn also keeps a connection that sends nothing, or a head or a body a byte at a time,
for as long as the client likes (it times out only idle keep-alive connections between
requests), and accepts any number of them. So each listener takes at most
``ConnectionLimits.max_connections`` (past it, a 503 and close), a request's head must
arrive within ``head_timeout_s`` of its first byte or of the connection's start, and its
body within ``body_timeout_s`` of its head (a 408 and close otherwise).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefixpin.core.defaults import MAX_BODY_CHUNKS
from prefixpin.core.errors import openai_error
from prefixpin.proxy.pipeline.relay import BODY_WRITER
from prefixpin.proxy.speed.client_writes import BatchedTransport, ChunkedBodyWriter, WriteBatch

# Agent clients send about 1 KiB of headers; nginx allows 32 KiB, Node.js 16 KiB.
MAX_HEAD_BYTES = 64 * 1024
LINGER_S = 2.0  # after a refusal, how long the rest of the request is read and dropped
# ... and how much of it: a client that keeps sending past this is not read again (it is
# reset at the linger's end), as reading a blast at line rate for two seconds would take
# the loop from every other connection.
LINGER_MAX_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int = 2048  # per listener; each is a descriptor and a protocol object
    head_timeout_s: float = 30.0  # request line and headers, from the first byte
    body_timeout_s: float = 300.0  # the whole body, from the end of the head
    max_body_chunks: int = MAX_BODY_CHUNKS
    # Told the limit each refusal hit (connections, head_timeout, body_timeout, head_size,
    # body_chunks): the metrics'.
    refused: Callable[[str], None] | None = None


def http_options(*, limits: ConnectionLimits | None = None) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config`` that put these limits in place, and no
    ``X-Forwarded-*`` rewriting of the client's address and scheme: nothing here reads
    either, and uvicorn's middleware for it is one more frame every streamed event's
    write resumes through."""
    try:
        return {"http": _bounded_httptools_protocol(limits or ConnectionLimits()),
                "proxy_headers": False}
    except ImportError:
        return {"http": "h11", "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
                "proxy_headers": False}


def error_bytes(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, with an OpenAI error body."""
    body = json.dumps(openai_error(message, "invalid_request_error", code=code)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    return head + body


class TooManyChunksError(Exception):
    """Raised from the parser's callback to stop it reading the rest of a refused body."""


def _without_next_warning(logger: logging.Logger) -> logging.Logger:
    """A child of ``logger`` (its records go to the same handlers) that drops the next
    warning: the one uvicorn logs for the parser error a refusal raises to stop the parser
    (``TooManyChunksError``: uvicorn takes it for an invalid request), which logged its
    own line."""
    dropped = False

    def keep(record: logging.LogRecord) -> bool:
        nonlocal dropped
        if dropped or record.levelno != logging.WARNING:
            return True
        dropped = True
        return False

    quiet = logging.Logger(logger.name)
    quiet.parent = logger
    quiet.addFilter(keep)
    return quiet


def _bounded_httptools_protocol(limits: ConnectionLimits) -> type[Any]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        """Counts the bytes of each request head (request line and headers) as they
        arrive; past ``MAX_HEAD_BYTES`` the connection gets a 431 and is closed. Its
        writes go out once per turn of the loop, and each request's scope carries a
        writer of its streamed body's chunks (``proxy.speed.client_writes``)."""

        _write_batch: WriteBatch | None = None  # this server's, on its loop
        _in_head = True
        _head_bytes = 0
        _tail = b""  # the last bytes of a head so far: its end may straddle two reads
        _refused = False
        _deadline: Any = None  # the head's or the body's timer (asyncio.TimerHandle)
        _body_chunks = 0
        _dropped = 0  # bytes read and dropped since the refusal
        # The request's keep-alive, set aside while its body is read (``on_headers_complete``)
        _kept_alive = False

        def connection_made(self, transport: Any) -> None:
            cls = type(self)
            batch = cls._write_batch
            if batch is None or batch.loop is not self.loop:
                batch = cls._write_batch = WriteBatch(self.loop)
            super().connection_made(BatchedTransport(transport, batch,
                                                     closes_later=self._linger_instead))
            if len(self.connections) > limits.max_connections:
                self.logger.warning("connection refused: %d open on this listener",
                                    limits.max_connections)
                self._refuse(error_bytes(503, "Service Unavailable",
                                         f"more than {limits.max_connections} connections "
                                         "are open on this listener", "too_many_connections"),
                             linger=False)
                self._count("connections")
                return
            self._arm(limits.head_timeout_s, "request head", "head_timeout")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self, seconds: float, what: str, limit: str) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expired, seconds, what, limit)

        def _count(self, limit: str) -> None:
            if limits.refused is not None:
                limits.refused(limit)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self, seconds: float, what: str, limit: str) -> None:
            self._deadline = None
            if self._refused or self.transport.is_closing():
                return
            self.logger.warning("%s not received within %.0f s: connection closed", what,
                                seconds)
            self._refuse(error_bytes(408, "Request Timeout",
                                     f"{what} not received within {seconds:g} s",
                                     "request_timeout"))
            self._count(limit)

        def data_received(self, data: bytes) -> None:
            if self._refused:  # the answer is out; what the client still sends is dropped
                self._dropped += len(data)
                if self._dropped > LINGER_MAX_BYTES:
                    self.transport.pause_reading()
                return
            if self._in_head and self._deadline is None:  # the next request's first bytes
                self._arm(limits.head_timeout_s, "request head", "head_timeout")
            if self._in_head:
                # Counted before the parser sees the bytes, up to the end of the head only:
                # a read may hold a whole request (head and a 150 kB body), or a head and
                # the start of its body; none of that body is head bytes.
                window = self._tail + data
                end = window.find(b"\r\n\r\n")
                head_part = len(data) if end < 0 else max(0, end + 4 - len(self._tail))
                self._head_bytes += head_part
                self._tail = window[-3:]
                if self._head_bytes > MAX_HEAD_BYTES:
                    self.logger.warning("request head over %d bytes refused", MAX_HEAD_BYTES)
                    self._refuse(error_bytes(
                        431, "Request Header Fields Too Large",
                        f"request line and headers exceed {MAX_HEAD_BYTES} bytes",
                        "headers_too_large"))
                    self._count("head_size")
                    return
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._in_head, self._head_bytes, self._tail = False, 0, b""
            self._body_chunks = 0
            self._arm(limits.body_timeout_s, "request body", "body_timeout")
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None and cycle.scope is self.scope:  # (not an upgrade)
                # An answer that comes before the body has all arrived says "connection:
                # close" (the connection closes after it: ``_linger_instead``), so no
                # client sends its next request on it; the body's end gives it back.
                self._kept_alive, cycle.keep_alive = cycle.keep_alive, False
                extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
                extensions[BODY_WRITER] = ChunkedBodyWriter(cycle).write

        def on_message_complete(self) -> None:
            self._disarm()  # between requests uvicorn's keep-alive timeout applies
            cycle = self.cycle
            if self._kept_alive and cycle is not None and not cycle.response_started:
                cycle.keep_alive = True
            self._kept_alive = False
            super().on_message_complete()
            # What follows on this connection is the next request head (bytes of it that
            # shared a read with this request's end are not counted: at most one read).
            self._in_head = True

        def on_chunk_header(self) -> None:
            """Each chunk of a chunked body costs the parser's callbacks, whatever its size:
            a read of one-byte chunks is tens of thousands of them, and held the loop for
            as long. Past ``max_body_chunks`` the request is refused (a 413), and the
            exception stops the parser in the middle of the read."""
            self._body_chunks += 1
            # (The body's last chunk, empty, is a chunk header too: one more is allowed,
            # and a body over the bound is refused at the header after its first too many.)
            if self._body_chunks > limits.max_body_chunks + 1:
                self.logger.warning("request body in over %d chunks refused",
                                    limits.max_body_chunks)
                self._refuse(error_bytes(
                    413, "Content Too Large",
                    f"request body sent in more than {limits.max_body_chunks} chunks",
                    "too_many_chunks"))
                self._count("body_chunks")
                # (This connection only, and only now: the refusal closes it.)
                self.logger = _without_next_warning(self.logger)
                raise TooManyChunksError

        def send_400_response(self, msg: str) -> None:
            if self._refused:  # (the parser stopped at a refusal: its answer is out)
                return
            self._refuse(error_bytes(400, "Bad Request", f"invalid HTTP request: {msg}",
                                     "invalid_http"))

        def shutdown(self) -> None:
            self._kept_alive = False  # the server is stopping: this connection closes
            super().shutdown()

        def _linger_instead(self) -> bool:
            """uvicorn closes a connection once its answer is out when the request did not
            keep it alive, as one answered before its body had all arrived did not (a 413
            past --max-body, a 401, ...). That one lingers first, as after a refusal: the
            rest of its body is not read on for a next request, whatever its length (an
            endless chunked one would keep the loop reading at line rate)."""
            if self._in_head or self._refused or self.transport.is_closing():
                return False
            self._close_after_answer()
            return True

        def _refuse(self, response: bytes, *, linger: bool = True) -> None:
            """Answer, then close (``_close_after_answer``)."""
            self.transport.write(response)
            self._close_after_answer(linger=linger)

        def _close_after_answer(self, *, linger: bool = True) -> None:
            """Half-close, then linger: keep reading (and dropping) what the client is
            still sending for a moment (up to ``LINGER_MAX_BYTES``), so that closing does
            not reset the connection before the client has read the answer (not when the
            point is to close at once)."""
            self._refused = True
            self._disarm()
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER_S if linger else 0.0, self.transport.close)

    return BoundedHttpToolsProtocol
