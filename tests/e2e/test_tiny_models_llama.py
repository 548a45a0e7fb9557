"""llama-server's cache mechanics on architectures no PyPI wheel ships: Qwen3.5's hybrid
(gated delta-net layers, full attention every 4th layer) and gpt-oss (sliding-window
attention alternating with full attention, a mixture of experts), as the tiny models of
``tests.rig.tiny_models``.

Their weights are RANDOM: what they generate is noise and is never checked. Only the
engine's side is real: the architecture's caches (recurrent state, KV cells, checkpoints,
slot files), the real chat templates, a real tokenizer; that is what these tests measure.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.rig.llama_process import LlamaServerProcess, run_llama_server
from tests.rig.tiny_models import ensure_tiny_model

pytestmark = [pytest.mark.llama, pytest.mark.anyio]

Json = dict[str, Any]
SLOTS = 2
MAX_TOKENS = 8

SYSTEM = {"role": "system", "content": "You answer questions about the weather. " * 12}
USER = {"role": "user", "content": "What is the weather like in Paris in spring?"}
NEXT_USER = {"role": "user", "content": "And in autumn?"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def tiny_server(name: str, save_dir: Path) -> Iterator[LlamaServerProcess]:
    # One compute thread: the models are tiny, and the test client and the other engine
    # need the CPU more than a second thread would help these.
    with run_llama_server(ensure_tiny_model(name), slots=SLOTS, ctx_per_slot=4096,
                          slot_save_path=save_dir, threads=1) as handle:
        yield handle


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServerProcess]:
    yield from tiny_server("qwen35-tiny", tmp_path_factory.mktemp("qwen35-slots"))


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServerProcess]:
    yield from tiny_server("gptoss-tiny", tmp_path_factory.mktemp("gptoss-slots"))


@pytest.fixture
async def engine(qwen35: LlamaServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    """A client for the qwen35 server, every slot erased first."""
    async with erased_client(qwen35) as client:
        yield client


@pytest.fixture
async def gptoss_engine(gptoss: LlamaServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    """A client for the gpt-oss server, every slot erased first."""
    async with erased_client(gptoss) as client:
        yield client


@contextlib.asynccontextmanager
async def erased_client(server: LlamaServerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        for slot in range(SLOTS):
            await post(client, f"/slots/{slot}?action=erase", {})
        yield client


async def post(client: httpx.AsyncClient, path: str, body: Json) -> Json:
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    answer: Json = response.json()
    return answer


async def chat(client: httpx.AsyncClient, messages: list[Json], **extra: Any) -> Json:
    return await post(client, "/v1/chat/completions", {
        "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **extra})


def assert_answered(answer: Json) -> None:
    """A whole answer with usage; its text is noise from random weights."""
    usage = answer["usage"]
    assert usage["prompt_tokens"] > 0
    assert usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert isinstance(answer["choices"][0]["message"].get("content"), str)


async def template_prompt(client: httpx.AsyncClient, messages: list[Json]) -> str:
    return str((await post(client, "/apply-template", {"messages": messages}))["prompt"])


async def tokens_of(client: httpx.AsyncClient, text: str) -> list[int]:
    answer = await post(client, "/tokenize", {"content": text, "add_special": False,
                                              "parse_special": True})
    return [int(t) for t in answer["tokens"]]


async def complete(client: httpx.AsyncClient, prompt: list[int], slot: int) -> Json:
    """Raw token ids on a given slot: a prompt that extends another token for token."""
    return await post(client, "/completion", {
        "prompt": prompt, "n_predict": MAX_TOKENS, "temperature": 0, "id_slot": slot,
        "cache_prompt": True, "return_tokens": True})


# ---------------------------------------------------------------- both models answer

async def test_qwen35_answers_a_chat_with_its_real_template(
        engine: httpx.AsyncClient) -> None:
    """Random weights, Qwen3.5's own template: a system and a user turn in ChatML, and the
    generation prompt opens a think block."""
    prompt = await template_prompt(engine, [SYSTEM, USER])
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert_answered(await chat(engine, [SYSTEM, USER]))


async def test_qwen35_answers_a_request_with_tools(engine: httpx.AsyncClient) -> None:
    """Random weights. The template writes the tools into the system turn."""
    plain = await chat(engine, [SYSTEM, USER])
    with_tools = await chat(engine, [SYSTEM, USER], tools=TOOLS)
    assert_answered(with_tools)
    assert with_tools["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 50


async def test_gptoss_answers_a_chat_with_its_real_template(
        gptoss_engine: httpx.AsyncClient) -> None:
    """Random weights, gpt-oss's harmony template. llama-server parses the reply as harmony
    (a reply that is not answers 500); the tiny model's scripted opening
    ``<|channel|>final<|message|>`` makes the random text that follows a final message."""
    prompt = await template_prompt(gptoss_engine, [SYSTEM, USER])
    assert prompt.startswith("<|start|>system<|message|>")
    assert prompt.endswith("<|start|>assistant")
    answer = await chat(gptoss_engine, [SYSTEM, USER])
    assert_answered(answer)
    # Never cut short: no end-of-generation token among the random weights' picks.
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS
    assert_answered(await chat(gptoss_engine, [SYSTEM, USER], tools=TOOLS))


async def test_qwen35_agent_variant_ends_its_reply_whatever_is_asked(
        tmp_path: Path) -> None:
    """Random weights. The agent CLIs ask for 32k tokens with tools, where llama-server's
    tool grammar replaces any default cap: the agent variant still ends after "Done", with
    thinking on and off."""
    for handle in tiny_server("qwen35-agent", tmp_path):
        async with httpx.AsyncClient(base_url=handle.url, timeout=60) as client:
            for thinking in (True, False):
                answer = await post(client, "/v1/chat/completions", {
                    "messages": [SYSTEM, USER], "tools": TOOLS, "max_tokens": 32000,
                    "chat_template_kwargs": {"enable_thinking": thinking}})
                choice = answer["choices"][0]
                assert choice["finish_reason"] == "stop", answer
                assert choice["message"]["content"] == "Done", answer
                assert answer["usage"]["completion_tokens"] <= 3, answer


# ---------------------------------------------------------------- qwen35's cache

async def test_qwen35_next_chat_turn_resumes_from_a_checkpoint_before_the_reply(
        engine: httpx.AsyncClient) -> None:
    """Random weights. The next turn of a chat is not an exact extension: Qwen3.5's template
    drops the think block of earlier turns, so the new prompt parts from the old one right
    after ``<|im_start|>assistant\\n``. The recurrent layers cannot roll back token by
    token; llama-server resumes from its checkpoint just before, and reuses nearly all of
    the previous prompt."""
    first = await chat(engine, [SYSTEM, USER], id_slot=0)
    reply = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
    second = await chat(engine, [SYSTEM, USER, reply, NEXT_USER], id_slot=0)
    previous = first["usage"]["prompt_tokens"]
    assert previous - 8 <= second["timings"]["cache_n"] < previous


async def test_qwen35_exact_extension_reuses_the_whole_prompt_and_reply(
        engine: httpx.AsyncClient) -> None:
    """Random weights. A prompt that is the previous prompt, the previous reply and a new
    turn, token for token: everything the slot evaluated is reused (the reply's last token
    was sampled, never evaluated, so it is the first to compute)."""
    first_prompt = await tokens_of(engine, await template_prompt(engine, [SYSTEM, USER]))
    first = await complete(engine, first_prompt, slot=0)
    turn = await tokens_of(engine, "<|im_end|>\n<|im_start|>user\nAnd in autumn?<|im_end|>\n"
                                   "<|im_start|>assistant\n<think>\n")
    second = await complete(engine, first_prompt + first["tokens"] + turn, slot=0)
    assert second["timings"]["cache_n"] == len(first_prompt) + len(first["tokens"]) - 1


async def test_qwen35_restored_slot_serves_all_of_the_saved_prompt(
        engine: httpx.AsyncClient) -> None:
    """Random weights. Save a slot, erase it, restore it (recurrent state and KV cells from
    the file), then extend the saved tokens exactly: all of them are cached."""
    prompt = await tokens_of(engine, await template_prompt(engine, [SYSTEM, USER]))
    first = await complete(engine, prompt, slot=0)
    saved = await post(engine, "/slots/0?action=save", {"filename": "tiny-qwen35.bin"})
    evaluated = len(prompt) + len(first["tokens"]) - 1
    assert saved["n_saved"] == evaluated
    await post(engine, "/slots/0?action=erase", {})
    restored = await post(engine, "/slots/0?action=restore", {"filename": "tiny-qwen35.bin"})
    assert restored["n_restored"] == saved["n_saved"]
    turn = await tokens_of(engine, "<|im_end|>\n<|im_start|>user\nAnd in autumn?<|im_end|>\n")
    second = await complete(engine, prompt + first["tokens"] + turn, slot=0)
    assert second["timings"]["cache_n"] == saved["n_saved"]


async def test_qwen35_restored_slot_is_reprocessed_when_the_next_chat_turn_diverges(
        engine: httpx.AsyncClient) -> None:
    """Random weights; the engine's behaviour as measured, pinned so a change shows. The
    next chat turn parts from the saved tokens just before their end (the dropped think
    block). A live slot resumes from a checkpoint there; a slot file carries no
    checkpoints, and recurrent state cannot roll back: llama-server re-processes the whole
    prompt after a restore."""
    first = await chat(engine, [SYSTEM, USER], id_slot=0)
    await post(engine, "/slots/0?action=save", {"filename": "tiny-qwen35-chat.bin"})
    await post(engine, "/slots/0?action=erase", {})
    await post(engine, "/slots/0?action=restore", {"filename": "tiny-qwen35-chat.bin"})
    reply = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
    second = await chat(engine, [SYSTEM, USER, reply, NEXT_USER], id_slot=0)
    assert second["timings"]["cache_n"] == 0


# ---------------------------------------------------------------- gpt-oss's cache

LONG_SYSTEM = {"role": "system", "content": "You answer questions about the weather. " * 60}
HARMONY_TURN = "<|end|><|start|>user<|message|>And in autumn?<|end|><|start|>assistant"


async def test_gptoss_exact_extension_past_the_window_reuses_everything(
        gptoss_engine: httpx.AsyncClient) -> None:
    """Random weights. A prompt longer than the sliding window (128), then its exact
    extension: all the slot evaluated is reused, the sliding layers' cells included."""
    prompt = await tokens_of(gptoss_engine,
                             await template_prompt(gptoss_engine, [LONG_SYSTEM, USER]))
    assert len(prompt) > 3 * 128
    first = await complete(gptoss_engine, prompt, slot=0)
    turn = await tokens_of(gptoss_engine, HARMONY_TURN)
    second = await complete(gptoss_engine, prompt + first["tokens"] + turn, slot=0)
    assert second["timings"]["cache_n"] == len(prompt) + len(first["tokens"]) - 1


