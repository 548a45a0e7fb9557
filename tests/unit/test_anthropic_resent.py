"""A resent Anthropic history parsed and converted once (``proxy.codecs.anthropic`` with
``proxy.pipeline.body_memo``): every request it reads is what the whole parse and
conversion make of its bytes, refusals and their messages included; a follow-up keeps the
earlier body's message objects and the chat messages they converted to, and only the
messages it adds are converted, checked and digested."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from prefixpin.core.errors import BadRequestError
from prefixpin.proxy.codecs import OPENAI_CHAT, anthropic_convert
from prefixpin.proxy.codecs.anthropic import AnthropicCodec
from prefixpin.proxy.pipeline.body_memo import MIN_BYTES, BodyMemo
from prefixpin.proxy.session import history as history_module
from prefixpin.proxy.session.history import DigestMemo
from tests.unit.resent_reading import read_as_whole

Json = dict[str, Any]
CODEC = AnthropicCodec()
TRICKY = ['say "messages": [1, {2}]', "a \\\"quoted\\\" ]} brace", "ünïcödé ✓ \u2028",
          '{"role": "user"}', "\\", "[[[", "}}}", "\\u0065", "cch=abcde;"]
EPHEMERAL = {"type": "ephemeral"}
TOOLS = [{"name": name, "description": f"{name} a file. " * 40,
          "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"},
                                                            "limit": {"type": "integer"}},
                           "required": ["file_path"]}}
         for name in ("Read", "Edit", "Bash", "Grep")]


def text(rng: random.Random, words: int = 40) -> str:
    return " ".join(rng.choice([*TRICKY, f"word{rng.randrange(1000)}"]) for _ in range(words))


def image(rng: random.Random) -> Json:
    if rng.random() < 0.5:
        return {"type": "image", "source": {"type": "url",
                                            "url": f"https://x.test/{rng.randrange(99)}.png"}}
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": "iVBORw0KGgo" + "A" * rng.randrange(40)}}


def user_turn(rng: random.Random) -> Json:
    roll = rng.random()
    if roll < 0.3:
        return {"role": "user", "content": text(rng)}
    blocks: list[Json] = [{"type": "text", "text": text(rng)}]
    if roll < 0.45:
        blocks.append(image(rng))
    if roll > 0.9:  # what Claude Code 2.1 sends inside messages
        return {"role": "system", "content": text(rng, 10)}
    return {"role": "user", "content": blocks}


def assistant_turn(rng: random.Random, number: int) -> Json:
    blocks: list[Json] = []
    if rng.random() < 0.5:
        blocks.append({"type": "thinking", "thinking": text(rng, 20), "signature": "sig" * 8})
    if rng.random() < 0.7:
        blocks.append({"type": "text", "text": text(rng, 15)})
    for call in range(rng.choice((0, 1, 1, 2))):
        blocks.append({"type": "tool_use", "id": f"toolu_{number}_{call}",
                       "name": rng.choice(TOOLS)["name"],
                       "input": {"file_path": f"/src/{text(rng, 1)}", "limit": call,
                                 "z": None, "a": [1.5, True]}})
    if not blocks and rng.random() < 0.5:
        return {"role": "assistant", "content": []}  # converts to nothing
    return {"role": "assistant", "content": blocks or text(rng, 5)}


def tool_results(rng: random.Random, assistant: Json) -> Json | None:
    calls = [b for b in assistant["content"] if isinstance(assistant["content"], list)
             and b["type"] == "tool_use"]
    if not calls:
        return None
    blocks: list[Json] = []
    for call in calls:
        content: Any = text(rng, 80)
        if rng.random() < 0.4:
            content = [{"type": "text", "text": text(rng, 30)}]
            if rng.random() < 0.4:
                content.append(image(rng))
        blocks.append({"type": "tool_result", "tool_use_id": call["id"], "content": content,
                       **({"is_error": True} if rng.random() < 0.1 else {})})
    return {"role": "user", "content": blocks}


def a_turn(rng: random.Random, number: int) -> list[Json]:
    assistant = assistant_turn(rng, number)
    results = tool_results(rng, assistant)
    return [assistant, results if results is not None else user_turn(rng)]


def with_cache_marker(messages: list[Json]) -> list[Json]:
    """Claude Code's marker on the last block of the last message only: the message that
    carried it last turn comes back without it."""
    out = []
    for at, message in enumerate(messages):
        content = message["content"]
        if isinstance(content, list):
            content = [{k: v for k, v in block.items() if k != "cache_control"}
                       if isinstance(block, dict) else block for block in content]
            if at == len(messages) - 1 and content and isinstance(content[-1], dict):
                content[-1] = {**content[-1], "cache_control": EPHEMERAL}
        out.append({**message, "content": content})
    return out


def system(rng: random.Random, stamp: int | None) -> Any:
    """Claude Code's two blocks, the billing line stamped per request, or (now and then,
    and always without a ``stamp``) one string."""
    prompt = "You are Claude Code, a coding agent. " * (MIN_BYTES // 36)
    if stamp is None or rng.random() < 0.2:
        return prompt
    billing = (f"x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; "
               f"cch={stamp % 100000:05d};")
    return [{"type": "text", "text": billing},
            {"type": "text", "text": prompt, "cache_control": EPHEMERAL}]


def body(rng: random.Random, messages: list[Json], *, style: int, stamp: int) -> bytes:
    """Claude Code's layout (compact, messages first), or another client's (a system
    prompt that does not change and the tools before the array, indented)."""
    value: Json = {"model": "claude-sonnet-4-5", "messages": with_cache_marker(messages),
                   "temperature": 1, "system": system(rng, stamp if style == 0 else None),
                   "tools": TOOLS,
                   "metadata": {"user_id": "user_abc_session_1"}, "max_tokens": 32000,
                   "stream": True}
    if rng.random() < 0.2:
        value["thinking"] = {"type": "enabled", "budget_tokens": 4000}
    if style == 1:
        value = {key: value[key] for key in ("system", "tools", "model", "stream",
                                             "max_tokens", "messages")}
        return json.dumps(value, indent=1).encode()
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def refused(rng: random.Random) -> Json:
    """A message the checks refuse (or one that passes them: not every roll is bad)."""
    return rng.choice([
        {"role": "tool", "content": "x"},
        {"role": "user", "content": [{"type": "text", "text": 5}]},
        {"role": "user", "content": [5]},
        {"role": "user", "content": None},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": [{"text": "no type"}]}]},
        {"role": "user", "content": [{"type": "mystery", "x": 1}]},
    ])


@pytest.mark.parametrize(("seed", "style", "max_messages"),
                         [(0, 0, 1000), (1, 1, 1000), (2, 0, 1000), (3, 0, 45), (4, 1, 60)])
def test_every_follow_up_reads_as_the_whole_parse_and_conversion(
        seed: int, style: int, max_messages: int) -> None:
    rng = random.Random(seed)
    memo = BodyMemo()
    messages: list[Json] = [user_turn(rng)]
    reused = 0
    earlier: list[Any] = []  # the last accepted request's Anthropic messages
    for turn in range(60):
        candidate = list(messages)
        bad = rng.random() < 0.15
        if bad:
            at = rng.randrange(len(candidate) + 1)
            candidate.insert(at, refused(rng))
        raw = body(rng, candidate, style=style, stamp=turn)
        mine = read_as_whole(CODEC, raw, "/v1/messages", max_messages, memo)
        if mine is not None:
            assert mine.source is not None
            now = mine.source["messages"]
            reused += sum(1 for a, b in zip(now, earlier, strict=False) if a is b)
            earlier = now
        elif not bad:
            messages = messages[:len(messages) // 2]  # over the limit: a compaction
            continue
        edit = rng.random()
        if edit < 0.6:  # the common turn: the reply and what answers it
            messages = [*messages, *a_turn(rng, turn)]
        elif edit < 0.75:  # the last message comes back changed
            messages = [*messages[:-1], user_turn(rng)]
        elif edit < 0.9 and len(messages) > 1:  # an edit in the middle
            at = rng.randrange(len(messages))
            messages = [*messages[:at], user_turn(rng), *messages[at + 1:]]
        # else: the same messages again (a retry)
    assert reused > 300  # messages kept from the request before


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many Anthropic messages were converted, and how many chat messages hashed."""
    counts = {"converted": 0, "hashed": 0}
    convert, canonical = anthropic_convert.convert_message, history_module.canonical_bytes

    def converting(message: Any) -> list[dict[str, Any]]:
        counts["converted"] += 1
        return convert(message)

    def hashing(value: Any) -> bytes:
        counts["hashed"] += 1
        return canonical(value)

    monkeypatch.setattr(anthropic_convert, "convert_message", converting)
    monkeypatch.setattr(history_module, "canonical_bytes", hashing)
    return counts


