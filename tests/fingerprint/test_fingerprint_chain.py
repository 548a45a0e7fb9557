"""The segment chain: splitting, edge hashing, chaining, nomination (pure, no tokenizer)."""

from __future__ import annotations

import struct

import pytest
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixpin.fingerprint.chain import (
    DEFAULT_BAR,
    Chain,
    Edges,
    chain,
    extend,
    nominates,
    segment_bounds,
    shared_leading,
    start_chain,
)

OPEN = 1  # stands for <|im_start|>
CLOSE = 2  # stands for <|im_end|>: a control token that does not open a segment
OPENERS = frozenset({OPEN})
EDGE = 8

# Ids 3.. are ordinary tokens; 0 and 2 are never openers.
plain_ids = st.integers(min_value=3, max_value=60)
any_ids = st.integers(min_value=0, max_value=60)
streams = st.lists(any_ids, max_size=80)


def message(body: list[int]) -> list[int]:
    return [OPEN, *body, CLOSE]


def test_bounds_start_at_each_opener_and_keep_a_leading_segment() -> None:
    """Tokens before the first opener form their own segment; each opener starts one."""
    assert segment_bounds([7, 8, OPEN, 9, OPEN, OPEN], OPENERS) == [(0, 2), (2, 4), (4, 5), (5, 6)]


def test_bounds_without_leading_tokens_and_of_nothing() -> None:
    """A stream that starts with an opener has no leading segment; nothing has none."""
    assert segment_bounds([OPEN, 5, OPEN, 6], OPENERS) == [(0, 2), (2, 4)]
    assert segment_bounds([], OPENERS) == []


def test_bounds_with_several_openers() -> None:
    """Every configured opener starts a segment, whichever comes first."""
    assert segment_bounds([9, 1, 5, 4, 1, 4], {1, 4}) == [(0, 1), (1, 3), (3, 4), (4, 5), (5, 6)]


def test_short_segment_hashes_each_token_once() -> None:
    """A segment shorter than 2 * edge is hashed whole, without counting any id twice."""
    tokens = message([10, 11, 12])
    expected = blake3(start_chain(OPENERS).root + struct.pack("<5I", *tokens)).digest()
    assert chain(tokens, OPENERS).digests == (expected,)


def test_long_segment_hashes_only_its_edges() -> None:
    """A long segment is hashed over its first 8 and last 8 ids, chained to the previous."""
    first = message(list(range(10, 40)))
    second = message(list(range(50, 90)))
    result = chain(first + second, OPENERS)
    d1 = blake3(result.root + struct.pack("<16I", *first[:8], *first[-8:])).digest()
    d2 = blake3(d1 + struct.pack("<16I", *second[:8], *second[-8:])).digest()
    assert result.digests == (d1, d2)


def test_edges_extend_by_filling_the_head_then_sliding_the_tail() -> None:
    """Appending to a short segment first fills the head, then keeps the last ``edge``."""
    edges = Edges().extended([1, 2, 3], 4)
    assert edges == Edges((1, 2, 3), ())
    assert edges.extended([4, 5], 4) == Edges((1, 2, 3, 4), (5,))
    assert edges.extended([4, 5, 6, 7, 8, 9, 10], 4) == Edges((1, 2, 3, 4), (7, 8, 9, 10))


def test_chain_configuration_is_validated() -> None:
    """Edge and bar below 1 are refused rather than silently hashing nothing."""
    with pytest.raises(ValueError, match="edge"):
        start_chain(OPENERS, edge=0)
    with pytest.raises(ValueError, match="bar"):
        nominates(chain([OPEN], OPENERS), chain([OPEN], OPENERS), bar=0)


def test_continuation_replaces_the_last_digest() -> None:
    """Tokens appended without an opener belong to the last segment and rehash it."""
    base = chain(message([5, 6]), OPENERS)
    longer = extend(base, [7, 8])
    assert len(longer) == len(base) == 1
    assert longer.digests != base.digests
    assert longer == chain([*message([5, 6]), 7, 8], OPENERS)


def test_markerless_prompt_is_one_unmarked_segment_that_never_nominates() -> None:
    """A raw prompt has no opener: one segment, and not even an identical one nominates."""
    raw = chain(list(range(3, 500)), OPENERS)
    assert len(raw) == 1
    assert not raw.marked
    assert not nominates(raw, raw, bar=1)


def test_nomination_needs_the_bar_of_shared_leading_segments() -> None:
    """Two segments shared is below the default bar of 3; three clears it."""
    system, user, reply, other = message([3, 4]), message([5]), message([6]), message([7])
    session = chain(system + user + reply, OPENERS)
    assert not nominates(chain(system + user + other, OPENERS), session)
    assert nominates(chain(system + user + reply + message([8]), OPENERS), session)
    assert DEFAULT_BAR == 3


