"""Cache figures from engine fields, and the usage chunk completed when a field is missing."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from prefixpin.adapters.base import Frame, Progress
from prefixpin.adapters.openai_sse import classify
from prefixpin.core.figures import figures_from, with_cached_tokens
from prefixpin.core.sse import SSEDecoder


def frame(payload: dict[str, Any]) -> Frame:
    (event,) = SSEDecoder().feed(b"data: " + json.dumps(payload).encode() + b"\n\n")
    return classify(event)


def test_usage_chunk_is_the_first_source() -> None:
    """usage.prompt_tokens and cached_tokens win over timings."""
    frames = [
        frame({"choices": [{"delta": {}, "finish_reason": "stop", "index": 0}],
               "timings": {"cache_n": 10, "prompt_n": 5, "prompt_ms": 12.5}}),
        frame({"choices": [], "usage": {"prompt_tokens": 15, "completion_tokens": 3,
                                        "prompt_tokens_details": {"cached_tokens": 10}}}),
    ]
    figures = figures_from(frames, None)
    assert (figures.prompt_tokens, figures.cached_tokens, figures.prompt_ms) == (15, 10, 12.5)
    assert figures.cached_fraction == 10 / 15


def test_timings_fill_in_when_usage_is_absent() -> None:
    """Without usage, prompt = cache_n + prompt_n and cached = cache_n."""
    frames = [frame({"choices": [{"delta": {}, "finish_reason": "stop", "index": 0}],
                     "timings": {"cache_n": 7, "prompt_n": 2, "predicted_n": 4}})]
    figures = figures_from(frames, None)
    assert (figures.prompt_tokens, figures.cached_tokens, figures.completion_tokens) == (9, 7, 4)


def test_progress_is_the_last_resort() -> None:
    """A generation cut off after its first progress report still has figures."""
    figures = figures_from([], Progress(total=100, cache=40, processed=40, time_ms=0))
    assert (figures.prompt_tokens, figures.cached_tokens) == (100, 40)


@given(cached=st.integers(-10**6, 10**6), prompt=st.integers(0, 10**6))
def test_cached_tokens_never_underflow_or_exceed_the_prompt(cached: int, prompt: int) -> None:
    """Whatever an engine reports, 0 <= cached <= prompt."""
    frames = [frame({"choices": [], "usage": {"prompt_tokens": prompt,
                                              "prompt_tokens_details": {"cached_tokens": cached}}})]
    figures = figures_from(frames, None)
    assert figures.cached_tokens is not None
    assert 0 <= figures.cached_tokens <= prompt


def test_missing_cached_tokens_are_filled_from_timings() -> None:
    """An engine that omits prompt_tokens_details still yields cached_tokens in usage."""
    last = frame({"choices": [{"delta": {}, "finish_reason": "stop", "index": 0}],
                  "timings": {"cache_n": 30, "prompt_n": 2}})
    usage = frame({"choices": [], "usage": {"prompt_tokens": 32, "completion_tokens": 1}})
    completed = with_cached_tokens(usage, [last], None)
    body = json.loads(completed.raw.removeprefix(b"data: "))
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 30}


def test_a_complete_usage_frame_keeps_its_bytes() -> None:
    """Frames are relayed unchanged when nothing is missing."""
    usage = frame({"choices": [], "usage": {"prompt_tokens": 3,
                                            "prompt_tokens_details": {"cached_tokens": 2}}})
    assert with_cached_tokens(usage, [], None) is usage
