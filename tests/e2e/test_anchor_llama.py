"""Anchoring on hybrid recurrent memory, against the real llama-server: two sessions take
turns on one slot of Qwen3.5's architecture with its real chat template, which renders the
last reply again (its reasoning dropped), so the next request never extends what the slot
held when it was saved.

The model is the rig's tiny random-weight ``qwen35`` (``tests.rig.tiny_models``): what it
says is noise; the recurrent state, the checkpoints, the slot files and the template are
real.

With anchoring (the default), a session parked ahead is restored as an extension and its
next turn reads its whole previous prompt from cache; with ``--no-anchor`` the same restore
is declined and the turn re-reads everything.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.settings import Settings
from tests.app.conftest import ProxyClient, clients_of, lanes_ready
from tests.app.test_parking import metric
from tests.e2e.helpers import filler
from tests.rig.llama_process import LlamaServerProcess, run_llama_server
from tests.rig.tiny_models import NO_NEWLINES, ensure_tiny_model

pytestmark = [pytest.mark.llama, pytest.mark.anyio]

Json = dict[str, Any]


@pytest.fixture
def park(tmp_path: Path) -> Path:
    path = tmp_path / "slots"
    path.mkdir()
    return path


@pytest.fixture
def qwen35(park: Path) -> Iterator[LlamaServerProcess]:
    with run_llama_server(ensure_tiny_model("qwen35-tiny"), slots=1, ctx_per_slot=8192,
                          slot_save_path=park, threads=1,
                          extra=["--cache-ram", "0"]) as handle:
        yield handle


class Agent:
    """One session: a system prompt of its own, a user turn per step, each reply sent back
    as the engine returned it (reasoning included: the template drops it)."""

    def __init__(self, name: str, fields: Json | None = None) -> None:
        self.name = name
        self.fields = fields or {}  # more request fields
        self.messages: list[Json] = [{"role": "system", "content": f"You are agent {name}. "
                                      + filler(200, seed=ord(name))}]
        self.usage: list[Json] = []

    async def turn(self, client: ProxyClient, step: int) -> Json:
        self.messages.append({"role": "user", "content": f"Step {step}: "
                              + filler(40, seed=ord(self.name) * 10 + step)})
        return await self.send(client)

    async def send(self, client: ProxyClient) -> Json:
        response = await client.post(
            "/v1/chat/completions", headers={"x-session-id": f"agent-{self.name}"},
            json={"messages": self.messages, "max_tokens": 16, "temperature": 0,
                  **self.fields})
        assert response.status_code == 200, response.text
        body: Json = response.json()
        self.messages.append(body["choices"][0]["message"])
        self.usage.append(body["usage"])
        return body


async def settle(client: ProxyClient, name: str, count: float, **labels: str) -> None:
    """Until the counter reaches ``count`` (parking ahead runs in the background)."""
    async with asyncio.timeout(30):
        while await metric(client, name, **labels) < count:  # noqa: ASYNC110 (a metric has no event to wait on)
            await asyncio.sleep(0.05)


def parking(engine: LlamaServerProcess, park: Path, *, anchor: bool = True,
            park_ahead: bool = True) -> Settings:
    return Settings(upstream=engine.url, park_dir=park, park_index_dir=park.with_name("index"),
                    park_min_tokens=32, health_interval_s=0.5, anchor=anchor,
                    park_ahead=park_ahead)


async def outcomes(client: ProxyClient) -> tuple[float, float, float]:
    """Restores done, restores declined (the request did not extend the file), anchors."""
    return (await metric(client, "prefixpin_restores_total", outcome="restored"),
            await metric(client, "prefixpin_restores_total", outcome="diverged"),
            await metric(client, "prefixpin_anchors_total", outcome="anchored"))


@pytest.mark.parametrize("anchor", [True, False])
async def test_a_restore_after_anchoring_is_an_extension(
        qwen35: LlamaServerProcess, park: Path, anchor: bool) -> None:
    """A and B alternate on one slot, each turn after the other's slot went idle (the time
    a user or a tool takes). Anchored, every return is a restore of a file the request
    extends: its whole previous prompt and reply cached. Not anchored, the same restores
    are declined (the template rewrote the last reply) and every return re-reads all."""
    apps = create_apps(parking(qwen35, park, anchor=anchor))
    app = apps.tenant
    agents = [Agent("A"), Agent("B")]
    async with app.router.lifespan_context(app), clients_of(apps, timeout=120) as client:
        await lanes_ready(app, timeout_s=60)
        for step in (1, 2, 3):
            for agent in agents:
                await agent.turn(client, step)
                # Its slot idles: anchored before the other session comes, once the slot
                # has changed hands (A's first turn is anchored when B's evicts it).
                if anchor and (step, agent.name) != (1, "A"):
                    await settle(client, "prefixpin_anchors_total", len(agent.usage) * 2
                                 - (agent.name == "A"), outcome="anchored")
        restored, declined, anchors = await outcomes(client)
    returns = [(before, after) for agent in agents
               for before, after in itertools.pairwise(agent.usage)]
    if anchor:
        assert anchors == 6
        assert restored == 4, (restored, declined)
        for before, after in returns:
            # All the previous turn held, its reply as the template renders it again too.
            assert after["prompt_tokens_details"]["cached_tokens"] >= before["prompt_tokens"], \
                returns
    else:
        assert anchors == 0
        assert declined == 4
        for before, after in returns:
            assert after["prompt_tokens_details"]["cached_tokens"] < before["prompt_tokens"] // 2


@pytest.fixture
def qwen35_unsaved() -> Iterator[LlamaServerProcess]:
    """No --slot-save-path: parking is off."""
    with run_llama_server(ensure_tiny_model("qwen35-tiny"), slots=1, ctx_per_slot=8192,
                          slot_save_path=None, threads=1) as handle:
        yield handle


async def test_a_session_that_keeps_its_slot_is_not_anchored(
        qwen35_unsaved: LlamaServerProcess) -> None:
    """Parking off, one session on its own slot: nothing is anchored after its turns
    (an anchor renders and tokenizes the whole conversation), and the engine's own
    checkpoint near the end of the prompt serves the next turn: it re-reads only the
    reply as the template renders it again, a few tokens."""
    apps = create_apps(Settings(upstream=qwen35_unsaved.url, health_interval_s=0.5))
    app = apps.tenant
    agent = Agent("H")
    async with app.router.lifespan_context(app), clients_of(apps, timeout=120) as client:
        await lanes_ready(app, timeout_s=60)
        assert app.state.prefixpin.router.lanes[0].parking is None
        await agent.turn(client, 1)
        await asyncio.sleep(0.6)  # past the idle delay an anchor would wait for
        await agent.turn(client, 2)
        anchors = await metric(client, "prefixpin_anchors_total", outcome="anchored")
    first, second = agent.usage
    assert anchors == 0
    assert second["prompt_tokens_details"]["cached_tokens"] >= first["prompt_tokens"] - 16, \
        agent.usage


@pytest.mark.parametrize("anchor", [True, False])
async def test_a_warm_hybrid_slot_is_anchored_with_parking_off_once_slots_change_hands(
        qwen35_unsaved: LlamaServerProcess, anchor: bool) -> None:
    """Parking off, two sessions on one slot: once the slot has changed hands, a turn's
    slot is anchored after it, so it holds what the session's next request starts with,
    and that request reads all of the previous prompt from cache; without anchoring the
    engine goes back to its checkpoint 4 tokens before the end."""
    apps = create_apps(Settings(upstream=qwen35_unsaved.url, anchor=anchor,
                                health_interval_s=0.5))
    app = apps.tenant
    other, agent = Agent("G"), Agent("H")
    async with app.router.lifespan_context(app), clients_of(apps, timeout=120) as client:
        await lanes_ready(app, timeout_s=60)
        assert app.state.prefixpin.router.lanes[0].parking is None
        await other.turn(client, 1)
        await agent.turn(client, 1)  # takes the slot from G: the engine is short of slots
        if anchor:
            await settle(client, "prefixpin_anchors_total", 1, outcome="anchored")
        else:
            await asyncio.sleep(0.5)
        await agent.turn(client, 2)
    first, second = agent.usage
    cached = second["prompt_tokens_details"]["cached_tokens"]
    if anchor:
        assert cached >= first["prompt_tokens"], agent.usage
    else:
        assert cached < first["prompt_tokens"], agent.usage


async def test_a_slot_evicted_before_it_idled_is_anchored_as_it_is_parked(
        qwen35: LlamaServerProcess, park: Path) -> None:
    """A and B alternate on one slot with no time between turns (a tool loop, a script):
    no slot ever idles, so each is anchored when the other's request evicts it, just
    before it is saved; every return is still a restore its request extends."""
    apps = create_apps(parking(qwen35, park, park_ahead=False))
    app = apps.tenant
    agents = [Agent("A"), Agent("B")]
    async with app.router.lifespan_context(app), clients_of(apps, timeout=120) as client:
        await lanes_ready(app, timeout_s=60)
        for step in (1, 2, 3):
            for agent in agents:
                await agent.turn(client, step)
        restored, declined, anchors = await outcomes(client)
    assert (restored, declined) == (4, 0)
    assert anchors == 5  # every eviction: A's three, B's two
    for agent in agents:
        for before, after in itertools.pairwise(agent.usage):
            assert after["prompt_tokens_details"]["cached_tokens"] >= before["prompt_tokens"], \
                agent.usage


def send_back_changed(agent: Agent, change: str) -> bool:
    """The agent's last reply as a client that shows its text (reasoning included) sends it
    back changed: ``interrupted`` (the half received before the user stopped it),
    ``edited``; ``regenerate`` drops it, to send the request that produced it again.
    Whether the next request is that resend (no new user turn)."""
    reply = agent.messages.pop()
    if change == "regenerate":
        return True
    text = reply.get("content") or reply.get("reasoning_content") or ""
    assert text.strip(), reply  # else the template renders no change
    kept = text[: len(text) // 2] if change == "interrupted" else f"Edited: {text}"
    agent.messages.append({"role": "assistant", "content": kept})
    return False


@pytest.mark.parametrize("change", ["interrupted", "edited", "regenerate"])
async def test_a_changed_last_reply_is_restored_from_the_prompt_end_snapshot(
        qwen35: LlamaServerProcess, park: Path, change: str) -> None:
    """A and B alternate on one slot, and every time one comes back it sends its last
    reply back changed (or resends the request that produced it): its anchored file holds
    the reply as generated, which the request leaves, so the restore comes from the
    snapshot taken where that reply started. Each return then prefills only what differs
    from the previous prompt (the changed reply, the new user turn), plus the few tokens
    between the reply's start and the prompt's end; on the code before snapshots every
    return re-read the whole conversation."""
    apps = create_apps(parking(qwen35, park))
    app = apps.tenant
    agents = [Agent("A", {"logit_bias": NO_NEWLINES}), Agent("B", {"logit_bias": NO_NEWLINES})]
    async with app.router.lifespan_context(app), clients_of(apps, timeout=120) as client:
        await lanes_ready(app, timeout_s=60)
        for step in (1, 2, 3):
            for agent in agents:
                if step > 1 and send_back_changed(agent, change):
                    await agent.send(client)
                else:
                    await agent.turn(client, step)
                await asyncio.sleep(0.6)  # its slot idles: parked ahead before the other's turn
        restored = await metric(client, "prefixpin_snapshots_total", outcome="restored")
        declined = await metric(client, "prefixpin_restores_total", outcome="diverged")
    assert (restored, declined) == (4, 0)
    for agent in agents:
        for before, after in itertools.pairwise(agent.usage):
            prompt, cached = after["prompt_tokens"], after["prompt_tokens_details"]["cached_tokens"]
            # the previous prompt, but for the tokens after its reply's start (2 here)
            assert cached >= before["prompt_tokens"] - 4, agent.usage
            assert prompt - cached <= max(prompt - before["prompt_tokens"], 0) + 16, agent.usage
            assert prompt - cached < prompt // 4, agent.usage