def test_a_follow_up_converts_checks_and_digests_only_what_it_adds(
        counted: dict[str, int]) -> None:
    rng = random.Random(7)
    memo, digests = BodyMemo(), DigestMemo()
    messages = [user_turn(rng)]
    for turn in range(30):
        messages += a_turn(rng, turn)
    first = CODEC.parse(body(rng, messages, style=0, stamp=1), "/v1/messages",
                        max_messages=1000, memo=memo)
    digests.digests(first.body["messages"])
    # The chat messages of all but the last message (it loses its cache marker next turn).
    kept = 1 + sum(len(anthropic_convert.convert_message(m)) for m in messages[:-1])
    counted.update(converted=0, hashed=0)
    later = CODEC.parse(body(rng, [*messages, *a_turn(rng, 99)], style=0, stamp=2),
                        "/v1/messages", max_messages=1000, memo=memo)
    assert counted["converted"] == 3  # the one that changed and the two added
    for mine, theirs in zip(later.body["messages"][1:kept], first.body["messages"][1:kept],
                            strict=True):
        assert mine is theirs  # the earlier request's own chat messages
    digests.digests(later.body["messages"])
    # The system message is built anew (found by its bytes), the rest by identity.
    assert counted["hashed"] == 1 + len(later.body["messages"]) - kept


