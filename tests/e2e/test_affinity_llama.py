"""Session affinity against the real llama-server (2 slots): two agent sessions of one
client (same system prompt) interleaved with one-off side requests, with affinity and with
PREFIXPIN_AFFINITY=0, measured side by side in one run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import ProxyRunner
from tests.e2e.helpers import filler

pytestmark = pytest.mark.llama

TITLE_SYSTEM = "You are a title generator. Reply with a title of at most five words."


def system_prompt(name: str) -> str:
    # Both sessions come from one agent client: the same long system prompt, as OpenCode's
    # two sessions would send. Only the conversations differ.
    return "You are a careful coding assistant. " + filler(800, seed=7)


def user_turn(name: str, turn: int) -> str:
    return f"Turn {turn} for {name}: " + filler(20, seed=ord(name) * 100 + turn)


def run_sequence(url: str) -> dict[str, list[dict[str, Any]]]:
    """A, B alternate for 4 turns; a title request under A's key after A's 2nd turn and a
    keyless one-off after B's 3rd. Returns each request's usage, per session."""
    histories = {name: [{"role": "system", "content": system_prompt(name)}] for name in "AB"}
    figures: dict[str, list[dict[str, Any]]] = {"A": [], "B": [], "side": []}
    with httpx.Client(base_url=url, timeout=300) as client:
        for turn in range(1, 5):
            for name in "AB":
                history = histories[name]
                history.append({"role": "user", "content": user_turn(name, turn)})
                body = client.post("/v1/chat/completions", headers={"x-session-id": name},
                                   json={"messages": history, "max_tokens": 8,
                                         "temperature": 0}).json()
                history.append(body["choices"][0]["message"])
                figures[name].append(body["usage"])
                if (name, turn) == ("A", 2):
                    title = [{"role": "system", "content": TITLE_SYSTEM}, history[1]]
                    figures["side"].append(client.post(
                        "/v1/chat/completions", headers={"x-session-id": "A"},
                        json={"messages": title, "max_tokens": 8}).json()["usage"])
                if (name, turn) == ("B", 3):
                    one_off = [{"role": "user", "content": "What is 2+2? " + filler(30)}]
                    figures["side"].append(client.post(
                        "/v1/chat/completions",
                        json={"messages": one_off, "max_tokens": 4}).json()["usage"])
    return figures


def fraction(usage: dict[str, Any]) -> float:
    return float(usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"])


def test_interleaved_sessions_keep_their_cache_with_affinity_and_side_by_side_without(
        run_proxy: ProxyRunner, erase_slots: Callable[[], None],
        capsys: pytest.CaptureFixture[str]) -> None:
    """With affinity every turn after a session's first reuses >= 90% of its prompt; the
    same run with PREFIXPIN_AFFINITY=0 is measured beside it."""
    with run_proxy() as url:
        on = run_sequence(url)
    erase_slots()
    with run_proxy(affinity=False) as url:
        off = run_sequence(url)
    with capsys.disabled():
        print("\nturn  A(on)  A(off)  B(on)  B(off)   cached fraction per turn")
        for turn in range(4):
            print(f"{turn + 1:>4}  {fraction(on['A'][turn]):.2f}   {fraction(off['A'][turn]):.2f}"
                  f"    {fraction(on['B'][turn]):.2f}   {fraction(off['B'][turn]):.2f}")
    for name in "AB":
        for turn, usage in enumerate(on[name][1:], start=2):
            assert fraction(usage) >= 0.9, (name, turn, usage)
    mean_on = sum(fraction(u) for n in "AB" for u in on[n][1:]) / 6
    mean_off = sum(fraction(u) for n in "AB" for u in off[n][1:]) / 6
    assert mean_on >= mean_off
