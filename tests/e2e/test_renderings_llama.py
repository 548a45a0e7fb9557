"""Spliced tokenizations (``proxy.parking.renderings``) against the real llama-server: every
opening anchoring and the prompt-end snapshot compute, and every prompt the restore path
compares, is the same token list whether the engine tokenizes each rendering whole or
only what it adds past a turn marker an earlier rendering shares; and what is sent to
and read from ``/tokenize`` stays the size of a turn as the conversation grows.

Three vocabularies and templates: SmolLM2 (ChatML), Gemma 3 (``<start_of_turn>``, a system
prompt folded into the first user turn, strict alternation) and the rig's tiny ``qwen35``
with Qwen3.5's real template (reasoning of earlier turns dropped, tool calls and results,
a system message only at the start). Sessions of many turns whose replies come back as
returned, reasoning stripped, edited, interrupted, as tool calls answered by tool
results, and with a system message in mid-conversation: where the template refuses a
conversation, both ways refuse it. Nothing is generated: the replies are scripted.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixpin.adapters.base import Adapter
from prefixpin.adapters.llama_server import LlamaServerAdapter
from prefixpin.core.errors import ProxyError
from prefixpin.proxy.ops.metrics import Metrics
from prefixpin.proxy.parking.anchor import (
    Texts,
    next_request_opening,
    prompt_opening,
    prompt_tokens,
)
from prefixpin.proxy.parking.renderings import Renderings
from tests.e2e.helpers import filler
from tests.rig.llama_process import LlamaServerProcess, run_llama_server
from tests.rig.tiny_models import ensure_tiny_model, llama_tree

pytestmark = [pytest.mark.llama, pytest.mark.anyio]

Json = dict[str, Any]
TURNS = 20
GEMMA_TEMPLATE = "google-gemma-2-2b-it.jinja"  # Gemma 3's is the same but for images
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the project.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]


@pytest.fixture(scope="module", params=["smollm2", "gemma3", "gemma3-chatml", "qwen35"])
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, LlamaServerProcess]]:
    """The engine, and the template family it renders. The rig's Gemma 3 file has no chat
    template of its own: llama-server renders ChatML (``gemma3-chatml``), whose markers
    are plain text in Gemma's vocabulary; ``gemma3`` is given Gemma's own template."""
    name = str(request.param)
    model: str | Path = ensure_tiny_model("qwen35-tiny") if name == "qwen35" else name
    extra: list[str] = []
    if name == "gemma3":
        template = tmp_path_factory.mktemp("template") / "gemma.jinja"
        with llama_tree() as tree:
            template.write_text((tree / "models" / "templates" / GEMMA_TEMPLATE).read_text(
                encoding="utf-8"), encoding="utf-8")
        extra = ["--chat-template-file", str(template)]
    elif name == "gemma3-chatml":
        model = "gemma3"
    with run_llama_server(model, slots=1, ctx_per_slot=2048, slot_save_path=None,
                          threads=1, extra=extra) as handle:
        yield name, handle


class Counted:
    """An adapter on the engine whose ``/tokenize`` and ``/apply-template`` bytes, sent and
    read, are summed per path."""

    def __init__(self, url: str) -> None:
        self.bytes: defaultdict[str, int] = defaultdict(int)
        self.calls: defaultdict[str, int] = defaultdict(int)
        self.http = httpx.AsyncClient(base_url=url, timeout=60, event_hooks={
            "request": [self._sent], "response": [self._read]})
        self.adapter = LlamaServerAdapter(self.http)

    async def _sent(self, request: httpx.Request) -> None:
        self.calls[request.url.path] += 1
        self.bytes[request.url.path] += len(request.content)

    async def _read(self, response: httpx.Response) -> None:
        self.bytes[response.request.url.path] += len(await response.aread())

    def take(self) -> dict[str, int]:
        out = dict(self.bytes)
        self.bytes.clear()
        return out


@pytest.fixture
async def counted(engine: tuple[str, LlamaServerProcess]) -> AsyncIterator[tuple[Counted,
                                                                                 Counted]]:
    whole, spliced = Counted(engine[1].url), Counted(engine[1].url)
    yield whole, spliced
    await whole.http.aclose()
    await spliced.http.aclose()


def scripted_reply(name: str, turn: int) -> Json:
    """The reply as the engine returns it: reasoning apart where the template has it, a
    tool call every fifth turn where the template takes tools."""
    reply: Json = {"role": "assistant", "content": f"Answer {turn}. " + filler(30, seed=turn)}
    if name == "qwen35":
        reply["reasoning_content"] = f"Thinking {turn}. " + filler(12, seed=100 + turn)
    if name != "gemma3" and turn % 5 == 4:
        reply["content"] = "" if name == "qwen35" else reply["content"]
        reply["tool_calls"] = [{"id": f"call{turn}", "type": "function", "function": {
            "name": "read_file", "arguments": {"path": f"src/file{turn}.py"}}}]
    return reply


def sent_back(reply: Json, turn: int) -> Json:
    """How the client sends ``reply`` back: as returned, reasoning stripped, edited, or
    interrupted (cut short as received)."""
    back = dict(reply)
    match turn % 4:
        case 1:
            back.pop("reasoning_content", None)
        case 2 if not back.get("tool_calls"):
            back["content"] = "Edited by the user: " + back["content"][::-1]
        case 3 if not back.get("tool_calls"):
            back["content"] = back["content"][:len(back["content"]) // 3]
            back.pop("reasoning_content", None)
    return back


def next_messages(name: str, reply: Json, turn: int) -> list[Json]:
    """What the client adds after the reply: the tool's result for a tool call, a system
    message in mid-conversation once, then the next user turn."""
    added: list[Json] = []
    if reply.get("tool_calls"):
        added.append({"role": "tool", "tool_call_id": f"call{turn}",
                      "content": f"contents of file{turn}: " + filler(40, seed=200 + turn)})
        if name == "qwen35":
            return added  # Qwen3.5 renders tool results in a user turn of their own
    if turn == 7:
        added.append({"role": "system", "content": "Mid-conversation note: be brief."})
    added.append({"role": "user", "content": f"Step {turn + 1}: " + filler(25, seed=turn)})
    return added


def computation(kind: str, adapter: Adapter, body: Json, reply: Json,
                texts: Texts | None) -> Awaitable[Any]:
    """The restore path's prompt, the snapshot's opening or the anchor's."""
    match kind:
        case "restore":
            return prompt_tokens(adapter, body, texts)
        case "snapshot":
            return prompt_opening(adapter, body, texts)
    return next_request_opening(adapter, body, reply, texts)


