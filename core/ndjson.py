"""Newline-delimited JSON framing, sans-IO: Ollama's native stream (``application/x-ndjson``).

Bytes go in, complete lines come out, each with the exact bytes it arrived as so the relay
can forward it unchanged. Lines split on ``\\n`` only, as Ollama's Go client does
(``bufio.ScanLines``); a blank or whitespace-only line is skipped, as ollama-js skips what it
cannot parse. Also here: the keep-alive bytes Ollama's clients tolerate, the encoding of the
lines the proxy writes itself, and the fold of a stream into the one body a ``stream:
false`` client expects (Ollama's ``writeChatResponse``).

Keep-alive (``docs/ollama-wire.md`` §2): the only bytes that ollama-python, Ollama's Go
client and ollama-js all accept and never see are spaces written *before the next JSON
object* (they become the start of its line; JSON ignores leading whitespace). A blank line,
a ``:`` comment or a bare ``\\r`` breaks ollama-python (``json.loads`` per
``iter_lines``) and Go's client.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

KEEPALIVE = b" "
NDJSON_MEDIA_TYPE = "application/x-ndjson"
GO_JSON_MEDIA_TYPE = "application/json; charset=utf-8"  # what Ollama's c.JSON answers with

# Characters str.splitlines (and so httpx's iter_lines, and so ollama-python) breaks lines
# on, besides \n and \r, that JSON allows raw inside strings: written escaped, never raw.
_LINE_BREAKING = {"\x0b": "\\u000b", "\x0c": "\\u000c", "\x1c": "\\u001c", "\x1d": "\\u001d",
                  "\x1e": "\\u001e", "\x85": "\\u0085", "\u2028": "\\u2028",
                  "\u2029": "\\u2029"}
_LINE_BREAKING_TABLE = str.maketrans(_LINE_BREAKING)


@dataclass(frozen=True, slots=True)
class Line:
    raw: bytes  # the line as it arrived, with its newline
    text: str  # decoded, without the newline


class NDJSONDecoder:
    """Feed byte chunks with ``feed``; call ``flush`` at the end for a last unterminated line."""

    def __init__(self, max_line_bytes: int = 64 * 1024 * 1024) -> None:
        self._buffer = bytearray()
        self._max_line_bytes = max_line_bytes

    def feed(self, chunk: bytes) -> list[Line]:
        self._buffer += chunk
        lines: list[Line] = []
        start = 0
        buffer = self._buffer
        while (end := buffer.find(b"\n", start)) != -1:
            line = _line(bytes(buffer[start:end + 1]))
            if line is not None:
                lines.append(line)
            start = end + 1
        if start:
            del buffer[:start]
        if len(buffer) > self._max_line_bytes:
            raise ValueError(f"NDJSON line longer than {self._max_line_bytes} bytes")
        return lines

    @property
    def idle(self) -> bool:
        """No part of a line is held."""
        return not self._buffer

    def flush(self) -> list[Line]:
        """A stream whose last line lacks its newline still yields that line (with one)."""
        raw = bytes(self._buffer) + b"\n"
        self._buffer.clear()
        line = _line(raw)
        return [line] if line is not None else []


def _line(raw: bytes) -> Line | None:
    text = raw.decode("utf-8", errors="replace").rstrip("\n").rstrip("\r")
    return Line(raw, text) if text.strip() else None


def encode_line(value: Mapping[str, Any]) -> bytes:
    """One JSON object as an NDJSON line: compact, UTF-8, nothing that splits a line for
    ollama-python inside it."""
    return encode_json(value) + b"\n"


def encode_json(value: Mapping[str, Any]) -> bytes:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return text.translate(_LINE_BREAKING_TABLE).encode()


def error_line(message: str) -> bytes:
    """Ollama's own error line after the stream started (``{"error": "..."}``)."""
    return encode_line({"error": message})


# --------------------------------------------------------------------------- folding

def fold_chat(chunks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``/api/chat`` chunks as one response: the done chunk, with the content and thinking
    concatenated and the tool calls collected (Ollama's ``writeChatResponse``)."""
    folded = dict(chunks[-1])
    messages = [c["message"] for c in chunks if isinstance(c.get("message"), Mapping)]
    message: dict[str, Any] = dict(messages[-1]) if messages else {"role": "assistant"}
    message["content"] = "".join(_text(m.get("content")) for m in messages)
    thinking = "".join(_text(m.get("thinking")) for m in messages)
    if thinking:
        message["thinking"] = thinking
    else:
        message.pop("thinking", None)
    calls = [call for m in messages for call in _list(m.get("tool_calls"))]
    if calls:
        message["tool_calls"] = calls
    else:
        message.pop("tool_calls", None)
    folded["message"] = message
    _fold_logprobs(chunks, folded)
    return folded


def fold_generate(chunks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``/api/generate`` chunks as one response: ``response`` and ``thinking`` concatenated,
    in the key order of ``api.GenerateResponse``."""
    folded = dict(chunks[-1])
    response = "".join(_text(c.get("response")) for c in chunks)
    thinking = "".join(_text(c.get("thinking")) for c in chunks)
    head = {key: folded.pop(key) for key in ("model", "created_at") if key in folded}
    folded.pop("response", None)
    folded.pop("thinking", None)
    out = head | {"response": response} | ({"thinking": thinking} if thinking else {}) | folded
    _fold_logprobs(chunks, out)
    return out


def reply_message(chunks: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The assistant message a chat stream produced (what the client will send back)."""
    if not chunks:
        return None
    message = fold_chat(chunks).get("message")
    return dict(message) if isinstance(message, Mapping) else None


def _fold_logprobs(chunks: Sequence[Mapping[str, Any]], folded: dict[str, Any]) -> None:
    logprobs = [item for c in chunks for item in _list(c.get("logprobs"))]
    if logprobs:
        folded["logprobs"] = logprobs


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []
