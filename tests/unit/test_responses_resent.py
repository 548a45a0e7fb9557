"""A resent Responses ``input`` parsed and converted once (``proxy.codecs.responses`` with
``proxy.pipeline.body_memo``): every request it reads is what the whole parse and
conversion make of its bytes, refusals included, though the conversion merges an item into
the message before it (reasoning, an assistant message, function calls: one assistant
message); a follow-up keeps the earlier body's final chat messages, the same objects."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from prefixpin.proxy.codecs import responses_convert
from prefixpin.proxy.codecs.responses import ResponsesCodec
from prefixpin.proxy.pipeline.body_memo import MIN_BYTES, BodyMemo
from prefixpin.proxy.session import history as history_module
from prefixpin.proxy.session.history import DigestMemo
from tests.unit.resent_reading import read_as_whole

Json = dict[str, Any]
CODEC = ResponsesCodec()
TRICKY = ['say "input": [1, {2}]', "a \\\"quoted\\\" ]} brace", "ünïcödé ✓ \u2028", "\\",
          "[[[", "}}}", "\\u0065"]
TOOLS = [{"type": "function", "name": "shell", "description": "Runs a command. " * 30,
          "strict": False, "parameters": {"type": "object", "properties": {
              "command": {"type": "array", "items": {"type": "string"}}}}},
         {"type": "web_search"}]


def text(rng: random.Random, words: int = 30) -> str:
    return " ".join(rng.choice([*TRICKY, f"word{rng.randrange(1000)}"]) for _ in range(words))


def user(rng: random.Random) -> Json:
    roll = rng.random()
    if roll < 0.3:
        return {"role": "user", "content": text(rng)}  # the SDK's easy input message
    parts: list[Json] = [{"type": "input_text", "text": text(rng)}]
    if roll < 0.4:
        parts.append({"type": "input_image", "image_url": "data:image/png;base64,AAAA"})
    return {"type": "message", "role": rng.choice(("user", "user", "developer")),
            "content": parts}


def assistant_turn(rng: random.Random, number: int) -> list[Json]:
    """Codex's echo of one answer: reasoning (with text, or encrypted: no content), an
    assistant message now and then, function calls, and their outputs."""
    items: list[Json] = []
    if rng.random() < 0.6:
        reasoning: Json = {"type": "reasoning", "summary": [], "encrypted_content": "x"}
        if rng.random() < 0.6:
            reasoning["content"] = [{"type": "reasoning_text", "text": text(rng, 10)}]
        items.append(reasoning)
    if rng.random() < 0.5:
        items.append({"type": "message", "role": "assistant", "id": f"msg_{number}",
                      "content": [{"type": "output_text", "text": text(rng, 10)}]
                      + ([{"type": "refusal", "refusal": "no"}] if rng.random() < 0.1
                         else [])})
    calls = [f"call_{number}_{k}" for k in range(rng.choice((0, 1, 1, 2)))]
    items += [{"type": "function_call", "name": "shell", "call_id": call,
               "arguments": json.dumps({"command": ["ls", text(rng, 1)]})} for call in calls]
    items += [{"type": "function_call_output", "call_id": call, "output": text(rng, 60)
               if rng.random() < 0.8 else [{"type": "input_text", "text": text(rng, 5)}]}
              for call in calls]
    return items or [user(rng)]


def body(items: list[Json], *, instructions: str | None, style: int) -> bytes:
    value: Json = {"model": "gpt-5-codex", "input": items, "tools": TOOLS,
                   "tool_choice": "auto", "store": False, "stream": True,
                   "include": ["reasoning.encrypted_content"], "prompt_cache_key": "s1"}
    if instructions is not None:
        value = {"instructions": instructions, **value}  # before the array, as Codex does
    if style == 1:
        return json.dumps(value, indent=1).encode()
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def refused(rng: random.Random) -> Json:
    return rng.choice([
        {"type": "message", "role": "user", "content": [{"type": "input_file"}]},
        {"type": "mystery"},
        {"type": "function_call", "name": 5, "call_id": "c", "arguments": "{}"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": 5}]},
        {"type": "message", "role": "assistant", "content": [{"type": "image"}]},
        {"type": "function_call_output", "call_id": "c", "output": 5},
    ])


@pytest.mark.parametrize(("seed", "style", "max_messages"),
                         [(0, 0, 1000), (1, 1, 1000), (2, 0, 1000), (3, 0, 30), (4, 1, 1000)])
def test_every_follow_up_reads_as_the_whole_parse_and_conversion(
        seed: int, style: int, max_messages: int) -> None:
    rng = random.Random(seed)
    memo = BodyMemo()
    instructions = "You are Codex, a coding agent. " * (MIN_BYTES // 30)
    items: list[Json] = [user(rng), user(rng)]
    reused = 0
    earlier: list[Any] = []
    for turn in range(60):
        candidate = list(items)
        bad = rng.random() < 0.15
        if bad:
            candidate.insert(rng.randrange(len(candidate) + 1), refused(rng))
        if rng.random() < 0.1:  # instructions dropped, or changed, for a turn
            raw = body(candidate, instructions=rng.choice((None, instructions + "!")),
                       style=style)
        else:
            raw = body(candidate, instructions=instructions, style=style)
        mine = read_as_whole(CODEC, raw, "/v1/responses", max_messages, memo)
        if mine is not None:
            now = mine.body["messages"]
            reused += sum(1 for a, b in zip(now, earlier, strict=False) if a is b)
            earlier = now
        elif not bad:
            items = items[:len(items) // 2]  # over the limit: a compaction
            continue
        edit = rng.random()
        if edit < 0.65:  # the common turn: the answer's items, and what follows them
            items = [*items, *assistant_turn(rng, turn)]
            if rng.random() < 0.3:
                items.append(user(rng))
        elif edit < 0.8:  # the last item comes back changed
            items = [*items[:-1], *assistant_turn(rng, turn + 500)[:1]]
        elif edit < 0.9 and len(items) > 1:  # an edit in the middle
            at = rng.randrange(len(items))
            items = [*items[:at], *assistant_turn(rng, turn + 900)[:1], *items[at + 1:]]
        # else: the same items again (a retry)
    assert reused > 300  # chat messages kept from the request before


def test_a_follow_up_converts_and_digests_only_what_it_adds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    counts = {"converted": 0, "hashed": 0}
    convert, canonical = responses_convert._convert_item, history_module.canonical_bytes

    def converting(where: str, item: Any, messages: list[Json]) -> None:
        counts["converted"] += 1
        convert(where, item, messages)

    def hashing(value: Any) -> bytes:
        counts["hashed"] += 1
        return canonical(value)

    monkeypatch.setattr(responses_convert, "_convert_item", converting)
    monkeypatch.setattr(history_module, "canonical_bytes", hashing)
    rng = random.Random(5)
    instructions = "You are Codex. " * (MIN_BYTES // 15)
    items: list[Json] = [user(rng)]
    for turn in range(30):
        items += [{"type": "reasoning", "summary": [], "content": [
                      {"type": "reasoning_text", "text": text(rng, 5)}]},
                  {"type": "function_call", "name": "shell", "call_id": f"c{turn}",
                   "arguments": "{}"},
                  {"type": "function_call_output", "call_id": f"c{turn}",
                   "output": text(rng, 40)}]
    memo, digests = BodyMemo(), DigestMemo()
    first = CODEC.parse(body(items, instructions=instructions, style=0), "/v1/responses",
                        max_messages=1000, memo=memo)
    digests.digests(first.body["messages"])
    counts.update(converted=0, hashed=0)
    added: list[Json] = [{"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Done."}]},
             {"type": "message", "role": "user", "content": "Thanks"}]
    later = CODEC.parse(body([*items, *added], instructions=instructions, style=0),
                        "/v1/responses", max_messages=1000, memo=memo)
    # The last item that opened a message (the last function call output), converted
    # again, and the two added.
    assert counts["converted"] == 3
    kept = len(first.body["messages"]) - 1  # all but the instructions and that output
    for mine, theirs in zip(later.body["messages"][1:kept], first.body["messages"][1:kept],
                            strict=True):
        assert mine is theirs  # the earlier request's own chat messages
    digests.digests(later.body["messages"])
    # The instructions' system message is built anew (found by its bytes), and the three
    # converted again; the rest are found by identity.
    assert counts["hashed"] == 4