async def both(whole: Any, spliced: Any) -> Any:
    """The two ways' results, which must agree; a refusal by the template (both refuse)
    gives None."""
    try:
        expected = await whole
    except ProxyError:
        with pytest.raises(ProxyError):
            await spliced
        return None
    assert await spliced == expected
    return expected


async def test_spliced_tokenizations_equal_the_whole_ones_turn_after_turn(
        engine: tuple[str, LlamaServerProcess], counted: tuple[Counted, Counted]) -> None:
    name = engine[0]
    whole, spliced = counted
    metrics = Metrics()
    renderings = Renderings(spliced.adapter, metrics, logging.getLogger("test"))
    messages: list[Json] = [{"role": "system", "content": "You are a coding agent. "
                             + filler(150, seed=1)},
                            {"role": "user", "content": "Step 1: " + filler(25, seed=0)}]
    fields: Json = {"tools": TOOLS} if name == "qwen35" else {}
    tokenized: dict[int, tuple[dict[str, int], dict[str, int]]] = {}
    refused = computed = 0
    for turn in range(1, TURNS + 1):
        body = {"messages": list(messages), **fields}
        reply = scripted_reply(name, turn)
        whole.take()
        spliced.take()
        # As the proxy does around a turn: the restore path's prompt, then the snapshot and
        # the anchor; each computation keeps its last rendering for the next one.
        results = []
        for kind in ("restore", "snapshot", "anchor"):
            texts = renderings.of("s")
            results.append(await both(computation(kind, whole.adapter, body, reply, None),
                                      computation(kind, spliced.adapter, body, reply, texts)))
            texts.keep()
        refused += sum(r is None for r in results)
        computed += sum(r is not None for r in results)
        tokenized[turn] = (whole.take(), spliced.take())
        if all(r is None for r in results):
            # The template refuses a system message in mid-conversation (Qwen3.5, Gemma 3):
            # the client would drop it.
            messages = [m for i, m in enumerate(messages) if i == 0 or m["role"] != "system"]
        messages += [sent_back(reply, turn), *next_messages(name, reply, turn)]
    spliced_count, first_count, whole_count = (
        metrics.registry.get_sample_value("prefixpin_tokenizations_total", {"outcome": o})
        for o in ("spliced", "first", "whole"))
    windows, whole_renderings = (
        metrics.registry.get_sample_value("prefixpin_template_renderings_total",
                                          {"outcome": o}) for o in ("window", "whole"))
    print(f"\n{name}: {computed} computed, {refused} refused; tokenizations spliced "
          f"{spliced_count}, first {first_count}, whole {whole_count}; renderings windowed "
          f"{windows}, whole {whole_renderings}")
    assert computed >= 3 * (TURNS - 1), (computed, refused)
    # Every template here renders a window from a user turn as the whole conversation does
    # (Gemma's folds the system prompt into the window's first turn: the splice keeps it).
    assert windows
    assert not whole_renderings
    early, late = tokenized[2][1], tokenized[TURNS][1]
    assert late["/apply-template"] < 3 * early["/apply-template"], (early, late)
    assert late["/apply-template"] * 3 < tokenized[TURNS][0]["/apply-template"]
    if name == "gemma3-chatml":  # no special token to cut at: every rendering whole, said
        assert not spliced_count
        assert whole_count
        return
    assert first_count == 1
    assert not whole_count
    # What /tokenize sends and reads stays the size of a turn too.
    print(f"{name} engine bytes per turn, whole / spliced: "
          f"turn 2 {tokenized[2][0]} / {early}; turn {TURNS} {tokenized[TURNS][0]} / {late}")
    assert late["/tokenize"] < 3 * early["/tokenize"], (early, late)
    assert late["/tokenize"] * 4 < tokenized[TURNS][0]["/tokenize"], (late, tokenized[TURNS])
