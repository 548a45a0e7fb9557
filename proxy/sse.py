"""A sans-IO Server-Sent Events decoder that keeps each event's raw bytes.

Bytes go in, complete events come out; no networking here (the model is httpx-sse's
decoder). Each event keeps the exact bytes it arrived as, so the relay can forward
frames unchanged and only re-encode the few it must edit.

See: https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
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

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        self._buffer += chunk
        events: list[SSEEvent] = []
        while (end := _find_event_end(self._buffer)) is not None:
            stop, after = end
            raw = bytes(self._buffer[:after])
            block = bytes(self._buffer[:stop])
            del self._buffer[:after]
            events.append(_parse_block(block, raw))
        if len(self._buffer) > self._max_event_bytes:
            raise ValueError(f"SSE event larger than {self._max_event_bytes} bytes")
        return events

    def flush(self) -> list[SSEEvent]:
        """A stream that ends without the final blank line still yields its last event."""
        if not self._buffer.strip():
            self._buffer.clear()
            return []
        raw = bytes(self._buffer)
        self._buffer.clear()
        return [_parse_block(raw, raw + b"\n\n")]


def _find_event_end(buffer: bytearray) -> tuple[int, int] | None:
    """Position of the blank line ending the first event: (end of block, end of separator)."""
    best: tuple[int, int] | None = None
    for separator in (b"\n\n", b"\r\n\r\n", b"\r\r"):
        index = buffer.find(separator)
        if index != -1 and (best is None or index < best[0]):
            best = (index, index + len(separator))
    return best


def _parse_block(block: bytes, raw: bytes) -> SSEEvent:
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
