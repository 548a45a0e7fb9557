"""History repair against the real llama-server: the repaired, cached path answers exactly
as a cold prefill of the same prompt does (greedy), for values buried in a long prompt."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import ProxyRunner
from tests.e2e.helpers import filler
from tests.rig.llama_process import LlamaServerProcess

pytestmark = pytest.mark.llama


def history(value: str) -> list[dict[str, Any]]:
    listing = filler(150, seed=11) + f"\nCONFIG_CODE = \"{value}\"\n" + filler(150, seed=12)
    return [
        {"role": "system", "content": "You are a coding agent. Answer with the value only."},
        {"role": "user", "content": "Read config.py and tell me CONFIG_CODE."},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_cfg", "type": "function",
            "function": {"name": "read", "arguments": '{"path": "config.py"}'}}]},
        {"role": "tool", "tool_call_id": "call_cfg", "content": listing},
    ]


def ask(url: str, messages: list[dict[str, Any]], max_tokens: int,
        headers: dict[str, str] | None = None, **fields: Any) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, **fields}
    response = httpx.post(f"{url}/v1/chat/completions", headers=headers or {}, json=body,
                          timeout=300)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def answer(result: dict[str, Any]) -> str:
    return str(result["choices"][0]["message"]["content"])


@pytest.mark.parametrize("value", ["QX-4417", "blue-heron-9", "7733"])
def test_a_repaired_cached_answer_equals_the_unrewritten_answer(
        llama: LlamaServerProcess, run_proxy: ProxyRunner, erase_slots: Callable[[], None],
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Turn 2 arrives with the tool result trimmed (the value cut off); repair restores it
    and the engine serves the prefix from cache. The answer equals, token for token, the
    one a client that never rewrote gets from llama-server directly (same turns, same
    cache path). A cold prefill of the same prompt is printed beside it: llama.cpp's own
    numerics differ between a cached and a cold prefix, with or without the proxy."""
    first = history(value)
    question = {"role": "user", "content": "What is CONFIG_CODE? Reply with the value only."}
    with run_proxy() as url:
        headers = {"x-session-id": f"faith-{value}"}
        reply = ask(url, first, 2, headers)["choices"][0]["message"]
        trimmed = [*first[:3], {**first[3], "content": first[3]["content"][:400]}]
        assert value not in str(trimmed)
        repaired = ask(url, [*trimmed, reply, question], 12, headers)
    erase_slots()
    full = [*first, reply, question]
    ask(llama.url, first, 2, id_slot=1)  # the client that never rewrites, direct
    unrewritten = ask(llama.url, full, 12, id_slot=1)
    cold = ask(llama.url, full, 12, id_slot=0, cache_prompt=False)
    usage = repaired["usage"]
    with capsys.disabled():
        print(f"\n[{value}] repaired+cached: {answer(repaired)!r}\n"
              f"[{value}] unrewritten:      {answer(unrewritten)!r}\n"
              f"[{value}] cold:             {answer(cold)!r}")
    assert usage["prompt_tokens"] == unrewritten["usage"]["prompt_tokens"]  # the same prompt
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.9 * usage["prompt_tokens"]
    assert answer(repaired) == answer(unrewritten)
    # Greedy decoding agrees with a cold prefill at least on the first tokens.
    assert answer(repaired)[:12] == answer(cold)[:12]
