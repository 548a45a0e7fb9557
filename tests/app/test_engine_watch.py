"""The engine watch (``proxy.engine.watch``) probes an engine every ``--health-interval``,
except over an interval that a stream from it stayed open through: a restart or a crash
would have closed that stream. (The fake engine stands in for llama-server's wire format:
its ``/metrics`` answers are the probes.)"""

from __future__ import annotations

import asyncio

import pytest

from tests.app.conftest import ProxyFactory
from tests.fakes.fake_llama import FakeLlamaConfig, FakeLlamaServer

pytestmark = pytest.mark.anyio

INTERVAL_S = 0.05
CHAT = {"model": "m", "stream": True, "max_tokens": 8,
        "messages": [{"role": "user", "content": "hello there"}]}


async def test_no_probe_while_a_stream_stays_open_and_probes_again_after(
        proxy: ProxyFactory) -> None:
    engine = FakeLlamaServer(FakeLlamaConfig(token_delay_s=0.25))
    async with proxy(engine, health_interval_s=INTERVAL_S) as (client, _):
        counts: list[int] = []
        async with client.stream("POST", "/v1/chat/completions", json=CHAT) as response:
            assert response.status_code == 200
            async for _ in response.aiter_bytes():
                counts.append(engine.metrics_served)
        # The stream took eight token delays (2 s, 40 intervals): one probe at most after
        # its answer's head (it vouches only for what follows the probe before it).
        assert counts[-1] - counts[0] <= 1, counts
        ended = engine.metrics_served
        await asyncio.sleep(10 * INTERVAL_S)
        assert engine.metrics_served >= ended + 3


async def test_a_probe_due_during_a_prefill_waits_for_its_output(proxy: ProxyFactory) -> None:
    """A stream that opens after a long one ended opens more than an interval after the
    last probe (none ran while the long one was open), so it vouches for nothing: the probe
    then due is put off while the engine prefills its prompt (a probe there is paid on
    the way to the first token), and taken once output flows."""
    engine = FakeLlamaServer(FakeLlamaConfig(token_delay_s=0.05, prefill_s_per_token=0.004))
    async with proxy(engine, health_interval_s=INTERVAL_S) as (client, _):
        response = await client.post("/v1/chat/completions", json=CHAT)  # 8 delays, 0.4 s
        assert response.status_code == 200
        long_prompt = {**CHAT, "messages": [
            {"role": "user", "content": " ".join(f"word{i}" for i in range(60))}]}
        during_prefill: int | None = None
        async with client.stream("POST", "/v1/chat/completions", json=long_prompt) as stream:
            assert stream.status_code == 200
            opened = engine.metrics_served  # the head: the engine has the request
            async for line in stream.aiter_lines():
                if during_prefill is None and '"content"' in line:
                    during_prefill = engine.metrics_served - opened
        # 60 tokens at 4 ms: a prefill of about 5 intervals, under PUT_OFF_INTERVALS.
        assert during_prefill == 0
        ended = engine.metrics_served
        await asyncio.sleep(10 * INTERVAL_S)
        assert engine.metrics_served >= ended + 3
