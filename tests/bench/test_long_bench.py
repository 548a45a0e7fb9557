"""``bench/long.py``'s pure parts: bands, the session's text, the schedule, the stream
reader and the CPU sum over a process's threads. No process is started."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from bench.long import (
    CALLS,
    EARLY_TOKENS,
    FOLLOW_UPS,
    MIN_TOOL_CHARS,
    TOOLS,
    Schedule,
    StreamReader,
    band_of,
    bands,
    planned_tool_chars,
    prompt_time_ratios,
    schedstat_ns,
    system_prompt,
    tool_step,
    tool_turn,
)


def turn(prompt: int, cpu_first: float, cpu_turn: float, ttft: float,
         direct_ttft: float) -> dict[str, Any]:
    return {"direct": {"ttft_ms": direct_ttft, "prompt_tokens": prompt},
            "prefixpin": {"prompt_tokens": prompt, "ttft_ms": ttft,
                          "cpu_to_first_event_ms": cpu_first, "cpu_whole_turn_ms": cpu_turn}}


def test_turns_are_banded_by_prompt_tokens_and_summarized_by_medians() -> None:
    assert [band_of(n) for n in (0, 9_999, 10_000, 74_999, 125_000, 262_144)] == [
        "<10k", "<10k", "10-25k", "50-75k", "125k+", "125k+"]
    rows = bands([turn(3_000, 2.0, 5.0, 110.0, 100.0), turn(8_000, 4.0, 9.0, 130.0, 100.0),
                  turn(9_000, 30.0, 40.0, 400.0, 100.0), turn(130_000, 50.0, 80.0, 900.0, 800.0)])
    assert [row["band"] for row in rows] == ["<10k", "125k+"]  # bands without turns left out
    low, high = rows
    assert (low["turns"], low["prompt_tokens_median"]) == (3, 8_000)
    assert (low["cpu_to_first_event_ms"], low["cpu_whole_turn_ms"]) == (4.0, 9.0)
    assert low["added_ttft_ms"] == 30.0  # per turn prefixpin - direct, then the median
    assert (high["turns"], high["added_ttft_ms"]) == (1, 100.0)
    assert high["added_past_prompt_ms"] is None  # no engine prompt time recorded


def test_the_added_ttft_past_prompt_time_leaves_out_the_engines_own_difference() -> None:
    """Engine B evaluates the prompt 8% slower than A: the raw added TTFT is that, the
    figure past each engine's prompt time is what the proxy adds."""
    turns = [turn(100_000, 5.0, 8.0, 10_000 * 1.08 + 260.0, 10_000 + 250.0)]
    turns[0]["direct"]["prompt_ms"] = 10_000.0
    turns[0]["prefixpin"]["prompt_ms"] = 10_000 * 1.08
    (row,) = bands(turns)
    assert row["added_ttft_ms"] == 810.0
    assert row["added_past_prompt_ms"] == 10.0


def test_turns_sent_straight_to_b_are_kept_out_of_the_bands_and_compared_by_route() -> None:
    """``--b-direct-every``: engine B's prompt time over A's, through prefixpin and not."""
    turns = [turn(40_000, 5.0, 8.0, 1_000.0, 1_000.0) for _ in range(4)]
    for index, (mine, theirs) in enumerate([(1_080, 1_000), (2_150, 2_000), (930, 1_000),
                                            (1_860, 2_000)]):
        turns[index]["prefixpin"] |= {"prompt_ms": float(mine), "prefilled_tokens": 2_000}
        turns[index]["direct"] |= {"prompt_ms": float(theirs), "prefilled_tokens": 2_000}
    turns[2]["route"] = turns[3]["route"] = "straight to B"
    (row,) = bands(turns)
    assert row["turns"] == 2
    assert prompt_time_ratios(turns) == "1.08 (2 turns), 0.93 (2 turns)"


def test_the_session_text_is_a_pure_function_of_seed_turn_and_size() -> None:
    assert tool_step(7, 12, 3_000) == tool_step(7, 12, 3_000)
    assert tool_step(7, 12, 3_000) != tool_step(7, 13, 3_000)
    assert system_prompt(7) == system_prompt(7)
    assert 8_000 < len(system_prompt(7)) < 9_500
    names = {t["function"]["name"] for t in TOOLS}
    steps = [tool_step(7, k, 3_000) for k in range(60)]
    for step in steps:
        assert step.call["type"] == "function"
        assert step.call["function"]["name"] in names
        assert isinstance(json.loads(step.call["function"]["arguments"]), dict)
    assert len({step.call["id"] for step in steps}) == len(steps)
    assert tool_step(7, 12, 3_000, index=1) != tool_step(7, 12, 3_000)
    sizes = [len(step.result) for step in steps]
    assert 0.8 * 3_000 < statistics.mean(sizes) < 1.2 * 3_000
    assert max(sizes) > 2 * min(sizes)  # mixed sizes, not one
    read = next(step for step in steps if step.call["function"]["name"] == "read_file")
    offset = json.loads(read.call["function"]["arguments"])["offset"]
    numbers = [int(line.split("\t")[0]) for line in read.result.splitlines()]
    assert numbers == list(range(offset, offset + len(numbers)))