def test_chains_configured_apart_share_nothing() -> None:
    """Chains with different openers or edge never share a segment."""
    tokens = message([5, 6]) + message([7])
    assert shared_leading(chain(tokens, {OPEN}), chain(tokens, {OPEN, 9})) == 0
    assert shared_leading(chain(tokens, OPENERS, edge=4), chain(tokens, OPENERS)) == 0


def test_hexdigests_for_logs() -> None:
    """Digests render as 64-character hex strings, one per segment."""
    hexes = chain(message([5]) + message([6]), OPENERS).hexdigests()
    assert [len(h) for h in hexes] == [64, 64]


@settings(deadline=None)  # microseconds of work, but a loaded CI box must not flake
@given(streams, streams, streams)
def test_extending_equals_recomputing(a: list[int], b: list[int], c: list[int]) -> None:
    """Extending a chain run by run gives exactly the chain of the concatenation."""
    whole = chain(a + b + c, OPENERS)
    assert extend(chain(a, OPENERS), b, c) == whole
    assert extend(extend(start_chain(OPENERS), a, b), c) == whole


@settings(deadline=None)
@given(st.lists(plain_ids, min_size=2 * EDGE + 1, max_size=60), st.data())
def test_interior_edits_never_change_the_segment(body: list[int], data: st.DataObject) -> None:
    """Replacing, inserting or deleting interior tokens keeps every digest."""
    segment = message(body)
    interior = data.draw(st.lists(plain_ids, max_size=40))
    edited = segment[:EDGE] + interior + segment[-EDGE:]
    before = message([20, 21])
    assert chain(before + edited, OPENERS).digests == chain(before + segment, OPENERS).digests


@settings(deadline=None)
@given(st.lists(plain_ids, min_size=0, max_size=40), st.data())
def test_edge_edits_always_change_the_segment(body: list[int], data: st.DataObject) -> None:
    """Changing any of the first or last 8 ids changes the segment's digest."""
    segment = message(body)
    covered = sorted({*range(1, min(EDGE, len(segment))),
                      *range(max(len(segment) - EDGE, 1), len(segment))})
    at = data.draw(st.sampled_from(covered))
    replacement = data.draw(plain_ids.filter(lambda token: token != segment[at]))
    edited = [*segment[:at], replacement, *segment[at + 1:]]
    assert chain(edited, OPENERS).digests[-1] != chain(segment, OPENERS).digests[-1]


@settings(deadline=None)
@given(streams, streams)
def test_shared_leading_is_symmetric_and_bounded(a: list[int], b: list[int]) -> None:
    """shared_leading(a, b) == shared_leading(b, a) <= min(len(a), len(b))."""
    left, right = chain(a, OPENERS), chain(b, OPENERS)
    shared = shared_leading(left, right)
    assert shared == shared_leading(right, left)
    assert shared <= min(len(left), len(right))


@settings(deadline=None)
@given(streams, streams)
def test_a_common_message_prefix_is_shared(prefix: list[int], rest: list[int]) -> None:
    """Every complete segment of a common prefix is shared (the last may still grow)."""
    head = chain(prefix, OPENERS)
    longer = chain([*prefix, OPEN, *rest], OPENERS)
    assert shared_leading(head, longer) == len(head)


def test_empty_chain() -> None:
    """An empty stream has no segments and shares none."""
    empty: Chain = chain([], OPENERS)
    assert len(empty) == 0
    assert shared_leading(empty, chain(message([3]), OPENERS)) == 0


def test_opener_bytes_straddling_two_ids_are_not_an_opener() -> None:
    """Openers are found in the packed ids only on id boundaries."""
    # Little-endian [256, 0] is 00 01 00 00 00 00 00 00: the bytes of id 1 at offset 1.
    straddling = [256, 0, OPEN, 5]
    assert segment_bounds(straddling, OPENERS) == [(0, 2), (2, 4)]
    assert chain(straddling, OPENERS) == extend(start_chain(OPENERS), [256, 0], [OPEN, 5])


@settings(deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=40), st.data())
def test_bounds_start_exactly_at_openers_for_any_ids(tokens: list[int],
                                                     data: st.DataObject) -> None:
    """Whatever the ids, segments start at exactly the openers' positions."""
    opener = data.draw(st.sampled_from(tokens)) if tokens else OPEN
    starts = [start for start, _ in segment_bounds(tokens, {opener})]
    expected = [i for i, token in enumerate(tokens) if token == opener]
    assert starts == ([0, *expected] if tokens and tokens[0] != opener else expected)
