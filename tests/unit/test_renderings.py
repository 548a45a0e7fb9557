"""Spliced tokenizations (``proxy.parking.renderings``) on a fake engine whose tokenizer cuts
a text at its special tokens as llama.cpp's does: the same tokens as the whole way, and
what is sent to and read from ``/tokenize`` for a turn does not grow with the
conversation; where no earlier rendering fits, the whole text, counted and logged. The
real engines: ``tests/e2e/test_renderings_llama.py``."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from prefixpin.core.errors import ProxyError
from prefixpin.proxy.ops.metrics import Metrics
from prefixpin.proxy.parking.anchor import next_request_opening, prompt_opening
from prefixpin.proxy.parking.renderings import Renderings, _last_cut_within
from prefixpin.proxy.session.tokens import common_text_prefix, common_text_suffix
from tests.e2e.helpers import filler

pytestmark = pytest.mark.anyio

Json = dict[str, Any]
_PIECE = re.compile(r"\w+|\s+|[^\w\s]")


class FakeEngine:
    """ChatML rendered, and tokenized as llama.cpp does with special tokens parsed: cut at
    each special token, each piece between on its own (here: words, spaces, signs), a BOS
    added. Counts the bytes each call sends and reads, as JSON on the wire."""

    def __init__(self, special: Mapping[str, int] | None = None, header: str = "",
                 template: str = "chatml") -> None:
        self.special = dict(special if special is not None else
                            {"<|im_start|>": 1, "<|im_end|>": 2})
        self.header = header  # rendered first, with the size of the messages: never the same
        # "chatml"; "qwen35": an assistant turn's reasoning only after the last user query;
        # "gemma": the system prompt folded into the first user turn, roles alternating;
        # "first-turn": refuses a conversation whose first user turn is not the session's
        self.template = template
        self.vocab: dict[str, int] = {}
        self.bytes = {"/apply-template": 0, "/tokenize": 0}

    async def apply_template(self, body: Mapping[str, Any]) -> str:
        messages = list(body["messages"])
        system = ""
        if self.template == "gemma" and messages[0]["role"] == "system":
            system = messages.pop(0)["content"] + "\n\n"
        last_query = max(i for i, m in enumerate(messages) if m["role"] == "user")
        if self.template == "first-turn" and messages[1]["content"] != FIRST_TURN:
            raise ProxyError("the conversation must open with the session's first turn")
        text = self.header.format(len(json.dumps(messages)))
        for i, m in enumerate(messages):
            if self.template == "gemma" and (m["role"] == "user") != (i % 2 == 0):
                raise ProxyError("roles must alternate user/assistant/user/assistant/...")
            content = m.get("content") or ""
            if self.template == "qwen35" and m["role"] == "assistant" and i > last_query:
                content = f"<think>{m.get('reasoning_content', '')}</think>{content}"
            text += f"<|im_start|>{m['role']}\n{system if i == 0 else ''}{content}<|im_end|>\n"
        text += "<|im_start|>assistant\n"
        self._count("/apply-template", body, {"prompt": text})
        return text

    async def tokenize(self, text: str, *, add_special: bool,
                       parse_special: bool = True) -> list[int]:
        tokens = [0] if add_special else []
        pattern = "|".join(re.escape(s) for s in self.special)
        pieces = re.split(f"({pattern})", text) if parse_special and self.special else [text]
        for piece in pieces:
            if piece in self.special and parse_special:
                tokens.append(self.special[piece])
            else:
                tokens += [self.vocab.setdefault(p, 100 + len(self.vocab))
                           for p in _PIECE.findall(piece)]
        self._count("/tokenize", {"content": text, "add_special": add_special,
                                  "parse_special": parse_special}, {"tokens": tokens})
        return tokens

    def _count(self, path: str, sent: Mapping[str, Any], read: Json) -> None:
        self.bytes[path] += len(json.dumps(sent)) + len(json.dumps(read))

    def take(self) -> dict[str, int]:
        out = dict(self.bytes)
        self.bytes = dict.fromkeys(self.bytes, 0)
        return out


def renderings_on(engine: FakeEngine) -> tuple[Renderings, Metrics]:
    metrics = Metrics()
    return Renderings(engine, metrics, logging.getLogger("test")), metrics  # type: ignore[arg-type]


def counted(metrics: Metrics, outcome: str,
            name: str = "prefixpin_tokenizations_total") -> float:
    return metrics.registry.get_sample_value(name, {"outcome": outcome}) or 0.0


def rendered(metrics: Metrics, outcome: str) -> float:
    return counted(metrics, outcome, "prefixpin_template_renderings_total")


def logged_reasons(caplog: pytest.LogCaptureFixture, event: str) -> set[str]:
    return {r.__dict__["fields"]["reason"] for r in caplog.records if r.getMessage() == event}


async def one_turn(engine: FakeEngine, renderings: Renderings, body: Json,
                   reply: Json) -> tuple[Any, Any]:
    """The snapshot's and the anchor's computations, spliced, checked against whole."""
    spliced = []
    for way in (lambda t: prompt_opening(engine, body, t),  # type: ignore[arg-type]
                lambda t: next_request_opening(engine, body, reply, t)):  # type: ignore[arg-type]
        tokenize = renderings.of("s")
        spliced.append(await way(tokenize))
        tokenize.keep()
    bytes_spliced = engine.take()
    assert spliced[0] == await prompt_opening(engine, body)  # type: ignore[arg-type]
    assert spliced[1] == await next_request_opening(engine, body, reply)  # type: ignore[arg-type]
    return bytes_spliced, engine.take()


FIRST_TURN = filler(40, seed=0)


def conversation(turns: int, tools: bool = False) -> list[tuple[Json, Json]]:
    """A session's bodies and replies, each reply sent back as returned or edited; with
    ``tools``, a user turn every third turn and tool results between (the reply reasons)."""
    messages: list[Json] = [{"role": "system", "content": filler(300, seed=1)}]
    out = []
    for turn in range(turns):
        if not tools or turn % 3 == 0:
            messages.append({"role": "user", "content": filler(40, seed=turn)})
        else:
            messages.append({"role": "tool", "content": filler(80, seed=90 + turn)})
        reply = {"role": "assistant", "content": filler(60, seed=50 + turn),
                 "reasoning_content": filler(20, seed=70 + turn)}
        out.append(({"messages": list(messages)}, reply))
        messages.append(reply if turn % 2 else {**reply, "content": "edited " + reply["content"]})
    return out


async def test_spliced_tokens_equal_the_whole_ones_and_stay_the_size_of_a_turn() -> None:
    engine = FakeEngine()
    renderings, metrics = renderings_on(engine)
    sizes = [await one_turn(engine, renderings, body, reply)
             for body, reply in conversation(20)]
    (early, early_whole), (late, late_whole) = sizes[1], sizes[19]
    assert late["/tokenize"] < 1.5 * early["/tokenize"], (early, late)
    assert late_whole["/tokenize"] > 4 * early_whole["/tokenize"]  # the whole way grows
    assert late["/tokenize"] * 10 < late_whole["/tokenize"]
    # The template renders the turns from the last user message on (and the system's).
    assert late["/apply-template"] < 1.5 * early["/apply-template"], (early, late)
    assert late["/apply-template"] * 4 < late_whole["/apply-template"]
    assert counted(metrics, "first") == 1
    assert counted(metrics, "whole") == 0
    assert counted(metrics, "spliced") == 5 * 20 - 1
    assert (rendered(metrics, "first"), rendered(metrics, "window")) == (1, 5 * 20 - 1)


@pytest.mark.parametrize("template", ["chatml", "qwen35", "gemma"])
async def test_windowed_renderings_equal_the_whole_ones(template: str) -> None:
    """Tool turns between user turns, reasoning a template drops before the last user
    query, a system prompt folded into the first user turn (Gemma's, whose alternation
    check allows no tool turns): the same tokens as the whole way, turn after turn."""
    engine = FakeEngine(template=template)
    renderings, metrics = renderings_on(engine)
    for body, reply in conversation(12, tools=template != "gemma"):
        await one_turn(engine, renderings, body, reply)
    assert rendered(metrics, "window") > 40
    assert rendered(metrics, "whole") == 0


async def test_a_template_that_rewrites_the_first_turn_is_tokenized_whole_and_said(
        caplog: pytest.LogCaptureFixture) -> None:
    engine = FakeEngine(header="<|im_start|>meta\n{} bytes<|im_end|>\n")
    renderings, metrics = renderings_on(engine)
    caplog.set_level(logging.INFO)
    for body, reply in conversation(3):
        await one_turn(engine, renderings, body, reply)
    assert counted(metrics, "spliced") == 0
    assert counted(metrics, "first") == 1
    assert counted(metrics, "whole") == 5 * 3 - 1
    reasons = logged_reasons(caplog, "rendering tokenized whole")
    assert reasons == {"it shares no turn marker with an earlier rendering"}
    # Its header counts the messages: a window's never matches the whole rendering's.
    # (Turn 0's and the edited reply's windows start at the first user turn: the whole.)
    assert (rendered(metrics, "whole"), rendered(metrics, "window")) == (9, 5)
    reasons = logged_reasons(caplog, "rendering rendered whole")
    assert reasons == {"the window's text does not end the whole rendering"}


async def test_a_header_that_changes_with_later_turns_is_caught_without_system_messages(
        ) -> None:
    """No system message, and a header made from the messages: the new window's header is
    not the old one's, so the conversation is rendered whole: the same tokens."""
    engine = FakeEngine(header="<|im_start|>meta\n{} bytes<|im_end|>\n")
    renderings, metrics = renderings_on(engine)
    for body, reply in conversation(6):
        body = {"messages": body["messages"][1:]}
        await one_turn(engine, renderings, body, reply)
    assert rendered(metrics, "window") <= 5  # only windows that are the whole conversation
    assert rendered(metrics, "whole") > 0


