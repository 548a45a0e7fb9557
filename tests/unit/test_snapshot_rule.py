"""When a prompt-end snapshot pays (``proxy.parking.snapshot.judge``), and which file is
which session's snapshot (``Book``). The snapshots themselves, against a real llama-server:
``tests/e2e/test_anchor_llama.py``."""

from __future__ import annotations

from prefixpin.proxy.parking.snapshot import Book, Speeds, judge

MEASURED = Speeds(prefill_tps=1000.0, write_bps=1e9)


def test_a_snapshot_pays_when_re_reading_its_tokens_takes_longer_than_its_file() -> None:
    # 5,000 tokens at 1,000 tok/s: 5 s; 100 MB written and read at 1 GB/s: 0.2 s
    verdict = judge(prompt=5002, opening=5000, cached=4000, estimate_bytes=100_000_000,
                    fits=True, speeds=MEASURED)
    assert verdict.take, verdict.rule
    assert "re-reading 5000 tokens" in verdict.rule


def test_a_snapshot_whose_file_costs_more_than_its_prefill_is_not_taken() -> None:
    # 500 tokens at 1,000 tok/s: 0.5 s; 1 GB written and read at 1 GB/s: 2 s
    verdict = judge(prompt=502, opening=500, cached=0, estimate_bytes=1_000_000_000,
                    fits=True, speeds=MEASURED)
    assert not verdict.take


def test_no_snapshot_over_the_park_budget() -> None:
    verdict = judge(prompt=5002, opening=5000, cached=0, estimate_bytes=10, fits=False,
                    speeds=MEASURED)
    assert not verdict.take
    assert "--park-max-bytes" in verdict.rule


def test_no_snapshot_where_the_rollback_has_no_checkpoint() -> None:
    """The reply starting further back than the engine's last checkpoint, or a turn that
    prefilled too little to make one: rolling back would re-read the whole prompt."""
    far = judge(prompt=5010, opening=5000, cached=0, estimate_bytes=10, fits=True,
                speeds=MEASURED)
    short_turn = judge(prompt=5002, opening=5000, cached=4999, estimate_bytes=10, fits=True,
                       speeds=MEASURED)
    assert not far.take
    assert not short_turn.take


def test_before_any_measure_a_snapshot_is_taken() -> None:
    verdict = judge(prompt=502, opening=500, cached=0, estimate_bytes=None, fits=True,
                    speeds=Speeds())
    assert verdict.take


def test_speeds_come_from_turns_that_prefilled_enough() -> None:
    speeds = Speeds()
    speeds.saw_turn(prompt_tokens=1000, cached_tokens=990, prefill_ms=10.0)  # 10 new: not a measure
    unmeasured = speeds.prefill_tps
    speeds.saw_turn(prompt_tokens=1000, cached_tokens=0, prefill_ms=500.0)
    speeds.saw_save(n_bytes=1_000_000, seconds=0.01)
    assert (unmeasured, speeds.prefill_tps, speeds.write_bps) == (None, 2000.0, 1e8)


def test_the_book_pairs_a_session_with_its_latest_snapshot() -> None:
    book = Book(bound=2)
    assert book.note("s1", "p1") is None
    assert book.note("s1", "p2") == "p1"
    assert not book.holds("p1")
    assert book.of("s1") == "p2"
    book.note("s2", "p3")
    book.note("s3", "p4")  # past the bound: the oldest note goes
    assert book.of("s1") is None
    assert not book.holds("p2")
    book.dropped("p3")
    assert book.of("s2") is None
    assert book.forget("s3") == "p4"
    assert not book.holds("p4")
