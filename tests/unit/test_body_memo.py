"""A resent history parsed once (``proxy.pipeline.body_memo``): every parse it gives is the
whole parse's, the messages a turn keeps are the earlier body's own objects, and only what
a turn adds is checked again."""

from __future__ import annotations

import json
import random
from typing import Any

import orjson
import pytest

from prefixpin.core.errors import BadRequestError
from prefixpin.proxy.pipeline.body_memo import CHAT, MIN_BYTES, BodyMemo, Wire
from prefixpin.proxy.pipeline.validation import parse_request

TRICKY = ['say "messages": [1, {2}]', "a \\\"quoted\\\" ]} brace", "ünïcödé ✓ \u2028",
          "{\"role\": \"user\"}", "\\", "[[[", "}}}"]


def message(rng: random.Random, index: int) -> dict[str, Any]:
    role = ("user", "assistant", "tool")[index % 3]
    text = " ".join(rng.choice([*TRICKY, f"word{rng.randrange(1000)}"]) for _ in range(60))
    out: dict[str, Any] = {"role": role, "content": text}
    if role == "assistant" and rng.random() < 0.5:
        out["tool_calls"] = [{"id": f"call_{index}", "type": "function",
                              "function": {"name": "read", "arguments": '{"path": "a]b"}'}}]
    if role == "user" and rng.random() < 0.3:
        out["content"] = [{"type": "text", "text": text}, {"type": "text", "text": "[x]"}]
    return out


def body(messages: list[dict[str, Any]], *, style: int = 0, **fields: Any) -> bytes:
    value = {"model": "m", "messages": messages, "stream": True, **fields}
    if style == 1:  # another client's layout: the array after other fields, indented
        value = {"stream": True, "tools": [{"type": "function", "function": {"name": "x"}}],
                 "messages": messages, "model": "m", **fields}
        return json.dumps(value, indent=1).encode()
    if style == 2:  # compact, non-ASCII kept as UTF-8
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    return json.dumps(value).encode()