async def test_sampling_fields_do_not_stop_a_window_and_tools_do(
        caplog: pytest.LogCaptureFixture) -> None:
    """The restore path renders the request's body, anchoring the committed one: they
    differ in fields no template reads. Tools that change are read: rendered whole."""
    engine = FakeEngine()
    renderings, metrics = renderings_on(engine)
    caplog.set_level(logging.INFO)
    for turn, (body, reply) in enumerate(conversation(6)):
        body |= {"max_tokens": 16 + turn, "temperature": 0.1 * turn, "stream": bool(turn % 2)}
        await one_turn(engine, renderings, body, reply)
    assert rendered(metrics, "whole") == 0
    await one_turn(engine, renderings, {**body, "tools": [{"type": "function"}]}, reply)
    reasons = logged_reasons(caplog, "rendering rendered whole")
    assert reasons == {"the body's tools changed"}


async def test_a_template_that_refuses_a_window_is_rendered_whole_and_said(
        caplog: pytest.LogCaptureFixture) -> None:
    engine = FakeEngine(template="first-turn")
    renderings, metrics = renderings_on(engine)
    caplog.set_level(logging.INFO)
    for body, reply in conversation(4):
        await one_turn(engine, renderings, body, reply)
    assert rendered(metrics, "whole") > 0
    reasons = logged_reasons(caplog, "rendering rendered whole")
    assert reasons == {"the template refused a window: the conversation must open with the "
                       "session's first turn"}