def test_a_tool_turn_makes_one_to_three_calls_at_once() -> None:
    turns = [tool_turn(7, k, 300) for k in range(120)]
    assert turns == [tool_turn(7, k, 300) for k in range(120)]
    counts = [len(calls) for calls in turns]
    assert set(counts) == {count for count, _ in CALLS}
    assert counts.count(1) > counts.count(3)
    assert turns[5][0] == tool_step(7, 5, 300)  # the first call is the turn's own step


def test_the_tool_size_plan_spends_what_the_target_leaves_over_the_tool_results() -> None:
    small = planned_tool_chars(20_000, 2_700, 200, 3.0, 4)
    large = planned_tool_chars(150_000, 2_700, 200, 3.0, 4)
    assert MIN_TOOL_CHARS <= small < large
    # 200 messages: 32 in follow-ups, 166 in growth turns, a cycle of four growth turns adds
    # three tool turns of 1.65 calls (2.65 messages) and a user turn (2): 9.95
    results = 166 / 9.95 * 3 * 1.65
    assert 0.85 * (150_000 - 2_700) < large / 3.0 * results < 150_000 - 2_700
    assert abs(planned_tool_chars(150_000, 2_700, 200, 6.0, 4) - 2 * large) <= 1
    assert planned_tool_chars(3_000, 2_700, 200, 3.0, 4) == MIN_TOOL_CHARS


def test_the_schedule_follows_up_early_grows_then_follows_up_at_the_end() -> None:
    schedule = Schedule(target_tokens=10_000, min_messages=30, user_every=5)
    prompt, messages, steps = 2_000, 2, []
    while (step := schedule.next(prompt, messages)) is not None:
        steps.append((step.phase, step.kind))
        messages += 2
        prompt += 40 if step.kind == "user" else 500
    assert steps[0] == ("growth", "tool")  # under EARLY_TOKENS: no follow-up yet
    early = [i for i, (phase, _) in enumerate(steps) if phase == "follow-up-early"]
    assert len(early) == FOLLOW_UPS
    assert early == list(range(early[0], early[0] + FOLLOW_UPS))
    assert 2_000 + 500 * early[0] >= EARLY_TOKENS
    growth = [kind for phase, kind in steps if phase == "growth"]
    assert [i + 1 for i, kind in enumerate(growth) if kind == "user"] == list(
        range(5, len(growth) + 1, 5))
    assert steps[-FOLLOW_UPS:] == [("follow-up-final", "user")] * FOLLOW_UPS
    assert prompt - 40 * FOLLOW_UPS >= 10_000
    assert messages >= 30


def test_the_stream_reader_times_the_first_output_and_keeps_usage() -> None:
    reader = StreamReader()
    events = [b": ping\n\n", b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n',
              b'data: {"choices":[{"delta":{"reasoning_content":"hm"}}]}\n\n',
              b'data: {"choices":[{"delta":{"content":"ok"}}]}\n\n',
              b'data: {"choices":[],"usage":{"prompt_tokens":900,'
              b'"prompt_tokens_details":{"cached_tokens":880}},"timings":{"prompt_ms":4.5}}\n\n',
              b"data: [DONE]\n\n"]
    for at, event in enumerate(events):
        reader.feed(event, at / 10)
    reader.close(0.6)
    figures = reader.figures()
    assert (figures["first_data_ms"], figures["ttft_ms"], figures["total_ms"]) == (
        100.0, 200.0, 600.0)
    assert (figures["prompt_tokens"], figures["cached_tokens"]) == (900, 880)
    assert (figures["prefilled_tokens"], figures["prompt_ms"]) == (20, 4.5)
    assert ("".join(reader.content), "".join(reader.reasoning)) == ("ok", "hm")


def test_the_cpu_sum_adds_every_threads_first_schedstat_field(tmp_path: Path) -> None:
    tasks = tmp_path / "4242" / "task"
    for tid, line in (("4242", "1500000 300 12\n"), ("4243", "250 7 1\n")):
        (tasks / tid).mkdir(parents=True)
        (tasks / tid / "schedstat").write_text(line)
    (tasks / "4244").mkdir()  # a thread that ended between the listing and the read
    assert schedstat_ns(4242, proc=tmp_path) == 1_500_250
