"""Namespaces and explicit session keys, in their documented precedence."""

from __future__ import annotations

import pytest

from proxy.identity import ANONYMOUS, explicit_identity, namespace_of


def test_namespace_is_a_hash_of_the_bearer_token_and_never_the_token() -> None:
    """Two tokens give two namespaces; the token text does not appear in either."""
    first = namespace_of({"authorization": "Bearer sk-secret-one"})
    second = namespace_of({"authorization": "Bearer sk-secret-two"})
    assert first != second
    assert first.startswith("t-")
    assert "secret" not in first
    assert namespace_of({"authorization": "Bearer sk-secret-one"}) == first


def test_an_anthropic_x_api_key_is_the_same_tenant_as_that_bearer_token() -> None:
    """Anthropic clients send their key in x-api-key: the same key is the same namespace
    in either header, and a bearer token wins when both are sent."""
    bearer = namespace_of({"authorization": "Bearer sk-one"})
    assert namespace_of({"x-api-key": "sk-one"}) == bearer
    assert namespace_of({"x-api-key": "sk-two"}) not in (bearer, ANONYMOUS)
    assert namespace_of({"authorization": "Bearer sk-one", "x-api-key": "sk-two"}) == bearer


@pytest.mark.parametrize("headers", [{}, {"authorization": "Basic abc"},
                                     {"authorization": "Bearer "}, {"x-api-key": "  "}])
def test_no_bearer_token_is_the_anonymous_namespace(headers: dict[str, str]) -> None:
    """Without a bearer token every request shares one anonymous namespace."""
    assert namespace_of(headers) == ANONYMOUS


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
