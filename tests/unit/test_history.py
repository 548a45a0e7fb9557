"""Bytes decide: extension, identity, divergence and its attributed cause."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixpin.proxy.session.history import Committed, DigestMemo, canonical, decide, digest

Message = dict[str, Any]
SYSTEM: Message = {"role": "system", "content": "You are a coding agent."}
USER: Message = {"role": "user", "content": "Fix the bug in parse.py"}
CALL: Message = {
    "role": "assistant", "content": None, "reasoning_content": "Look at the file first.",
    "tool_calls": [{"id": "c1", "type": "function",
                        "function": {"name": "read", "arguments": '{"path": "parse.py"}'}}]}
RESULT: Message = {"role": "tool", "tool_call_id": "c1",
                   "content": "def parse(x):\n" + "    pass\n" * 80}
REPLY: Message = {"role": "assistant", "content": "Fixed."}
HISTORY: list[Message] = [SYSTEM, USER, CALL, RESULT]


def body(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"messages": messages, **fields}


COMMITTED = Committed.of_chat(body(HISTORY))


def test_one_more_message_extends() -> None:
    """The committed messages followed by a new one: an extension."""
    verdict = decide(COMMITTED, body([*HISTORY, REPLY]))
    assert verdict.extends
    assert verdict.resumable
    assert verdict.reason() == "extends committed history"


def test_the_commit_point_is_the_prompt_not_the_reply() -> None:
    """The committed history holds exactly the forwarded messages; the model's reply is
    the first message of the next request's new suffix, never part of the commit."""
    assert len(COMMITTED.messages) == len(HISTORY)
    assert decide(COMMITTED, body([*HISTORY, REPLY, {"role": "user", "content": "ok"}])).extends


def test_the_same_messages_again_are_an_identical_resend() -> None:
    """A resend repeats the history: resumable, but not an extension."""
    verdict = decide(COMMITTED, body(HISTORY))
    assert verdict.identical
    assert not verdict.extends
    assert verdict.resumable


def test_one_character_off_at_the_boundary_declines() -> None:
    """A change in the last committed message, even one character, is a divergence there."""
    edited = copy.deepcopy(HISTORY)
    edited[-1]["content"] += "!"
    verdict = decide(COMMITTED, body([*edited, REPLY]))
    assert not verdict.resumable
    assert verdict.index == 3
    assert verdict.reason().startswith("history diverged at message 3, char ")


@pytest.mark.parametrize(("index", "change", "cause"), [
    (2, lambda m: m.pop("reasoning_content"), "reasoning_stripped"),
    (2, lambda m: m["tool_calls"][0]["function"].update(arguments='{"path":"parse.py"}'),
     "tool_args_reserialized"),
    (3, lambda m: m.update(content=m["content"][:400]), "tool_result_trimmed"),
    (3, lambda m: m.update(content="[Old tool result content cleared]"), "tool_result_trimmed"),
    (0, lambda m: m.update(content=m["content"] + " Today is 2026-11-29."), "system_changed"),
    (1, lambda m: m.update(content="Fix the bug in lex.py"), "edited"),
])
def test_divergences_name_their_cause(index: int, change: Any, cause: str) -> None:
    """Each rewrite class real agents apply is attributed to its cause."""
    rewritten = copy.deepcopy(HISTORY)
    change(rewritten[index])
    verdict = decide(COMMITTED, body([*rewritten, REPLY]))
    assert (verdict.index, verdict.cause) == (index, cause)


def test_a_moved_window_is_recognised() -> None:
    """The client dropped the oldest messages: the first one now appears later."""
    verdict = decide(COMMITTED, body([SYSTEM, CALL, RESULT, REPLY]))
    assert (verdict.index, verdict.cause) == (1, "window_moved")


def test_reordered_tools_are_a_change_of_request_fields() -> None:
    """Tools are part of the rendered prompt: a different tool list declines."""
    tools = [{"type": "function", "function": {"name": "read"}},
             {"type": "function", "function": {"name": "edit"}}]
    committed = Committed.of_chat(body(HISTORY, tools=tools))
    verdict = decide(committed, body([*HISTORY, REPLY], tools=tools[::-1]))
    assert not verdict.resumable
    assert (verdict.field, verdict.cause) == ("tools", "tools_changed")
    assert decide(committed, body([*HISTORY, REPLY], tools=tools)).extends


def test_a_shorter_history_never_resumes() -> None:
    """Fewer messages than committed: not an extension, and the reason says so."""
    verdict = decide(COMMITTED, body(HISTORY[:2]))
    assert not verdict.resumable
    assert verdict.cause == "shorter"
    assert "of committed 4 messages" in verdict.reason()


def test_raw_prompts_extend_by_prefix() -> None:
    """/v1/completions: a longer prompt with the committed one as prefix extends."""
    committed = Committed.of_completion({"prompt": "Once upon a time"})
    assert decide(committed, {"prompt": "Once upon a time there"}).extends
    assert decide(committed, {"prompt": "Once upon a time"}).identical
    assert decide(committed, {"prompt": "Once upon a tide"}).char == 14


