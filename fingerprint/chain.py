"""Segment chains: a prefix-sensitive structural fingerprint of a token stream (sans-IO).

A token stream is split into segments at *opener* tokens: the control token a chat
template emits at the start of every message (``<|im_start|>``, ``<start_of_turn>``).
Tokens before the first opener, if any, form a leading segment.

Each segment is summarised by its edges only: its first ``edge`` and last ``edge`` token
ids, never the interior. A rewrite inside a turn (a stripped think block, a trimmed tool
result, a timestamp in the middle of a system prompt) therefore leaves the segment's
hash unchanged, while a change at either end of it does not.

Summaries are chained with blake3, ``d_i = blake3(d_{i-1} || edges_i)``, so each digest
commits to every segment before it: two chains agree on their first ``k`` digests
exactly when their first ``k`` segments have equal edges.

Nothing here tokenizes, reads a file or keeps global state.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from blake3 import blake3

__all__ = [
    "DEFAULT_BAR",
    "DEFAULT_EDGE",
    "Chain",
    "Edges",
    "chain",
    "extend",
    "nominates",
    "segment_bounds",
    "shared_leading",
    "start_chain",
]

DEFAULT_EDGE = 8
# A bare system prompt is shared by every fresh conversation of one client, and a first
# user message can be boilerplate too: nominating takes one segment more than that.
DEFAULT_BAR = 3

_DOMAIN = b"prefixpin.fingerprint.chain.v1"


@dataclass(frozen=True, slots=True)
class Edges:
    """The token ids of one segment that its hash covers.

    ``head`` holds the first ``edge`` ids; ``tail`` the last ``edge`` ids that are not
    already in ``head``, so a segment shorter than ``2 * edge`` is covered whole and no id
    is counted twice.
    """

    head: tuple[int, ...] = ()
    tail: tuple[int, ...] = ()

    @classmethod
    def of(cls, tokens: Sequence[int], start: int, stop: int, edge: int) -> Edges:
        """The edges of the segment ``tokens[start:stop]``."""
        head_stop = min(start + edge, stop)
        return cls(tuple(tokens[start:head_stop]), tuple(tokens[max(head_stop, stop - edge):stop]))

    def extended(self, tokens: Sequence[int], edge: int) -> Edges:
        """The edges of this segment once ``tokens`` are appended to it."""
        room = max(edge - len(self.head), 0)
        rest = tokens[room:]
        return Edges(self.head + tuple(tokens[:room]), (self.tail + tuple(rest[-edge:]))[-edge:])

    def packed(self) -> bytes:
        """The hashed bytes: every covered id as a little-endian uint32."""
        ids = self.head + self.tail
        return struct.pack(f"<{len(ids)}I", *ids)


@dataclass(frozen=True, slots=True)
class Chain:
    """The chained segment digests of a token stream, extendable with more tokens.

    ``digests[i]`` commits to segments ``0..i``. ``last`` keeps the edges of the final
    segment, which tokens appended later without a leading opener still belong to.
    ``marked`` tells whether any opener was seen: a markerless stream never nominates.
    """

    openers: frozenset[int]
    edge: int
    digests: tuple[bytes, ...] = ()
    last: Edges | None = None
    marked: bool = False

    def __len__(self) -> int:
        return len(self.digests)

    @property
    def root(self) -> bytes:
        """The digest every chain of this configuration starts from."""
        return _root(self.edge)

    def hexdigests(self) -> list[str]:
        """The digests as hex strings, for logs and the sessions view."""
        return [digest.hex() for digest in self.digests]


_ROOTS: dict[int, bytes] = {}


def _root(edge: int) -> bytes:
    """``Chain.root``, hashed once per edge width (it is read on every extension)."""
    root = _ROOTS.get(edge)
    if root is None:
        root = _ROOTS[edge] = blake3(_DOMAIN + struct.pack("<I", edge)).digest()
    return root


def start_chain(openers: Collection[int], edge: int = DEFAULT_EDGE) -> Chain:
    """An empty chain that splits at ``openers`` and hashes ``edge`` ids at each end."""
    if edge < 1:
        raise ValueError(f"edge must be at least 1, got {edge}")
    return Chain(openers=frozenset(openers), edge=edge)


def segment_bounds(tokens: Sequence[int], openers: Collection[int]) -> list[tuple[int, int]]:
    """``(start, stop)`` of every segment of ``tokens``, in order, covering all of it.

    A segment starts at each opener; tokens before the first opener form a leading
    segment when there are any.
    """
    if not tokens:
        return []
    starts = _opener_positions(tokens, openers)
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    return list(zip(starts, [*starts[1:], len(tokens)], strict=True))


def extend(chain: Chain, *runs: Sequence[int]) -> Chain:
    """``chain`` followed by the tokens of ``runs``, as if hashed in one piece.

    Earlier segments are never rehashed: tokens that do not start with an opener continue
    the chain's last segment, whose digest is replaced; each opener starts a new one.
    """
    openers, edge, root = chain.openers, chain.edge, chain.root
    digests = list(chain.digests)
    last, marked = chain.last, chain.marked
    for tokens in runs:
        for start, stop in segment_bounds(tokens, openers):
            opens = tokens[start] in openers
            if last is not None and not opens:
                digests.pop()
                last = last.extended(tokens[start:stop], edge)
            else:
                last = Edges.of(tokens, start, stop, edge)
                marked = marked or opens
            previous = digests[-1] if digests else root
            digests.append(blake3(previous + last.packed()).digest())
    return Chain(openers, edge, tuple(digests), last, marked)


def chain(tokens: Sequence[int], openers: Collection[int], edge: int = DEFAULT_EDGE) -> Chain:
    """The chain of ``tokens`` split at ``openers``."""
    return extend(start_chain(openers, edge), tokens)


def shared_leading(a: Chain, b: Chain) -> int:
    """How many leading segments ``a`` and ``b`` share (0 for chains configured apart)."""
    if (a.openers, a.edge) != (b.openers, b.edge):
        return 0
    shared = 0
    for left, right in zip(a.digests, b.digests, strict=False):
        if left != right:
            break
        shared += 1
    return shared


def nominates(incoming: Chain, candidate: Chain, bar: int = DEFAULT_BAR) -> bool:
    """Whether ``incoming`` may be the continuation of ``candidate`` (bytes still decide).

    True iff both streams carry message markers and share at least ``bar`` leading
    segments. A markerless raw prompt is one segment with no opener and never clears it.
    """
    if bar < 1:
        raise ValueError(f"bar must be at least 1, got {bar}")
    if not (incoming.marked and candidate.marked):
        return False
    return shared_leading(incoming, candidate) >= bar


def _opener_positions(tokens: Sequence[int], openers: Collection[int]) -> list[int]:
    # Searching the packed ids with bytes.find runs at memory speed; a per-token Python
    # loop (or list.index, which compares boxed ints) would dominate the warm path of a
    # 30k-token conversation. A match must sit on a 4-byte boundary to be a whole id.
    packed = tokens if isinstance(tokens, array) and tokens.typecode == "I" else array("I", tokens)
    data = packed.tobytes()
    positions: list[int] = []
    for opener in openers:
        needle = array("I", [opener]).tobytes()
        at = data.find(needle)
        while at >= 0:
            aligned = at % 4 == 0
            if aligned:
                positions.append(at // 4)
            at = data.find(needle, at + (4 if aligned else 1))
    positions.sort()
    return positions
