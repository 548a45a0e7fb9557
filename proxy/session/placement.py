"""Placement inside one engine: which slot a request runs in, one request per slot at a time.

llama-server picks slots itself unless told (``id_slot``); pinning is only safe when the
proxy never sends a request to a busy slot (research note §3: a pinned busy slot can have
its sequence overwritten). So each slot is leased to one request at a time; a request
whose slot is busy, or that finds every slot busy, waits (the relay keeps sending
heartbeats) up to ``--queue-timeout``, then gets a 503 with Retry-After.

The queue is bounded (``QueueGate``): each waiting request holds its body for up to
``--queue-timeout``. A request that would wait while its namespace already has
``max_queued_per_namespace`` requests waiting on the lane, or the lane ``max_queued_per_lane``,
gets a 429 with Retry-After at once (``QueueFullError``, its ``code`` naming the cap).

Victims, when a slot must change hands: an empty slot first; then a slot holding a side
history (a title request, a sub-agent, a one-off); then the main history whose loss costs
least: its size discounted by how long it has been idle (a 30k-token session used a minute
ago outweighs a 500-token one used just now).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AbstractContextManager, asynccontextmanager
from dataclasses import dataclass

from prefixpin.core.errors import QueueTimeoutError, RetryLaterError
from prefixpin.proxy.session.sessions import Kind

# Idle seconds that halve a resident session's worth: recency matters, size matters more.
IDLE_HALF_LIFE_S = 120.0
SIDE_DISCOUNT = 0.1


class SlotEntry:
    """One engine slot as the proxy sees it. ``occupant`` (the session whose history the
    slot holds) and ``busy`` are properties: the pool that owns the entry keeps its
    indexes (who holds which slot, which slots are idle, how many are busy) from their
    assignments, whoever makes them (the pool, parking, the Redis slot table), so that
    placing a request reads them instead of scanning every slot (on a 256-slot engine
    under load each scan was tens of microseconds of cache misses, several per request)."""

    __slots__ = ("_busy", "_occupant", "_pool", "index", "kind", "last_used", "tokens")

    def __init__(self, index: int, occupant: str | None = None, kind: Kind | None = None,
                 tokens: int = 0, busy: bool = False, last_used: float | None = None, *,
                 pool: SlotPool | None = None) -> None:
        self.index = index
        self._occupant = occupant
        self.kind = kind
        self.tokens = tokens
        self._busy = busy
        self.last_used = time.monotonic() if last_used is None else last_used
        self._pool = pool

    @property
    def occupant(self) -> str | None:
        return self._occupant

    @occupant.setter
    def occupant(self, occupant: str | None) -> None:
        before = self._occupant
        if occupant != before:
            self._occupant = occupant
            if self._pool is not None:
                self._pool._moved(self, before)

    @property
    def busy(self) -> bool:
        return self._busy

    @busy.setter
    def busy(self, busy: bool) -> None:
        if busy != self._busy:
            self._busy = busy
            if self._pool is not None:
                self._pool._flipped(self)

    def detached(self) -> SlotEntry:
        """A copy no pool owns (a scratch entry: its changes move no index)."""
        return SlotEntry(self.index, self._occupant, self.kind, self.tokens, self._busy,
                         self.last_used)

    def worth(self, now: float) -> float:
        """What keeping this slot's history is worth (tokens not re-prefilled, discounted;
        ``SlotPool._choose`` computes the same inline)."""
        idle = max(0.0, now - self.last_used)
        value = self.tokens * IDLE_HALF_LIFE_S / (IDLE_HALF_LIFE_S + idle)
        return value * (SIDE_DISCOUNT if self.kind == "side" else 1.0)

    def __repr__(self) -> str:
        return (f"SlotEntry(index={self.index}, occupant={self._occupant!r}, "
                f"kind={self.kind!r}, tokens={self.tokens}, busy={self._busy}, "
                f"last_used={self.last_used})")


@dataclass(frozen=True, slots=True)
class Want:
    session_id: str
    kind: Kind
    preferred: int | None  # the slot that holds this session's history, if any
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class Lease:
    slot: int
    eviction: Eviction | None  # the history the slot held for another session, if any
    resident: bool = False  # the slot already held this session's history


@dataclass(frozen=True, slots=True)
class Eviction:
    slot: int
    session_id: str
    kind: Kind | None
    tokens: int
    reason: str  # empty | side | worth


Evictor = Callable[[Eviction], Awaitable[None]]


class QueueFullError(RetryLaterError):
    """Too many requests already wait for a slot (of this namespace, or in all)."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, code: str, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.code = code


