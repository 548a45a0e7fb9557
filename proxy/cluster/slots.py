"""Slot assignments in Redis: which session each slot of a backend holds, and who uses it.

Every replica in front of a backend sees one slot table (a hash, one JSON entry per slot:
occupant session, kind, tokens, last use, whether the proxy knows its contents) and leases
a slot with a Redis lock (``SET NX PX``) whose value names the replica. The slot choice is
``SlotPool``'s own (own slot, else empty, else cheapest victim), made on a fresh copy of the
table; the lock and the new occupant are written by one script that fails when the slot
changed hands since it was read, and the choice is made again.

- A lease is exclusive across replicas: one lock per slot, renewed every third of its TTL
  while the request runs, deleted (only by its owner) when the engine's answer is read.
- A replica that dies holding a lock: the lock expires after ``LOCK_TTL_S``; sooner, a
  waiter that sees the holder's heartbeat gone deletes it (compare-and-delete).
- Waiting: a request whose slot is busy polls the table every ``POLL_S`` (and wakes at once
  on a release by its own replica), with heartbeats to its client, up to --queue-timeout.
- Queue depth per backend (for placement): a hash of waiting requests per replica; the
  fields of dead replicas are not counted.
- An engine restart (another start time) clears the table once: whichever replica sees it
  first swaps the recorded start time and deletes the table.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
import redis

from prefixpin.adapters.base import EngineInfo
from prefixpin.core.errors import QueueTimeoutError
from prefixpin.proxy.cluster.core import Cluster
from prefixpin.proxy.ops.logs import log_event
from prefixpin.proxy.pipeline.records import Load
from prefixpin.proxy.pipeline.shared import SharedStateError
from prefixpin.proxy.session.placement import Eviction, Evictor, Lease, SlotEntry, SlotPool, Want

LOCK_TTL_S = 15.0
POLL_S = 0.05
LOAD_CACHE_S = 0.25

# KEYS: lock, table. ARGV: slot, token, ttl ms, expected occupant ("" none), new entry.
_TAKE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local current = redis.call('HGET', KEYS[2], ARGV[1])
local occupant = ''
if current then occupant = cjson.decode(current)['o'] end
if occupant ~= ARGV[4] then return -1 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[5])
return 1
"""

# KEYS: lock, table. ARGV: token, slot, entry. The entry is written only while the lock is
# still this lease's (it may have expired and gone to another replica).
_RELEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('DEL', KEYS[1])
return 1
"""

# KEYS: table. ARGV: slot, occupant, tokens. Tokens of a slot still held by that occupant.
_TOKENS = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
if not current then return 0 end
local entry = cjson.decode(current)
if entry['o'] ~= ARGV[2] then return 0 end
entry['t'] = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(entry))
return 1
"""

# KEYS: engine start key, table. ARGV: start time. Clears the table when it changed.
_ENGINE = """
local before = redis.call('GET', KEYS[1])
if before == ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
return 1
"""


