"""A reference for the compiled relay's scanner (``scan`` in ``core/_relay.c``), written
apart from it, in plain Python and from its contract rather than its code: what a chunked
body's bytes give, cut into whole chunks, SSE events and the token shape.

The contract: the input is a chunked body from a chunk's start. Each chunk is a size line
of 1 to ``MAX_SIZE_LINE`` hex digits (no extension) and CRLF, then its data and CRLF. The
data of every whole chunk joins the *carry*; every whole event (ending at the first
``\\n\\n``) at the carry's start that is a token of the shape (the head, a JSON string's
body the relay takes, the tail, whose digits past a run's first may differ) is taken and
leaves it. The scan stops at the first thing that is not the lane's: the last chunk
("end"), a bad size line ("size"), a chunk over ``MAX_PENDING`` ("too-long"), data not
followed by CRLF ("framing"), an event not of the shape ("event"), and, after a chunk's
events, a carry over ``MAX_PENDING`` ("too-long") or holding a CR ("cr"); otherwise at the
first chunk not whole ("more").
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

MAX_SIZE_LINE = 16
MAX_PENDING = 65536

# A JSON string's body the lane takes: characters other than a quote, a backslash or a
# control character, and the two-character escapes (never \u).
_PLAIN = re.compile(r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt])+')
_HEX = frozenset(b"0123456789abcdefABCDEF")


def chunk(data: bytes) -> bytes:
    """``data`` as one HTTP/1.1 chunk."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def plain_text(body: bytes) -> bool:
    """Whether ``body`` is a JSON string's body the lane takes as a token's text."""
    try:
        text = body.decode("utf-8")  # strict: no overlong form, no surrogate, <= U+10FFFF
    except UnicodeDecodeError:
        return False
    return _PLAIN.fullmatch(text) is not None


def same_tail(seen: bytes, learned: bytes) -> bool:
    """The learned tail, but for digits after a run's first (a time that moved on)."""
    return len(seen) == len(learned) and all(
        a == b or (i > 0 and _digit(a) and _digit(b) and _digit(seen[i - 1]))
        for i, (a, b) in enumerate(zip(seen, learned, strict=True)))


def _digit(byte: int) -> bool:
    return 0x30 <= byte <= 0x39


def is_token(event: bytes, head: bytes, tail: bytes) -> bool:
    if len(event) <= len(head) + len(tail) or not event.startswith(head):
        return False
    return same_tail(event[-len(tail):], tail) and plain_text(event[len(head):-len(tail)])


@dataclass
class Scanned:
    """What a scan gives: like ``scan``'s tuple, and the state after each whole chunk."""

    consumed: int
    events: list[bytes]
    carry: bytes
    stop: str
    # (consumed, events taken, carry): at the start and after each whole chunk's events.
    checkpoints: list[tuple[int, int, bytes]] = field(default_factory=list)

    def given_back(self, consumed: int, carry: bytes, data: bytes) -> bytes:
        """The body's bytes a give-back at that point holds: the carry framed, the rest."""
        return (chunk(carry) if carry else b"") + data[consumed:]


def _size_line(rest: bytes) -> tuple[str, int, int]:
    """("ok", size, bytes of the line), or (stop, 0, 0) for a stop or "more"."""
    end = rest.find(b"\r", 0, MAX_SIZE_LINE + 1)
    if end < 0:
        return ("more" if len(rest) <= MAX_SIZE_LINE else "size"), 0, 0
    if end == 0:
        return "size", 0, 0
    if end + 1 == len(rest):
        return "more", 0, 0
    digits = rest[:end]
    if rest[end + 1:end + 2] != b"\n" or not set(digits) <= _HEX:
        return "size", 0, 0
    return "ok", int(digits, 16), end + 2


def reference_scan(data: bytes, head: bytes, tail: bytes, carry: bytes = b"") -> Scanned:
    out = Scanned(0, [], carry, "more", [(0, 0, carry)])
    while out.consumed < len(data):
        rest = data[out.consumed:]
        verdict, size, line = _size_line(rest)
        if verdict != "ok":
            out.stop = verdict
            break
        if size == 0:
            out.stop = "end"
            break
        if size > MAX_PENDING:
            out.stop = "too-long"
            break
        if len(rest) < line + size + 2:
            break
        if rest[line + size:line + size + 2] != b"\r\n":
            out.stop = "framing"
            break
        out.carry += rest[line:line + size]
        out.consumed += line + size + 2
        while (end := out.carry.find(b"\n\n")) >= 0:
            event = out.carry[:end + 2]
            if not is_token(event, head, tail):
                out.stop = "event"
                break
            out.events.append(event)
            out.carry = out.carry[end + 2:]
        if out.stop == "more" and len(out.carry) > MAX_PENDING:
            out.stop = "too-long"
        elif out.stop == "more" and b"\r" in out.carry:
            out.stop = "cr"
        out.checkpoints.append((out.consumed, len(out.events), out.carry))
        if out.stop != "more":
            break
    return out


class Scan(Protocol):
    """The compiled scanner's signature (``prefixpin.core._relay.scan``)."""

    def __call__(self, data: bytes, head: bytes, tail: bytes, carry: bytes = ...,
                 /) -> tuple[int, list[bytes], bytes, str]: ...


def scan_in_pieces(scan: Scan, data: bytes, head: bytes, tail: bytes, sizes: Iterable[int],
                   carry: bytes = b"") -> tuple[int, list[bytes], bytes, str]:
    """``scan`` fed ``data`` as a socket's reads of ``sizes`` bytes (the last gets the
    rest) would feed it: each scan gets the bytes the last one did not consume and the
    new ones, and the carry. (consumed in all, events taken, carry, stop)."""
    pending = b""
    consumed = at = 0
    events: list[bytes] = []
    stop = "more"
    pieces = [*sizes, len(data)]
    for size in pieces:
        pending += data[at:at + max(size, 1)]
        at += max(size, 1)
        taken, got, carry, stop = scan(pending, head, tail, carry)
        consumed += taken
        events += got
        pending = pending[taken:]
        if stop != "more" or at >= len(data):
            break
    return consumed, events, carry, stop
