"""Mid-conversation system messages rendered in place (proxy.pipeline.system_turns), as data."""

from __future__ import annotations

from prefixpin.proxy.pipeline.system_turns import CLOSE, OPEN, has_mid_system, in_place


def test_only_system_messages_after_the_first_position_are_rewritten() -> None:
    messages = [{"role": "system", "content": "lead"}, {"role": "user", "content": "u"},
                {"role": "system", "content": "mid"}, {"role": "assistant", "content": "a"}]
    assert has_mid_system(messages)
    rewritten = in_place(messages)
    assert rewritten[0] == messages[0]
    assert rewritten[1] is messages[1]
    assert rewritten[2] == {"role": "user", "content": f"{OPEN}mid{CLOSE}"}
    assert rewritten[3] is messages[3]
    assert in_place(messages) == rewritten  # the same history, the same bytes


def test_text_parts_are_joined_and_other_parts_dropped() -> None:
    messages = [{"role": "user", "content": "u"},
                {"role": "system", "content": [{"type": "text", "text": "one"},
                                               {"type": "image_url", "image_url": {}},
                                               {"type": "text", "text": "two"}]}]
    assert in_place(messages)[1]["content"] == f"{OPEN}one\ntwo{CLOSE}"


def test_a_leading_system_message_alone_is_not_mid_conversation() -> None:
    assert not has_mid_system([{"role": "system", "content": "s"},
                               {"role": "user", "content": "u"}])
    assert not has_mid_system("not a list")
    assert in_place([]) == []


def test_a_developer_message_after_the_first_is_one_too() -> None:
    """Codex's Responses body converts to its instructions (system), then developer
    messages, which llama-server renders as system ones."""
    messages = [{"role": "system", "content": "instructions"},
                {"role": "developer", "content": "permissions"},
                {"role": "user", "content": "u"}]
    assert has_mid_system(messages)
    assert in_place(messages)[1] == {"role": "user", "content": f"{OPEN}permissions{CLOSE}"}
    assert not has_mid_system([{"role": "developer", "content": "d"},
                               {"role": "user", "content": "u"}])
