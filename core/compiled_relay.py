"""The compiled relay: a stream's token events moved between its two sockets in C.

Per event, the Python relay runs the loop's read callback, the HTTP parser's, the SSE
decoder, the frame, the generation's log and the client's write; the loop's own callbacks
and socket calls per event stay even with all of our Python bypassed. Once a stream's
token events have a learned shape (``adapters.openai_sse.SameShapeTokens``) and one client
reads it, the compiled relay (``core/_relay.c``) takes both sockets: the loop watches one
epoll descriptor for every adopted engine socket, and each turn one call reads them all,
writes each client's token events once, chunk-framed, and returns the streams it gives
back. It is an accelerator behind the Python relay, which stays the reference path (what
it saves, measured side by side: docs/benchmarks.md).

It gives a stream back at the first event that is not a token of its shape (the finish,
the usage, an error), at the body's end, an engine end of file or error, a failed client
write (a full one holds the stream back: the engine is not read until the client's socket
drains); Python can reclaim a stream at any moment (a second client joins, a heartbeat or
read timer fires, the client leaves). What comes back is exact (``GivenBack``): the events
relayed (the generation's log gets them then), the engine bytes not relayed (its HTTP parser
reads on from them) and the client bytes not written (its transport writes them before
anything newer). Once a stream's relayed events reach ``hold_bytes`` (``MAX_RELAYED_HELD``
unless the relay is built with another) they are delivered to its hold (``Delivered``) and
the stream stays: a flood keeps its bounded share of each turn here, in C.

Only Linux builds the extension (epoll); without it ``available()`` is False and every
stream takes the Python path, which stays complete on its own.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from prefixpin.core.errors import ProxyError

try:
    from prefixpin.core._relay import MAX_READ_PER_RUN as MAX_READ_PER_RUN
    from prefixpin.core._relay import MAX_RELAYED_HELD as MAX_RELAYED_HELD
    from prefixpin.core._relay import MIN_READ_PER_RUN as MIN_READ_PER_RUN
    from prefixpin.core._relay import Relay
except ImportError:  # not built here (no compiler, not Linux): the Python path does it all
    Relay = None  # type: ignore[assignment,misc,unused-ignore]
    # The extension's defaults and floor (core/_relay.c), for the signature alone: no
    # relay is built.
    from prefixpin.core.defaults import MAX_READ_PER_RUN as MAX_READ_PER_RUN
    from prefixpin.core.defaults import MAX_RELAYED_HELD as MAX_RELAYED_HELD
    from prefixpin.core.defaults import MIN_READ_PER_RUN as MIN_READ_PER_RUN


def available() -> bool:
    """Whether the compiled relay is importable on this install."""
    return Relay is not None


@dataclass(frozen=True, slots=True)
class GivenBack:
    """A stream the compiled relay let go. ``relayed``: the token events written to the client since
    its last hand, as the engine sent them (``count`` of them); ``engine``: the engine's
    bytes not relayed, chunk-framed from a chunk's start; ``unsent``: chunk-framed client
    bytes not written yet; ``last_read``/``last_write``: ``time.monotonic()`` of its last
    read of the engine and write to the client (the adoption's time if none); ``texts``:
    the relayed events' texts as the JSON string bodies they were, joined (one JSON
    string's body: a log that folds needs only that)."""

    relayed: bytes
    count: int
    engine: bytes
    unsent: bytes
    last_read: float
    last_write: float
    texts: bytes


@dataclass(frozen=True, slots=True)
class Delivered:
    """Token events the compiled relay wrote to a stream's client since its last hand (``count``
    of them, as the engine sent them, and ``texts`` as in ``GivenBack``), for the
    generation's log; the relay keeps the stream. ``last_write``: ``time.monotonic()`` of
    its last write to the client."""

    relayed: bytes
    count: int
    last_write: float
    texts: bytes


class Hold(Protocol):
    """What a stream is adopted with, and given back to (``proxy.pipeline.relay.StreamHold``): the
    one handle of a stream in the compiled relay, in C and in Python."""

    def given_back(self, back: GivenBack) -> None: ...

    def delivered(self, delivered: Delivered) -> None:
        """Events for the log while the relay keeps the stream; raising gives it back."""


class CompiledRelay:
    """One loop's compiled relay. ``adopt`` a stream; what it gives back reaches its ``Hold``, from
    the loop's callback (``run``) or from ``reclaim`` itself.

    ``read_per_run``: the engine bytes one turn reads, all its streams together, past what
    each ready engine socket that is not flooding may read anyway (``MIN_READ_PER_RUN``,
    which is also its least; a flooding one, whose last read filled what it was given,
    reads from this budget alone, each in turn); ``hold_bytes``: the relayed event bytes a
    stream's hold keeps before they are delivered to it (at least 1). ValueError below
    either."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *,
                 read_per_run: int = MAX_READ_PER_RUN, hold_bytes: int = MAX_RELAYED_HELD) -> None:
        if Relay is None:
            raise RuntimeError("the compiled relay's extension (core._relay) is not built")
        self.loop = loop
        self._core = Relay(read_per_run=read_per_run, hold_bytes=hold_bytes)
        self.read_per_run, self.hold_bytes = read_per_run, hold_bytes
        self._fd = self._core.fileno()
        loop.add_reader(self._fd, self.run)
        self.adopted = 0  # streams adopted so far (a stream adopted again counts again)
        self.relayed = 0  # token events the compiled relay wrote (as handed to Python so far)
        self.deliveries = 0  # relayed events handed over while a stream stayed adopted

    def adopt(self, engine_fd: int, client_fd: int, head: bytes, tail: bytes,
              hold: Hold) -> None:
        """The relay takes the stream's token events from now on: the engine socket's
        reading must be paused in the loop, and every byte written to the client so far
        must have left (the compiled relay writes to the socket itself)."""
        self._core.adopt(engine_fd, client_fd, head, tail, hold)
        self.adopted += 1

    def run(self) -> None:
        """One turn of the compiled relay (the loop's callback when its descriptor is readable)."""
        for item in self._core.run():
            self._hand_back(item)

    def reclaim(self, hold: Hold) -> bool:
        """Give the stream back now (its ``given_back`` runs before this returns); False
        when the compiled relay does not hold it."""
        item = self._core.reclaim(hold)
        if item is None:
            return False
        self._hand_back(item)
        return True

    def drop(self, hold: Hold) -> bool:
        """Forget the stream without giving anything back (its connections are closing)."""
        return bool(self._core.drop(hold))

    @property
    def held(self) -> int:
        return int(self._core.held())

    def close(self) -> None:
        self.loop.remove_reader(self._fd)
        self._core.close()

    def _hand_back(self, item: tuple[Hold, bytes, int, bytes | None, bytes, float, float, bytes]
                   ) -> None:
        hold, relayed, count, engine, unsent, last_read, last_write, texts = item
        self.relayed += count
        try:
            if engine is None:
                self.deliveries += 1
                self._deliver(hold, Delivered(relayed, count, last_write, texts))
            else:
                hold.given_back(GivenBack(relayed, count, engine, unsent, last_read, last_write,
                                          texts))
        except ProxyError:
            pass  # refused (past --max-reply-events): the stream's own path ends it, logged
        except Exception as exc:  # one stream's failure: never the other streams' turn
            self.loop.call_exception_handler({
                "message": "a stream given back by the compiled relay failed", "exception": exc})

    def _deliver(self, hold: Hold, delivered: Delivered) -> None:
        """A delivery its hold refuses gives the stream back: Python's path meets the same
        fault in its own read and ends the stream there."""
        try:
            hold.delivered(delivered)
        except Exception:
            self.reclaim(hold)
            raise
