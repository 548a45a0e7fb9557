"""Bytes decide and history repair on Ollama's native messages: reasoning in ``thinking``
(``reasoning`` on Ollama's /v1), tool-call arguments as objects, calls whose ``id`` and
``index`` ollama-python drops, tool results keyed by ``tool_name``, ``images`` kept as they
are. Pure functions, then through the proxy in front of the fake Ollama (Ollama cannot be
installed here; the fake replays its recorded wire formats)."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from prefixpin.proxy.session.history import Committed, decide
from prefixpin.proxy.session.repair import POLICIES, RepairConfig, Repairer, RepairMemory

from .conftest import MODEL, proxy_rig

Message = dict[str, Any]

SYSTEM: Message = {"role": "system", "content": "You are an agent."}
USER: Message = {"role": "user", "content": "What is the weather in Paris?",
                 "images": ["aGVsbG8="]}
CALL: Message = {"role": "assistant", "content": "", "thinking": "I should ask the tool.",
                 "tool_calls": [{"id": "call_ab12cd34", "function": {
                     "index": 0, "name": "get_weather",
                     "arguments": {"city": "Paris", "unit": "celsius"}}}]}
RESULT: Message = {"role": "tool", "tool_name": "get_weather",
                   "content": "Sunny, 21 degrees. " + "Wind calm. " * 80}
ANSWER: Message = {"role": "assistant", "content": "It is sunny.",
                   "thinking": "The tool says sunny."}
NEXT: Message = {"role": "user", "content": "And tomorrow?"}
HISTORY = [SYSTEM, USER, CALL, RESULT, ANSWER, NEXT]
BODY = {"model": MODEL, "messages": HISTORY}
COMMITTED = Committed.of_chat(BODY)


def count(messages: Sequence[Mapping[str, Any]]) -> int:
    return sum(len(str(m.get("content") or "")) // 4 + 6 for m in messages)


def repair(messages: list[Message], memory: RepairMemory | None = None) -> Any:
    repairer = Repairer(RepairConfig(enabled=frozenset(POLICIES)), count)
    return repairer.repair(COMMITTED.messages, BODY, {**BODY, "messages": messages},
                           memory or RepairMemory(), None)


def rewritten(index: int, **changes: Any) -> list[Message]:
    messages = copy.deepcopy(HISTORY)
    for key, value in changes.items():
        if value is None:
            messages[index].pop(key, None)
        else:
            messages[index][key] = value
    return messages


OLLAMA_PYTHON_CALLS = [{"function": {"name": "get_weather",
                                     "arguments": {"unit": "celsius", "city": "Paris"}}}]

CASES = [
    ("reasoning", rewritten(2, thinking=None)),
    ("reasoning", rewritten(4, thinking=None)),
    ("tool_calls", rewritten(2, tool_calls=OLLAMA_PYTHON_CALLS)),
    ("tool_results", rewritten(3, content="Sunny, 21 degrees.")),
    ("tool_results", rewritten(3, content="")),
]


@pytest.mark.parametrize(("policy", "messages"), CASES)
def test_native_rewrites_are_repaired(policy: str, messages: list[Message]) -> None:
    """Each rewrite a native client makes comes back as the committed bytes, and the
    repaired body extends the committed history."""
    body = [*messages, {"role": "assistant", "content": "Maybe."},
            {"role": "user", "content": "Thanks."}]
    repaired = repair(body)
    assert not decide(COMMITTED, {**BODY, "messages": body}).resumable
    assert [a.policy for a in repaired.applied] == [policy]
    assert repaired.body["messages"][:6] == HISTORY
    assert decide(COMMITTED, repaired.body).extends


def test_object_arguments_in_another_key_order_are_the_same_bytes() -> None:
    """Arguments are compared as JSON values: another key order is no divergence."""
    messages = copy.deepcopy(HISTORY)
    messages[2]["tool_calls"][0]["function"]["arguments"] = {"unit": "celsius", "city": "Paris"}
    assert decide(COMMITTED, {**BODY, "messages": [*messages, NEXT]}).extends


@pytest.mark.parametrize(("index", "changes"), [
    (2, {"tool_calls": [{"function": {"name": "get_weather",
                                      "arguments": {"city": "Lyon", "unit": "celsius"}}}]}),
    (2, {"tool_calls": [{"id": "call_zz", "function": {
        "index": 0, "name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]}),
    (2, {"thinking": "Something else entirely."}),
    (3, {"tool_name": "other_tool", "content": "Sunny."}),
    (1, {"images": ["b3RoZXI="]}),
])
def test_real_edits_are_never_repaired(index: int, changes: dict[str, Any]) -> None:
    """Other arguments, another call id, other thinking, another tool's result, another
    image: the client's edit stands."""
    messages = rewritten(index, **changes)
    repaired = repair([*messages, NEXT])
    assert not repaired.applied
    assert repaired.body["messages"][index] == messages[index]


def test_the_reply_keeps_its_thinking_and_call_ids() -> None:
    """The reply the proxy returned, sent back without thinking and without the call id
    (ollama-python keeps name and arguments only), is restored as returned."""
    reply = copy.deepcopy(CALL)
    memory = RepairMemory(last_reply=reply)
    sent_back = {"role": "assistant", "content": "", "tool_calls": OLLAMA_PYTHON_CALLS}
    body = [*HISTORY, sent_back, {"role": "tool", "tool_name": "get_weather",
                                  "content": "Rain."}]
    repaired = repair(body, memory)
    assert repaired.body["messages"][6] == reply
    assert {a.policy for a in repaired.applied} == {"reasoning", "tool_calls"}


def test_a_stripped_thinking_is_classified() -> None:
    verdict = decide(COMMITTED, {**BODY, "messages": [*rewritten(4, thinking=None), NEXT]})
    assert (verdict.index, verdict.cause) == (4, "reasoning_stripped")


@pytest.mark.anyio
@pytest.mark.parametrize("on", [True, False], ids=["repair", "no-repair"])
async def test_native_repair_through_the_proxy(on: bool) -> None:
    """Through the proxy: turn 2's forwarded messages start with exactly turn 1's, though
    the client dropped thinking, trimmed the tool result and lost the call ids (with
    PREFIXPIN_REPAIR=0 the rewrite reaches Ollama)."""
    headers = {"x-session-id": "weather"}
    async with proxy_rig(recorder=True, repair=on) as rig:
        await rig.client.post("/api/chat", headers=headers,
                              json={"model": MODEL, "messages": HISTORY, "stream": False})
        second = rewritten(4, thinking=None)
        second[3]["content"] = "Sunny, 21 degrees."
        second[2]["tool_calls"] = OLLAMA_PYTHON_CALLS
        second += [{"role": "assistant", "content": "Rain likely."},
                   {"role": "user", "content": "Thanks."}]
        await rig.client.post("/api/chat", headers=headers,
                              json={"model": MODEL, "messages": second, "stream": False})
        assert rig.recorder is not None
        forwarded = [body["messages"] for path, body in rig.recorder.bodies]
        metrics = await rig.metrics()
        cached = [r.cached_tokens for r in rig.ollama.requests]
    assert forwarded[0] == HISTORY
    if not on:
        assert forwarded[1] == second
        assert "prefixpin_repairs_total{" not in metrics
        return
    assert forwarded[1][:6] == HISTORY
    for policy in ("reasoning", "tool_calls", "tool_results"):
        assert f'prefixpin_repairs_total{{policy="{policy}"}}' in metrics
    assert cached[1] >= rig.ollama.requests[0].prompt_tokens
