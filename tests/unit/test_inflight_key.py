"""The in-flight key with the messages entered by their digests (``Incoming.digests``): the
same requests share a key, and no two different bodies do."""

from __future__ import annotations

from typing import Any

from prefixpin.proxy.pipeline.inflight import inflight_key
from prefixpin.proxy.session.history import digest

MESSAGES = [{"role": "system", "content": "You help."}, {"role": "user", "content": "hi"}]


def key(body: dict[str, Any], *, by_digest: bool = True, session: str | None = None) -> bytes:
    messages = body.get("messages")
    digests = [digest(m) for m in messages] if by_digest and isinstance(messages, list) \
        else None
    return inflight_key("anon", "chat", "/v1/chat/completions", session, body, digests)


def test_a_streaming_and_a_whole_client_of_one_request_share_the_key() -> None:
    body = {"messages": MESSAGES, "max_tokens": 8}
    assert key({**body, "stream": True, "stream_options": {"include_usage": True}}) == key(
        {**body, "stream": False, "return_progress": True})


def test_another_message_another_field_another_session_is_another_key() -> None:
    body = {"messages": MESSAGES, "max_tokens": 8}
    keys = {key(body), key({**body, "max_tokens": 9}), key(body, session="a\0"),
            key({**body, "messages": [*MESSAGES, {"role": "user", "content": "more"}]}),
            key({**body, "messages": MESSAGES[:1]}),
            key({**body, "messages": [MESSAGES[1], MESSAGES[0]]})}
    assert len(keys) == 6


def test_messages_by_digest_never_read_as_another_body() -> None:
    body = {"messages": MESSAGES}
    assert key(body) != key({})
    assert key(body) != key({"messages": None})
    assert key({"messages": []}) != key({})
    # a body whose "messages" is not a list is serialised whole, as before
    odd = {"messages": "ab"}
    assert key(odd) == key(odd, by_digest=False)


def test_the_same_body_has_one_key_whichever_way_it_is_keyed() -> None:
    # the digests must be those of the messages: a mismatch falls back to the bytes
    body = {"messages": MESSAGES, "max_tokens": 8}
    wrong = inflight_key("anon", "chat", "/v1/chat/completions", None, body, [b"x" * 16])
    assert wrong == inflight_key("anon", "chat", "/v1/chat/completions", None, body)
