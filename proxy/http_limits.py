"""The HTTP server's own limits: a bounded request head, and OpenAI-shaped errors for what
uvicorn rejects before the app sees it.

uvicorn's httptools parser buffers a request line and headers of any size (a header flood
grows the process without bound), and answers unparsable requests with a plain-text 400.
``BoundedHttpToolsProtocol`` refuses a head over ``MAX_HEAD_BYTES`` with a 431 and gives
both errors the body every OpenAI client can parse. Without httptools, uvicorn's h11
protocol applies the same bound (``h11_max_incomplete_event_size``).
"""

from __future__ import annotations

import json
from typing import Any

from core import compiled_relay as relay_core
from core.errors import openai_error
from proxy.client_writes import (
    BODY_WRITER,
    RELAY_CLIENT,
    BatchedTransport,
    ChunkedBodyWriter,
    RelayClient,
    WriteBatch,
)

# Agent clients send about 1 KiB of headers; nginx allows 32 KiB, Node.js 16 KiB.
MAX_HEAD_BYTES = 64 * 1024
LINGER_S = 2.0  # after a refusal, how long the rest of the request is read and dropped


def http_options(*, compiled_relay: bool = False) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config`` that put these limits in place, and no
    ``X-Forwarded-*`` rewriting of the client's address and scheme: nothing here reads
    either, and uvicorn's middleware for it is one more frame every streamed event's
    write resumes through. ``compiled_relay``: the server runs the compiled relay
    (``core.compiled_relay``) where it is built: each request's scope then carries its
    ``RelayClient``."""
    try:
        return {"http": _bounded_httptools_protocol(
            compiled_relay and relay_core.available()),
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


def _bounded_httptools_protocol(compiled_relay: bool) -> type[Any]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        """Counts the bytes of each request head (request line and headers) as they
        arrive; past ``MAX_HEAD_BYTES`` the connection gets a 431 and is closed. Its
        writes go out once per turn of the loop, and each request's scope carries a
        writer of its streamed body's chunks (``proxy.client_writes``)."""

        _write_batch: WriteBatch | None = None  # this server's, on its loop
        _compiled_relay: relay_core.CompiledRelay | None = None  # likewise, if on
        _in_head = True
        _head_bytes = 0
        _tail = b""  # the last bytes of a head so far: its end may straddle two reads
        _refused = False

        def connection_made(self, transport: Any) -> None:
            cls = type(self)
            batch = cls._write_batch
            if batch is None or batch.loop is not self.loop:
                batch = cls._write_batch = WriteBatch(self.loop)
            super().connection_made(BatchedTransport(transport, batch))

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # the answer is out; what the client still sends is dropped
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
                    return
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._in_head, self._head_bytes, self._tail = False, 0, b""
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None and cycle.scope is self.scope:  # (not an upgrade)
                extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
                extensions[BODY_WRITER] = ChunkedBodyWriter(cycle).write
                if compiled_relay:
                    extensions[RELAY_CLIENT] = RelayClient(cycle, self._relay())

        def _relay(self) -> relay_core.CompiledRelay:
            cls = type(self)
            current = cls._compiled_relay
            if current is None or current.loop is not self.loop:
                current = cls._compiled_relay = relay_core.CompiledRelay(self.loop)
            return current

        def on_message_complete(self) -> None:
            super().on_message_complete()
            # What follows on this connection is the next request head (bytes of it that
            # shared a read with this request's end are not counted: at most one read).
            self._in_head = True

        def send_400_response(self, msg: str) -> None:
            self._refuse(error_bytes(400, "Bad Request", f"invalid HTTP request: {msg}",
                                     "invalid_http"))

        def _refuse(self, response: bytes) -> None:
            """Answer, then linger: keep reading (and dropping) what the client is still
            sending for a moment, so that closing does not reset the connection before
            the client has read the answer."""
            self._refused = True
            self.transport.write(response)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)

    return BoundedHttpToolsProtocol
