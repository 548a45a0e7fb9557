"""The retry loop, reproduced and broken against the real llama-server: a client that gives
up after a few seconds during a long prefill and resends the identical request. Through
prefixpin the engine prefills the prompt once (resends join the generation still running
in its grace period); the last resend gets the whole answer."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import ProxyRunner
from tests.e2e.helpers import filler
from tests.rig.llama_process import LlamaServerProcess

pytestmark = pytest.mark.llama

CLIENT_TIMEOUT_S = 3.0


def prompt_tokens_processed(llama: LlamaServerProcess) -> float:
    for line in httpx.get(f"{llama.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("llamacpp:prompt_tokens_total"):
            return float(line.split()[-1])
    raise AssertionError("no llamacpp:prompt_tokens_total")


def impatient_stream(url: str, body: dict[str, Any]) -> str | None:
    """Stream the request; give up after CLIENT_TIMEOUT_S in total (heartbeats or not).
    Returns the full answer text, or None when it gave up."""
    deadline = time.monotonic() + CLIENT_TIMEOUT_S
    text, done = [], False
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=CLIENT_TIMEOUT_S) as response:
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
                break
            if line.startswith("data: {"):
                for choice in json.loads(line[6:]).get("choices") or []:
                    text.append((choice.get("delta") or {}).get("content") or "")
            if time.monotonic() > deadline:
                return None
    return "".join(text) if done else None


def test_resends_during_a_long_prefill_cost_one_prefill(
        llama: LlamaServerProcess, run_proxy: ProxyRunner,
        erase_slots: Callable[[], None]) -> None:
    """A ~2k-token prompt, a client that gives up after 3 s and resends: the engine's
    prompt-token counter grows by one prefill (plus at most a few tokens), and a resend
    finally receives the complete answer."""
    content = "Summarise: " + filler(1500, seed=9)
    body: dict[str, Any] = {"messages": [{"role": "user", "content": content}],
                            "max_tokens": 8, "temperature": 0}
    before = prompt_tokens_processed(llama)
    attempts, answer = 0, None
    with run_proxy(retry_grace_s=30) as url:
        while answer is None and attempts < 40:
            attempts += 1
            answer = impatient_stream(url, body)
        metrics = httpx.get(f"{url.admin}/metrics").text
    processed = prompt_tokens_processed(llama) - before
    prompt = httpx.post(f"{llama.url}/tokenize", json={"content": content}).json()["tokens"]
    assert answer, f"no complete answer after {attempts} attempts"
    assert attempts >= 2, "the prefill finished within one client timeout: not a long prefill"
    assert len(prompt) <= processed <= len(prompt) + 64, (processed, len(prompt), attempts)
    joins = [line for line in metrics.splitlines()
             if line.startswith('prefixpin_inflight_joins_total{api="openai",endpoint="chat"}')]
    assert joins
    assert float(joins[0].split()[-1]) >= attempts - 2
