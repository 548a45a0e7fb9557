"""A resent history parsed once: each turn of an agent session sends the whole conversation
again, byte for byte the same up to what the turn changed. ``BodyMemo.loads`` finds the
earlier body that shares the longest run of whole messages with this one, keeps those
messages as that body's parse made them, and parses only the rest (the new messages and
the fields around the array), so a follow-up's parse costs what it adds, not the length
of the conversation.

Sans-IO and exact: a message is reused only when every byte of the body up to its end is
the earlier body's, so it is what parsing this body would make of it. The reused message
objects are shared with the earlier request: nothing on the request path mutates a
client's message (each stage that changes one builds a new one).

Where the bytes are not the valid JSON this reads (a message array of something else than
objects, a parse error in a piece, the array's key given again after it: the parse keeps
the last), ``loads`` answers None and the caller parses the body whole, so every refusal
and its message stay the whole parse's.

Bodies are held per ``Wire``: a message is reused only for a body of the format that
checked it (each format has its own rules for a message), and a format that converts its
messages (Anthropic's into chat messages) may hold what each one became beside it
(``keep(converted=...)``), reused with the message.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

MIN_BYTES = 16 << 10  # a smaller body parses whole faster than it is looked up
MAX_BYTES = 32 << 20  # the bodies held, at most (their bytes; the oldest dropped first)
CANDIDATES = 8  # earlier bodies with the same first message compared, the latest first

# A JSON string (no unescaped quote can occur inside one) or a bracket: what the scan
# needs to follow the nesting. Everything else between them is skipped.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_BRACKET_OR_QUOTE = re.compile(rb'["\[\]{}]')
_STRING_REST = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*"')  # _TOKEN's string, past its quote
_SPACE = b" \t\r\n"
_UNICODE_ESCAPE = b"\\u"  # the one escape that can spell a key's letters


@dataclass(frozen=True, slots=True)
class Wire:
    """A format whose bodies are held: its name (bodies of one format never lend their
    messages to another's) and the key of its top-level array of messages."""

    name: str
    array: str

    @property
    def key(self) -> bytes:
        """The array's key as the scan meets it: a JSON string without escapes."""
        return b'"' + self.array.encode() + b'"'


CHAT = Wire("chat", "messages")  # OpenAI chat completions


@dataclass(frozen=True, slots=True)
class _Held:
    raw: bytes
    messages: tuple[Any, ...]
    ends: tuple[int, ...]  # the offset just past each message
    # what the format's conversion made of each message, where the format converts them
    converted: tuple[Any, ...] | None = None


@dataclass(frozen=True, slots=True)
class Parsed:
    """A body's parse: ``value`` as ``orjson.loads`` would make it (a fresh top-level
    object each time), and the first ``reused`` of its messages taken from an earlier
    body (checked when that body was: a caller checks only the rest)."""

    value: dict[str, Any]
    reused: int
    held: _Held  # what ``BodyMemo.keep`` holds of it
    extends: int  # the number of the body it reused, which it replaces when kept
    wire: Wire
    # what the earlier body's conversion made of each reused message (None where it
    # held none)
    converted: tuple[Any, ...] | None


@dataclass(frozen=True, slots=True)
class _Elements:
    """The elements of an array from some offset on: where each starts and ends, and the
    offset of the array's closing bracket."""

    starts: list[int]
    ends: list[int]
    close: int


_Head = tuple[str, bytes]  # a wire's name and a body's bytes to the end of its first message


class BodyMemo:
    """The parses of recent bodies with an array of messages, found again by their bytes.
    Thread-safe: a large body is parsed off the event loop."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self._by_head: dict[_Head, OrderedDict[int, _Held]] = {}
        self._order: OrderedDict[int, tuple[_Head, _Held]] = OrderedDict()
        self._bytes = 0
        self._max_bytes = max_bytes
        self._next = 0
        self._lock = threading.Lock()

    def loads(self, raw: bytes, wire: Wire = CHAT) -> Parsed | None:
        """``raw`` parsed, reusing an earlier body's messages where its bytes allow, or
        None: parse it whole (too small, not an object with a messages array, refused)."""
        if len(raw) < MIN_BYTES:
            return None
        opened = _messages_array(raw, wire.key)
        if opened is None:
            return None
        head = _first_element(raw, opened)
        if head is None:
            return None
        with self._lock:
            earlier = self._longest_shared(raw, (wire.name, raw[:head]))
        if earlier is None:
            return None
        number, held, shared = earlier
        after = held.ends[shared - 1]
        rest = _elements(raw, after)
        if rest is None or _names_again(raw, rest.close + 1, wire):
            return None
        value = _parse_around(raw, opened, after, rest, held.messages[:shared], wire.array)
        if value is None:
            return None
        messages = tuple(value[wire.array])
        converted = None if held.converted is None else held.converted[:shared]
        return Parsed(value, shared, _Held(raw, messages, (*held.ends[:shared], *rest.ends)),
                      number, wire, converted)

    def keep(self, raw: bytes, parsed: Parsed | dict[str, Any], wire: Wire = CHAT, *,
             converted: tuple[Any, ...] | None = None) -> None:
        """Hold ``raw``'s parse for the bodies of ``wire`` that resend it: a body that
        passed every check (only what was accepted is reused), as ``loads`` gave it or
        parsed whole; ``converted``: what the format's conversion made of each of its
        messages, in order."""
        if len(raw) > self._max_bytes:
            return
        if isinstance(parsed, Parsed):
            held: _Held | None = parsed.held
            wire = parsed.wire
        else:
            held = _held_of(raw, parsed, wire)
        if held is None or not held.ends:
            return
        if converted is not None and len(converted) == len(held.messages):
            held = _Held(held.raw, held.messages, held.ends, converted)
        with self._lock:
            if isinstance(parsed, Parsed):  # a session's next turn: its last one is done
                self._drop(parsed.extends)
            self._hold((wire.name, raw[:held.ends[0]]), held)

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def _longest_shared(self, raw: bytes, head: _Head) -> tuple[int, _Held, int] | None:
        """The earlier body sharing the most whole messages with ``raw`` (its number,
        itself, and how many)."""
        candidates = self._by_head.get(head)
        if not candidates:
            return None
        best: tuple[int, _Held, int] | None = None
        for number in list(reversed(candidates))[:CANDIDATES]:
            held = candidates[number]
            shared = _shared_messages(raw, held)
            if best is None or shared > best[2]:
                best = (number, held, shared)
        return best if best is not None and best[2] > 0 else None

    def _hold(self, head: _Head, held: _Held) -> None:
        number, self._next = self._next, self._next + 1
        self._by_head.setdefault(head, OrderedDict())[number] = held
        self._order[number] = (head, held)
        self._bytes += len(held.raw)
        while self._bytes > self._max_bytes:
            self._drop(next(iter(self._order)))

    def _drop(self, number: int) -> None:
        dropped = self._order.pop(number, None)
        if dropped is None:  # dropped already (the oldest, or replaced by another turn)
            return
        head, held = dropped
        self._bytes -= len(held.raw)
        candidates = self._by_head[head]
        del candidates[number]
        if not candidates:
            del self._by_head[head]


def _held_of(raw: bytes, value: dict[str, Any], wire: Wire) -> _Held | None:
    """A body parsed whole, with the offsets of its messages (one scan of its bytes)."""
    messages = value.get(wire.array)
    if len(raw) < MIN_BYTES or not isinstance(messages, list) or not messages:
        return None
    opened = _messages_array(raw, wire.key)
    elements = None if opened is None else _elements(raw, opened + 1)
    if (elements is None or len(elements.ends) != len(messages)
            or _names_again(raw, elements.close + 1, wire)):
        return None  # (the parse's messages are another array's: the last one given)
    return _Held(raw, tuple(messages), tuple(elements.ends))


def _names_again(raw: bytes, start: int, wire: Wire) -> bool:
    """Whether the top-level object's fields after its array (from ``start``, just past
    the array's bracket) give the array's key again: a parse keeps a repeated key's last
    value, so the scanned array would not be the parse's. Only a body that holds the key's
    bytes or a ``\\u`` escape after the array is scanned for it."""
    key = wire.key
    if raw.find(key, start) == -1 and raw.find(_UNICODE_ESCAPE, start) == -1:
        return False
    depth = 1
    for match in _TOKEN.finditer(raw, start):
        token = raw[match.start()]
        if token == 0x22:
            if depth == 1 and _is_key(raw, match.end()) and _spells(match.group(), wire):
                return True
            continue
        depth += 1 if token in b"[{" else -1
        if depth <= 0:
            return False
    return False


def _is_key(raw: bytes, after: int) -> bool:
    """Whether the string that ends at ``after`` names a field (a colon follows it)."""
    at = _skip_space(raw, after)
    return raw[at:at + 1] == b":"


def _spells(string: bytes, wire: Wire) -> bool:
    """Whether a JSON string token is the array's key, escapes read."""
    if string == wire.key:
        return True
    try:
        return b"\\" in string and orjson.loads(string) == wire.array
    except orjson.JSONDecodeError:
        return False


def _shared_messages(raw: bytes, held: _Held) -> int:
    """How many of ``held``'s messages ``raw`` holds byte for byte at the same offsets. A
    turn keeps all of them, or all but its last one or two: the bytes to the end of the
    third last are compared once, then each of the last two by its own bytes (comparing
    the whole prefix for each, a long history's bytes were compared three times); else a
    bisection. The earlier body is compared through a view: a slice would copy it."""
    ends, earlier = held.ends, memoryview(held.raw)
    count = len(ends)
    shared = max(count - 2, 1)
    if not raw.startswith(earlier[:ends[shared - 1]]):
        return _fewer_shared(raw, earlier, ends, shared - 1)
    while shared < count and raw.startswith(earlier[ends[shared - 1]:ends[shared]],
                                            ends[shared - 1]):
        shared += 1
    return shared


def _fewer_shared(raw: bytes, earlier: memoryview, ends: tuple[int, ...], most: int) -> int:
    """The messages shared, at most ``most`` (a bisection)."""
    low, high = 0, most  # ``low`` messages are shared, ``high + 1`` are not
    while low < high:
        middle = (low + high + 1) // 2
        if raw.startswith(earlier[:ends[middle - 1]]):
            low = middle
        else:
            high = middle - 1
    return low


def _parse_around(raw: bytes, opened: int, after: int, rest: _Elements,
                  shared: tuple[Any, ...], array: str) -> dict[str, Any] | None:
    """The body with its first messages ``shared`` (they end at ``after``) and the rest
    parsed from ``raw``."""
    tail = raw[after:rest.close].lstrip(_SPACE)
    if tail and not tail.startswith(b","):
        return None
    try:
        value = orjson.loads(raw[:opened + 1] + raw[rest.close:])
        added = orjson.loads(b"[" + tail[1:] + b"]")
    except orjson.JSONDecodeError:
        return None
    if (not isinstance(value, dict) or value.get(array) != []
            or len(added) != len(rest.ends)):
        return None
    value[array] = [*shared, *added]
    return value


def _messages_array(raw: bytes, key: bytes) -> int | None:
    """The offset of the opening bracket of the top-level array named ``key`` (quoted),
    or None."""
    depth = 0
    for match in _TOKEN.finditer(raw):
        token = raw[match.start()]
        if token == 0x22:  # a string: the key, when it is one at the top level
            if depth == 1 and match.group() == key:
                after = _skip_space(raw, match.end())
                if raw[after:after + 1] == b":":
                    bracket = _skip_space(raw, after + 1)
                    return bracket if raw[bracket:bracket + 1] == b"[" else None
            continue
        depth += 1 if token in b"[{" else -1
        if depth <= 0:
            return None
    return None


def _first_element(raw: bytes, opened: int) -> int | None:
    """The offset just past the array's first element (an object), or None. The first
    message is a system prompt of up to tens of kB, read on every request: its strings are
    skipped to their closing quotes (``_string_end``: ~15x faster than ``_TOKEN`` over a
    prompt's text)."""
    depth = 0
    at = opened + 1
    while (match := _BRACKET_OR_QUOTE.search(raw, at)) is not None:
        token = raw[match.start()]
        if token == 0x22:
            end = _string_end(raw, match.end())
            if depth == 0 or end is None:
                return None
            at = end
            continue
        depth += 1 if token in b"[{" else -1
        if depth == 0:
            return match.end()
        if depth < 0:
            return None
        at = match.end()
    return None


def _string_end(raw: bytes, start: int) -> int | None:
    """The offset just past the quote that closes the JSON string whose text starts at
    ``start``. A string without an escaped quote ends at its first quote (found at memory
    speed); one with any is read by the token scan's own pattern."""
    quote = raw.find(b'"', start)
    if quote == -1:
        return None
    if raw[quote - 1] != 0x5C:  # not after a backslash: the closing quote
        return quote + 1
    match = _STRING_REST.match(raw, start)
    return match.end() if match is not None else None


def _elements(raw: bytes, start: int) -> _Elements | None:
    """The object elements of an array from ``start`` (just past its bracket or past an
    element) to its closing bracket; None where an element is not an object or the
    array does not close."""
    depth, starts, ends = 0, [], []
    for match in _TOKEN.finditer(raw, start):
        token = raw[match.start()]
        if token == 0x22:
            if depth == 0:
                return None
            continue
        if token in b"[{":
            if depth == 0:
                if token != 0x7B:
                    return None
                starts.append(match.start())
            depth += 1
            continue
        depth -= 1
        if depth == 0:
            ends.append(match.end())
        elif depth < 0:
            return _Elements(starts, ends, match.start())
    return None


def _skip_space(raw: bytes, at: int) -> int:
    while raw[at:at + 1] and raw[at:at + 1] in _SPACE:
        at += 1
    return at
