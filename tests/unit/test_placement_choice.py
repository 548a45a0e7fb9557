"""``SlotPool``'s slot choice, written for speed, chooses what it chose before."""

from __future__ import annotations

import random
import time

import pytest

from proxy.placement import SlotEntry, SlotPool, Want


def chosen_before(pool: SlotPool, want: Want) -> SlotEntry | None:
    """The choice as it was written before (lists of idle and empty slots, then victims)."""
    if want.preferred is not None:
        own = pool.entries[want.preferred]
        if own.occupant == want.session_id:
            return None if own.busy else own
    idle = [e for e in pool.entries if not e.busy]
    if not idle:
        return None
    empty = [e for e in idle if e.occupant is None]
    if empty:
        return empty[0]
    now = time.monotonic()
    return min(idle, key=lambda e: (e.worth(now), e.last_used))


@pytest.mark.parametrize("seed", range(200))
def test_the_choice_and_would_wait_are_those_of_the_lists(seed: int) -> None:
    rng = random.Random(seed)
    pool = SlotPool(rng.choice((1, 2, 4, 16)))
    sessions = [f"s{i}" for i in range(6)]
    base = time.monotonic()
    for entry in pool.entries:
        entry.occupant = rng.choice((None, *sessions))
        entry.kind = rng.choice(("main", "side")) if entry.occupant else None
        entry.tokens = rng.choice((0, 100, 5000))
        entry.busy = rng.random() < 0.4
        entry.last_used = base - rng.choice((0.0, 10.0, 300.0))
    session = rng.choice(sessions)
    holder = pool.holder_of(session)
    assert holder == next((e.index for e in pool.entries if e.occupant == session), None)
    for preferred in {None, holder, rng.randrange(len(pool.entries))}:
        want = Want(session, "main", preferred)
        assert pool._choose(want) is chosen_before(pool, want)
        assert pool.would_wait(want) == (chosen_before(pool, want) is None)
