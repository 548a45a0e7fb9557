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
    return _shared_run(min(len(a), len(b)),
                       lambda start, end: list(a[start:end]) == list(b[start:end]),
                       lambda index: a[index] == b[index])


def common_text_prefix(a: str, b: str) -> int:
    """How many characters ``a`` and ``b`` share from the start."""
    return _shared_run(min(len(a), len(b)), lambda start, end: a[start:end] == b[start:end],
                       lambda index: a[index] == b[index])


def common_text_suffix(a: str, b: str) -> int:
    """How many characters ``a`` and ``b`` share at the end."""
    end_a, end_b = len(a), len(b)
    return _shared_run(
        min(end_a, end_b),
        lambda start, end: a[end_a - end:end_a - start] == b[end_b - end:end_b - start],
        lambda index: a[end_a - 1 - index] == b[end_b - 1 - index])


def _shared_run(n: int, same_block: Callable[[int, int], bool],
                same_item: Callable[[int], bool]) -> int:
    """How many of the first ``n`` items (counted from either end) two sequences share:
    ``same_block(start, end)`` compares items ``start`` to ``end``, ``same_item`` one."""
    start = 0
    while start < n and same_block(start, min(start + _BLOCK, n)):
        start += _BLOCK
    for index in range(start, min(start + _BLOCK, n)):
        if not same_item(index):
            return index
    return n
