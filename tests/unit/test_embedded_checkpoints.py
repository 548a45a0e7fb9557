"""The embedded engine's checkpoint bookkeeping and slot-file trailer (no model needed;
the rollback itself runs on a real model in tests/engine/test_embedded_hybrid.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from prefixpin.adapters.embedded.model.checkpoints import (
    Checkpoint,
    CheckpointFileError,
    Checkpoints,
    decode_trailer,
    encode_trailer,
)


def at(n_tokens: int) -> Checkpoint:
    return Checkpoint(n_tokens, bytearray(n_tokens.to_bytes(4, "little")))


def test_a_slot_keeps_its_newest_checkpoints_in_order() -> None:
    kept = Checkpoints([at(10), at(20), at(30), at(40)], bound=3)
    assert [kept.latest_within(n) for n in (9, 25, 100)] == [None, at(20), at(40)]
    assert len(kept) == 3  # the oldest went


def test_checkpoints_past_a_cut_are_forgotten() -> None:
    kept = Checkpoints([at(10), at(20), at(30)])
    kept.forget_after(20)
    assert kept.newest() == at(20)
    kept.add(at(15))  # a prompt that left the tokens at 15: nothing after it stays
    assert kept.newest() == at(15)
    assert kept.latest_within(19) == at(15)
    assert len(kept) == 2


def test_a_trailer_reads_back_what_was_written() -> None:
    written = [at(7), at(1234)]
    assert decode_trailer(encode_trailer(written)) == written


@pytest.mark.parametrize("damage", [
    lambda raw: raw[:-1],  # cut short
    lambda raw: raw + b"\0",  # bytes after it
    lambda raw: b"xxxx" + raw[4:],  # not a trailer
])
def test_a_damaged_trailer_is_refused(damage: Callable[[bytes], bytes]) -> None:
    raw = encode_trailer([at(7)])
    with pytest.raises(CheckpointFileError):
        decode_trailer(damage(raw))