def test_json_values_that_python_equates_stay_distinct() -> None:
    """true, 1 and 1.0 render differently in a template: canonical JSON keeps them apart."""
    assert len({canonical(True), canonical(1), canonical(1.0)}) == 3


@given(st.lists(st.text(max_size=20), min_size=1, max_size=6), st.integers(0, 5),
       st.text(min_size=1, max_size=5))
def test_divergence_index_is_within_both_histories(contents: list[str], at: int,
                                                   extra: str) -> None:
    """The reported index never exceeds either history (no "message 5 of 4")."""
    messages = [{"role": "user", "content": c} for c in contents]
    committed = Committed.of_chat(body(messages))
    changed = copy.deepcopy(messages)
    at = at % len(changed)
    changed[at]["content"] += extra
    verdict = decide(committed, body(changed))
    assert not verdict.resumable
    assert verdict.index is not None
    assert 0 <= verdict.index <= min(len(messages), len(changed)) - 1
    assert verdict.committed_messages == len(messages)


def test_a_commit_that_extends_keeps_the_previous_messages_and_counts_only_the_new() -> None:
    """A turn's commit reuses what the previous commit holds of the same messages (not
    rendered nor measured again), and holds and counts exactly what a fresh commit would."""
    junk: Message = {"role": "user", "content": "and again", "x-junk": "dropped"}
    extended = body([*HISTORY, REPLY, junk], model="m")
    again = Committed.of_chat(extended, previous=COMMITTED)
    fresh = Committed.of_chat(extended)
    assert again == fresh
    # the bytes it holds: its messages' JSON array, their digests, its other fields
    assert again.size == fresh.size == (len(canonical(list(fresh.messages))) + 32 * 6
                                        + len(canonical({"model": "m"})))
    assert all(a is b for a, b in zip(again.messages, COMMITTED.messages, strict=False))
    assert "x-junk" not in again.messages[-1]


def test_a_commit_that_rewrites_the_history_starts_afresh() -> None:
    changed = body([SYSTEM, {"role": "user", "content": "Another task"}, REPLY])
    again = Committed.of_chat(changed, previous=COMMITTED)
    assert again == Committed.of_chat(changed)


_MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool"]), "content": st.text(max_size=120)}),
    max_size=8)


@given(_MESSAGES, _MESSAGES)
def test_the_memo_gives_each_message_its_own_digest(first: list[Any], second: list[Any]) -> None:
    """Found again or made, a message's digest is ``digest``'s: a message whose length and
    edges match another's, and whose middle differs, is not taken for it."""
    memo = DigestMemo()
    assert memo.digests(first) == [digest(m) for m in first]
    assert memo.digests(first + second) == [digest(m) for m in first + second]


def test_the_memo_tells_apart_messages_that_differ_only_in_the_middle() -> None:
    memo = DigestMemo()
    a = {"role": "tool", "content": "x" * 200 + "a" + "y" * 200}
    b = {"role": "tool", "content": "x" * 200 + "b" + "y" * 200}
    assert memo.digests([a, b, a]) == [digest(a), digest(b), digest(a)]


def test_the_memo_holds_at_most_its_bytes_the_newest_kept() -> None:
    memo = DigestMemo(max_bytes=10_000)
    messages = [{"role": "user", "content": f"{i:04d}" + "z" * 1_000} for i in range(50)]
    assert memo.digests(messages) == [digest(m) for m in messages]
    assert 9_000 <= memo.held_bytes <= 10_000
    assert memo.digests(messages[-5:]) == [digest(m) for m in messages[-5:]]
    assert memo.digests([{"role": "user", "content": "w" * 20_000}])  # too big to hold
    assert memo.held_bytes <= 10_000


def test_the_memo_knows_a_message_object_it_digested_and_holds_at_most_its_objects() -> None:
    """A resent history's messages are the earlier body's objects: found by identity. An
    equal message in another object is found by its bytes, and gets the same digest."""
    memo = DigestMemo(max_objects=10)
    messages = [{"role": "user", "content": f"message {i}"} for i in range(20)]
    first = memo.digests(messages)
    held = memo.held_bytes
    assert memo.digests(messages[-10:]) == first[-10:]
    assert memo.held_bytes == held  # nothing made again
    copies = [dict(m) for m in messages]
    assert memo.digests(copies) == first == [digest(m) for m in messages]


def test_the_objects_the_memo_knows_are_bounded_by_their_bytes() -> None:
    memo = DigestMemo(max_bytes=10_000)
    big = [{"role": "tool", "content": f"{i:04d}" + "q" * 3_000} for i in range(10)]
    assert memo.digests(big) == [digest(m) for m in big]
    assert memo.digests(big[-2:]) == [digest(m) for m in big[-2:]]
    assert 6_000 < memo.known_object_bytes <= 10_000
