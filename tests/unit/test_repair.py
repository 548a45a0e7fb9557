"""History repair, pure: each policy turns a real client's rewrite back into the committed
history, only there, deterministically, and within the budget."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from prefixpin.proxy.session.history import Committed, decide
from prefixpin.proxy.session.repair import (
    POLICIES,
    TRIM_CHARS,
    RepairConfig,
    Repairer,
    RepairMemory,
    proxy_trim,
)

Message = dict[str, Any]


def count(messages: Sequence[Mapping[str, Any]]) -> int:
    """Tokens as characters/4: enough for budget tests."""
    return sum(len(str(m.get("content") or "")) // 4 + 6 for m in messages)


def repairer(*only: str) -> Repairer:
    enabled = frozenset(only or POLICIES)
    return Repairer(RepairConfig(enabled=enabled), count)


SYSTEM: Message = {"role": "system", "content": "You are an agent.\nToday is 2026-11-29."}
USER: Message = {"role": "user", "content": "Fix parse.py"}
CALL: Message = {"role": "assistant", "content": "", "reasoning_content": "Read it first.",
                 "tool_calls": [{"id": "c1", "type": "function", "function": {
                     "name": "read", "arguments": '{"path": "parse.py", "lines": 400}'}}]}
RESULT: Message = {"role": "tool", "tool_call_id": "c1", "content": "line\n" * 600}
THINK: Message = {"role": "assistant", "content": "<think>It is a loop.</think>Found it."}
USER2: Message = {"role": "user", "content": "Go on"}
HISTORY = [SYSTEM, USER, CALL, RESULT, THINK, USER2]
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"a": 1, "b": 2}}},
         {"type": "function", "function": {"name": "edit", "parameters": {}}}]
BODY = {"messages": HISTORY, "tools": TOOLS}
COMMITTED = Committed.of_chat(BODY)
REPLY: Message = {"role": "assistant", "content": "Done."}


def run(body: Mapping[str, Any], *, only: tuple[str, ...] = (), budget: int | None = None,
        memory: RepairMemory | None = None) -> Any:
    return repairer(*only).repair(COMMITTED.messages, BODY, body, memory or RepairMemory(),
                                  budget)


def rewritten(index: int, **changes: Any) -> list[Message]:
    messages = copy.deepcopy(HISTORY)
    for key, value in changes.items():
        if value is None:
            messages[index].pop(key, None)
        else:
            messages[index][key] = value
    return messages


CASES = [
    ("reasoning", rewritten(2, reasoning_content=None)),
    ("reasoning", rewritten(4, content="Found it.")),
    ("tool_calls", rewritten(2, tool_calls=[{"id": "c1", "type": "function", "function": {
        "name": "read", "arguments": '{"lines":400,"path":"parse.py"}'}}])),
    ("tool_results", rewritten(3, content="line\n" * 80)),
    ("tool_results", rewritten(3, content="[Old tool result content cleared]")),
    ("volatile", rewritten(0, content="You are an agent.\nToday is 2026-11-30.")),
]


@pytest.mark.parametrize(("policy", "messages"), CASES)
def test_each_rewrite_is_repaired_into_the_committed_history(
        policy: str, messages: list[Message]) -> None:
    """After repair the request extends the committed history byte for byte."""
    result = run({"messages": [*messages, REPLY], "tools": TOOLS})
    assert [a.policy for a in result.applied] == [policy]
    assert result.complete
    assert decide(COMMITTED, result.body).extends
    assert result.body["messages"][:-1] == HISTORY


@pytest.mark.parametrize(("policy", "messages"), CASES)
def test_a_switched_off_policy_repairs_nothing(policy: str, messages: list[Message]) -> None:
    """Each policy has its own switch."""
    others = tuple(p for p in POLICIES if p != policy)
    result = run({"messages": [*messages, REPLY], "tools": TOOLS}, only=others)
    assert not decide(COMMITTED, result.body).resumable


def test_the_same_input_always_gives_the_same_output() -> None:
    """Repair is deterministic."""
    body = {"messages": [*rewritten(3, content="cleared"), REPLY], "tools": TOOLS[::-1]}
    first, second = run(body), run(copy.deepcopy(body))
    assert first.body == second.body
    assert first.applied == second.applied


def test_reordered_tools_keep_the_first_serialization() -> None:
    """The same tool set in another order is forwarded as the session first sent it."""
    result = run({"messages": [*HISTORY, REPLY], "tools": TOOLS[::-1]})
    assert result.body["tools"] is TOOLS
    assert [a.policy for a in result.applied] == ["tools"]
    assert decide(COMMITTED, result.body).extends


def test_a_moved_window_gets_its_dropped_messages_back() -> None:
    """The client dropped the oldest messages after the system prompt: re-added."""
    result = run({"messages": [SYSTEM, THINK, USER2, REPLY], "tools": TOOLS})
    assert [a.policy for a in result.applied] == ["window"]
    assert result.body["messages"] == [*HISTORY, REPLY]


def test_a_real_edit_is_not_repaired() -> None:
    """Different visible content is an edit: nothing is restored after it."""
    messages = rewritten(1, content="Fix lex.py")
    result = run({"messages": [*messages, REPLY], "tools": TOOLS})
    assert not result.complete
    assert result.body["messages"][1]["content"] == "Fix lex.py"
    assert not decide(COMMITTED, result.body).resumable


def test_nothing_is_restored_after_a_divergence() -> None:
    """A trimmed tool result after an edited message stays trimmed: repair only restores
    where everything before already equals the committed history."""
    messages = rewritten(1, content="Fix lex.py")
    messages[3]["content"] = "cleared"
    result = run({"messages": messages, "tools": TOOLS})
    assert result.body["messages"][3]["content"] == "cleared"
    assert result.applied == []


def test_different_reasoning_is_not_dropped_reasoning() -> None:
    """Reasoning that changed (not removed) is an edit, never overwritten."""
    messages = rewritten(2, reasoning_content="Another thought.")
    assert not run({"messages": messages, "tools": TOOLS}).complete


def test_the_reply_the_proxy_returned_gets_its_reasoning_back() -> None:
    """The newest assistant message, sent back without the reasoning the proxy returned."""
    returned = {"role": "assistant", "content": "Done.", "reasoning_content": "Checked twice."}
    result = run({"messages": [*HISTORY, REPLY, {"role": "user", "content": "next"}],
                  "tools": TOOLS}, memory=RepairMemory(last_reply=returned))
    assert result.body["messages"][len(HISTORY)] == returned
    assert "the proxy's last reply" in result.applied[0].detail


def test_over_budget_tool_results_are_trimmed_before_a_pinned_cut() -> None:
    """Restoring would exceed the budget: the proxy trims old tool results itself, by turn,
    pins the cut, and keeps it while the prompt fits."""
    memory = RepairMemory()
    body = {"messages": [*rewritten(3, content="cleared"), REPLY], "tools": TOOLS}
    first = run(body, budget=600, memory=memory)
    assert first.cut_moved
    assert memory.cut == 5  # the user turn after the long tool result
    assert first.body["messages"][3]["content"] == proxy_trim(RESULT["content"])
    assert len(first.body["messages"][3]["content"]) < TRIM_CHARS + 60
    assert count(first.body["messages"]) <= 0.7 * 600
    # Next step: the client sends the next turn; the cut stays where it was.
    committed = Committed.of_chat(first.body)
    nxt = [*rewritten(3, content="cleared"), REPLY, {"role": "user", "content": "more"}]
    second = repairer().repair(committed.messages, first.body,
                               {"messages": nxt, "tools": TOOLS}, memory, 600)
    assert not second.cut_moved
    assert memory.cut == 5
    assert decide(committed, second.body).extends


REMINDED: Message = {"role": "user", "content": [
    {"type": "text", "text": "<system-reminder>\nAs you answer, use the tools.\n"
                             "</system-reminder>\n"},
    {"type": "text", "text": "Fix parse.py"}]}


def _claude_history(first_user: Message) -> dict[str, Any]:
    return {"messages": [SYSTEM, first_user, REPLY, USER2]}


@pytest.mark.parametrize("moved", [
    {"role": "user", "content": [{"type": "text", "text": "Fix parse.py"}]},  # dropped
    {"role": "user", "content": [  # another reminder in its place
        {"type": "text", "text": "<system-reminder>\nToday's todo list is empty.\n"
                                 "</system-reminder>\n"},
        {"type": "text", "text": "Fix parse.py"}]},
    {"role": "user", "content": [  # moved after the prompt
        {"type": "text", "text": "Fix parse.py"},
        {"type": "text", "text": "<system-reminder>\nAs you answer, use the tools.\n"
                                 "</system-reminder>\n"}]},
])
def test_moved_system_reminders_keep_the_committed_user_message(moved: Message) -> None:
    """Claude Code adds, drops and moves <system-reminder> blocks in earlier user turns:
    the committed message is kept, by the reminders policy and only with it on."""
    committed_body = _claude_history(REMINDED)
    committed = Committed.of_chat(committed_body)
    incoming = {"messages": [SYSTEM, moved, REPLY, USER2, REPLY]}
    result = repairer().repair(committed.messages, committed_body, incoming, RepairMemory(),
                               None)
    assert [a.policy for a in result.applied] == ["reminders"]
    assert decide(committed, result.body).extends
    off = repairer(*(p for p in POLICIES if p != "reminders")).repair(
        committed.messages, committed_body, incoming, RepairMemory(), None)
    assert not decide(committed, off.body).resumable


def test_a_changed_prompt_beside_a_reminder_is_not_repaired() -> None:
    """Only the reminder blocks may differ: an edited prompt is a real edit."""
    committed_body = _claude_history(REMINDED)
    committed = Committed.of_chat(committed_body)
    edited = {"role": "user", "content": [REMINDED["content"][0],
                                          {"type": "text", "text": "Fix lex.py"}]}
    result = repairer().repair(committed.messages, committed_body,
                               {"messages": [SYSTEM, edited, REPLY, USER2]}, RepairMemory(),
                               None)
    assert not result.applied
    assert not decide(committed, result.body).resumable