class SharedSlotPool(SlotPool):
    def __init__(self, cluster: Cluster, backend: str, n_slots: int, logger: logging.Logger,
                 *, on_evict: Evictor | None = None) -> None:
        super().__init__(n_slots, on_evict=on_evict)
        self.cluster = cluster
        self.backend = backend
        self.log = logger
        self._table = cluster.key("slots", backend)
        self._queue = cluster.key("queue", backend)
        self._engine = cluster.key("engine", backend)
        self._take_script = cluster.r.register_script(_TAKE)
        self._release_script = cluster.r.register_script(_RELEASE)
        self._tokens_script = cluster.sync.register_script(_TOKENS)
        self._engine_script = cluster.r.register_script(_ENGINE)
        self._queued_elsewhere = 0
        self._load_at = -1.0
        self._held: set[int] = set()  # slots this replica leases now: its copy is the truth

    def _lock(self, slot: int) -> str:
        return self.cluster.key("lock", self.backend, str(slot))

    async def adopt_engine(self, info: EngineInfo) -> bool:
        """The table describes this engine process; cleared if it describes another
        (returns whether it was cleared)."""
        marker = f"{info.start_time}/{info.n_slots}/{info.model}"
        cleared = bool(await self._engine_script(keys=[self._engine, self._table],
                                                 args=[marker]))
        if info.n_slots != len(self.entries):
            self.resize(info.n_slots)
        if cleared:
            self.reset()
            log_event(self.log, logging.INFO, "slot table reset", upstream=self.backend,
                      reason="engine (re)started", slots=info.n_slots)
        return cleared

    def shared_table(self) -> tuple[Callable[[], Awaitable[None]],
                                    tuple[type[BaseException], ...]]:
        return self.refresh, self.cluster.errors

    async def refresh(self) -> None:
        """Read the slot table, the locks and the queue into this replica's copy."""
        n = len(self.entries)
        async with self.cluster.r.pipeline(transaction=False) as pipe:
            pipe.hgetall(self._table)
            pipe.mget([self._lock(i) for i in range(max(n, 1))])
            pipe.hgetall(self._queue)
            table, locks, queue = await pipe.execute()
        now_wall, now = time.time(), time.monotonic()
        self._known &= self._held
        for entry in self.entries:
            if entry.index in self._held:
                continue  # written back when its lease ends
            raw = table.get(str(entry.index).encode())
            data: dict[str, Any] = orjson.loads(raw) if raw else {}
            entry.occupant = data.get("o") or None
            entry.kind = data.get("k") or None
            entry.tokens = int(data.get("t") or 0)
            entry.last_used = now - max(0.0, now_wall - float(data.get("u") or 0.0))
            entry.busy = locks[entry.index] is not None
            if data.get("n"):
                self._known.add(entry.index)
        self._queued_elsewhere = sum(
            int(count) for replica, count in queue.items()
            if self.cluster.alive(replica.decode()) and replica.decode() != self.cluster.replica)
        self._load_at = now

    async def recent(self) -> None:
        """The table as read at most ``LOAD_CACHE_S`` ago (placement just read it)."""
        if time.monotonic() - self._load_at > LOAD_CACHE_S:
            await self.refresh()

    async def load(self) -> Load:
        await self.recent()
        return Load(len(self.entries), self.busy, self.waiting + self._queued_elsewhere)

    def record_tokens(self, slot: int, session_id: str, tokens: int) -> None:
        """Called from the (synchronous) commit: one round trip, occupant checked."""
        super().record_tokens(slot, session_id, tokens)
        try:
            self._tokens_script(keys=[self._table], args=[slot, session_id, tokens])
        except (redis.RedisError, OSError) as exc:
            log_event(self.log, logging.WARNING, "slot tokens not shared", slot=slot,
                      error=str(exc))

    @asynccontextmanager
    async def lease(self, want: Want, *, timeout_s: float,
                    on_wait: Callable[[str], None] | None = None) -> AsyncIterator[Lease]:
        entry, eviction, resident, token = await self._acquire_shared(want, timeout_s, on_wait)
        renewal = asyncio.create_task(self._renew(entry.index, token),
                                      name="prefixpin-slot-lock")
        try:
            if eviction is not None and self._on_evict is not None:
                await self._on_evict(eviction)
            yield Lease(entry.index, eviction, resident)
        finally:
            renewal.cancel()
            await asyncio.gather(renewal, return_exceptions=True)
            entry.busy = False
            entry.last_used = time.monotonic()
            await self._release(entry, token)
            self._held.discard(entry.index)
            async with self._changed:
                self._changed.notify_all()

    async def _acquire_shared(self, want: Want, timeout_s: float,
                              on_wait: Callable[[str], None] | None
                              ) -> tuple[SlotEntry, Eviction | None, bool, str]:
        try:
            return await self._acquire_waiting(want, timeout_s, on_wait)
        except self.cluster.errors as exc:
            raise SharedStateError(f"shared state (Redis) unreachable: {exc}") from None

    async def _acquire_waiting(self, want: Want, timeout_s: float,
                               on_wait: Callable[[str], None] | None
                               ) -> tuple[SlotEntry, Eviction | None, bool, str]:
        deadline = time.monotonic() + timeout_s
        self.waiting += 1
        await self._count_waiting(+1)
        try:
            while True:
                await self.refresh()
                entry = self._choose(want)
                if entry is not None:
                    taken = await self._try_take(entry, want)
                    if taken is not None:
                        return taken
                    continue  # the slot changed hands since it was read: choose again
                await self._take_over_dead_locks()
                if on_wait is not None:
                    on_wait(self._wait_text(want))
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise QueueTimeoutError(
                        f"no engine slot became free within {timeout_s:.0f} s "
                        "(--queue-timeout)", retry_after_s=max(1, int(timeout_s / 10)))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(POLL_S, remaining)), self._changed:
                        await self._changed.wait()
        finally:
            self.waiting -= 1
            await self._count_waiting(-1)

    async def _try_take(self, entry: SlotEntry, want: Want
                        ) -> tuple[SlotEntry, Eviction | None, bool, str] | None:
        expected = entry.occupant or ""
        resident = entry.occupant == want.session_id
        scratch = entry.detached()
        eviction = self._take(scratch, want)
        token = self.cluster.token()
        result = await self._take_script(
            keys=[self._lock(entry.index), self._table],
            args=[entry.index, token, int(LOCK_TTL_S * 1000), expected,
                  self._encode(scratch)])
        if int(result) != 1:
            return None
        entry.occupant, entry.kind, entry.tokens = scratch.occupant, scratch.kind, scratch.tokens
        entry.busy = True
        self._held.add(entry.index)
        return entry, eviction, resident, token

    async def _release(self, entry: SlotEntry, token: str) -> None:
        try:
            await self._release_script(keys=[self._lock(entry.index), self._table],
                                       args=[token, entry.index, self._encode(entry)])
        except (redis.RedisError, OSError) as exc:  # the lock expires by itself
            log_event(self.log, logging.WARNING, "slot lock not released", slot=entry.index,
                      upstream=self.backend, error=str(exc))

    async def _renew(self, slot: int, token: str) -> None:
        while True:
            await asyncio.sleep(LOCK_TTL_S / 3)
            try:
                kept = await self.cluster.expire_if(keys=[self._lock(slot)],
                                                    args=[token, int(LOCK_TTL_S * 1000)])
            except (redis.RedisError, OSError) as exc:
                log_event(self.log, logging.WARNING, "slot lock not renewed", slot=slot,
                          error=str(exc))
                continue
            if not kept:
                log_event(self.log, logging.WARNING, "slot lock lost", slot=slot,
                          upstream=self.backend)
                return

    async def _take_over_dead_locks(self) -> None:
        """A lock whose replica stopped its heartbeat is dropped (its request died with it:
        the engine cancels a request whose connection closed)."""
        busy = [e.index for e in self.entries if e.busy]
        if not busy:
            return
        holders = await self.cluster.r.mget([self._lock(i) for i in busy])
        for slot, holder in zip(busy, holders, strict=True):
            if (holder is not None and not await self.cluster.is_alive(Cluster.owner_of(holder))
                    and await self.cluster.delete_if(keys=[self._lock(slot)], args=[holder])):
                log_event(self.log, logging.WARNING, "slot lock taken over", slot=slot,
                          upstream=self.backend, dead_replica=Cluster.owner_of(holder))

    async def _count_waiting(self, delta: int) -> None:
        with contextlib.suppress(redis.RedisError, OSError):
            await self.cluster.r.hincrby(self._queue, self.cluster.replica, delta)

    def _encode(self, entry: SlotEntry) -> bytes:
        age = max(0.0, time.monotonic() - entry.last_used)
        return orjson.dumps({"o": entry.occupant or "", "k": entry.kind or "",
                             "t": entry.tokens, "u": time.time() - age,
                             "n": entry.index in self._known})
