"""``prefixpin serve`` collects the collector's youngest generation on a timer
(``proxy.speed.collector.collect_young``): CPython's own count lets young objects pile up while old
ones die as fast as new ones are made, and their collection then holds the loop for tens
of milliseconds."""

from __future__ import annotations

import asyncio
import gc
import sys

import pytest

from prefixpin.proxy.speed.collector import GC_THRESHOLDS, collect_young

pytestmark = pytest.mark.anyio


def young() -> int:
    return len(gc.get_objects(generation=0))


async def churn(old: list[list[int]], kept: list[list[int]], rounds: int, each: int) -> None:
    """A young object made for each old one freed, a turn of the loop between rounds."""
    for _ in range(rounds):
        for _ in range(each):
            old.pop()
            kept.append([0])
        await asyncio.sleep(0.02)


async def stop(collector: asyncio.Task[None]) -> None:
    collector.cancel()
    with pytest.raises(asyncio.CancelledError):
        await collector


async def test_the_young_generation_is_collected_on_time_whatever_the_count() -> None:
    """Objects made while as many old ones are freed never bring CPython's count to its
    threshold: only the timer collects them."""
    old = [[i] for i in range(200_000)]  # made, then aged past the youngest generation
    gc.collect()
    thresholds = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLDS)
    kept: list[list[int]] = []
    try:
        def churn() -> None:  # a young object made for each old one freed
            for _ in range(2_000):
                old.pop()
                kept.append([0])

        for _ in range(20):
            churn()
        piled = young()
        collector = asyncio.create_task(collect_young(0.01))
        for _ in range(20):
            churn()
            await asyncio.sleep(0.02)
        collector.cancel()
        with pytest.raises(asyncio.CancelledError):
            await collector
        after = young()
    finally:
        gc.set_threshold(*thresholds)
    if sys.version_info < (3, 14):  # (3.14's collector is incremental: another count)
        assert piled >= 40_000  # CPython's own count let them pile up
    assert after < 10_000  # the timer's collections kept them few


async def test_an_idle_loop_slows_the_timer_until_objects_pile_up_again() -> None:
    """Idle for its ticks, the collector sleeps for its idle period (a wake-up is paid
    for every second a request waits on a prefill); objects made and kept wake it before
    that, and it collects on its timer again, whatever the count does next."""
    old = [[i] for i in range(200_000)]
    gc.collect()
    thresholds = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLDS)
    timed: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            timed.append(info["generation"])

    kept: list[list[int]] = []
    gc.callbacks.append(count)
    try:
        collector = asyncio.create_task(collect_young(0.05, idle_ticks=3, idle_every_s=5.0))
        await asyncio.sleep(0.3)  # idle: three ticks, then the timer slows (to 5 s here)
        timed.clear()
        await asyncio.sleep(0.6)  # (a timer, however slow, would have ticked)
        asleep = len(timed)
        kept.extend([0] for _ in range(5_000))  # work starts: the count passes the tripwire
        # ... and the tripwire is gone at once, before the loop gets to wake the timer (a
        # busy loop may take a while; meanwhile work would collect every 1,000 objects)
        tripped_threshold = gc.get_threshold()
        await churn(old, kept, rounds=20, each=2_000)  # then the count stands still
        after = young()
        await stop(collector)
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*thresholds)
    assert asleep == 0  # no collection while the loop idled
    assert tripped_threshold == GC_THRESHOLDS
    assert gc.get_threshold() == thresholds
    assert after < 10_000  # the timer collects again


async def test_a_flood_the_count_misses_is_found_by_the_idle_tick() -> None:
    """Old objects freed as fast as new ones are made, from an idle start: the count never
    trips, and the idle period's tick finds the process busy."""
    old = [[i] for i in range(400_000)]
    gc.collect()
    thresholds = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLDS)
    kept: list[list[int]] = []
    try:
        collector = asyncio.create_task(collect_young(0.05, idle_ticks=2, idle_every_s=0.3))
        await asyncio.sleep(0.5)  # idle: the ticks slow to the idle period
        await churn(old, kept, rounds=40, each=4_000)
        after = young()
        await stop(collector)
    finally:
        gc.set_threshold(*thresholds)
    assert after < 10_000
