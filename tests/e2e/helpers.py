"""Small helpers for end-to-end tests: prompts of a known size and SSE reading with times."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "iota", "kappa",
         "lambda", "omicron", "sigma", "upsilon", "omega", "parse", "render", "token", "slot",
         "cache", "prefix", "commit", "session", "engine", "queue", "def", "return", "import",
         "class", "while", "yield", "async", "await", "tuple", "dict", "list"]


def filler(n_words: int, seed: int = 0) -> str:
    """Deterministic varied text (about 1.3 tokens a word with SmolLM2)."""
    out = []
    state = seed * 7919 + 17
    for i in range(n_words):
        state = (state * 1103515245 + 12345) % 2**31
        out.append(WORDS[state % len(WORDS)])
        if i % 13 == 12:
            out.append(f"{state % 1000}.\n")
    return " ".join(out)


@dataclass(slots=True)
class StreamCapture:
    status: int
    first_byte_s: float | None = None
    comments: list[tuple[float, str]] = field(default_factory=list)
    data: list[tuple[float, Any]] = field(default_factory=list)

    def payloads(self) -> list[Any]:
        return [d for _, d in self.data]

    def usage(self) -> dict[str, Any]:
        usages = [d["usage"] for d in self.payloads()
                  if isinstance(d, dict) and d.get("choices") == [] and "usage" in d]
        assert usages, "no usage chunk"
        return dict(usages[-1])


def stream_chat(url: str, body: dict[str, Any], *, timeout: float = 300) -> StreamCapture:
    """POST a streaming chat request and record when each comment and data event arrived,
    from when the request is sent (a new httpx client's own set-up, its TLS context, takes
    20-40 ms here: not the proxy's)."""
    with httpx.Client(timeout=timeout) as http:
        start = time.monotonic()
        with http.stream("POST", f"{url}/v1/chat/completions",
                         json={**body, "stream": True}) as response:
            return _captured(response, start)


def _captured(response: httpx.Response, start: float) -> StreamCapture:
    capture = StreamCapture(response.status_code)
    buffer = b""
    for chunk in response.iter_raw():
        if capture.first_byte_s is None:
            capture.first_byte_s = time.monotonic() - start
        buffer += chunk
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            _record(capture, block.decode(), time.monotonic() - start)
    return capture


def _record(capture: StreamCapture, block: str, at: float) -> None:
    if block.startswith(":"):
        capture.comments.append((at, block[1:].strip()))
    elif block.startswith("data: "):
        text = block[6:]
        capture.data.append((at, text if text == "[DONE]" else json.loads(text)))