class QueueGate:
    """Counts the requests of one lane waiting for a slot lease, per namespace; refuses one
    that would have to wait beyond either cap."""

    def __init__(self, *, max_queued: int, max_queued_per_namespace: int,
                 retry_after_s: int = 2) -> None:
        self.max_queued = max_queued
        self.max_queued_per_namespace = max_queued_per_namespace
        self.retry_after_s = retry_after_s
        self.waiting = 0
        self.by_namespace: dict[str, int] = {}

    def admit(self, namespace: str, *, would_wait: bool) -> None:
        if not would_wait:
            return
        if self.waiting >= self.max_queued:
            raise QueueFullError(
                f"{self.waiting} requests already wait for a slot on this engine "
                "(max_queued_per_lane)", code="queue_full_lane", retry_after_s=self.retry_after_s)
        if self.by_namespace.get(namespace, 0) >= self.max_queued_per_namespace:
            raise QueueFullError(
                f"{self.max_queued_per_namespace} requests of this namespace already wait for "
                "a slot (max_queued_per_namespace)", code="queue_full_namespace",
                retry_after_s=self.retry_after_s)

    def queued(self, namespace: str) -> AbstractContextManager[Callable[[], None]]:
        """Count one request until the callable it yields is called (its lease granted)
        or the block ends."""
        return _Queued(self, namespace)


class _Queued:
    """``QueueGate.queued``: a plain context manager (a generator-based one costs ~1 us
    more, on every request that takes a slot)."""

    __slots__ = ("_done", "_gate", "_namespace")

    def __init__(self, gate: QueueGate, namespace: str) -> None:
        self._gate = gate
        self._namespace = namespace
        self._done = False

    def __enter__(self) -> Callable[[], None]:
        gate, namespace = self._gate, self._namespace
        gate.waiting += 1
        gate.by_namespace[namespace] = gate.by_namespace.get(namespace, 0) + 1
        return self.leave

    def __exit__(self, *exc: object) -> None:
        self.leave()

    def leave(self) -> None:
        if self._done:
            return
        self._done = True
        gate, namespace = self._gate, self._namespace
        gate.waiting -= 1
        left = gate.by_namespace[namespace] - 1
        if left:
            gate.by_namespace[namespace] = left
        else:
            del gate.by_namespace[namespace]