def test_a_refused_follow_up_is_not_held_and_the_next_one_is_checked_again() -> None:
    rng = random.Random(3)
    memo = BodyMemo()
    messages = [user_turn(rng), *a_turn(rng, 0)]
    CODEC.parse(body(rng, messages, style=0, stamp=1), "/v1/messages", max_messages=100,
                memo=memo)
    bad = [*messages, {"role": "tool", "content": "x"}]
    for tail in ([], [{"role": "user", "content": "more"}]):
        with pytest.raises(BadRequestError, match=r"'messages\[3\]\.role'"):
            CODEC.parse(body(rng, [*bad, *tail], style=0, stamp=2), "/v1/messages",
                        max_messages=100, memo=memo)


def test_a_chat_body_lends_nothing_to_an_anthropic_one() -> None:
    """The same bytes read as OpenAI chat were checked by its rules (a "tool" role is
    one): an Anthropic body resending them is checked by its own."""
    memo = BodyMemo()
    prompt = {"role": "user", "content": "x" * MIN_BYTES}
    chat = json.dumps({"messages": [prompt, {"role": "tool", "content": "t"}]}).encode()
    OPENAI_CHAT.parse(chat, "/v1/chat/completions", max_messages=100, memo=memo)
    anthropic = chat[:-2] + b', {"role": "user", "content": "y"}]}'
    with pytest.raises(BadRequestError, match=r"'messages\[1\]\.role'"):
        CODEC.parse(anthropic, "/v1/messages", max_messages=100, memo=memo)
