"""Per-message work reused by identity (``proxy.session.resent``): every stage that takes a
follow-up's results from the earlier list answers exactly what computing them anew does,
over random sessions of resent, edited, retried and interleaved histories, and a resent
history is served from the earlier list, not message by message."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from prefixpin.fingerprint import prefix_keys
from prefixpin.proxy.pipeline.system_turns import SystemTurns, has_mid_system, in_place
from prefixpin.proxy.session.history import DigestMemo, digest
from prefixpin.proxy.session.resent import PrefixKeys, PrefixMemo

Message = dict[str, Any]


def fresh(rng: random.Random, turn: int) -> Message:
    role = rng.choice(("user", "assistant", "tool", "system", "developer"))
    return {"role": role, "content": f"{role} {turn} {rng.randint(0, 3)}"}


def next_history(rng: random.Random, history: list[Message], turn: int) -> list[Message]:
    """What a client sends next: the same objects with a turn added (as the body memo hands
    them over), or a copy (parsed anew), an edit, a retry, a trimmed history."""
    roll = rng.random()
    if roll < 0.5 or not history:
        return [*history, *(fresh(rng, turn) for _ in range(rng.randint(1, 3)))]
    if roll < 0.6:
        return copy.deepcopy(history)  # equal messages, other objects
    if roll < 0.75:
        edited = list(history)
        edited[rng.randrange(len(edited))] = fresh(rng, turn)
        return edited
    if roll < 0.85:
        return list(history)  # a retry: the very same messages
    return history[:rng.randint(1, len(history))]


def sessions(seed: int, turns: int = 120) -> list[list[Message]]:
    """Requests of a few interleaved sessions, some sharing their first message object."""
    rng = random.Random(seed)
    shared_first = {"role": "system", "content": "You are an agent."}
    histories: list[list[Message]] = [[shared_first] if rng.random() < 0.5 else []
                                      for _ in range(rng.randint(1, 5))]
    requests = []
    for turn in range(turns):
        index = rng.randrange(len(histories))
        histories[index] = next_history(rng, histories[index], turn)
        requests.append(histories[index])
    return requests


@pytest.mark.parametrize("seed", range(12))
def test_digests_of_resent_histories_are_the_digests(seed: int) -> None:
    memo = DigestMemo(max_objects=rng_bound(seed))
    for messages in sessions(seed):
        assert memo.digests(messages) == [digest(m) for m in messages]


@pytest.mark.parametrize("seed", range(12))
def test_prefix_keys_of_resent_histories_are_the_prefix_keys(seed: int) -> None:
    digests, keys = DigestMemo(), PrefixKeys()
    for n, messages in enumerate(sessions(seed)):
        scope = b"anon" if n % 3 else b"tenant"
        made = digests.digests(messages)
        assert keys(made, scope) == prefix_keys(made, scope)


@pytest.mark.parametrize("seed", range(12))
def test_system_turns_rewrite_as_in_place_does(seed: int) -> None:
    turns = SystemTurns()
    for messages in sessions(seed):
        rewritten = turns.in_place(messages)
        if has_mid_system(messages):
            assert rewritten == in_place(messages)
        else:
            assert rewritten is None


def test_a_resent_history_keeps_its_rewritten_messages() -> None:
    """Later stages find a rewritten system message by identity, as a client's own."""
    history: list[Message] = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                              {"role": "system", "content": "env"}]
    turns = SystemTurns()
    first = turns.in_place(history)
    second = turns.in_place([*history, {"role": "user", "content": "next"}])
    assert first is not None
    assert second is not None
    assert second[2] is first[2]


def test_a_resent_list_is_served_from_the_earlier_one() -> None:
    memo: PrefixMemo[int] = PrefixMemo()
    items = [object() for _ in range(5)]
    memo.keep(items, [1, 2, 3, 4, 5])
    assert memo.shared([*items, object()]) == (1, 2, 3, 4, 5)
    assert memo.shared([*items[:3], object(), items[4]]) == (1, 2, 3)
    assert memo.shared([object(), *items[1:]]) == ()
    assert memo.shared(items, tag="other") == ()


def test_the_memo_holds_what_its_bounds_allow() -> None:
    memo: PrefixMemo[int] = PrefixMemo(lists=2, items=10)
    lists = [[object() for _ in range(4)] for _ in range(3)]
    for items in lists:
        memo.keep(items, list(range(4)))
    assert memo.shared(lists[0]) == ()  # the oldest went
    assert memo.shared(lists[2]) == (0, 1, 2, 3)
    memo.keep([object() for _ in range(11)], list(range(11)))  # over the bound alone
    assert memo.shared(lists[2]) == (0, 1, 2, 3)


def test_an_extended_list_replaces_the_one_it_extends() -> None:
    memo: PrefixMemo[int] = PrefixMemo(lists=2)
    items = [object() for _ in range(3)]
    memo.keep(items[:2], [1, 2])
    memo.keep(items, [1, 2, 3])
    other = [object()]
    memo.keep(other, [9])
    assert memo.shared(items) == (1, 2, 3)  # one list for the session, not two
    assert memo.shared(other) == (9,)


def rng_bound(seed: int) -> int:
    """Small identity bounds on some seeds: eviction must not change an answer."""
    return (4, 16, 1 << 14)[seed % 3]
