"""Sans-IO classification of OpenAI-style SSE events into ``Frame``s.

llama-server, the embedded engine and Ollama's ``/v1`` API all stream OpenAI chunks; this
module turns one decoded SSE event into a typed frame, once, so the relay and the figures
never re-parse JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import orjson

from adapters.base import Frame, FrameKind, Progress
from core.errors import UpstreamProtocolError
from core.figures import count_of
from core.sse import SSEEvent


def classify(event: SSEEvent) -> Frame:
    if event.is_comment_only:
        return Frame(FrameKind.PING, event.raw)
    if event.data.strip() == "[DONE]":
        return Frame(FrameKind.DONE, event.raw)
    data = _parse_object(event.data)
    if "error" in data:
        return Frame(FrameKind.ERROR, event.raw, data)
    progress = parse_progress(data.get("prompt_progress"))
    choices = data.get("choices")
    if choices == [] and "usage" in data:
        return Frame(FrameKind.USAGE, event.raw, data, progress)
    has_output = chunk_has_output(choices)
    if progress is not None and not has_output and not _has_finish(choices):
        return Frame(FrameKind.PROGRESS, event.raw, data, progress)
    return Frame(FrameKind.CHUNK, event.raw, data, progress, has_output)


def parse_progress(value: object) -> Progress | None:
    """llama-server's ``prompt_progress``; None unless its counts are counts. The counts
    are kept within the prompt (an engine's slip must not show "prefill 9/5")."""
    if not isinstance(value, Mapping):
        return None
    total, cache, processed = (count_of(value.get(k)) for k in ("total", "cache", "processed"))
    if total is None or cache is None or processed is None:
        return None
    time_ms = value.get("time_ms", 0.0)
    if isinstance(time_ms, bool) or not isinstance(time_ms, int | float) or not math.isfinite(
            time_ms):
        time_ms = 0.0
    return Progress(total=total, cache=min(cache, total), processed=min(processed, total),
                    time_ms=max(0.0, float(time_ms)))


def chunk_has_output(choices: object) -> bool:
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, Mapping):
            continue
        if choice.get("text"):  # /v1/completions
            return True
        delta = choice.get("delta")
        if isinstance(delta, Mapping) and (
            delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")
        ):
            return True
    return False


def _has_finish(choices: object) -> bool:
    return isinstance(choices, list) and any(
        isinstance(choice, Mapping) and choice.get("finish_reason") for choice in choices
    )


def _parse_object(text: str) -> dict[str, Any]:
    try:
        # orjson first: every event of every stream goes through here (~5x faster).
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        value = _parse_lenient(text)
    if not isinstance(value, dict):
        raise UpstreamProtocolError("engine sent an SSE event that is not a JSON object")
    return value


def _parse_lenient(text: str) -> Any:
    """What orjson refuses but is still an engine's JSON (NaN, huge integers)."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise UpstreamProtocolError(f"engine sent an SSE event that is not JSON: {exc}") from exc
