"""Explicit session keys, in their documented precedence (namespaces: test_tenants)."""

from __future__ import annotations

import pytest

from prefixpin.proxy.session.identity import explicit_identity


@pytest.mark.parametrize(("body", "headers", "key", "source"), [
    ({"session_id": "b1", "prompt_cache_key": "b2"}, {"x-session-id": "h"}, "b1",
     "body.session_id"),
    ({"prompt_cache_key": "b2", "user": "u"}, {"x-session-id": "h"}, "b2",
     "body.prompt_cache_key"),
    ({"user": "u"}, {"x-session-id": "h"}, "u", "body.user"),
    ({"metadata": {"user_id": "user_ab12_account_x1_session_5f0e-77"}}, {"x-session-id": "h"},
     "5f0e-77", "body.metadata.user_id"),
    ({}, {"x-session-id": "h1", "x-session-affinity": "h2"}, "h1", "header.x-session-id"),
    ({}, {"x-session-affinity": "h2", "session_id": "h3"}, "h2", "header.x-session-affinity"),
    ({}, {"session_id": "h3", "x-litellm-session-id": "h4"}, "h3", "header.session_id"),
    ({}, {"x-litellm-session-id": "h4", "x-claude-code-session-id": "h5"}, "h4",
     "header.x-litellm-session-id"),
    ({"metadata": {"user_id": '{"device_id":"d1","account_uuid":"","session_id":"s-9"}'}},
     {"x-claude-code-session-id": "s-9"}, "s-9", "body.metadata.user_id"),
    ({"metadata": {"user_id": '{"device_id":"d1"}'}}, {}, '{"device_id":"d1"}',
     "body.metadata.user_id"),
    ({}, {"x-claude-code-session-id": "h5", "session-id": "h6"}, "h5",
     "header.x-claude-code-session-id"),
    ({}, {"session-id": "h6", "thread-id": "h7"}, "h6", "header.session-id"),
    ({}, {"thread-id": "h7"}, "h7", "header.thread-id"),
])
def test_explicit_keys_follow_the_documented_precedence(
        body: dict[str, object], headers: dict[str, str], key: str, source: str) -> None:
    """Body fields win over headers, in the listed order."""
    identity = explicit_identity(body, headers)
    assert identity is not None
    assert (identity.key, identity.source) == (key, source)


def test_parent_header_marks_a_sub_agent() -> None:
    """x-parent-session-id is carried as the parent of the named session."""
    identity = explicit_identity({}, {"x-session-id": "child", "x-parent-session-id": "main"})
    assert identity is not None
    assert identity.parent == "main"


@pytest.mark.parametrize("value", ["", "   ", 5, None, "x" * 300])
def test_unusable_keys_are_ignored(value: object) -> None:
    """Empty, non-string and absurdly long keys name no session."""
    assert explicit_identity({"session_id": value}, {}) is None


CLAUDE_USER_ID = '{"device_id":"d1","account_uuid":"","session_id":"S"}'


@pytest.mark.parametrize(("headers", "key", "source"), [
    ({"x-dynamo-session-id": "dyn", "x-session-id": "h"}, "dyn", "header.x-dynamo-session-id"),
    ({"x-qwen-code-session-id": "qwen"}, "qwen", "header.x-qwen-code-session-id"),
    ({"x-kilocode-taskid": "ses_kilo"}, "ses_kilo", "header.x-kilocode-taskid"),
    ({"x-roo-task-id": "roo-task"}, "roo-task", "header.x-roo-task-id"),
    ({"x-task-id": "cline-task"}, "cline-task", "header.x-task-id"),
    # Roo Code's OpenAI providers and Cline's Codex provider send the task id as session_id
    ({"session_id": "roo-task"}, "roo-task", "header.session_id"),
    # pi's Responses transport sends Session-ID; the router lower-cases header names
    ({"session-id": "pi-session"}, "pi-session", "header.session-id"),
    ({"thread-id": "codex-thread"}, "codex-thread", "header.thread-id"),
    ({"x-session-affinity": "ses_open"}, "ses_open", "header.x-session-affinity"),
    # the agents' headers that name one session are read after the generic ones
    ({"x-qwen-code-session-id": "q", "x-kilocode-taskid": "k", "x-roo-task-id": "r",
      "x-task-id": "c"}, "q", "header.x-qwen-code-session-id"),
    ({"x-kilocode-taskid": "k", "x-roo-task-id": "r", "x-task-id": "c"}, "k",
     "header.x-kilocode-taskid"),
    ({"x-roo-task-id": "r", "x-task-id": "c"}, "r", "header.x-roo-task-id"),
])
def test_each_agents_session_header_names_the_session(
        headers: dict[str, str], key: str, source: str) -> None:
    """Every 2026 agent's session header names a session, each in its documented place;
    none of them is a sub-agent or ends its session."""
    identity = explicit_identity({}, headers)
    assert identity is not None
    assert (identity.key, identity.source, identity.parent, identity.final) == (
        key, source, None, False)


