"""The adapter contract: every engine adapter gives the same cache figures for the same
conversation moves (cold, identical resend, extension, edited last message, disconnect
mid-prefill), reports progress before prefill, and saves/restores slots.

What a slotless engine (Ollama) cannot do is skipped with the reason: it chooses its own
slots (no pinning, no /slots), reports no prompt progress, has no slot files and renders
no template on request. The cache figures apply to it all the same."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

import pytest

from prefixpin.adapters.base import Adapter, Frame, FrameKind
from prefixpin.core.errors import ProxyError
from prefixpin.core.figures import Figures, figures_from
from tests.contract.conftest import OLLAMA_MODEL
from tests.e2e.helpers import filler

pytestmark = pytest.mark.anyio

SYSTEM = {"role": "system", "content": "You answer briefly. " + filler(120, seed=1)}


def chat(*user_turns: str, replies: tuple[str, ...] = ()) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [SYSTEM]
    for index, turn in enumerate(user_turns):
        messages.append({"role": "user", "content": turn})
        if index < len(replies):
            messages.append({"role": "assistant", "content": replies[index]})
    return {"messages": messages, "max_tokens": 4, "temperature": 0}


def request_for(adapter: Adapter, body: dict[str, Any], slot: int) -> Any:
    """The engine call: pinned to ``slot`` where the engine lets the proxy choose; Ollama
    needs the model named."""
    if adapter.name == "ollama":
        body = {"model": OLLAMA_MODEL, **body}
    return adapter.prepare("/v1/chat/completions", body,
                           slot=slot if adapter.capabilities.slots else None)


async def run(adapter: Adapter, body: dict[str, Any], slot: int = 0) -> tuple[Figures,
                                                                               list[Frame]]:
    call = request_for(adapter, body, slot)
    frames: list[Frame] = []
    async with adapter.open_stream(call) as upstream:
        assert upstream.status_code == 200, await upstream.aread_error()
        async for frame in upstream.aiter_frames():
            frames.append(frame)
    progress = next((f.progress for f in reversed(frames) if f.progress), None)
    return figures_from(frames, progress), frames


async def wait_idle(adapter: Adapter, slot: int, limit_s: float = 10) -> float:
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        if not (await adapter.list_slots())[slot].is_processing:
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    raise AssertionError(f"slot {slot} still processing after {limit_s} s")


async def test_probe_describes_the_engine(adapter: Adapter) -> None:
    """Slots, per-slot context and the model name come from the engine itself."""
    info = await adapter.probe()
    if adapter.name == "ollama":  # slots and models are Ollama's business, per request
        assert (info.engine, info.n_slots, info.build) == ("ollama", 0, "ollama 0.35.1")
        assert not adapter.capabilities.slots
        assert not adapter.capabilities.progress
        assert adapter.capabilities.measured_cache  # 0.35.1 reports cached counts
        return
    assert info.n_slots == 2
    assert info.n_ctx_slot == 4096
    assert info.model.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert adapter.capabilities.slots
    assert adapter.capabilities.progress


async def test_cold_then_identical_resend(adapter: Adapter) -> None:
    """Cold: nothing cached. The same request again on the same slot: all but one token."""
    body = chat("Name three colours. " + filler(40, seed=2))
    cold, frames = await run(adapter, body)
    again, _ = await run(adapter, body)
    assert cold.prompt_tokens is not None
    assert cold.prompt_tokens > 200
    assert cold.cached_tokens == 0
    assert again.prompt_tokens == cold.prompt_tokens
    assert again.cached_tokens == cold.prompt_tokens - 1
    assert frames[-1].kind is FrameKind.DONE
    if not adapter.capabilities.progress:
        return  # Ollama reports no progress: its first bytes are the first token
    first_progress = next(f for f in frames if f.progress is not None)
    assert first_progress.kind is FrameKind.PROGRESS
    assert first_progress.progress is not None
    assert first_progress.progress.processed == first_progress.progress.cache == 0
    assert frames.index(first_progress) < next(i for i, f in enumerate(frames) if f.has_output)
    assert frames[-1].kind is FrameKind.DONE


async def test_an_extended_conversation_reuses_the_whole_previous_prompt(
        adapter: Adapter) -> None:
    """One more turn: every token of the previous prompt comes from the cache."""
    first, _ = await run(adapter, chat("Say one word. " + filler(30, seed=3)))
    second, _ = await run(adapter, chat("Say one word. " + filler(30, seed=3), "Another.",
                                        replies=("Blue.",)))
    assert first.prompt_tokens is not None
    assert second.cached_tokens is not None
    assert second.cached_tokens >= first.prompt_tokens
    assert second.prompt_tokens is not None
    assert second.prompt_tokens > first.prompt_tokens


async def test_an_edited_last_message_reuses_everything_before_it(adapter: Adapter) -> None:
    """The last user message edited: the cache covers the prompt up to that message."""
    base = chat("First question. " + filler(20, seed=4), "Second question, original.",
                replies=("First answer.",))
    original, _ = await run(adapter, base)
    prefix_only, _ = await run(adapter, {**base, "messages": base["messages"][:-1]}, slot=1)
    edited = {**base, "messages": [*base["messages"][:-1],
                                   {"role": "user", "content": "Second question, edited!"}]}
    figures, _ = await run(adapter, edited)
    assert original.cached_tokens == 0
    assert prefix_only.prompt_tokens is not None
    assert figures.cached_tokens is not None
    # Everything before the edited message (its role header included) is reused.
    assert figures.cached_tokens >= prefix_only.prompt_tokens - 3
    assert figures.cached_tokens < (original.prompt_tokens or 0)


async def test_a_disconnect_mid_prefill_frees_the_slot_and_keeps_what_was_processed(
        adapter: Adapter) -> None:
    """Leaving during prefill: the slot is idle again within seconds and the tokens already
    processed are reused by the resend."""
    body = chat("Summarise. " + filler(500, seed=5))
    call = request_for(adapter, body, 0)
    if not adapter.capabilities.progress:
        # No progress reports (Ollama sends nothing before the first token): leave after
        # a part of the prefill, by the clock.
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5), adapter.open_stream(call):
                pytest.fail("the engine answered before its prefill could have ended")
        resend, _ = await run(adapter, body)
        assert resend.cached_tokens is not None
        assert resend.prompt_tokens is not None
        assert 0 < resend.cached_tokens < resend.prompt_tokens // 2
        return
    processed = 0
    async with adapter.open_stream(call) as upstream:
        async for frame in upstream.aiter_frames():
            if frame.progress is not None and 0 < frame.progress.processed < frame.progress.total:
                processed = frame.progress.processed
                break
    assert processed > 0, "no progress report arrived mid-prefill"
    await wait_idle(adapter, 0)
    resend, _ = await run(adapter, body)
    assert resend.cached_tokens is not None
    assert resend.cached_tokens >= processed


async def test_slots_save_erase_and_restore(adapter: Adapter) -> None:
    """A saved slot, erased, then restored, serves the same prompt from cache; an engine
    without slot files refuses each action with a clear error, touching nothing."""
    if not adapter.capabilities.slot_files:
        await refuses(adapter.save_slot(1, "contract.bin"), "slot files")
        await refuses(adapter.restore_slot(1, "contract.bin"), "slot files")
        await refuses(adapter.erase_slot(1), "slot files")
        return
    body = chat("Remember this. " + filler(60, seed=6))
    cold, _ = await run(adapter, body, slot=1)
    saved = await adapter.save_slot(1, "contract.bin")
    await adapter.erase_slot(1)
    assert (await adapter.list_slots())[1].n_prompt_tokens == 0
    restored = await adapter.restore_slot(1, "contract.bin")
    again, _ = await run(adapter, body, slot=1)
    assert saved.n_tokens == restored.n_tokens >= (cold.prompt_tokens or 0)
    assert again.cached_tokens == (cold.prompt_tokens or 0) - 1


async def test_render_and_tokenize_as_the_chat_path_does(adapter: Adapter) -> None:
    """apply-template + tokenize(add_special) count exactly the chat path's prompt tokens;
    an engine that renders nothing on request says so for each."""
    if not adapter.capabilities.render:
        await refuses(adapter.apply_template(chat("Count my tokens.")), "template rendering")
        await refuses(adapter.tokenize("Count my tokens.", add_special=True), "tokenization")
        return
    body = chat("Count my tokens.")
    prompt = await adapter.apply_template(body)
    tokens = await adapter.tokenize(prompt, add_special=True)
    figures, _ = await run(adapter, body, slot=1)
    assert "Count my tokens." in prompt
    assert len(tokens) == figures.prompt_tokens


async def refuses(action: Awaitable[object], what: str) -> None:
    """The adapter says it cannot do ``what``, as an error of the one exception tree."""
    with pytest.raises(ProxyError, match=what):
        await action
