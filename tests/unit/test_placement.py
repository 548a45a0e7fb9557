"""Slot leases: one request per slot, empty slots first, the cheapest victim, bounded waits."""

from __future__ import annotations

import asyncio
import time

import pytest

from prefixpin.core.errors import QueueTimeoutError
from prefixpin.proxy.session.placement import Eviction, SlotPool, Want

pytestmark = pytest.mark.anyio


async def occupy(pool: SlotPool, session: str, kind: str = "main", tokens: int = 0,
                 idle_s: float = 0.0) -> int:
    async with pool.lease(Want(session, kind, None), timeout_s=1) as lease:  # type: ignore[arg-type]
        slot = lease.slot
    pool.record_tokens(slot, session, tokens)
    pool.entries[slot].last_used = time.monotonic() - idle_s
    return slot


async def test_new_sessions_take_empty_slots_first() -> None:
    """Two sessions, two slots: each gets its own."""
    pool = SlotPool(2)
    assert {await occupy(pool, "a"), await occupy(pool, "b")} == {0, 1}
    assert pool.holder_of("a") is not None
    assert pool.holder_of("a") != pool.holder_of("b")


async def test_a_side_history_is_evicted_before_a_main_one() -> None:
    """A title request's slot goes before a main session's, whatever their recency."""
    pool = SlotPool(2)
    await occupy(pool, "main", "main", tokens=500, idle_s=600)
    side = await occupy(pool, "title", "side", tokens=500)
    evicted: list[Eviction] = []

    async def record(eviction: Eviction) -> None:
        evicted.append(eviction)

    pool._on_evict = record
    async with pool.lease(Want("new", "main", None), timeout_s=1) as lease:
        assert lease.slot == side
    assert [(e.session_id, e.reason) for e in evicted] == [("title", "side")]


async def test_a_large_recent_session_outweighs_a_small_fresh_one() -> None:
    """A 30k-token session idle a minute is kept; a 500-token one used just now goes."""
    pool = SlotPool(2)
    big = await occupy(pool, "big", tokens=30_000, idle_s=60)
    small = await occupy(pool, "small", tokens=500)
    async with pool.lease(Want("new", "main", None), timeout_s=1) as lease:
        assert lease.slot == small
    assert pool.holder_of("big") == big


async def test_a_session_waits_for_its_own_busy_slot() -> None:
    """Never two requests in one slot: the second of a session waits for the first."""
    pool = SlotPool(2)
    slot = await occupy(pool, "a")
    order: list[str] = []

    async def second() -> None:
        async with pool.lease(Want("a", "main", slot), timeout_s=5) as lease:
            order.append(f"second@{lease.slot}")

    async with pool.lease(Want("a", "main", slot), timeout_s=1):
        task = asyncio.create_task(second())
        await asyncio.sleep(0.05)
        assert order == []
        order.append("first done")
    await task
    assert order == ["first done", f"second@{slot}"]


async def test_waiting_is_bounded_by_the_queue_timeout() -> None:
    """Every slot busy past --queue-timeout: a 503-class error with Retry-After."""
    pool = SlotPool(1)
    texts: list[str] = []
    async with pool.lease(Want("a", "main", None), timeout_s=1):
        with pytest.raises(QueueTimeoutError) as caught:
            async with pool.lease(Want("b", "main", None), timeout_s=0.1, on_wait=texts.append):
                pass
    assert caught.value.status_code == 503
    assert "Retry-After" in caught.value.headers()
    assert texts == ["queued: all 1 slots busy"]


async def test_reset_forgets_every_occupant() -> None:
    """After an engine restart no slot is believed to hold anything."""
    pool = SlotPool(2)
    await occupy(pool, "a")
    pool.mark_known(0)
    pool.reset()
    assert pool.holder_of("a") is None
    assert not pool.known(0)


async def test_holding_a_slot_is_for_its_idle_occupant_only_and_makes_requests_wait() -> None:
    """Work on a slot outside a request (parking it ahead) holds it only while it is idle
    and still holds the session; a request for it waits until the work ends."""
    pool = SlotPool(2)
    a = await occupy(pool, "a")
    async with pool.holding(a, "b") as entry:
        assert entry is None  # not b's history
    async with pool.holding(7, "a") as entry:
        assert entry is None
    order: list[str] = []

    async def request() -> None:
        async with pool.lease(Want("a", "main", a), timeout_s=5):
            order.append("request")

    async with pool.holding(a, "a") as entry:
        assert entry is not None
        assert entry.busy
        assert pool.others_busy(1 - a)
        assert not pool.others_busy(a)
        async with pool.holding(a, "a") as again:
            assert again is None  # busy
        task = asyncio.create_task(request())
        await asyncio.sleep(0.05)
        order.append("held")
    await task
    assert order == ["held", "request"]


async def test_a_pool_is_contended_while_requests_wait_or_soon_after_an_eviction() -> None:
    pool = SlotPool(1)
    await occupy(pool, "a")
    assert not pool.contended(600)
    await occupy(pool, "b")  # a evicted
    assert pool.contended(600)
    assert pool.last_eviction is not None
    pool.last_eviction -= 601
    assert not pool.contended(600)
