"""Cache figures of one generation, read from the engine's own fields (sans-IO).

Sources, best first: the usage chunk (``usage.prompt_tokens``,
``prompt_tokens_details.cached_tokens``), ``timings`` (``cache_n``, ``prompt_n``,
``prompt_ms``) on the last chunk, and the last progress report; for Ollama's native API,
the metrics of its done chunk (``prompt_eval_count``, ``prompt_eval_cached_count``,
``prompt_eval_duration``, ``eval_count``, ``load_duration``; durations in nanoseconds;
the cached count is absent before Ollama 0.33.3 and stays unknown); for llama-server's
native API (``/completion``, ``/infill``), its final events (``"stop": true``:
``tokens_evaluated``, ``tokens_predicted``, ``timings.cache_n``, ``prompt_n``,
``prompt_ms``; one per prompt, summed) and the last progress report (``prompt_progress``)
where they fall short. (Its ``tokens_cached`` is not a cached count: it is every token
the slot holds after the answer, the prompt and the generated tokens.) Figures never underflow
or overstate: a count is a non-negative integer or unknown (an engine sending anything
else in a field makes that figure unknown), cached tokens are clamped to [0, prompt
tokens], and a time is finite and non-negative.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefixpin.core.frames import Frame, FrameKind, Progress


def may_carry_figures(frame: Frame) -> bool:
    """Whether ``figures_from`` may read anything from ``frame`` (kept by a log that lets go
    of the frames its clients have read: ``proxy.pipeline.aggregate.fold_read``)."""
    if frame.figured is not None:
        return frame.figured
    if frame.raw:
        return _names_a_figure(frame.raw)
    data = frame.data or {}
    return any(key in data for key in ("timings", "usage", "stop", "done"))


def _names_a_figure(raw: bytes) -> bool:
    """The fields figures are read from, as they appear in an event's bytes (a key is
    written as a JSON string; escaped within a string's text it is not this sequence)."""
    return (b'"timings"' in raw or b'"usage"' in raw or b'"stop"' in raw
            or b'"done"' in raw)


@dataclass(frozen=True, slots=True)
class Figures:
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    prompt_ms: float | None = None
    completion_tokens: int | None = None
    load_ms: float | None = None  # Ollama: time to get a loaded model (a jump = a cold load)

    @property
    def cached_fraction(self) -> float | None:
        if not self.prompt_tokens or self.cached_tokens is None:
            return None
        return self.cached_tokens / self.prompt_tokens


def figures_from(frames: Sequence[Frame], progress: Progress | None) -> Figures:
    usage: Mapping[str, Any] = {}
    timings: Mapping[str, Any] = {}
    native: Mapping[str, Any] | None = None
    finals: list[Mapping[str, Any]] = []
    for frame in frames:
        if not frame.parsed and not (frame.figured if frame.figured is not None
                                     else _names_a_figure(frame.raw)):
            continue  # a plain output chunk (``Frame.unparsed``): nothing to parse it for
        data = frame.data or {}
        if isinstance(data.get("timings"), Mapping):
            timings = data["timings"]
        if isinstance(data.get("usage"), Mapping):
            usage = data["usage"]
        if frame.kind is FrameKind.DONE and data.get("done") is True:
            native = data
        if data.get("stop") is True and frame.kind is not FrameKind.PROGRESS:
            finals.append(data)  # llama-server's native final event, one per prompt
    if native is not None:
        return _native(native)
    if finals:
        return _llama_native(finals, progress)
    return _combine(usage, timings, progress)


def _native(done: Mapping[str, Any]) -> Figures:
    """Ollama's native done chunk. Every metric is omitted when zero (``omitempty``), except
    the cached count, which is present (even 0) whenever Ollama reports one."""
    prompt = count_of(done.get("prompt_eval_count"))
    cached = count_of(done.get("prompt_eval_cached_count"))
    if cached is not None:
        prompt = prompt or 0
        cached = min(cached, prompt)
    eval_count = count_of(done.get("eval_count"))
    return Figures(
        prompt_tokens=prompt,
        cached_tokens=cached,
        prompt_ms=_nanoseconds_as_ms(done.get("prompt_eval_duration")),
        completion_tokens=eval_count if eval_count is not None else (
            0 if "prompt_eval_count" in done else None),
        load_ms=_nanoseconds_as_ms(done.get("load_duration")),
    )


