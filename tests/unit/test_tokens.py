"""The token-count cache is per namespace: one tenant's count never warms another's; token runs
compared."""

from __future__ import annotations

import asyncio
from array import array

from hypothesis import given
from hypothesis import strategies as st

from prefixpin.proxy.session.tokens import TokenCounter, common_prefix, scope


class CountingEncoder:
    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return list(range(len(text.split())))


def test_counts_are_cached_per_namespace() -> None:
    encoder = CountingEncoder()
    counter = TokenCounter(encoder)
    assert counter.count_text("a b c", "t-one") == 3
    assert counter.count_text("a b c", "t-one") == 3
    assert encoder.calls == 1
    assert counter.count_text("a b c", "t-two") == 3
    assert encoder.calls == 2  # another tenant's text is counted anew, never a cache hit


def test_the_request_scope_names_the_namespace() -> None:
    encoder = CountingEncoder()
    counter = TokenCounter(encoder)
    messages = [{"role": "user", "content": "a b"}]
    with scope("t-one"):
        counter.count_messages(messages)
        counter.count_messages(messages)
    assert encoder.calls == 1
    with scope("t-two"):
        counter.count_messages(messages)
    assert encoder.calls == 2
    counter.count_text("a b", "t-two")
    assert encoder.calls == 2


def test_the_scope_follows_the_request_into_threads() -> None:
    encoder = CountingEncoder()
    counter = TokenCounter(encoder)

    async def main() -> None:
        with scope("t-one"):
            await asyncio.to_thread(counter.count_text, "x y")
        counter.count_text("x y", "t-one")

    asyncio.run(main())
    assert encoder.calls == 1


@given(st.lists(st.integers(0, 3), max_size=9000), st.lists(st.integers(0, 3), max_size=9000))
def test_common_prefix_is_the_first_difference(a: list[int], b: list[int]) -> None:
    """Blocks compared at a time give the index of the first differing token, whatever the
    kinds of sequence (a list, a tuple, an array of ids)."""
    shared = a[:len(b)]
    b = shared + b[len(shared):] if len(b) > len(a) // 2 else b
    expected = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                    min(len(a), len(b)))
    assert common_prefix(a, b) == expected
    assert common_prefix(array("i", a), tuple(b)) == expected
