"""The fake engine's streamed answers, as sent and reshaped: ``Reshaped`` wraps its app,
records the bytes of every streamed answer as they left (``answers``), and can rewrite
the events of the answers on their way out (``Rewrite``), as other engines and versions
shape them: CRLF line endings, comments, an event split over two writes, another delta
field, UTF-8 text. The proxy's relays must give every such event back as the engine sent it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# A rewrite of one event of a streamed answer: (the index of the token it carries, or None
# when it is no token, the event's bytes) -> the pieces to send in its place, each its own
# write (none: the event is dropped).
Rewrite = Callable[[int | None, bytes], list[bytes]]


def token_index_counter() -> Callable[[bytes], int | None]:
    """The index in its answer of each token event (a delta's ``content`` or a completion's
    ``text``, not empty) fed to it in order; None for any other event."""
    count = 0

    def index_of(event: bytes) -> int | None:
        nonlocal count
        if not event.startswith(b"data: {"):
            return None
        try:
            payload = json.loads(event[6:])
        except ValueError:
            return None
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not choices or not isinstance(choices[0], dict):
            return None
        choice = choices[0]
        text = (choice.get("delta") or {}).get("content") or choice.get("text")
        if not isinstance(text, str) or not text:
            return None
        count += 1
        return count - 1

    return index_of


class Reshaped:
    """``app`` (the fake engine's), each event of its streamed (``text/event-stream``)
    answers passed through ``rewrite`` (``None``: as is) with ``gap_s`` between the
    pieces of one event, and each streamed answer's bytes as sent recorded in
    ``answers``, one per request in order of arrival."""

    def __init__(self, app: ASGIApp, rewrite: Rewrite | None = None, *,
                 gap_s: float = 0.005) -> None:
        self.app = app
        self.rewrite = rewrite
        self.gap_s = gap_s
        self.answers: list[bytearray] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = bytearray()
        index_of = token_index_counter()
        streamed = False
        pending = b""  # an event's start that one write of the app left unfinished

        async def reshaping_send(message: Message) -> None:
            nonlocal streamed, pending
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                streamed = headers.get(b"content-type", b"").startswith(b"text/event-stream")
                if streamed:
                    self.answers.append(sent)
                await send(message)
                return
            if message["type"] != "http.response.body" or not streamed:
                await send(message)
                return
            more = bool(message.get("more_body", False))
            if self.rewrite is None:  # as the app wrote it
                sent.extend(message.get("body", b""))
                await send(message)
                return
            pending += message.get("body", b"")
            *events, pending = pending.split(b"\n\n")
            pieces: list[bytes] = []
            for event in events:
                event += b"\n\n"
                pieces += self.rewrite(index_of(event), event)
            if not more and pending:
                pieces.append(pending)
                pending = b""
            for number, piece in enumerate(pieces):
                if number:
                    await asyncio.sleep(self.gap_s)
                sent.extend(piece)
                await send({"type": "http.response.body", "body": piece,
                            "more_body": True})
            if not more:
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        await self.app(scope, receive, reshaping_send)


def crlf(first: int, last: int) -> Rewrite:
    """Tokens ``first`` to ``last`` (included) with CRLF line endings."""
    def rewrite(index: int | None, event: bytes) -> list[bytes]:
        if index is not None and first <= index <= last:
            return [event.replace(b"\n", b"\r\n")]
        return [event]
    return rewrite


def comment_before(index_wanted: int, text: bytes = b": keep-alive") -> Rewrite:
    """An SSE comment event (as an engine's keep-alive) just before token ``index_wanted``."""
    def rewrite(index: int | None, event: bytes) -> list[bytes]:
        if index == index_wanted:
            return [text + b"\n\n", event]
        return [event]
    return rewrite


def split(index_wanted: int, at: int = 20) -> Rewrite:
    """Token ``index_wanted``'s event in two writes, cut ``at`` bytes in."""
    def rewrite(index: int | None, event: bytes) -> list[bytes]:
        if index == index_wanted:
            return [event[:at], event[at:]]
        return [event]
    return rewrite


def reasoning(first: int, last: int) -> Rewrite:
    """Tokens ``first`` to ``last`` (included) as reasoning (``delta.reasoning_content``),
    as a thinking model's engine sends them."""
    def rewrite(index: int | None, event: bytes) -> list[bytes]:
        if index is not None and first <= index <= last:
            return [event.replace(b'"delta":{"content":', b'"delta":{"reasoning_content":')]
        return [event]
    return rewrite


def utf8() -> Rewrite:
    """Every JSON event's text in UTF-8, not ``\\u`` escapes (as llama-server writes it;
    the fake writes ASCII)."""
    def rewrite(index: int | None, event: bytes) -> list[bytes]:
        if not event.startswith(b"data: {"):
            return [event]
        payload = json.loads(event[6:])
        return [b"data: " + json.dumps(payload, separators=(",", ":"),
                                       ensure_ascii=False).encode() + b"\n\n"]
    return rewrite


def data_of_answer(answer: bytes) -> list[Any]:
    """The data payloads of a recorded answer's events, in order (JSON decoded, ``[DONE]``
    as is); not those of an event that did not end."""
    out: list[Any] = []
    for block in answer.replace(b"\r\n", b"\n").split(b"\n\n")[:-1]:
        for line in block.split(b"\n"):
            if line.startswith(b"data: "):
                payload = line[6:]
                out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out
