"""The garbage collector, tuned for a loop relaying hundreds of streams (``serve``).

What it buys: the relay's p99 pauses. With CPython's default thresholds the youngest
generation is collected every 700 allocations; a stream in flight holds a frame per event,
and at hundreds of streams those frequent collections (and the older generations they
promote into) are the pauses (bench/results/load/PROFILE.md). ``collect_less_often`` moves
the threshold to 20,000, and ``collect_young`` takes the youngest generation on a timer
instead, so the young objects a flood piles up never make one long collection: without it
the p99 was 18-41 ms (young collections of 15-46 ms of CPU; docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time

GC_THRESHOLDS = (20_000, 50, 100)  # gc.set_threshold for `serve` (collect_less_often)
GC_YOUNG_EVERY_S = 0.05  # and its youngest generation collected this often (collect_young)
IDLE_TICKS = 2  # collect_young's ticks in a row that find the process idle before it slows
GC_YOUNG_IDLE_S = 30.0  # ... to this period (or less: until_objects_pile)
GC_TRIPWIRE = 1_000  # the count that wakes it again (until_objects_pile)
IDLE_SHARE = 0.02  # a tick whose period the process spent under this share of CPU is idle


def collect_less_often() -> None:
    """The collector's youngest generation every 20,000 allocations, not 700 (process-wide):
    ``collect_young`` takes it on a timer meanwhile."""
    gc.set_threshold(*GC_THRESHOLDS)


async def collect_young(every_s: float, idle_ticks: int = IDLE_TICKS,
                        idle_every_s: float = GC_YOUNG_IDLE_S) -> None:
    """The collector's youngest generation, every ``every_s`` on the loop. CPython counts
    towards that collection the objects made less those freed, of any age: when old
    objects die as fast as new ones are made (a long reply's read frames folded away
    while new ones come, under a flood), the count stays low while the young objects
    pile up to tens of thousands, and their collection, when it comes, holds the loop
    for tens of milliseconds. Taken every 50 ms they are a few thousand at most: about a
    millisecond's pause. Once the process has been all but idle for ``idle_ticks`` ticks in
    a row (waiting on a long prefill, or on nothing), it cannot be piling objects up: the
    next tick waits until objects pile up (``until_objects_pile``: work has started
    again), or ``idle_every_s`` at most: a wake-up costs more than the collection (about
    0.2 ms of CPU on a virtual machine), paid for each second a request waits on a long
    prefill."""
    idle, cpu, wall = 0, time.process_time(), time.monotonic()
    while True:
        piling = False
        if idle >= idle_ticks:
            piling = await until_objects_pile(idle_every_s)
        else:
            await asyncio.sleep(every_s)
        gc.collect(0)
        now_cpu, now_wall = time.process_time(), time.monotonic()
        quiet = not piling and now_cpu - cpu < (now_wall - wall) * IDLE_SHARE
        idle = idle + 1 if quiet else 0
        cpu, wall = now_cpu, now_wall


async def until_objects_pile(at_most_s: float, tripwire: int = GC_TRIPWIRE) -> bool:
    """Until the interpreter collects on its own count, lowered to ``tripwire`` objects
    made and not freed (work has started again: True), or ``at_most_s`` (False). The count
    goes back up the moment it trips, not when the loop next runs this task: a loop busy
    with a flood would otherwise collect every ``tripwire`` objects until then."""
    loop = asyncio.get_running_loop()
    woken = loop.create_future()
    tripped = False

    def wake() -> None:
        if not woken.done():
            woken.set_result(None)

    def on_collection(phase: str, info: dict[str, int]) -> None:
        nonlocal tripped  # (any thread's allocation may collect: the loop is told safely)
        if phase == "start" and not tripped:
            tripped = True
            gc.set_threshold(*thresholds)
            loop.call_soon_threadsafe(wake)

    thresholds = gc.get_threshold()
    gc.set_threshold(tripwire, *thresholds[1:])
    gc.callbacks.append(on_collection)
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(at_most_s):
                await woken
    finally:
        gc.callbacks.remove(on_collection)
        gc.set_threshold(*thresholds)
    return tripped
