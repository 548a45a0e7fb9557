"""``prefixpin serve`` collects the collector's youngest generation on a timer
(``proxy.server.collect_young``): CPython's own count lets young objects pile up while old
ones die as fast as new ones are made, and their collection then holds the loop for tens
of milliseconds."""

from __future__ import annotations

import asyncio
import gc
import sys

import pytest

from prefixpin.proxy.server import GC_THRESHOLDS, collect_young

pytestmark = pytest.mark.anyio


def young() -> int:
    return len(gc.get_objects(generation=0))


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
