"""Per-message results of a resent history, found again by identity.

An agent's follow-up resends its whole history, and the body memo
(``proxy.pipeline.body_memo``) hands it the earlier request's message objects for every
message whose bytes are unchanged. A stage that computes something per message (a digest,
a prefix key, a role check) keeps what it computed for a recent list here, and for the next
list takes the results of the run of leading items that are the very same objects: the
comparison runs at C speed (``map(operator.is_, ...)``), so a follow-up's stage costs what
the turn added, not the length of the conversation.

Exact by construction: an item is reused only where it *is* the earlier list's item, and
every stage that uses this computes a pure function of its item (an object nobody mutates
on the request path). Identity can only miss (an equal object parsed anew), never mislead.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from prefixpin.fingerprint import extend_prefix_keys, prefix_keys

T = TypeVar("T")

LISTS = 32  # the recent lists held, at most (the objects are mostly the body memo's own)
ITEMS = 1 << 15  # their items, in all, at most
PER_START = 4  # lists held under one first item (sessions that share their first object)


@dataclass(frozen=True, slots=True)
class _Held(Generic[T]):
    items: tuple[object, ...]  # kept alive: an id is unique only while its object lives
    results: tuple[T, ...]


class PrefixMemo(Generic[T]):
    """Results of recent lists, one per item, under the identity of their first item."""

    def __init__(self, lists: int = LISTS, items: int = ITEMS) -> None:
        self._held: OrderedDict[tuple[Hashable, int], list[_Held[T]]] = OrderedDict()
        self._max_lists = lists
        self._max_items = items
        self._lists = 0
        self._items = 0

    def shared(self, items: Sequence[object], tag: Hashable = None) -> tuple[T, ...]:
        """The results of the longest run of leading ``items`` that a held list (kept with
        the same ``tag``) starts with, the very same objects in the same places."""
        if not items:
            return ()
        held = self._held.get((tag, id(items[0])))
        if not held:
            return ()
        best: tuple[T, ...] = ()
        for entry in held:
            count = _same_leading(items, entry.items)
            if count > len(best):
                best = entry.results[:count]
        return best

    def keep(self, items: Sequence[object], results: Sequence[T], tag: Hashable = None) -> None:
        """Hold ``results`` (one per item) of ``items``; a held list that this one extends
        under the same first item is replaced."""
        if not items or len(items) > self._max_items:
            return
        entry = _Held(tuple(items), tuple(results))
        key = (tag, id(items[0]))
        held = self._held.pop(key, [])
        kept = [entry]
        for old in held:
            if len(kept) < PER_START and not _extended_by(old, entry):
                kept.append(old)
            else:
                self._forget(old)
        self._held[key] = kept
        self._lists += 1
        self._items += len(entry.items)
        self._trim()

    def _trim(self) -> None:
        while self._held and (self._lists > self._max_lists or self._items > self._max_items):
            _, dropped = self._held.popitem(last=False)
            for old in dropped:
                self._forget(old)

    def _forget(self, entry: _Held[T]) -> None:
        self._lists -= 1
        self._items -= len(entry.items)


def _same_leading(items: Sequence[object], held: Sequence[object]) -> int:
    """How many leading items are the very objects ``held`` has in the same places."""
    same = list(map(operator.is_, items, held))
    return same.index(False) if False in same else len(same)


def _extended_by(old: _Held[T], new: _Held[T]) -> bool:
    return len(old.items) <= len(new.items) and _same_leading(new.items, old.items) == len(
        old.items)


class PrefixKeys:
    """``prefix_keys`` of digest lists, a follow-up's extending the keys of the earlier list
    its digests start with (the very same digest objects: ``DigestMemo`` hands them out)."""

    def __init__(self) -> None:
        self._keys: PrefixMemo[bytes] = PrefixMemo()

    def __call__(self, digests: Sequence[bytes], scope: bytes) -> list[bytes]:
        known = self._keys.shared(digests, scope)
        if not known:
            keys = prefix_keys(digests, scope)
        else:
            keys = [*known, *extend_prefix_keys(known[-1], digests[len(known):])]
        self._keys.keep(digests, keys, scope)
        return keys
