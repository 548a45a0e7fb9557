"""Sans-IO: an SSE byte stream in, the time of the first generated token out.

The clock stops at the first event whose chunk carries generated output: a non-empty
``delta.content``, ``delta.reasoning_content`` or ``delta.tool_calls``. It ignores SSE
comments (llama-server's ``:`` pings, a proxy's heartbeats), the role-only opening chunk,
``prompt_progress`` chunks (``delta {"content": null}``), the usage-only chunk and
``[DONE]``. Nothing here reads a socket or a clock: callers pass bytes and timestamps.
"""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass, field
from typing import Any

JSON = dict[str, Any]
_EOL = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True, slots=True)
class SSEEvent:
    data: str  # the joined ``data:`` lines; empty for a comment-only event
    comment_only: bool


class SSEDecoder:
    """Bytes to events per the WHATWG event-stream rules (only ``data`` matters here)."""

    def __init__(self) -> None:
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self._data: list[str] = []
        self._saw_comment = False

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        self._pending += self._text.decode(chunk)
        events: list[SSEEvent] = []
        while True:
            line, found = self._next_line()
            if not found:
                return events
            event = self._take_line(line)
            if event is not None:
                events.append(event)

    def flush(self) -> list[SSEEvent]:
        """End of stream. Lenient: an event missing its final blank line still counts."""
        self._pending += self._text.decode(b"", final=True)
        events = [e for e in (self._take_line(self._pending), self._take_line("")) if e]
        self._pending = ""
        return events

    def _next_line(self) -> tuple[str, bool]:
        match = _EOL.search(self._pending)
        if match is None:
            return "", False
        # NOTE: a \r at the very end may be the first half of a \r\n: wait for more bytes.
        if match.group() == "\r" and match.end() == len(self._pending):
            return "", False
        line, self._pending = self._pending[: match.start()], self._pending[match.end():]
        return line, True

    def _take_line(self, line: str) -> SSEEvent | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            self._saw_comment = True
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def _dispatch(self) -> SSEEvent | None:
        if self._data:
            event = SSEEvent("\n".join(self._data), comment_only=False)
        elif self._saw_comment:
            event = SSEEvent("", comment_only=True)
        else:
            return None
        self._data, self._saw_comment = [], False
        return event


def carries_output(chunk: JSON) -> bool:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if isinstance(delta, dict) and (delta.get("content") or delta.get("reasoning_content")
                                        or delta.get("tool_calls")):
            return True
    return False


@dataclass(slots=True)
class StreamObservation:
    """What one streamed response showed, with times in seconds from the request start."""

    first_token_s: float | None = None
    first_event_s: float | None = None
    last_event_s: float | None = None
    comments: int = 0
    progress_chunks: int = 0
    usage: JSON | None = None
    timings: JSON | None = None
    error: str | None = None
    done: bool = False
    text: list[str] = field(default_factory=list)


class FirstTokenClock:
    """Feed it the response bytes with their arrival times; it keeps the observation."""

    def __init__(self, started_at: float) -> None:
        self._started_at = started_at
        self._decoder = SSEDecoder()
        self.observation = StreamObservation()

    @property
    def stopped(self) -> bool:
        return self.observation.first_token_s is not None

    def feed(self, chunk: bytes, now: float) -> None:
        for event in self._decoder.feed(chunk):
            self._observe(event, now - self._started_at)

    def close(self, now: float) -> StreamObservation:
        for event in self._decoder.flush():
            self._observe(event, now - self._started_at)
        return self.observation

    def _observe(self, event: SSEEvent, elapsed: float) -> None:
        seen = self.observation
        if event.comment_only:
            seen.comments += 1
            return
        if seen.first_event_s is None:
            seen.first_event_s = elapsed
        seen.last_event_s = elapsed
        if event.data.strip() == "[DONE]":
            seen.done = True
            return
        try:
            chunk = json.loads(event.data)
        except ValueError:
            seen.error = f"event is not JSON: {event.data[:80]!r}"
            return
        if not isinstance(chunk, dict):
            seen.error = f"event is not a JSON object: {event.data[:80]!r}"
            return
        self._record(chunk, elapsed)

    def _record(self, chunk: JSON, elapsed: float) -> None:
        seen = self.observation
        if "error" in chunk:
            seen.error = json.dumps(chunk["error"])[:300]
        if "prompt_progress" in chunk:
            seen.progress_chunks += 1
        if isinstance(chunk.get("usage"), dict):
            seen.usage = chunk["usage"]
        if isinstance(chunk.get("timings"), dict):
            seen.timings = chunk["timings"]
        if carries_output(chunk):
            if seen.first_token_s is None:
                seen.first_token_s = elapsed
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                seen.text.append(str(delta.get("content") or delta.get("reasoning_content")
                                     or ""))
