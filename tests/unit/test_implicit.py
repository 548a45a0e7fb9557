"""The proxy's fingerprinter: prefix chains memoised by the client's bytes, new messages
normalised and tokenized once, small ones on the event loop and large ones in a worker
thread. The real SmolLM2 tokenizer throughout."""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from prefixpin.fingerprint import Markers, MessageTokenCache, chain_for_messages
from prefixpin.fingerprint.tokenizer import ModelTokenizer, markers_for
from prefixpin.proxy.session.history import digest
from prefixpin.proxy.session.implicit import INLINE_CHARS, Fingerprinter
from tests.fingerprint.conftest import rig_tokenizer

pytestmark = pytest.mark.anyio

Message = Mapping[str, Any]


class ThreadRecordingTokenizer:
    """The real tokenizer, noting the thread each text was tokenized on."""

    def __init__(self, inner: ModelTokenizer) -> None:
        self.inner = inner
        self.threads: list[int] = []

    def encode(self, text: str) -> list[int]:
        self.threads.append(threading.get_ident())
        return self.inner.encode(text)


@pytest.fixture(scope="module")
def smollm() -> ModelTokenizer:
    return rig_tokenizer("smollm2")


@pytest.fixture(scope="module")
def markers(smollm: ModelTokenizer) -> Markers:
    found = markers_for(smollm)
    assert found is not None
    return found


def conversation(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Today is 2026-11-29."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Step {turn}: read module_{turn}.py"})
        messages.append({"role": "assistant", "content": f"module_{turn} defines f{turn}()."})
    return messages


def blank_dates(messages: Sequence[Message]) -> list[Message]:
    return [{**m, "content": str(m["content"]).replace("2026-11-29", "<date>")}
            if m["role"] == "system" else m for m in messages]


async def chain_of(fingerprinter: Fingerprinter, messages: Sequence[Message],
                   normalize: Any = blank_dates, namespace: str = "tenant-a") -> Any:
    return await fingerprinter.chain_of_messages(messages, [digest(m) for m in messages],
                                                 normalize, namespace)


async def test_the_chain_is_that_of_the_normalised_messages(smollm: ModelTokenizer,
                                                           markers: Markers) -> None:
    fingerprinter = Fingerprinter(smollm, markers)
    messages = conversation(4)
    expected = chain_for_messages(blank_dates(messages), smollm, MessageTokenCache(), markers)
    assert await chain_of(fingerprinter, messages) == expected
    other_day = copy.deepcopy(messages)
    other_day[0]["content"] = "You are a coding agent. Today is 2026-11-30."
    assert await chain_of(fingerprinter, other_day) != expected  # not blanked: differs


async def test_a_resent_history_costs_only_its_new_messages(smollm: ModelTokenizer,
                                                           markers: Markers) -> None:
    """The same history again does no work at all; one more turn normalises and tokenizes
    the new messages only; each result equals the chain computed from scratch."""
    fingerprinter = Fingerprinter(smollm, markers)
    normalised: list[int] = []

    def counting(messages: Sequence[Message]) -> list[Message]:
        normalised.append(len(messages))
        return blank_dates(messages)

    first = conversation(3)
    await chain_of(fingerprinter, first, counting)
    misses = fingerprinter.cache.stats.misses
    again = await chain_of(fingerprinter, copy.deepcopy(first), counting)
    assert fingerprinter.cache.stats.misses == misses
    later = conversation(4)
    extended = await chain_of(fingerprinter, later, counting)
    assert normalised == [len(first), 2]
    assert fingerprinter.cache.stats.misses == misses + 2
    fresh = Fingerprinter(smollm, markers)
    assert again == await chain_of(fresh, first)
    assert extended == await chain_of(fresh, later)


async def test_small_news_are_fingerprinted_inline_and_large_ones_in_a_thread(
        smollm: ModelTokenizer, markers: Markers) -> None:
    tokenizer = ThreadRecordingTokenizer(smollm)
    fingerprinter = Fingerprinter(smollm, markers)
    fingerprinter.tokenizer = tokenizer  # type: ignore[assignment]
    loop_thread = threading.get_ident()
    small = conversation(1)
    await chain_of(fingerprinter, small)
    assert tokenizer.threads
    assert set(tokenizer.threads) == {loop_thread}
    tokenizer.threads.clear()
    # A long message is tokenized by its edges alone (inline); many new messages are not.
    long = [*small, {"role": "user", "content": "x " * INLINE_CHARS}]
    await chain_of(fingerprinter, long)
    assert set(tokenizer.threads) == {loop_thread}
    tokenizer.threads.clear()
    many = [*long, *({"role": "user", "content": f"message {i}: " + "y " * 100}
                     for i in range(INLINE_CHARS // 100))]
    await chain_of(fingerprinter, many)
    assert tokenizer.threads
    assert len(set(tokenizer.threads)) == 1
    assert tokenizer.threads[0] != loop_thread


async def test_what_one_namespace_cached_no_other_finds(smollm: ModelTokenizer,
                                                       markers: Markers) -> None:
    """The same history from another tenant is tokenized again (no timing tells it what the
    first tenant sent) and gets the same chain."""
    fingerprinter = Fingerprinter(smollm, markers)
    messages = conversation(2)
    first = await chain_of(fingerprinter, messages, namespace="tenant-a")
    misses = fingerprinter.cache.stats.misses
    second = await chain_of(fingerprinter, messages, namespace="tenant-b")
    assert fingerprinter.cache.stats.misses == 2 * misses
    assert second == first
    await chain_of(fingerprinter, messages, namespace="tenant-b")
    assert fingerprinter.cache.stats.misses == 2 * misses
