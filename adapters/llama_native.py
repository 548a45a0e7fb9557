"""Sans-IO classification of llama-server's native completion stream into ``Frame``s.

``POST /completion``, ``/completions`` (the same handler) and ``/infill`` stream
``to_json_non_oaicompat`` events (``tools/server/server-task.cpp``), not OpenAI chunks:

    data: {"index":0,"content":"","tokens":[0],"stop":false,...,"prompt_progress":{...}}
    data: {"index":0,"content":" Paris","tokens":[7042],"stop":false,...}
    data: {"index":0,"content":"","tokens":[],"id_slot":1,"stop":true,...,"timings":{...}}

and no ``[DONE]``: the stream ends after the last prompt's ``"stop": true`` event, which
carries the figures (``tokens_evaluated``, ``tokens_cached``, ``timings.cache_n``). So:

- ``prompt_progress`` and no text: PROGRESS (``return_progress``; llama-server never puts
  text on a progress event);
- ``"stop": true``: the final event of one prompt. A body with several prompts (an array
  of strings or token lists) streams one per prompt, interleaved by ``index``: the last of
  them is DONE (what ends the generation, as Ollama's native done line does), the others
  are CHUNKs; every one is forwarded as it came;
- any other event: CHUNK, ``has_output`` when it carries text;
- ``{"error": ...}``: ERROR; an SSE comment (llama-server's ``sse_ping_interval`` ping) and
  ``data: null`` (what llama-server streams for a further prompt's start when progress is
  off): PING, never forwarded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefixpin.adapters.base import Frame, FrameKind
from prefixpin.adapters.openai_sse import _parse_object as parse_object
from prefixpin.adapters.openai_sse import parse_progress
from prefixpin.core.sse import SSEEvent

# llama-server's native completion paths (tools/server/server.cpp: "/completion" is its
# legacy name of "/completions"; "/infill" the fill-in-the-middle API of editor plugins).
NATIVE_PATHS = frozenset({"/completion", "/completions", "/infill"})


def prompt_count(path: str, body: Mapping[str, Any]) -> int:
    """How many prompts llama-server makes of a body, so how many final events its stream
    has (``tokenize_input_prompts``): an array with no token id at its top level is one
    prompt per element; anything else, and ``/infill``, is one prompt. (``n_cmpl`` and its
    alias ``n`` would multiply them; the proxy never forwards either.)"""
    prompt = body.get("prompt")
    if path == "/infill" or not isinstance(prompt, list):
        return 1
    if any(isinstance(item, int | float) and not isinstance(item, bool) for item in prompt):
        return 1
    return max(1, len(prompt))


def is_final(data: Mapping[str, Any] | None) -> bool:
    """A prompt's final event (``server_task_result_cmpl_final``): ``"stop": true``."""
    return data is not None and data.get("stop") is True


class NativeClassifier:
    """One stream's classifier: it counts the final events, so the last is DONE."""

    def __init__(self, prompts: int = 1) -> None:
        self._left = max(1, prompts)

    def __call__(self, event: SSEEvent) -> Frame:
        if event.is_comment_only or event.data.strip() == "null":
            return Frame(FrameKind.PING, event.raw)
        data = parse_object(event.data)
        if "error" in data:
            return Frame(FrameKind.ERROR, event.raw, data)
        if data.get("stop") is True:
            self._left -= 1
            kind = FrameKind.DONE if self._left <= 0 else FrameKind.CHUNK
            return Frame(kind, event.raw, data, has_output=_has_text(data))
        progress = parse_progress(data.get("prompt_progress"))
        has_text = _has_text(data)
        if progress is not None and not has_text:
            return Frame(FrameKind.PROGRESS, event.raw, data, progress)
        if has_text and progress is None:
            # A plain text event, the bulk of a stream: its objects are let go and made
            # again only if something reads them (``Frame.unparsed``).
            return Frame.unparsed(FrameKind.CHUNK, event.raw, event.data, None, True, False)
        return Frame(FrameKind.CHUNK, event.raw, data, progress, has_text)


def classify(event: SSEEvent) -> Frame:
    """One event of a single-prompt stream (a fresh classifier per call: no counting)."""
    return NativeClassifier()(event)


def _has_text(data: Mapping[str, Any]) -> bool:
    content = data.get("content")
    return isinstance(content, str) and bool(content)
