"""System messages in the middle of a conversation (Claude Code sends them) against the real
llama-server on Qwen3.5's real chat template, which refuses them with a 500.

The model is the rig's tiny random-weight ``qwen35`` (``tests.rig.tiny_models``): what it
says is noise; the template, the tokenizer and the engine's cache are real.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.pipeline.system_turns import CLOSE, OPEN, in_place
from prefixpin.proxy.settings import Settings
from tests.app.conftest import ProxyClient, clients_of, lanes_ready
from tests.e2e.helpers import filler
from tests.rig.llama_process import LlamaServerProcess, run_llama_server
from tests.rig.tiny_models import ensure_tiny_model

pytestmark = pytest.mark.llama

Json = dict[str, Any]
AGENTS = "Available agent types: general-purpose, Explore, Plan. " * 8


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServerProcess]:
    with run_llama_server(ensure_tiny_model("qwen35-tiny"), slots=2, ctx_per_slot=4096,
                          slot_save_path=tmp_path_factory.mktemp("slots"), threads=1,
                          extra=["--cache-ram", "0"]) as handle:
        yield handle


@pytest.fixture
async def proxy(qwen35: LlamaServerProcess, caplog: pytest.LogCaptureFixture
                ) -> AsyncIterator[ProxyClient]:
    caplog.set_level(logging.INFO, "prefixpin")
    apps = create_apps(Settings(upstream=qwen35.url, health_interval_s=0.5))
    app = apps.tenant
    async with app.router.lifespan_context(app), clients_of(apps, timeout=120) as client:
        await lanes_ready(app, timeout_s=60)
        yield client


def conversation(turns: int) -> list[Json]:
    """A system prompt, then turns each preceded by a mid-conversation system message."""
    messages: list[Json] = [{"role": "system", "content": "You are a coding agent. "
                             + filler(120, seed=3)}]
    for turn in range(turns):
        messages.append({"role": "system", "content": AGENTS})
        messages.append({"role": "user", "content": f"Step {turn}: " + filler(30, seed=turn)})
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": f"Done with step {turn}."})
    return messages


def test_the_template_refuses_them_directly(qwen35: LlamaServerProcess) -> None:
    response = httpx.post(f"{qwen35.url}/v1/chat/completions", timeout=60,
                          json={"messages": conversation(1), "max_tokens": 4})
    assert response.status_code == 500
    assert "System message must be at the beginning" in response.text


@pytest.mark.anyio
async def test_through_prefixpin_they_render_in_place_and_the_prefix_holds(
        proxy: ProxyClient, caplog: pytest.LogCaptureFixture) -> None:
    assert [r for r in caplog.get_records("setup")
            if r.getMessage() == "system messages in place"]
    answers = []
    for turns in (1, 2, 3):
        response = await proxy.post(
            "/v1/chat/completions", headers={"x-session-id": "cc-1"},
            json={"messages": conversation(turns), "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200, response.text
        answers.append(response.json()["usage"])
    for before, after in itertools.pairwise(answers):
        # The next turn re-reads only what it adds (and the reply's re-rendering).
        assert after["prompt_tokens_details"]["cached_tokens"] >= before["prompt_tokens"] - 8, \
            answers


@pytest.mark.anyio
async def test_claude_codes_messages_with_a_system_turn_are_answered(
        proxy: ProxyClient) -> None:
    """Anthropic Messages as Claude Code sends them: a top-level system, and a system
    message inside ``messages``."""
    body = {"model": "qwen35-tiny", "max_tokens": 4, "system": "You are Claude Code.",
            "messages": [{"role": "user", "content": "Hello."},
                         {"role": "system", "content": AGENTS},
                         {"role": "user", "content": "List the files."}]}
    response = await proxy.post("/v1/messages", json=body,
                                headers={"x-api-key": "sk-ant-dummy"})
    assert response.status_code == 200, response.text
    assert response.json()["type"] == "message"


@pytest.mark.anyio
async def test_codexs_responses_with_developer_messages_are_answered(
        proxy: ProxyClient, qwen35: LlamaServerProcess) -> None:
    """OpenAI Responses as Codex sends them: instructions, then developer input items,
    which llama-server renders as system messages after the first (refused directly)."""
    body = {"model": "qwen35-tiny", "max_output_tokens": 4, "instructions": "You are Codex.",
            "input": [{"type": "message", "role": "developer",
                       "content": [{"type": "input_text", "text": "Sandbox: read-only."}]},
                      {"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "List the files."}]}]}
    async with httpx.AsyncClient(timeout=60) as http:
        direct = await http.post(f"{qwen35.url}/v1/responses", json=body)
    response = await proxy.post("/v1/responses", json=body,
                                headers={"authorization": "Bearer codex-dummy"})
    assert direct.status_code == 500, direct.text
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "completed"


def test_the_rendering_is_the_system_text_as_a_reminder_turn(
        qwen35: LlamaServerProcess) -> None:
    """What the engine renders for the rewritten turn: the system text, whole, inside the
    reminder tags of a user turn, where the system message stood."""
    rendered = httpx.post(f"{qwen35.url}/apply-template", timeout=60,
                          json={"messages": in_place(conversation(1))}).json()["prompt"]
    assert f"<|im_start|>user\n{OPEN}{AGENTS}{CLOSE}<|im_end|>" in rendered, rendered
    assert rendered.index(OPEN) < rendered.index("Step 0:")