def test_a_claude_code_sub_agent_is_its_own_session_under_the_main_one() -> None:
    """X-Claude-Code-Agent-Id: key <session>/<agent>, parent the main agent's key."""
    main = explicit_identity({}, {"x-claude-code-session-id": "S"})
    sub = explicit_identity({}, {"x-claude-code-session-id": "S",
                                 "x-claude-code-agent-id": "a1"})
    assert main is not None
    assert sub is not None
    assert (main.key, main.parent) == ("S", None)
    assert (sub.key, sub.parent) == ("S/a1", "S")
    assert sub.source == "header.x-claude-code-session-id+header.x-claude-code-agent-id"


def test_a_claude_code_sub_agents_sub_agent_names_its_parent_agent() -> None:
    """X-Claude-Code-Parent-Agent-Id: the parent is that sub-agent's own key."""
    identity = explicit_identity({}, {"x-claude-code-session-id": "S",
                                      "x-claude-code-agent-id": "a2",
                                      "x-claude-code-parent-agent-id": "a1"})
    assert identity is not None
    assert (identity.key, identity.parent) == ("S/a2", "S/a1")


def test_the_agent_id_is_joined_to_the_session_in_the_body_too() -> None:
    """Claude Code's metadata.user_id (read before headers) carries the same session id:
    the agent header still makes the request a sub-agent of it."""
    body = {"metadata": {"user_id": CLAUDE_USER_ID}}
    identity = explicit_identity(body, {"x-claude-code-session-id": "S",
                                        "x-claude-code-agent-id": "a1"})
    main = explicit_identity(body, {"x-claude-code-session-id": "S"})
    assert identity is not None
    assert main is not None
    assert (identity.key, identity.parent) == ("S/a1", "S")
    assert identity.source == "body.metadata.user_id+header.x-claude-code-agent-id"
    assert (main.key, main.parent) == ("S", None)


def test_a_parent_agent_id_without_an_agent_id_says_nothing() -> None:
    """The parent-agent header travels only with an agent id: alone it is ignored."""
    identity = explicit_identity({}, {"x-claude-code-session-id": "S",
                                      "x-claude-code-parent-agent-id": "a1"})
    assert identity is not None
    assert (identity.key, identity.parent) == ("S", None)


def test_an_agent_id_alone_names_no_session() -> None:
    """Without the session it belongs to, an agent id is no session key."""
    assert explicit_identity({}, {"x-claude-code-agent-id": "a1"}) is None


def test_dynamo_parent_header_marks_a_sub_agent() -> None:
    """X-Dynamo-Parent-Session-ID is the parent, after OpenCode's x-parent-session-id."""
    identity = explicit_identity({}, {"x-dynamo-session-id": "child",
                                      "x-dynamo-parent-session-id": "main"})
    assert identity is not None
    assert (identity.key, identity.parent) == ("child", "main")
    both = explicit_identity({}, {"x-session-id": "child", "x-parent-session-id": "open",
                                  "x-dynamo-parent-session-id": "dyn"})
    assert both is not None
    assert both.parent == "open"


@pytest.mark.parametrize(("value", "final"), [
    ("true", True), ("1", True), ("TRUE", True), (" yes ", True),
    ("false", False), ("0", False), ("", False), ("maybe", False),
])
def test_dynamo_session_final_ends_the_named_session(value: str, final: bool) -> None:
    """X-Dynamo-Session-Final: true (or 1, yes) marks the request as the session's last."""
    identity = explicit_identity({}, {"x-dynamo-session-id": "d",
                                      "x-dynamo-session-final": value})
    assert identity is not None
    assert (identity.key, identity.final) == ("d", final)


def test_final_applies_to_whichever_key_named_the_session() -> None:
    """The final header ends the session the request names, wherever its key came from,
    a sub-agent's included; without a session it names nothing."""
    identity = explicit_identity({"prompt_cache_key": "p"}, {"x-dynamo-session-final": "1"})
    assert identity is not None
    assert (identity.key, identity.final) == ("p", True)
    sub = explicit_identity({}, {"x-claude-code-session-id": "S", "x-claude-code-agent-id": "a",
                                 "x-dynamo-session-final": "true"})
    assert sub is not None
    assert (sub.key, sub.final) == ("S/a", True)
    assert explicit_identity({}, {"x-dynamo-session-final": "true"}) is None
