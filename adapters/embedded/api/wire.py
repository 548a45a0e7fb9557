"""llama-server's JSON shapes for OpenAI-compatible results (tools/server/server-task.cpp).

Renderers turn the worker's events into the exact objects llama-server sends:

- chat, streaming: a progress event is a ``chat.completion.chunk`` whose delta is
  ``{"role": "assistant", "content": null}`` with ``prompt_progress`` at the top level;
  the first token adds that same role chunk before its content chunk; an empty text sends
  nothing; the end is a chunk with ``delta: {}`` and the finish reason, then (only with
  ``stream_options.include_usage``) a ``choices: []`` chunk with ``usage``; ``timings`` ride
  on whichever of those comes last;
- text completion, streaming: one ``text_completion`` object per event, empty text
  included; the last one carries ``finish_reason``, ``usage`` and ``timings``;
- non-streaming: one object with ``usage`` and ``timings`` at the top level.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from prefixpin.adapters.embedded.model.generate import (
    STOP_EOS,
    STOP_WORD,
    Event,
    Failed,
    Finished,
    PromptProgress,
    PromptStarted,
    TokenOut,
)

SSE_DONE = "data: [DONE]\n\n"


def compact_json(value: object) -> str:
    """JSON as nlohmann's ``dump()`` writes it: no spaces, UTF-8 kept (not ``\\u`` escapes)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def sse(payload: object) -> str:
    # llama-server's format_oai_sse
    return f"data: {compact_json(payload)}\n\n"


def finish_reason(stop_type: str) -> str:
    return "stop" if stop_type in (STOP_EOS, STOP_WORD) else "length"


def usage(result: Finished) -> dict[str, Any]:
    """OpenAI usage: prompt_tokens is the whole prompt, cached_tokens the reused prefix."""
    n_decoded = result.stats.n_gen
    return {
        "completion_tokens": n_decoded,
        "prompt_tokens": result.n_prompt,
        "total_tokens": n_decoded + result.n_prompt,
        "prompt_tokens_details": {"cached_tokens": result.stats.n_prompt_cached},
    }


def progress_json(event: PromptStarted | PromptProgress) -> dict[str, int]:
    if isinstance(event, PromptStarted):
        # the first progress point: nothing decoded yet, processed == cache
        return {"total": event.total, "cache": event.cache, "processed": event.cache,
                "time_ms": 0}
    return {"total": event.total, "cache": event.cache, "processed": event.processed,
            "time_ms": event.time_ms}


@dataclass(frozen=True, slots=True)
class ResultMeta:
    """Fields every result object repeats."""

    completion_id: str
    model: str
    system_fingerprint: str
    include_usage: bool = False
    return_progress: bool = False


class ChatRenderer:
    """``/v1/chat/completions`` results."""

    def __init__(self, meta: ResultMeta) -> None:
        self.meta = meta

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "choices": choices,
            "created": int(time.time()),
            "id": self.meta.completion_id,
            "model": self.meta.model,
            "system_fingerprint": self.meta.system_fingerprint,
            "object": "chat.completion.chunk",
        }

    def _delta(self, delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        return self._chunk([{"finish_reason": reason, "index": 0, "delta": delta}])

    def stream(self, event: Event) -> list[dict[str, Any]]:
        """The chunks one event becomes in a stream (possibly none)."""
        if isinstance(event, PromptStarted | PromptProgress):
            if not self.meta.return_progress:
                return []  # llama-server's "begin" marker only flushes the headers
            chunk = self._delta({"role": "assistant", "content": None})
            chunk["prompt_progress"] = progress_json(event)
            return [chunk]
        if isinstance(event, TokenOut):
            return self._token_chunks(event)
        if isinstance(event, Finished):
            return self._final_chunks(event)
        return [{"error": event.error.to_json()}]

    def _token_chunks(self, event: TokenOut) -> list[dict[str, Any]]:
        chunks = []
        if event.n_decoded == 1:
            chunks.append(self._delta({"role": "assistant", "content": None}))
        if event.text:
            chunks.append(self._delta({"content": event.text}))
        if chunks and event.timings is not None:
            chunks[-1]["timings"] = event.timings
        return chunks

    def _final_chunks(self, result: Finished) -> list[dict[str, Any]]:
        chunks = [self._delta({}, finish_reason(result.stop_type))]
        if self.meta.include_usage:
            usage_chunk = self._chunk([])
            usage_chunk["usage"] = usage(result)
            chunks.append(usage_chunk)
        chunks[-1]["timings"] = result.stats.timings()
        return chunks

    def complete(self, result: Finished) -> dict[str, Any]:
        """The whole non-streaming ``chat.completion`` object."""
        return {
            "choices": [{
                "finish_reason": finish_reason(result.stop_type),
                "index": 0,
                "message": {"role": "assistant", "content": result.content},
            }],
            "created": int(time.time()),
            "model": self.meta.model,
            "system_fingerprint": self.meta.system_fingerprint,
            "object": "chat.completion",
            "usage": usage(result),
            "id": self.meta.completion_id,
            "timings": result.stats.timings(),
        }


class TextRenderer:
    """``/v1/completions`` results."""

    def __init__(self, meta: ResultMeta) -> None:
        self.meta = meta

    def _object(self, text: str, reason: str | None) -> dict[str, Any]:
        return {
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": reason}],
            "created": int(time.time()),
            "model": self.meta.model,
            "system_fingerprint": self.meta.system_fingerprint,
            "object": "text_completion",
            "id": self.meta.completion_id,
        }

    def stream(self, event: Event) -> list[dict[str, Any]]:
        if isinstance(event, PromptStarted | PromptProgress):
            if not self.meta.return_progress:
                return []
            chunk = self._object("", None)
            chunk["prompt_progress"] = progress_json(event)
            return [chunk]
        if isinstance(event, TokenOut):
            chunk = self._object(event.text, None)
            if event.timings is not None:
                chunk["timings"] = event.timings
            return [chunk]
        if isinstance(event, Finished):
            return [self._final(event, "")]
        return [{"error": event.error.to_json()}]

    def _final(self, result: Finished, text: str) -> dict[str, Any]:
        final = self._object(text, finish_reason(result.stop_type))
        final["usage"] = usage(result)
        final["timings"] = result.stats.timings()
        return final

    def complete(self, result: Finished) -> dict[str, Any]:
        return self._final(result, result.content)


Renderer = ChatRenderer | TextRenderer


def is_last(event: Event) -> bool:
    return isinstance(event, Finished | Failed)