def system() -> dict[str, Any]:
    return {"role": "system", "content": "You are a coding agent. " * (MIN_BYTES // 20)}


@pytest.mark.parametrize("style", [0, 1, 2])
def test_a_session_s_turns_parse_as_whole_parses_do_and_reuse_what_they_keep(style: int) -> None:
    rng = random.Random(style)
    memo = BodyMemo()
    history = [system(), message(rng, 0)]
    earlier: list[Any] | None = None
    reused_total = 0
    for turn in range(40):
        raw = body(history, style=style)
        parsed = memo.loads(raw)
        expected = orjson.loads(raw)
        if parsed is None:
            value = expected
        else:
            assert parsed.value == expected
            value = parsed.value
            reused_total += parsed.reused
            assert earlier is not None
            for mine, theirs in zip(value["messages"][:parsed.reused], earlier, strict=False):
                assert mine is theirs  # the earlier body's own objects
        memo.keep(raw, parsed if parsed is not None else value)
        earlier = value["messages"]
        edit = rng.random()
        if edit < 0.6:  # the common turn: new messages appended
            history = [*history, message(rng, turn * 2 + 1), message(rng, turn * 2 + 2)]
        elif edit < 0.8:  # the last reply comes back changed
            history = [*history[:-1], message(rng, turn + 500)]
        elif edit < 0.9:  # an edit in the middle
            at = rng.randrange(1, len(history))
            history = [*history[:at], message(rng, turn + 900), *history[at + 1:]]
        # else: an identical resend (a retry)
    assert reused_total > 200


@pytest.mark.parametrize("style", [0, 1, 2])
def test_a_first_message_with_escapes_is_found_again(style: int) -> None:
    """The first message (a system prompt) is skipped string by string: quotes after runs
    of backslashes, brackets and a key's name inside its strings end no string early."""
    tricky = ["\\", '\\"', '\\\"', '"]}', '{"messages": [', "\\\\", *TRICKY]
    first = {"role": "system", "content": " ".join(tricky) * (MIN_BYTES // 60),
             "name": '\\"]}'}
    memo = BodyMemo()
    history = [first, {"role": "user", "content": "hi"}]
    raw = body(history, style=style)
    memo.keep(raw, orjson.loads(raw))
    later = body([*history, {"role": "assistant", "content": "ok"}], style=style)
    parsed = memo.loads(later)
    assert parsed is not None
    assert parsed.reused == 2
    assert parsed.value == orjson.loads(later)


def test_a_resent_body_that_is_not_what_the_scan_reads_is_parsed_whole() -> None:
    memo = BodyMemo()
    history = [system(), {"role": "user", "content": "hi"}]
    raw = body(history)
    memo.keep(raw, orjson.loads(raw))
    odd = raw.replace(b'"content": "hi"}]', b'"content": "hi"}, 5]')
    assert memo.loads(odd) is None
    broken = raw[:-3]
    assert memo.loads(broken) is None
    other = body([system(), {"role": "user", "content": "hi"}], max_tokens=5)
    parsed = memo.loads(other)
    assert parsed is not None
    assert parsed.value == orjson.loads(other)


def test_a_small_body_or_one_without_messages_is_left_to_the_whole_parse() -> None:
    memo = BodyMemo()
    small = body([{"role": "user", "content": "hi"}])
    memo.keep(small, orjson.loads(small))
    assert memo.loads(small) is None
    assert memo.held_bytes == 0
    prompt = json.dumps({"prompt": "x" * MIN_BYTES}).encode()
    memo.keep(prompt, orjson.loads(prompt))
    assert memo.loads(prompt) is None
    assert memo.held_bytes == 0


def test_a_session_holds_its_latest_turn_and_the_memo_its_bound() -> None:
    memo = BodyMemo(max_bytes=10 * MIN_BYTES)
    history = [system(), {"role": "user", "content": "start"}]
    for turn in range(30):
        raw = body(history)
        parsed = memo.loads(raw)
        memo.keep(raw, parsed if parsed is not None else orjson.loads(raw))
        assert memo.held_bytes <= len(raw)  # the turn before it was replaced
        history = [*history, {"role": "user", "content": f"turn {turn}"}]
    for other in range(30):  # other sessions, the same system prompt
        raw = body([system(), {"role": "user", "content": f"session {other}"}])
        memo.keep(raw, orjson.loads(raw))
        assert memo.held_bytes <= 10 * MIN_BYTES


def test_only_the_messages_a_turn_adds_are_checked_again() -> None:
    memo = BodyMemo()
    history = [system(), {"role": "user", "content": "hi"}]
    first = parse_request(body(history), "chat", "/v1/chat/completions", max_messages=100,
                          memo=memo)
    bad = [*history, {"role": "wizard", "content": "x"}]
    with pytest.raises(BadRequestError, match=r"messages\[2\]\.role"):
        parse_request(body(bad), "chat", "/v1/chat/completions", max_messages=100, memo=memo)
    # The refused body was not kept: a later one resending it is checked whole again.
    with pytest.raises(BadRequestError, match=r"messages\[2\]\.role"):
        parse_request(body([*bad, {"role": "user", "content": "y"}]), "chat",
                      "/v1/chat/completions", max_messages=100, memo=memo)
    with pytest.raises(BadRequestError, match="limit is 3"):
        parse_request(body([*history, *history]), "chat", "/v1/chat/completions",
                      max_messages=3, memo=memo)
    good = [*history, {"role": "assistant", "content": "hello"}]
    later = parse_request(body(good), "chat", "/v1/chat/completions", max_messages=100,
                          memo=memo)
    assert later.body["messages"][0] is first.body["messages"][0]
    assert later.body == orjson.loads(body(good))


def test_a_huge_number_in_an_added_message_is_read_exactly() -> None:
    memo = BodyMemo()
    history = [system(), {"role": "user", "content": "hi"}]
    parse_request(body(history), "chat", "/v1/chat/completions", max_messages=100, memo=memo)
    raw = body(history, seed=2**64 + 1)
    again = parse_request(raw, "chat", "/v1/chat/completions", max_messages=100, memo=memo)
    assert again.body["seed"] == 2**64 + 1


def test_engine_controls_are_dropped_from_a_resent_body() -> None:
    memo = BodyMemo()
    history = [system(), {"role": "user", "content": "hi"}]
    parse_request(body(history), "chat", "/v1/chat/completions", max_messages=100, memo=memo)
    again = parse_request(body(history, id_slot=3, cache_prompt=False), "chat",
                          "/v1/chat/completions", max_messages=100, memo=memo)
    assert "id_slot" not in again.body
    assert "cache_prompt" not in again.body


def test_an_array_key_given_again_after_the_array_is_left_to_the_whole_parse() -> None:
    """A parse keeps a repeated key's last value: the array the scan found is not the
    parse's then, whether the key comes again as its bytes or spelled with escapes."""
    memo = BodyMemo()
    history = [system(), {"role": "user", "content": "hi"}]
    raw = body(history)
    memo.keep(raw, orjson.loads(raw))
    for again in (b', "messages": []}', b', "messag\\u0065s": []}'):
        repeated = raw[:-1] + again
        assert orjson.loads(repeated)["messages"] == []
        assert memo.loads(repeated) is None
    # The key's bytes elsewhere after the array (a nested field, a value) are no repeat.
    nested = body(history, tools=[{"messages": 1}], note="messages", other="\\u00e9")
    parsed = memo.loads(nested)
    assert parsed is not None
    assert parsed.value == orjson.loads(nested)


def test_a_body_parsed_whole_with_its_array_key_repeated_is_not_held() -> None:
    memo = BodyMemo()
    first = [system(), {"role": "user", "content": "A"}]
    kept = [system(), {"role": "user", "content": "B"}]
    raw = body(first)[:-1] + b', "messages": ' + json.dumps(kept).encode() + b"}"
    memo.keep(raw, orjson.loads(raw))
    assert memo.held_bytes == 0
    follow_up = body([*first, {"role": "user", "content": "C"}])
    assert memo.loads(follow_up) is None


def test_a_format_reuses_only_its_own_bodies_and_their_conversions() -> None:
    """Each format checks a message by its own rules: a body held for one lends nothing to
    another's. What a format's conversion made of each message comes back with it."""
    other = Wire("other", "messages")
    memo = BodyMemo()
    history = [system(), {"role": "user", "content": "hi"}]
    raw = body(history)
    memo.keep(raw, orjson.loads(raw))
    follow_up = body([*history, {"role": "user", "content": "more"}])
    assert memo.loads(follow_up, other) is None
    memo.keep(raw, orjson.loads(raw), other, converted=("system", "hi"))
    parsed = memo.loads(follow_up, other)
    assert parsed is not None
    assert parsed.wire == other
    assert parsed.reused == 2
    assert parsed.converted == ("system", "hi")
    assert memo.loads(follow_up, CHAT) is not None  # the chat body is still held


def test_an_array_under_another_key() -> None:
    inputs = Wire("inputs", "input")
    memo = BodyMemo()
    items = [system(), {"role": "user", "content": "hi"}]
    raw = json.dumps({"model": "m", "input": items}).encode()
    memo.keep(raw, orjson.loads(raw), inputs)
    follow_up = json.dumps({"model": "m", "input": [*items, {"type": "x"}]}).encode()
    parsed = memo.loads(follow_up, inputs)
    assert parsed is not None
    assert parsed.reused == 2
    assert parsed.value == orjson.loads(follow_up)
    assert parsed.converted is None  # none was held
