"""Bytes decide: does an incoming history extend a session's committed history? (sans-IO)

A session's committed history is what the proxy forwarded for its last completed request:
the messages and the request fields that shape the rendered prompt. It ends where that
prompt ended (before the generated tokens). An incoming request *extends* it when its
first ``n`` messages equal the ``n`` committed ones exactly and it adds at least one; an
identical resend is reported as such. Anything else diverges, and the verdict names where
and, as far as it can tell, why (the cause classes are bounded: they are metric labels).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import blake3
import orjson

from prefixpin.proxy.session.resent import PrefixMemo

# Request fields that change the prompt a chat template renders (tools go into the system
# turn, kwargs switch template branches) or the model that holds the cache. The last ones
# are Ollama's native fields (``think`` switches template branches; ``/api/generate``
# renders ``system``, ``template``, ``suffix``, ``images`` and ``context`` into the prompt).
SHAPE_FIELDS = ("model", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                "reasoning_effort", "reasoning_format", "functions",
                "think", "system", "template", "raw", "suffix", "images", "context")

# What a committed history keeps of each message: the keys a chat template renders (and
# Ollama's native ones: ``thinking``, ``images``, ``tool_name``), and the reasoning fields
# history repair restores. Anything else in a message never reaches the prompt, and is
# not kept: a client's 4 MiB junk key would otherwise live on in every session it sent.
RENDERED_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id",
                           "tool_name", "reasoning_content", "thinking", "reasoning",
                           "images"})
_CALL_KEYS = frozenset({"id", "type", "index", "function"})
_FUNCTION_KEYS = frozenset({"name", "arguments", "index"})


def rendered(message: Any) -> Any:
    """The part of a message the prompt is made of (the message itself when that is all
    of it): unknown keys dropped, and those of its tool calls. Not a mapping: as is."""
    if not isinstance(message, Mapping):
        return message
    calls = message.get("tool_calls")
    kept_calls = _rendered_calls(calls) if isinstance(calls, list) else calls
    if kept_calls is calls and message.keys() <= RENDERED_KEYS:
        return message
    out = {k: v for k, v in message.items() if k in RENDERED_KEYS}
    if "tool_calls" in out:
        out["tool_calls"] = kept_calls
    return out


def _rendered_calls(calls: list[Any]) -> list[Any]:
    def call_of(call: Any) -> Any:
        if not isinstance(call, Mapping):
            return call
        function = call.get("function")
        if isinstance(function, Mapping) and not function.keys() <= _FUNCTION_KEYS:
            function = {k: v for k, v in function.items() if k in _FUNCTION_KEYS}
        elif call.keys() <= _CALL_KEYS:
            return call
        out = {k: v for k, v in call.items() if k in _CALL_KEYS}
        if "function" in out:
            out["function"] = function
        return out

    kept = [call_of(c) for c in calls]
    return calls if all(a is b for a, b in zip(kept, calls, strict=True)) else kept


Cause = Literal["reasoning_stripped", "tool_result_trimmed", "tool_args_reserialized",
                "window_moved", "system_changed", "tools_changed", "edited", "new_turn_only",
                "shorter", "none"]


def canonical_bytes(value: Any) -> bytes:
    """Canonical JSON: sorted keys, no spaces. ``true``, ``1`` and ``1.0`` stay distinct.

    orjson is ~30x faster than the standard library here, which matters on the request
    path (a 64-message, 120 kB history is digested on every request); integers beyond
    64 bits, which orjson refuses, fall back to the standard library.
    """
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return json.dumps(value, sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False).encode()


def canonical(value: Any) -> str:
    return canonical_bytes(value).decode()


def digest(value: Any) -> bytes:
    return _digest_of(canonical_bytes(value))


def _digest_of(data: bytes) -> bytes:
    return blake3.blake3(data).digest(length=16)


MEMO_BYTES = 64 << 20  # the canonical bytes a DigestMemo holds, at most
MEMO_EDGE = 48  # the bytes of each end of a message that key it in the memo
MEMO_OBJECTS = 1 << 14  # the message objects a DigestMemo knows by identity, at most


class DigestMemo:
    """The digests of the messages of recent requests, found again by their canonical
    bytes: every turn of a session resends its whole history, and only the messages it
    adds need hashing (a 347-message, 600 kB history: 0.77 ms hashed message by message,
    0.33 ms found here, where each message's canonical bytes are still made and compared).
    Keyed by each message's length and edges, and confirmed by its whole bytes; the least
    recently used dropped first, beyond ``max_bytes``.

    A message object seen before is found by identity, without its bytes: a resent
    history's messages are the earlier body's own objects
    (``proxy.pipeline.body_memo``), and no stage mutates a client's message."""

    def __init__(self, max_bytes: int = MEMO_BYTES, max_objects: int = MEMO_OBJECTS) -> None:
        self._held: OrderedDict[tuple[int, bytes, bytes], tuple[bytes, bytes]] = OrderedDict()
        self._bytes = 0
        self._max_bytes = max_bytes
        # id -> (the object, kept alive so that its id is not reused; its digest; its
        # canonical size): at most ``max_objects`` of them, of ``max_bytes`` in all
        self._objects: OrderedDict[int, tuple[Any, bytes, int]] = OrderedDict()
        self._object_bytes = 0
        self._max_objects = max_objects
        # a follow-up's resent messages, the earlier list's own objects: their digests at
        # once, without a lookup per message
        self._resent: PrefixMemo[bytes] = PrefixMemo(items=max_objects)

    def digests(self, messages: Sequence[Any]) -> list[bytes]:
        """``digest`` of each message, in order."""
        out = list(self._resent.shared(messages))
        objects = self._objects
        for message in messages[len(out):]:
            known = objects.get(id(message))
            if known is not None and known[0] is message:
                objects.move_to_end(id(message))
                out.append(known[1])
                continue
            made, size = self._digest(message)
            if (replaced := objects.pop(id(message), None)) is not None:
                self._object_bytes -= replaced[2]
            objects[id(message)] = (message, made, size)
            self._object_bytes += size
            out.append(made)
        while objects and (len(objects) > self._max_objects
                           or self._object_bytes > self._max_bytes):
            self._object_bytes -= objects.popitem(last=False)[1][2]
        self._resent.keep(messages, out)
        return out

    def _digest(self, message: Any) -> tuple[bytes, int]:
        """A new object's digest and canonical size, found by its canonical bytes where a
        message with the same bytes was digested before."""
        data = canonical_bytes(message)
        key = (len(data), data[:MEMO_EDGE], data[-MEMO_EDGE:])
        found = self._held.get(key)
        if found is not None and found[0] == data:
            self._held.move_to_end(key)
            return found[1], len(data)
        made = _digest_of(data)
        self._hold(key, data, made)
        return made, len(data)

    def _hold(self, key: tuple[int, bytes, bytes], data: bytes, made: bytes) -> None:
        if len(data) > self._max_bytes:
            return
        replaced = self._held.pop(key, None)
        if replaced is not None:
            self._bytes -= len(replaced[0])
        self._held[key] = (data, made)
        self._bytes += len(data)
        while self._bytes > self._max_bytes:
            _, (dropped, _) = self._held.popitem(last=False)
            self._bytes -= len(dropped)

    @property
    def held_bytes(self) -> int:
        return self._bytes

    @property
    def known_object_bytes(self) -> int:
        """The canonical size of the message objects known by identity."""
        return self._object_bytes


@dataclass(frozen=True, slots=True)
class Committed:
    """The part of a forwarded request that the engine's cache now holds.

    ``messages`` keeps of each message only what the prompt is made of (``rendered``);
    ``digests`` are those of the messages *as forwarded*, whole: bytes decide on what the
    client sends, exactly as before, and a message that differs only in a key the engine
    ignores still reads as a change (a resend with the same junk extends as ever).
    ``size``: the bytes it holds, what the per-namespace budget counts.
    """

    messages: tuple[Mapping[str, Any], ...]
    digests: tuple[bytes, ...]
    shape: Shape
    prompt: str | None = None  # /v1/completions: the raw prompt text
    body: Mapping[str, Any] | None = None  # the forwarded request (to render it again)
    size: int = -1  # computed when not given
    # Each message's canonical bytes, counted (computed when not given): a turn's commit
    # counts only the messages it added.
    message_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if len(self.message_sizes) != len(self.messages):
            object.__setattr__(self, "message_sizes",
                               tuple(len(canonical_bytes(m)) for m in self.messages))
        if self.size < 0:
            object.__setattr__(self, "size", self._measure())

    def _measure(self) -> int:
        # The length of the messages' canonical JSON array: its elements, commas, brackets.
        size = sum(self.message_sizes) + max(len(self.messages) - 1, 0) + 2
        size += 32 * len(self.digests)
        if self.prompt is not None:
            size += len(self.prompt.encode("utf-8", "replace"))
        if self.body is not None:
            size += len(canonical_bytes({k: v for k, v in self.body.items()
                                         if k != "messages"}))
        return size

    @classmethod
    def of_chat(cls, body: Mapping[str, Any], digests: Sequence[bytes] | None = None,
                shape: Shape | None = None, previous: Committed | None = None) -> Committed:
        """``digests`` and ``shape``, when the caller has them, must be those of
        ``body["messages"]`` and ``shape_digest(body)``. ``previous``: the session's
        committed history, whose messages this one keeps where their digests are the same
        (a turn that extends it costs what it added, not the conversation)."""
        forwarded = tuple(body.get("messages") or ())
        known = tuple(digests) if digests is not None and len(digests) == len(forwarded) \
            else tuple(digest(m) for m in forwarded)
        shared = _kept_prefix(previous, known)
        messages = (previous.messages[:shared] if previous is not None else ()) + tuple(
            rendered(m) for m in forwarded[shared:])
        sizes = (previous.message_sizes[:shared] if previous is not None else ()) + tuple(
            len(canonical_bytes(m)) for m in messages[shared:])
        kept = {k: v for k, v in body.items() if k in SHAPE_FIELDS}
        kept["messages"] = list(messages)
        return cls(messages, known, shape if shape is not None else shape_digest(body),
                   body=kept, message_sizes=sizes)

    @classmethod
    def of_completion(cls, body: Mapping[str, Any], shape: Shape | None = None) -> Committed:
        prompt = body.get("prompt")
        text = prompt if isinstance(prompt, str) else canonical(prompt)
        return cls((), (), shape if shape is not None else shape_digest(body), text)


def _kept_prefix(previous: Committed | None, digests: tuple[bytes, ...]) -> int:
    """How many leading messages a new committed history shares with ``previous``: all of
    them when it extends or repeats it (one comparison of the digests), else none."""
    if previous is None or previous.prompt is not None:
        return 0
    n = len(previous.digests)
    return n if n <= len(digests) and digests[:n] == previous.digests else 0


@dataclass(frozen=True, slots=True)
class Verdict:
    extends: bool
    identical: bool = False
    index: int | None = None  # first differing message
    char: int | None = None  # first differing character of that message's canonical JSON
    field: str | None = None
    cause: Cause = "none"
    committed_messages: int = 0
    committed_chars: int | None = None  # a raw prompt's verdict: its committed length

    @property
    def resumable(self) -> bool:
        return self.extends or self.identical

    def reason(self) -> str:
        if self.extends:
            return "extends committed history"
        if self.identical:
            return "identical to committed history"
        if self.committed_chars is not None:  # a raw prompt has characters, not messages
            return (f"prompt diverged at char {self.char} (of committed "
                    f"{self.committed_chars} chars; {self.cause})")
        if self.index is None:
            return f"request fields changed ({self.field}; {self.cause})"
        where = f"message {self.index}"
        if self.char is not None:
            where += f", char {self.char}"
        return (f"history diverged at {where} (of committed {self.committed_messages} "
                f"messages; {self.field or 'message'}: {self.cause})")


Shape = tuple[tuple[str, bytes], ...]


def shape_digest(body: Mapping[str, Any]) -> Shape:
    """Per shaping field present in the body, its digest (absent and null are the same)."""
    return tuple((name, digest(body[name])) for name in SHAPE_FIELDS
                 if body.get(name) is not None)


def decide(committed: Committed, body: Mapping[str, Any],
           incoming_digests: Sequence[bytes] | None = None,
           shape: Shape | None = None) -> Verdict:
    """Compare an incoming body with a committed history (``incoming_digests`` and
    ``shape``: those of ``body``, when the caller has them: the shaping fields, tools
    among them, are then not digested again for every candidate)."""
    if shape is None:
        shape = shape_digest(body)
    if shape != committed.shape:
        field = _changed_field(committed.shape, shape)
        return Verdict(False, field=field, committed_messages=len(committed.messages),
                       cause="tools_changed" if field in ("tools", "functions") else "edited")
    if committed.prompt is not None:
        return _decide_prompt(committed.prompt, body.get("prompt"))
    incoming = list(body.get("messages") or ())
    digests = incoming_digests if incoming_digests is not None else [digest(m) for m in incoming]
    n = len(committed.digests)
    for index in range(min(n, len(incoming))):
        if digests[index] != committed.digests[index]:
            return _diverged(committed, incoming, index)
    if len(incoming) < n:
        return Verdict(False, index=len(incoming), cause="shorter", committed_messages=n)
    if len(incoming) == n:
        return Verdict(False, identical=True, committed_messages=n)
    return Verdict(True, committed_messages=n)


def _decide_prompt(committed: str, prompt: object) -> Verdict:
    text = prompt if isinstance(prompt, str) else canonical(prompt)
    if text == committed:
        return Verdict(False, identical=True)
    if text.startswith(committed):
        return Verdict(True)
    return Verdict(False, index=0, char=_first_difference(committed, text),
                   cause="shorter" if committed.startswith(text) else "edited",
                   committed_chars=len(committed))


def _diverged(committed: Committed, incoming: Sequence[Mapping[str, Any]], index: int) -> Verdict:
    old, new = committed.messages[index], incoming[index]
    field = _first_changed_key(old, new)
    char = _first_difference(canonical(old), canonical(new))
    cause = classify(committed.messages, incoming, index, field)
    return Verdict(False, index=index, char=char, field=field, cause=cause,
                   committed_messages=len(committed.messages))


def classify(committed: Sequence[Mapping[str, Any]], incoming: Sequence[Mapping[str, Any]],
             index: int, field: str | None) -> Cause:
    """Why message ``index`` differs: the rewrite classes real agent clients apply."""
    old, new = committed[index], incoming[index]
    if _is_window_move(committed, incoming, index):
        return "window_moved"
    role = old.get("role")
    if role in ("system", "developer") and new.get("role") == role:
        return "system_changed"
    if role == "assistant" and new.get("role") == "assistant":
        if _reasoning_stripped(old, new):
            return "reasoning_stripped"
        if field == "tool_calls" and _same_tool_calls_modulo_json(old, new):
            return "tool_args_reserialized"
    if role == "tool" and new.get("role") == "tool" and _tool_result_shortened(old, new):
        return "tool_result_trimmed"
    return "edited"


def _is_window_move(committed: Sequence[Mapping[str, Any]],
                    incoming: Sequence[Mapping[str, Any]], index: int) -> bool:
    """The client dropped early messages: the one here appears later in the committed list."""
    new = canonical(incoming[index])
    return any(canonical(m) == new for m in committed[index + 1:])


def _reasoning_stripped(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    if any(old.get(name) and not new.get(name)
           for name in ("reasoning_content", "thinking", "reasoning")):
        return _visible(old) == _visible(new)
    return _visible(old) == _visible(new) and old.get("content") != new.get("content")


def _visible(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    text = content if isinstance(content, str) else canonical(content)
    while "<think>" in text and "</think>" in text:
        start, end = text.index("<think>"), text.index("</think>") + len("</think>")
        if end <= start:
            break
        text = text[:start] + text[end:]
    return text.strip()


def _same_tool_calls_modulo_json(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    def normal(message: Mapping[str, Any]) -> Any:
        calls = []
        for call in message.get("tool_calls") or []:
            function = dict(call.get("function") or {})
            try:
                function["arguments"] = json.loads(function.get("arguments") or "null")
            except (TypeError, ValueError):
                return None
            calls.append({**call, "function": function})
        return canonical(calls)

    normalized = normal(old)
    return normalized is not None and normalized == normal(new)


def _tool_result_shortened(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    if old.get("tool_call_id") != new.get("tool_call_id"):
        return False
    before, after = _visible(old), _visible(new)
    return len(after) < len(before)


def _first_changed_key(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    for key in sorted(set(old) | set(new)):
        if canonical(old.get(key)) != canonical(new.get(key)):
            return key
    return None


def _changed_field(old: Shape, new: Shape) -> str:
    before, after = dict(old), dict(new)
    return next(name for name in SHAPE_FIELDS if before.get(name) != after.get(name))


def _first_difference(a: str, b: str) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))
