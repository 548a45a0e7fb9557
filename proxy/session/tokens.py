"""Token counts for budgets: the model's tokenizer when the proxy has it, else an estimate.

Counts are cached per namespace and message text (blake3 key, bounded), so a long
conversation costs only its new messages. The namespace is part of the key: a tenant must
not learn, from how fast its request is counted, that another tenant sent the same text.
It is the request's (``scope``: set by the request path before planning, so the planner's
callers need not pass it), or the anonymous namespace outside a request. The estimate
(3 characters a token) errs on the high side for English and code, so a budget it
enforces is not exceeded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import blake3

from prefixpin.fingerprint import Encoder
from prefixpin.proxy.session.history import canonical

PER_MESSAGE_OVERHEAD = 6  # role header and end-of-turn markers of a chat template

_NAMESPACE: ContextVar[str] = ContextVar("prefixpin_token_namespace", default="anon")


@contextmanager
def scope(namespace: str) -> Iterator[None]:
    """Counts made inside (in this task, and threads it starts with its context) are
    cached under ``namespace``."""
    token = _NAMESPACE.set(namespace)
    try:
        yield
    finally:
        _NAMESPACE.reset(token)


class TokenCounter:
    def __init__(self, encoder: Encoder | None, max_entries: int = 16384) -> None:
        self._encoder = encoder
        self._cache: OrderedDict[bytes, int] = OrderedDict()
        self._max = max_entries

    @property
    def exact(self) -> bool:
        return self._encoder is not None

    def count_messages(self, messages: Sequence[Mapping[str, Any]],
                       namespace: str | None = None) -> int:
        return sum(self.count_text(_message_text(m), namespace) + PER_MESSAGE_OVERHEAD
                   for m in messages)

    def count_text(self, text: str, namespace: str | None = None) -> int:
        """``namespace``: whose cache; by default the current request's (``scope``)."""
        if self._encoder is None:
            return (len(text) + 2) // 3
        hasher = blake3.blake3((namespace or _NAMESPACE.get()).encode() + b"\0")
        hasher.update(text.encode("utf-8", "replace"))
        key = hasher.digest()
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        count = len(self._encoder.encode(text))
        self._cache[key] = count
        if len(self._cache) > self._max:
            self._cache.popitem(last=False)
        return count


def _message_text(message: Mapping[str, Any]) -> str:
    parts = []
    for key in ("content", "reasoning_content"):
        value = message.get(key)
        if isinstance(value, str):
            parts.append(value)
        elif value is not None:
            parts.append(canonical(value))
    if message.get("tool_calls"):
        parts.append(canonical(message["tool_calls"]))
    return "\n".join(parts)


# Runs are compared a block at a time (one C comparison), then the block that differs item
# by item: a whole conversation's ids are a hundred thousand of them, its text more.
_BLOCK = 4096


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` share from the start (lists and arrays alike)."""
    return _shared_run(a, b, lambda start, end: list(a[start:end]) == list(b[start:end]))


def common_text_prefix(a: str, b: str) -> int:
    """How many characters ``a`` and ``b`` share from the start."""
    return _shared_run(a, b, lambda start, end: a[start:end] == b[start:end])


def common_text_suffix(a: str, b: str) -> int:
    """How many characters ``a`` and ``b`` share at the end."""
    n, end_a, end_b = min(len(a), len(b)), len(a), len(b)
    shared = 0
    while shared < n:
        step = min(_BLOCK, n - shared)
        if a[end_a - shared - step:end_a - shared] != b[end_b - shared - step:end_b - shared]:
            break
        shared += step
    while shared < n and a[end_a - shared - 1] == b[end_b - shared - 1]:
        shared += 1
    return shared


def _shared_run(a: Sequence[object], b: Sequence[object],
                same_block: Callable[[int, int], bool]) -> int:
    n = min(len(a), len(b))
    start = 0
    while start < n and same_block(start, start + _BLOCK):
        start += _BLOCK
    for index in range(start, min(start + _BLOCK, n)):
        if a[index] != b[index]:
            return index
    return n
