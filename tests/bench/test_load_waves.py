"""``bench/load.py`` reports each wave's first events apart: whether a wave's first events
leave one by one or all at the end of its work is what tells queueing from cost."""

from __future__ import annotations

from bench.load import Stream, first_event_by_wave, first_wave_cost


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


def sent(wave: int, at_s: float, first_ms: float) -> Stream:
    return Stream(wave=wave, status=200, done=True, started_s=at_s,
                  first_event_s=first_ms / 1000)


def test_the_first_wave_costs_the_proxy_cpu_from_its_first_request_to_its_last_first_event(
        ) -> None:
    # The proxy's CPU, sampled every 10 ms: busy 80% of the time from 100.000 s on.
    trace = tuple((100.0 + k * 0.01, 5.0 + max(0, k) * 0.008) for k in range(-3, 40))
    failed = sent(0, 100.0, 900.0)
    failed.status = 500
    streams = [sent(0, 100.0, 50.0), sent(0, 100.001, 199.0), sent(0, 100.0, 120.0),
               sent(1, 100.3, 1.0), failed]  # a later wave and a failed stream: left out
    cost = first_wave_cost(streams, trace)
    assert cost == {"streams": 3, "window_ms": 200.0, "proxy_cpu_ms": 160.0,
                    "cpu_us_per_stream": 53333.3, "busy": 0.8}


def test_no_cost_is_told_where_the_trace_does_not_span_the_wave() -> None:
    trace = ((100.0, 5.0), (100.1, 5.08))
    assert first_wave_cost([sent(0, 100.0, 150.0)], trace) is None
    assert first_wave_cost([sent(1, 100.0, 50.0)], trace) is None  # no first wave
    assert first_wave_cost([sent(0, 100.0, 50.0)], ()) is None
