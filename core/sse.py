"""A sans-IO Server-Sent Events decoder that keeps each event's raw bytes.

Bytes go in, complete events come out; no networking here (the model is httpx-sse's
decoder). Each event keeps the exact bytes it arrived as, so the relay can forward
frames unchanged and only re-encode the few it must edit.

See: https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)  # not frozen: a frozen init costs a setattr call per field, per event
class SSEEvent:
    raw: bytes
    data: str = ""
    event: str = ""
    comments: tuple[str, ...] = field(default=())

    @property
    def is_comment_only(self) -> bool:
        return not self.data and not self.event


class SSEDecoder:
    """Feed byte chunks with ``feed``; call ``flush`` at end of stream for a trailing event."""

    def __init__(self, max_event_bytes: int = 64 * 1024 * 1024) -> None:
        self._buffer = bytearray()
        self._max_event_bytes = max_event_bytes
        self._scanned = 0  # the buffer holds no event end before this offset
        self._cr = False
        # No part of an event is held, and no CR was seen (a CR switches to the line
        # endings' general search for the rest of the stream). Kept as the buffer and the CR
        # change, not computed: it is read once per engine read (``adapters.http``).
        self.idle = True

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if self.idle and b"\r" not in chunk:
            if (data := one_data_line(chunk)) is not None:
                # The read of a token stream: one event of one data line, whole (what
                # ``_feed_whole`` and ``_parse_block`` make of it, without their calls).
                return [SSEEvent(chunk, data.decode("utf-8", errors="replace"))]
            return self._feed_whole(chunk)
        self._buffer += chunk
        events: list[SSEEvent] = []
        start = 0
        buffer = self._buffer
        # Engines end events with LF LF; CR-style endings are rare, so only pay for them
        # once a CR has actually been seen.
        self._cr = self._cr or b"\r" in chunk
        find_end = _find_event_end if self._cr else _find_lf_event_end
        # Each byte is searched once: an event arriving in many chunks costs its length,
        # not its length squared (a runaway event must not stall the event loop).
        search = self._scanned
        while (end := find_end(buffer, max(start, search))) is not None:
            stop, after = end
            events.append(_parse_block(bytes(buffer[start:stop]), bytes(buffer[start:after])))
            start = after
        if start:
            del buffer[:start]
        self.idle = not buffer and not self._cr
        self._scanned = max(0, len(buffer) - 3)  # a separator may straddle the next chunk
        if len(buffer) > self._max_event_bytes:
            raise ValueError(f"SSE event larger than {self._max_event_bytes} bytes")
        return events

    def _feed_whole(self, chunk: bytes) -> list[SSEEvent]:
        """The common read: nothing buffered, LF endings, usually whole events. They are
        cut straight from the chunk (no copy through the buffer); what follows the last
        event waits in the buffer."""
        events: list[SSEEvent] = []
        find = chunk.find
        start = 0
        while (index := find(b"\n\n", start)) != -1:
            after = index + 2
            raw = chunk[start:after] if start or after != len(chunk) else chunk
            events.append(_parse_block(raw[:-2], raw))
            start = after
        if start < len(chunk):
            rest = chunk[start:] if start else chunk
            self._buffer += rest
            self.idle = False
            self._scanned = max(0, len(rest) - 3)
            if len(rest) > self._max_event_bytes:
                raise ValueError(f"SSE event larger than {self._max_event_bytes} bytes")
        return events

    def flush(self) -> list[SSEEvent]:
        """A stream that ends without the final blank line still yields its last event."""
        if not self._buffer.strip():
            self._buffer.clear()
            self._scanned = 0
            self.idle = not self._cr
            return []
        raw = bytes(self._buffer)
        self._buffer.clear()
        self._scanned = 0
        self.idle = not self._cr
        return [_parse_block(raw, raw + b"\n\n")]


def one_data_line(chunk: bytes) -> bytes | None:
    """The data of ``chunk`` when it is exactly one event of one ``data:`` line with LF
    endings (a streamed token, mostly), else None: what ``SSEDecoder.feed`` makes the
    event's ``data`` of, undecoded, for a decoder that holds nothing (``idle``)."""
    if (chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
            and chunk.find(b"\n", 6) == len(chunk) - 2 and b"\r" not in chunk):
        return chunk[6:-2]
    return None


def _find_lf_event_end(buffer: bytearray, start: int) -> tuple[int, int] | None:
    index = buffer.find(b"\n\n", start)
    return None if index == -1 else (index, index + 2)


def _find_event_end(buffer: bytearray, start: int) -> tuple[int, int] | None:
    """Position of the blank line ending the first event: (end of block, end of separator)."""
    best: tuple[int, int] | None = None
    for separator in (b"\n\n", b"\r\n\r\n", b"\r\r"):
        index = buffer.find(separator, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, index + len(separator))
    return best


def _parse_block(block: bytes, raw: bytes) -> SSEEvent:
    if block.startswith(b"data: ") and b"\n" not in block and b"\r" not in block:
        # The common case, one data line, without the general line machinery.
        return SSEEvent(raw, block[6:].decode("utf-8", errors="replace"))
    data_lines: list[str] = []
    comments: list[str] = []
    event = ""
    text = block.decode("utf-8", errors="replace")
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if line.startswith(":"):
            comments.append(line[1:].lstrip(" "))
            continue
        name, _, value = line.partition(":")
        # NOTE: as per the SSE spec, a single leading space after the colon is dropped.
        value = value.removeprefix(" ")
        if name == "data":
            data_lines.append(value)
        elif name == "event":
            event = value
    return SSEEvent(raw=raw, data="\n".join(data_lines), event=event, comments=tuple(comments))


def encode_comment(text: str) -> bytes:
    """An SSE comment frame: every client library skips it, but it resets idle timers."""
    safe = text.replace("\r", " ").replace("\n", " ")
    return f": {safe}\n\n".encode()


def encode_data(payload: str) -> bytes:
    return b"data: " + payload.encode() + b"\n\n"