def _llama_native(finals: Sequence[Mapping[str, Any]], progress: Progress | None) -> Figures:
    """llama-server's native final events (``to_json_non_oaicompat``), one per prompt of the
    request: the prompt is ``tokens_evaluated`` (else ``prompt_n`` + ``cache_n``), the
    cached part ``timings.cache_n``; the last progress report stands in for a figure a
    single final event lacks. Several prompts: each figure summed, unknown if any is."""
    figures = [_llama_final(data, progress if len(finals) == 1 else None) for data in finals]
    if len(figures) == 1:
        return figures[0]
    prompt_ms = [f.prompt_ms for f in figures]
    return Figures(
        prompt_tokens=_sum([f.prompt_tokens for f in figures]),
        cached_tokens=_sum([f.cached_tokens for f in figures]),
        prompt_ms=None if None in prompt_ms else sum(ms or 0.0 for ms in prompt_ms),
        completion_tokens=_sum([f.completion_tokens for f in figures]),
    )


def _sum(counts: Sequence[int | None]) -> int | None:
    return None if None in counts else sum(c or 0 for c in counts)


def _llama_final(data: Mapping[str, Any], progress: Progress | None) -> Figures:
    """One native final event: its ``tokens_evaluated`` and ``tokens_predicted`` are the
    chat usage's prompt and completion counts (it has no ``cached_tokens``), the rest as
    for chat."""
    usage = {"prompt_tokens": data.get("tokens_evaluated"),
             "completion_tokens": data.get("tokens_predicted")}
    return _combine(usage, mapping_of(data.get("timings")), progress)


def _nanoseconds_as_ms(value: object) -> float | None:
    duration = _duration(value)
    return duration / 1e6 if duration is not None else None


def _combine(usage: Mapping[str, Any], timings: Mapping[str, Any],
             progress: Progress | None) -> Figures:
    prompt = count_of(usage.get("prompt_tokens"))
    prompt_n = count_of(timings.get("prompt_n"))
    if prompt is None and prompt_n is not None:
        prompt = prompt_n + (count_of(timings.get("cache_n")) or 0)
    if prompt is None and progress is not None:
        prompt = progress.total
    # A negative cached count says "no hit" at worst: it reads as 0, not as unknown.
    cached = _integer(mapping_of(usage.get("prompt_tokens_details")).get("cached_tokens"))
    if cached is None:
        cached = _integer(timings.get("cache_n"))
    if cached is None and progress is not None:
        cached = progress.cache
    if cached is not None:
        cached = max(0, min(cached, prompt) if prompt is not None else cached)
    completion = count_of(usage.get("completion_tokens"))
    return Figures(
        prompt_tokens=prompt,
        cached_tokens=cached,
        prompt_ms=_duration(timings.get("prompt_ms")),
        completion_tokens=completion if completion is not None else count_of(
            timings.get("predicted_n")),
    )


def with_cached_tokens(frame: Frame, frames: Sequence[Frame],
                       progress: Progress | None) -> Frame:
    """The usage frame with ``prompt_tokens_details.cached_tokens`` present.

    llama-server fills it itself; older builds and some engines do not. The frame's bytes
    are left untouched when nothing is missing.
    """
    data = dict(frame.data or {})
    usage = dict(mapping_of(data.get("usage")))
    details = dict(mapping_of(usage.get("prompt_tokens_details")))
    if "cached_tokens" in details:
        return frame
    figures = figures_from([*frames, frame], progress)
    details["cached_tokens"] = figures.cached_tokens or 0
    usage["prompt_tokens_details"] = details
    data["usage"] = usage
    raw = b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
    return Frame(frame.kind, raw, data, frame.progress, frame.has_output)


def count_of(value: object) -> int | None:
    """A token count as the engine sent it: a non-negative integer, else unknown."""
    number = _integer(value)
    return number if number is not None and number >= 0 else None


def _integer(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def mapping_of(value: object) -> Mapping[str, Any]:
    """An object field of an engine's event, or an empty one when it is not an object."""
    return value if isinstance(value, Mapping) else {}


def _duration(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None
