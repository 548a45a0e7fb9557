"""The engine request encoder (``adapters.http.MessagesEncoder``): the bytes it sends read
back as the body it was given, whichever messages it held from earlier bodies, and a
message is encoded once while it stays the same object."""

from __future__ import annotations

import json
import random
from typing import Any

import orjson

from prefixpin.adapters.http import MessagesEncoder, encode_json


def _message(rng: random.Random, i: int) -> dict[str, Any]:
    role = rng.choice(["user", "assistant", "tool", "system"])
    text = "".join(rng.choice("ab \"\\\n\u00e9\U0001f600{}[],:") for _ in range(rng.randint(0, 40)))
    message: dict[str, Any] = {"role": role, "content": f"{i} {text}"}
    if rng.random() < 0.2:
        message["tool_calls"] = [{"id": f"c{i}", "type": "function", "function": {
            "name": "f", "arguments": json.dumps({"n": rng.randint(-5, 5)})}}]
    return message


def test_bodies_read_back_as_given_across_a_growing_and_edited_session() -> None:
    rng = random.Random(7)
    encoder = MessagesEncoder(max_bytes=4_000)  # small: the oldest go while in use
    history: list[dict[str, Any]] = []
    for turn in range(200):
        history = [*history, *(_message(rng, turn * 3 + k) for k in range(rng.randint(1, 3)))]
        if rng.random() < 0.1 and history:  # an edit: a new object in the middle
            at = rng.randrange(len(history))
            history[at] = {**history[at], "content": "edited"}
        if rng.random() < 0.05:
            history = history[: len(history) // 2]
        body = {"model": "m", "stream": True, "messages": history,
                "stream_options": {"include_usage": True}}
        if rng.random() < 0.3:
            body = {"messages": history}
        encoded = encoder(body)
        assert orjson.loads(encoded) == orjson.loads(encode_json(body))


def test_a_message_held_is_not_encoded_again() -> None:
    encoder = MessagesEncoder()
    held = {"role": "user", "content": "x"}
    assert orjson.loads(encoder({"messages": [held], "model": "m"})) == {
        "messages": [held], "model": "m"}
    # Changed in place (which the proxy never does): the bytes held still say what it was.
    held["content"] = "changed"
    assert orjson.loads(encoder({"messages": [held]})) == {
        "messages": [{"role": "user", "content": "x"}]}
    assert orjson.loads(encoder({"messages": [dict(held)]})) == {"messages": [held]}


def test_what_orjson_refuses_and_bodies_without_messages() -> None:
    encoder = MessagesEncoder()
    huge = {"role": "user", "content": "n", "n": 2**70}
    body = {"messages": [huge], "seed": 2**65}
    assert json.loads(encoder(body)) == body
    assert orjson.loads(encoder({"prompt": "p", "n_predict": 1})) == {
        "prompt": "p", "n_predict": 1}
    assert orjson.loads(encoder({"messages": []})) == {"messages": []}