async def test_gptoss_restored_slot_is_reprocessed_even_on_an_exact_extension(
        gptoss_engine: httpx.AsyncClient) -> None:
    """Random weights; the engine's behaviour as measured, pinned so a change shows. A slot
    file keeps only the sliding layers' cells inside the window (llama_kv_cache::
    state_write), and llama-server wants one cell more before it reuses a prefix without a
    checkpoint (tools/server/server-context.cpp, pos_min >= pos_min_thold); a restored slot
    has no checkpoints, so even an exact extension is re-processed from the start."""
    prompt = await tokens_of(gptoss_engine,
                             await template_prompt(gptoss_engine, [LONG_SYSTEM, USER]))
    first = await complete(gptoss_engine, prompt, slot=0)
    saved = await post(gptoss_engine, "/slots/0?action=save", {"filename": "tiny-gptoss.bin"})
    await post(gptoss_engine, "/slots/0?action=erase", {})
    restored = await post(gptoss_engine, "/slots/0?action=restore",
                          {"filename": "tiny-gptoss.bin"})
    assert restored["n_restored"] == saved["n_saved"] == len(prompt) + len(first["tokens"]) - 1
    turn = await tokens_of(gptoss_engine, HARMONY_TURN)
    second = await complete(gptoss_engine, prompt + first["tokens"] + turn, slot=0)
    assert second["timings"]["cache_n"] == 0