class SlotPool:
    def __init__(self, n_slots: int, *, on_evict: Evictor | None = None) -> None:
        self.entries: list[SlotEntry] = []
        self._new_entries(n_slots)
        self._changed = asyncio.Condition()
        self._on_evict = on_evict
        self.waiting = 0
        self.last_eviction: float | None = None  # when a slot last changed hands (monotonic)
        self._known: set[int] = set()  # slots whose contents the proxy put there

    # ------------------------------------------------------------ the indexes

    def _new_entries(self, n_slots: int) -> None:
        for entry in self.entries:
            entry._pool = None  # an entry let go moves no index of this pool
        self.entries = [SlotEntry(i, pool=self) for i in range(n_slots)]
        self._holders: dict[str, list[SlotEntry]] = {}  # occupant -> its slots (one, mostly)
        self._idle_empty: set[int] = set(range(n_slots))  # idle slots holding nothing
        self._idle_held: dict[int, SlotEntry] = {}  # idle slots holding a history
        self._n_busy = 0
        self._n_occupied = 0

    def _moved(self, entry: SlotEntry, before: str | None) -> None:
        """``entry.occupant`` changed from ``before`` (called by the entry)."""
        if before is not None:
            held = self._holders[before]
            held.remove(entry)
            if not held:
                del self._holders[before]
            self._n_occupied -= 1
        occupant = entry._occupant
        if occupant is not None:
            self._holders.setdefault(occupant, []).append(entry)
            self._n_occupied += 1
        if not entry._busy and (before is None) != (occupant is None):
            # An idle slot filled or emptied: from one idle index to the other.
            if occupant is None:
                del self._idle_held[entry.index]
                self._idle_empty.add(entry.index)
            else:
                self._idle_empty.discard(entry.index)
                self._idle_held[entry.index] = entry

    def _flipped(self, entry: SlotEntry) -> None:
        """``entry.busy`` flipped (called by the entry): out of the idle indexes when it
        became busy, into the one for its contents when it became idle."""
        if entry._busy:
            self._n_busy += 1
            if entry._occupant is None:
                self._idle_empty.discard(entry.index)
            else:
                self._idle_held.pop(entry.index, None)
            return
        self._n_busy -= 1
        if entry._occupant is None:
            self._idle_empty.add(entry.index)
        else:
            self._idle_held[entry.index] = entry

    def holder_of(self, session_id: str) -> int | None:
        """The slot holding ``session_id``'s history (the first, should two)."""
        held = self._holders.get(session_id)
        if not held:
            return None
        return held[0].index if len(held) == 1 else min(entry.index for entry in held)

    @property
    def occupied(self) -> int:
        """How many slots hold a history."""
        return self._n_occupied

    @property
    def busy(self) -> int:
        """How many slots are leased."""
        return self._n_busy

    def forget(self, session_id: str) -> None:
        for entry in list(self._holders.get(session_id, ())):
            if not entry.busy:
                entry.occupant, entry.kind, entry.tokens = None, None, 0

    def release(self, session_id: str) -> None:
        """``session_id`` ended: no slot holds it any more as far as placement goes, even
        one still leased to its last request (it is empty to placement from then on). What
        the engine still holds there is unknown from then on: the next request in the slot,
        of whichever tenant, is not read from cache."""
        for entry in list(self._holders.get(session_id, ())):
            entry.occupant, entry.kind, entry.tokens = None, None, 0
            self._known.discard(entry.index)

    def reset(self) -> None:
        """The engine restarted: no slot holds anything the proxy knows of."""
        for entry in self.entries:
            entry.occupant, entry.kind, entry.tokens = None, None, 0
        self._known.clear()

    def resize(self, n_slots: int) -> None:
        """The engine came back with another slot count (only called between requests)."""
        self._new_entries(n_slots)

    def would_wait(self, want: Want) -> bool:
        """No slot for ``want`` is free now (as this pool's copy sees it): ``_choose`` would
        find none, told without weighing victims."""
        if want.preferred is not None:
            own = self.entries[want.preferred]
            if own.occupant == want.session_id:
                return own.busy
        return self._n_busy == len(self.entries)

    def shared_table(self) -> tuple[Callable[[], Awaitable[None]],
                                    tuple[type[BaseException], ...]] | None:
        """How to read this pool's table again from where replicas share it, and the errors
        that read may raise (``proxy.cluster.slots.SharedSlotPool``); None: the table is
        this process's own."""
        return None

    def known(self, slot: int) -> bool:
        return slot in self._known

    def mark_known(self, slot: int) -> None:
        self._known.add(slot)

    def lease(self, want: Want, *, timeout_s: float,
              on_wait: Callable[[str], None] | None = None
              ) -> AbstractAsyncContextManager[Lease]:
        """The slot for ``want`` while the block runs (waiting for it up to ``timeout_s``:
        ``QueueTimeoutError``); ``on_wait`` is told why while it waits."""
        return _Leasing(self, want, timeout_s, on_wait)

    async def _free(self, entry: SlotEntry) -> None:
        entry.busy = False
        entry.last_used = time.monotonic()
        if self.waiting:  # nobody waits: nobody to wake
            async with self._changed:
                self._changed.notify_all()

    def contended(self, within_s: float) -> bool:
        """More sessions want slots than there are: requests wait now, or a slot changed
        hands within ``within_s``."""
        if self.waiting:
            return True
        return (self.last_eviction is not None
                and time.monotonic() - self.last_eviction < within_s)

    def others_busy(self, slot: int) -> bool:
        entry = self._entry_at(slot)
        return self._n_busy - (entry is not None and entry.busy) > 0

    def _entry_at(self, slot: int) -> SlotEntry | None:
        return self.entries[slot] if 0 <= slot < len(self.entries) else None

    @asynccontextmanager
    async def holding(self, slot: int, session_id: str) -> AsyncIterator[SlotEntry | None]:
        """The slot, marked busy, if it is idle and still holds ``session_id``; else None.
        For work on a slot's contents outside any request (parking it ahead): a request for
        the slot waits until the block ends, as for any lease; it is not a use of the slot
        (its idle time, which the eviction order reads, goes on)."""
        entry = self._entry_at(slot)
        if entry is None or entry.busy or entry.occupant != session_id:
            yield None
            return
        entry.busy = True
        try:
            yield entry
        finally:
            entry.busy = False
            async with self._changed:
                self._changed.notify_all()

    def record_tokens(self, slot: int, session_id: str, tokens: int) -> None:
        entry = self.entries[slot]
        if entry.occupant == session_id:
            entry.tokens = tokens

    def _take_now(self, want: Want) -> tuple[SlotEntry, Eviction | None, bool] | None:
        """The slot, taken at once when nobody waits and one is free: what ``_acquire``
        would take without waiting, without its deadline timer and lock."""
        if self.waiting or self._changed.locked():
            return None  # those already waiting come first
        entry = self._choose(want)
        if entry is None:
            return None
        resident = entry.occupant == want.session_id
        return entry, self._take(entry, want), resident

    async def _acquire(self, want: Want, timeout_s: float, on_wait: Callable[[str], None] | None
                       ) -> tuple[SlotEntry, Eviction | None, bool]:
        try:
            async with asyncio.timeout(timeout_s), self._changed:
                self.waiting += 1
                try:
                    while (entry := self._choose(want)) is None:
                        if on_wait is not None:
                            on_wait(self._wait_text(want))
                        await self._changed.wait()
                finally:
                    self.waiting -= 1
                resident = entry.occupant == want.session_id
                return entry, self._take(entry, want), resident
        except TimeoutError:
            raise QueueTimeoutError(
                f"no engine slot became free within {timeout_s:.0f} s (--queue-timeout)",
                retry_after_s=max(1, int(timeout_s / 10))) from None

    def _choose(self, want: Want) -> SlotEntry | None:
        if want.preferred is not None:
            own = self.entries[want.preferred]
            if own.occupant == want.session_id:
                return None if own.busy else own
        # The first empty idle slot, else the cheapest victim among the idle: the least
        # ``worth``, then the least recently used, the first of equals (``min`` over
        # (worth, last_used, slot), written out). Read from the idle indexes: on a full
        # engine under load most slots are busy, and none of them is touched.
        if self._idle_empty:
            return self.entries[min(self._idle_empty)]
        now = time.monotonic()
        half_life = IDLE_HALF_LIFE_S
        best: SlotEntry | None = None
        best_worth = best_used = 0.0
        for entry in self._idle_held.values():
            used = entry.last_used
            idle_s = now - used
            if idle_s < 0.0:
                idle_s = 0.0
            worth = entry.tokens * half_life / (half_life + idle_s)
            if entry.kind == "side":
                worth *= SIDE_DISCOUNT
            if best is None or worth < best_worth or (worth == best_worth and (
                    used < best_used or (used == best_used and entry.index < best.index))):
                best, best_worth, best_used = entry, worth, used
        return best

    def _take(self, entry: SlotEntry, want: Want) -> Eviction | None:
        eviction = None
        if entry.occupant is not None and entry.occupant != want.session_id:
            reason = "side" if entry.kind == "side" else "worth"
            eviction = Eviction(entry.index, entry.occupant, entry.kind, entry.tokens, reason)
            self.last_eviction = time.monotonic()
        if entry.occupant != want.session_id:
            entry.tokens = 0
        entry.occupant, entry.kind, entry.busy = want.session_id, want.kind, True
        return eviction

    def _wait_text(self, want: Want) -> str:
        if want.preferred is not None and self.entries[want.preferred].occupant == want.session_id:
            return f"queued for slot {want.preferred}"
        return f"queued: all {len(self.entries)} slots busy"


class _Leasing:
    """``SlotPool.lease``: a plain async context manager (a generator-based one costs
    ~1.5 us more per request)."""

    __slots__ = ("_entry", "_on_wait", "_pool", "_timeout_s", "_want")

    def __init__(self, pool: SlotPool, want: Want, timeout_s: float,
                 on_wait: Callable[[str], None] | None) -> None:
        self._pool = pool
        self._want = want
        self._timeout_s = timeout_s
        self._on_wait = on_wait
        self._entry: SlotEntry | None = None

    async def __aenter__(self) -> Lease:
        pool, want = self._pool, self._want
        taken = pool._take_now(want)
        entry, eviction, resident = (taken if taken is not None else
                                     await pool._acquire(want, self._timeout_s, self._on_wait))
        self._entry = entry
        if eviction is not None and pool._on_evict is not None:
            try:
                await pool._on_evict(eviction)  # parking saves the slot before it is reused
            except BaseException:
                self._entry = None
                await pool._free(entry)
                raise
        return Lease(entry.index, eviction, resident)

    async def __aexit__(self, *exc: object) -> None:
        entry, self._entry = self._entry, None
        if entry is not None:
            await self._pool._free(entry)
