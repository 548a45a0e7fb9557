"""The transcript generator: deterministic, committed, and sized like a real session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.make_transcripts import DEFAULT_SEED, generate, stale_files, write
from bench.synth.story import CHARS_PER_TOKEN
from bench.transcript import Transcript, load, transcripts_dir


@pytest.fixture(scope="module")
def generated() -> dict[str, Transcript]:
    return generate(DEFAULT_SEED)


def test_same_seed_writes_byte_identical_files(tmp_path: Path) -> None:
    """Two generations from the same seed produce the same bytes on disk."""
    write(generate(DEFAULT_SEED), tmp_path / "a")
    write(generate(DEFAULT_SEED), tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_committed_transcripts_match_the_seed(generated: dict[str, Transcript]) -> None:
    """bench/transcripts/ is exactly what the default seed generates."""
    assert stale_files(generated, transcripts_dir()) == []


def test_another_seed_gives_other_sessions(generated: dict[str, Transcript]) -> None:
    """The seed drives the content (a constant generator would pass the tests above)."""
    other = generate(DEFAULT_SEED + 100)
    assert all(other[name].dumps() != generated[name].dumps() for name in generated)


def test_files_round_trip(tmp_path: Path, generated: dict[str, Transcript]) -> None:
    """Loading a written transcript gives the same transcript back."""
    write(generated, tmp_path)
    for name, transcript in generated.items():
        assert load(tmp_path / f"{name}.json") == transcript


def _tokens(text: str) -> float:
    return len(text) / CHARS_PER_TOKEN


def _rendered_tokens(message: dict[str, object]) -> float:
    """What a tool-aware ChatML template renders: content, reasoning, call arguments."""
    calls = message.get("tool_calls") or []
    assert isinstance(calls, list)
    text = str(message.get("content") or "") + str(message.get("reasoning_content") or "")
    text += "".join(call["function"]["name"] + call["function"]["arguments"] for call in calls)
    return _tokens(text) + 8 + 12 * len(calls)  # role markers, tags


@pytest.mark.parametrize("name", [f"session-{i:02d}" for i in range(6)])
def test_session_shape(generated: dict[str, Transcript], name: str) -> None:
    """12-20 answer steps, a 1-2k token preamble, 3-6k tokens in all, tool results 200-2k.

    Token counts here are estimates (characters / 3.4, measured for SmolLM2 on these
    texts); bench/transcripts/README.md has the exact counts from llama-server /tokenize.
    """
    transcript = generated[name]
    assert 12 <= len(transcript.steps) <= 20
    preamble = _tokens(json.dumps(transcript.tools) + transcript.messages[0]["content"])
    assert 1000 <= preamble <= 2000
    total = preamble + sum(_rendered_tokens(m) for m in transcript.messages[1:])
    assert 3000 <= total <= 6000
    results = [m["content"] for m in transcript.messages if m["role"] == "tool"]
    assert len(results) >= len(transcript.steps) // 2
    assert all(150 <= _tokens(text) <= 2000 for text in results)
    assert any(_tokens(text) >= 500 for text in results)  # one big read per session
    assert sum(1 for m in transcript.messages if m["role"] == "user") >= 3


def test_assistant_turns_carry_reasoning_and_tool_calls(
        generated: dict[str, Transcript]) -> None:
    """Assistant turns have reasoning; tool calls have ids, JSON args and one result each."""
    messages = generated["session-00"].messages
    assistants = [m for m in messages if m["role"] == "assistant"]
    assert all(m["reasoning_content"] for m in assistants)
    calls = [c for m in assistants for c in m.get("tool_calls", [])]
    assert calls
    assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls)
    result_ids = [m["tool_call_id"] for m in messages if m["role"] == "tool"]
    assert sorted(result_ids) == sorted(c["id"] for c in calls)
    assert len(set(result_ids)) == len(result_ids)


def test_inline_variant_carries_the_same_text(generated: dict[str, Transcript]) -> None:
    """session-NN-think is session-NN with the reasoning moved into <think> blocks."""
    field, inline = generated["session-00"], generated["session-00-think"]
    assert len(field.messages) == len(inline.messages)
    for plain, think in zip(field.messages, inline.messages, strict=True):
        if plain["role"] != "assistant":
            assert plain == think
            continue
        assert "reasoning_content" not in think
        assert think["content"].startswith(f"<think>\n{plain['reasoning_content']}\n</think>")
        assert think.get("tool_calls") == plain.get("tool_calls")
