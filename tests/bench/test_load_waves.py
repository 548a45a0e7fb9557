"""``bench/load.py`` reports each wave's first events apart: whether a wave's first events
leave one by one or all at the end of its work is what tells queueing from cost."""

from __future__ import annotations

from bench.load import Stream, first_event_by_wave


def stream(wave: int, first_ms: float, *, failed: bool = False) -> Stream:
    return Stream(wave=wave, status=500 if failed else 200, done=True,
                  first_event_s=first_ms / 1000)


def test_each_arm_and_wave_has_its_own_spread_and_failed_streams_are_left_out() -> None:
    by_arm = {
        "direct": [stream(0, ms) for ms in (1.0, 2.0, 3.0)] + [stream(1, 5.0)],
        "proxy": [stream(0, ms) for ms in range(80, 101)] + [stream(0, 900.0, failed=True)],
    }
    rows = first_event_by_wave(by_arm)
    assert rows == [
        {"arm": "direct", "wave": 0, "p0_ms": 1.0, "p50_ms": 2.0, "p99_ms": 3.0},
        {"arm": "direct", "wave": 1, "p0_ms": 5.0, "p50_ms": 5.0, "p99_ms": 5.0},
        {"arm": "proxy", "wave": 0, "p0_ms": 80.0, "p50_ms": 90.0, "p99_ms": 100.0},
    ]
