"""How the tenant listener writes to its clients: gathered over one turn of the event loop
and sent at its end (``BatchedTransport``), and a streamed body's chunks written without an
ASGI ``send`` each (``ChunkedBodyWriter``).

A relayed event is written to its client from the engine connection's read
(``proxy.pipeline.relay.LiveStream``); left alone, each of those writes is a ``write`` syscall at
once. On one machine that also wakes the client's process once per event: the relay's
writes are spread over the turn (an event's Python runs between two of them), so a client
that reads quickly has gone back to sleep before the next one, and waking it again costs
the proxy's kernel time (``bench/results/load/PROFILE.md``).

Here a client connection's transport keeps what is written during a turn and the loop
sends every connection's bytes in one pass at the end of it (``call_soon``: after the
turn's reads have all been handled): one syscall per connection per turn (a response's
head and its first bytes, two events of one read, the last event and the chunked
terminator each share one), and the writes of a turn arrive together. What it costs is the
rest of that turn before a byte leaves, at most ``HOLD_S`` once other connections write
(a turn that plans a burst of new requests is long, and the flush queued behind its task
steps would wait for all of them): under load the turn that read an event is a few
milliseconds long; on an idle proxy it is the event's own handling.

Everything but ``write`` goes to the socket's transport as it is, after the bytes kept
(``close``, ``write_eof``: the bytes first; ``abort``: dropped with the connection; the
buffer size counts them). Bytes kept for a connection lost before the flush are dropped
(its socket is closed: writing would raise, and nobody would read them), and one
connection's failed write is reported to the loop, never in the way of the others'.
Flow control stays the socket's: its ``pause_writing`` reaches the protocol when a flush
fills it.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from typing import Any

from prefixpin.proxy.speed.uvicorn_seam import ResponseCycle

# The longest a byte is kept when the turn goes on (checked as other connections write):
# a turn that reads engine events is a few milliseconds even at hundreds of streams, one
# that plans a burst of new requests can be tens.
HOLD_S = 0.002


class WriteBatch:
    """The connections of one loop that have bytes waiting, flushed at the end of the
    loop's turn, or sooner once the first of them has waited ``HOLD_S``."""

    __slots__ = ("_scheduled", "deadline", "loop", "waiting")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        # The connections with bytes kept, in the order of their first write this turn.
        self.waiting: list[BatchedTransport] = []
        self._scheduled = False
        self.deadline = 0.0  # when the bytes kept first this turn have waited ``HOLD_S``

    def join(self, transport: BatchedTransport) -> None:
        """``transport`` has bytes to send (its first write since it was flushed)."""
        waiting = self.waiting
        if not waiting:
            if not self._scheduled:
                self._scheduled = True
                self.loop.call_soon(self._end_of_turn)
            self.deadline = time.monotonic() + HOLD_S
        elif time.monotonic() >= self.deadline:
            # A long turn (a burst of new requests, each planned in its task's step): the
            # bytes kept so far leave now, not after every step queued before the flush.
            self.flush()
            self.deadline = time.monotonic() + HOLD_S
        waiting.append(transport)

    def _end_of_turn(self) -> None:
        self._scheduled = False
        self.flush()

    def flush(self) -> None:
        waiting = self.waiting
        try:
            for transport in waiting:  # (one that writes meanwhile is appended: flushed too)
                try:
                    transport.flush()
                except Exception as exc:  # one connection's: the others' bytes still go
                    self.loop.call_exception_handler({
                        "message": "a client write failed", "exception": exc,
                        "transport": transport})
        finally:
            waiting.clear()


class BatchedTransport(asyncio.Transport):
    """A socket transport whose writes wait for the end of the loop's turn."""

    def __init__(self, transport: asyncio.Transport, batch: WriteBatch,
                 closes_later: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self._transport = transport
        self._batch = batch
        # Asked at ``close``: true when its protocol closes the socket itself, later (a
        # linger after an answer that came before the request's body had all arrived). A
        # method of the protocol, which holds this transport: held weakly, or every
        # connection would be a reference cycle left to the collector's older generations.
        self._closes_later = None if closes_later is None else weakref.WeakMethod(closes_later)
        self._kept: list[bytes] = []
        self._kept_bytes = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        kept = self._kept
        if not kept:  # this turn's first write: this connection waits for the flush
            if self._transport.is_closing():
                self._transport.write(data)  # the socket's own answer to a late write
                return
            batch = self._batch
            if batch.waiting and time.monotonic() < batch.deadline:
                batch.waiting.append(self)  # ``join``'s common case (a call per event fewer)
            else:
                batch.join(self)
        kept.append(bytes(data) if type(data) is not bytes else data)
        self._kept_bytes += len(data)

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def flush(self) -> None:
        """Send what was kept (called by the batch at the end of the turn, and before the
        socket is closed or half-closed)."""
        kept = self._kept
        if not kept:
            return
        data = kept[0] if len(kept) == 1 else b"".join(kept)
        kept.clear()  # (the same list again: not one made per connection per turn)
        self._kept_bytes = 0
        if self._transport.is_closing():
            return  # the connection went meanwhile (its loss closed the socket): nobody reads
        self._transport.write(data)

    def close(self) -> None:
        self.flush()
        closes_later = self._closes_later() if self._closes_later is not None else None
        if closes_later is not None and closes_later():
            return
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def abort(self) -> None:
        self._kept, self._kept_bytes = [], 0
        self._transport.abort()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_write_buffer_size(self) -> int:
        return self._kept_bytes + self._transport.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)


class ChunkedBodyWriter:
    """One response's body chunks, written as uvicorn's ``send`` writes them, without it.

    ``write(body)`` does what ``send({"type": "http.response.body", "body": body,
    "more_body": True})`` does on a started chunked response (the chunk's size line, the
    bytes, CRLF, to the transport), as a plain call: the relay writes one per event from
    the engine connection's read, and a coroutine made, run and finished per event, with
    its message dict and checks, was the largest part of that write's Python. It returns
    False, having written nothing, whenever ``send`` must be used instead: the response
    not started or not chunked (a HEAD, a content length), complete, the client gone, the
    socket's buffer over its high-water mark (``send`` waits for it to drain), or an empty
    body. The state it reads is the request cycle's own (uvicorn's
    ``RequestResponseCycle``), so both ways of writing stay one response. The tenant
    listener's protocol offers ``write`` in each request's scope under the relay's
    extension name (``proxy.pipeline.relay.BODY_WRITER``): the relay knows the name, never
    this class.

    It holds the cycle weakly: the cycle's scope holds the writer, and a strong reference
    back would make every request a reference cycle, its scope and events kept until the
    collector's next older generation runs instead of freed as the response ends.
    """

    __slots__ = ("_cycle",)

    def __init__(self, cycle: ResponseCycle) -> None:
        self._cycle = weakref.ref(cycle)

    def write(self, body: bytes) -> bool:
        cycle = self._cycle()
        if cycle is None:
            return False
        # A started chunked response, not complete, its client there, its socket under the
        # high-water mark: the chunk may go to the transport without ``send``. (Checked
        # inline: one call per relayed event fewer.)
        if (not body or cycle.chunked_encoding is not True or cycle.response_complete
                or cycle.disconnected or cycle.flow.write_paused):
            return False
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True
