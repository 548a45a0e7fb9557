from typing import Any, Literal, TypeAlias

# Why a scan stopped: "more" needs more bytes; every other gives the stream back (see
# scan_stop_t in _relay.c). scan() raises MemoryError rather than say "memory".
ScanStop: TypeAlias = Literal["more", "event", "cr", "size", "framing", "end", "too-long",
                              "memory"]

STOPS: tuple[ScanStop, ...]
MAX_PENDING: int  # bytes of a chunk, or of an event not whole yet, before "too-long"
MAX_RELAYED_HELD: int  # Relay(hold_bytes=)'s default: relayed event bytes kept until delivered
MAX_READ_PER_RUN: int  # Relay(read_per_run=)'s default: engine bytes one run() reads
# What every ready engine socket that is not flooding may read in a run, budget or not (a
# flooding one, whose last read filled what it was given, reads from the budget alone)
MIN_READ_PER_RUN: int
MAX_SIZE_LINE: int  # hex digits of a chunk's size line

class Relay:
    # read_per_run: engine bytes one run() reads past the floors of the sockets not
    # flooding (at least MIN_READ_PER_RUN); hold_bytes: relayed event bytes a stream keeps
    # before run() delivers them (at least 1). Below either, ValueError.
    def __init__(self, *, read_per_run: int = ..., hold_bytes: int = ...) -> None: ...
    def fileno(self) -> int: ...
    def adopt(self, engine_fd: int, client_fd: int, head: bytes, tail: bytes,
              hold: Any, /) -> None: ...
    # (hold, relayed, count, engine, unsent, last_read, last_write, texts): a give-back, or a
    # delivery (the stream stays adopted) where the engine's bytes are None.
    def run(self) -> list[tuple[Any, bytes, int, bytes | None, bytes, float, float, bytes]]: ...
    def reclaim(self, hold: Any, /) -> tuple[Any, bytes, int, bytes, bytes, float,
                                              float, bytes] | None: ...
    def drop(self, hold: Any, /) -> bool: ...
    def close(self) -> None: ...
    def held(self) -> int: ...

def plain_json_text(data: bytes, /) -> bool: ...

def scan(data: bytes, head: bytes, tail: bytes, carry: bytes = b"",
         /) -> tuple[int, list[bytes], bytes, ScanStop]:
    """The relay's own scanner (the one its socket loop runs) on bytes alone.

    ``data``: a chunked body from a chunk's start; ``head``, ``tail``: the token shape;
    ``carry``: the carry the previous scan returned (``b""`` at a body's start). Returns
    ``(consumed, events, carry, stop)``: the bytes of ``data`` taken (whole chunks only),
    the token events taken in order, the bytes of whole chunks not taken as events yet
    (pass them to the next scan, with ``data[consumed:]`` and what came next), and why it
    stopped. Framed as one chunk, the carry followed by ``data[consumed:]`` is the body's
    rest exactly (what the relay gives back)."""