async def test_a_marker_that_is_not_a_special_token_is_never_a_cut(
        caplog: pytest.LogCaptureFixture) -> None:
    engine = FakeEngine(special={"<|im_end|>": 2})
    renderings, metrics = renderings_on(engine)
    caplog.set_level(logging.INFO)
    for body, reply in conversation(3):
        await one_turn(engine, renderings, body, reply)
    assert counted(metrics, "spliced") == 0
    assert counted(metrics, "whole") == 5 * 3 - 1
    # Said once, not for every rendering.
    assert [r.getMessage() for r in caplog.records] == ["rendering tokenized whole"]


async def test_a_restarted_engine_with_another_vocabulary_is_caught() -> None:
    """The marker's token changed under a session's last rendering (a restart not yet
    seen): the tail does not start with it, and the text is tokenized whole."""
    engine = FakeEngine()
    renderings, metrics = renderings_on(engine)
    (body, reply), (next_body, next_reply) = conversation(2)
    await one_turn(engine, renderings, body, reply)
    engine.special["<|im_start|>"] = 7
    renderings._markers.clear()  # probed again, as after a restart
    await one_turn(engine, renderings, next_body, next_reply)
    assert counted(metrics, "whole") == 1
    renderings.engine_restarted()
    assert renderings.last("s") is None


@pytest.mark.parametrize(("a", "b", "shared"), [("", "x", 0), ("abc", "abd", 2),
                                                 ("a" * 9000, "a" * 9000 + "b", 9000),
                                                 ("a" * 5000 + "x", "a" * 5000 + "y", 5000)])
def test_common_text_prefix(a: str, b: str, shared: int) -> None:
    assert common_text_prefix(a, b) == common_text_prefix(b, a) == shared


@pytest.mark.parametrize(("a", "b", "shared"), [("", "x", 0), ("abc", "xbc", 2),
                                                 ("a" * 9000, "b" + "a" * 9000, 9000),
                                                 ("x" + "a" * 5000, "y" + "a" * 5000, 5000),
                                                 ("ab" * 3000, "b" + "ab" * 3000, 6000)])
def test_common_text_suffix(a: str, b: str, shared: int) -> None:
    assert common_text_suffix(a, b) == common_text_suffix(b, a) == shared


@pytest.mark.parametrize(("cuts", "limit", "index"), [((), 5, None), ((3,), 2, None),
                                                      ((3,), 3, 0), ((0, 4, 9), 8, 1),
                                                      ((0, 4, 9), 99, 2)])
def test_last_cut_within(cuts: Sequence[int], limit: int, index: int | None) -> None:
    assert _last_cut_within(cuts, limit) == index
