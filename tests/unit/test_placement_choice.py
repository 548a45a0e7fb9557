"""``SlotPool``'s slot choice, written for speed, chooses what it chose before."""

from __future__ import annotations

import random
import time

import pytest

from prefixpin.proxy.session.placement import SlotEntry, SlotPool, Want


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


@pytest.mark.parametrize("seed", range(100))
def test_the_indexes_agree_with_a_scan_after_any_changes(seed: int) -> None:
    """Whatever assigns ``occupant`` and ``busy`` (the pool, parking, the Redis table), in
    whatever order, the pool's indexes say what a scan of its slots says."""
    rng = random.Random(seed)
    pool = SlotPool(rng.choice((1, 3, 8)))
    sessions = [f"s{i}" for i in range(4)]
    for step in range(60):
        if rng.random() < 0.03:
            pool.resize(rng.choice((1, 3, 8)))
        entry = rng.choice(pool.entries)
        if rng.random() < 0.5:
            entry.occupant = rng.choice((None, *sessions))
        else:
            entry.busy = not entry.busy
        if rng.random() < 0.1:
            pool.reset()
        assert pool.busy == sum(e.busy for e in pool.entries), step
        assert pool.occupied == sum(e.occupant is not None for e in pool.entries), step
        for session in sessions:
            assert pool.holder_of(session) == next(
                (e.index for e in pool.entries if e.occupant == session), None), step
        for slot in range(len(pool.entries)):
            assert pool.others_busy(slot) == any(
                e.busy for e in pool.entries if e.index != slot), step
        want = Want(rng.choice(sessions), "main", None)
        assert pool._choose(want) is chosen_before(pool, want), step


def test_an_entry_let_go_by_a_resize_moves_no_index() -> None:
    pool = SlotPool(2)
    old = pool.entries[0]
    pool.resize(2)
    old.occupant, old.busy = "s1", True
    assert (pool.busy, pool.occupied, pool.holder_of("s1")) == (0, 0, None)


def test_a_detached_copy_moves_no_index() -> None:
    pool = SlotPool(2)
    scratch = pool.entries[1].detached()
    scratch.occupant, scratch.busy = "s1", True
    assert (pool.busy, pool.occupied, pool.holder_of("s1")) == (0, 0, None)
    assert pool.entries[1].occupant is None


def test_forget_empties_the_idle_slots_of_a_session_and_leaves_a_busy_one() -> None:
    pool = SlotPool(4)
    for index in (0, 2, 3):
        pool.entries[index].occupant = "s1"
    pool.entries[3].busy = True
    pool.forget("s1")
    assert [e.occupant for e in pool.entries] == [None, None, None, "s1"]
    assert (pool.occupied, pool.holder_of("s1")) == (1, 3)
