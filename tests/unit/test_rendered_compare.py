"""The planner's rendered-prompt comparison (``AffinityPlanner._rendered_extends``): a client
rewrite that neither the bytes nor repair resolve, but that the engine's template does not
render, resumes the session; and what the engine is asked to render for it stays the size
of a turn as the conversation grows (``proxy/parking/windows.py``). The engine here is a
stub whose template trims each message's text, as Qwen3.5's does (the client sends its
last reply back with a trailing newline, and trims it the turn after), and drops the
reasoning of replies before the last user message."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, cast

import pytest

from prefixpin.adapters.base import Capabilities
from prefixpin.core.figures import Figures
from prefixpin.proxy.codecs import codec_of
from prefixpin.proxy.listen.tenants import ANONYMOUS
from prefixpin.proxy.ops.metrics import Metrics
from prefixpin.proxy.pipeline.records import Backend, Incoming, Outcome
from prefixpin.proxy.pipeline.validation import parse_request
from prefixpin.proxy.session.affinity import AffinityPlanner
from prefixpin.proxy.session.history import DigestMemo
from prefixpin.proxy.session.placement import SlotPool
from prefixpin.proxy.session.repair import RepairConfig, Repairer
from prefixpin.proxy.session.sessions import SessionStore
from tests.e2e.helpers import filler

pytestmark = pytest.mark.anyio

Json = dict[str, Any]


class Engine:
    name = "stub"
    capabilities = Capabilities(slots=True, render=True)

    def __init__(self) -> None:
        self.rendered_bytes: list[int] = []

    async def apply_template(self, body: Mapping[str, Any]) -> str:
        messages = body["messages"]
        last_query = max(i for i, m in enumerate(messages) if m["role"] == "user")
        text = ""
        for i, message in enumerate(messages):
            content = (message.get("content") or "").strip()
            if message["role"] == "assistant" and i > last_query:
                content = f"<think>{message.get('reasoning_content', '')}</think>{content}"
            text += f"<|im_start|>{message['role']}\n{content}<|im_end|>\n"
        self.rendered_bytes.append(len(json.dumps(body)))
        return text + "<|im_start|>assistant\n"


async def test_a_rewrite_the_template_hides_resumes_and_renders_only_the_turn() -> None:
    engine = Engine()
    metrics = Metrics()
    store = SessionStore()
    repairer = Repairer(RepairConfig.from_switches({}), lambda m: 10 * len(m))
    planner = AffinityPlanner(store, SlotPool(1), metrics, None, logging.getLogger("t"),
                              repairer)
    backend = Backend("engine", cast(Any, engine))
    messages: list[Json] = [{"role": "system", "content": filler(200, seed=1)}]
    per_turn, decisions = [], []
    for turn in range(12):
        messages.append({"role": "user", "content": filler(30, seed=turn)})
        client = parse_request(json.dumps({"messages": messages}).encode(), "chat",
                               "/v1/chat/completions", max_messages=1000)
        engine.rendered_bytes.clear()
        plan = await planner.plan(Incoming.of(client, codec_of(client),
                                              {"x-session-id": "s"}, ANONYMOUS,
                                              memo=DigestMemo()), backend)
        session = store.get(plan.session or "")
        assert session is not None
        decisions.append(session.last_decision)
        per_turn.append(sum(engine.rendered_bytes))
        reply = {"role": "assistant", "content": filler(40, seed=50 + turn)}
        planner.commit(plan, Outcome(True, Figures(10, 5, 1.0, 1), 1.0, reply))
        if turn:  # the previous reply, trimmed now: the bytes changed, the rendering not
            messages[-2] = {**messages[-2], "content": messages[-2]["content"].strip()}
        messages.append({**reply, "content": reply["content"] + "\n"})
    assert decisions == ["new"] + ["resumed"] * 11
    windows = metrics.registry.get_sample_value("prefixpin_template_renderings_total",
                                                {"outcome": "window"})
    # Two renderings a comparison from turn 2 on (turn 1 extends the bytes), all windows
    # but the first; the second of a turn is the next turn's first, kept (not asked for).
    assert windows == 2 * 10 - 1
    assert per_turn[-1] < 1.2 * per_turn[2], per_turn  # a turn, not the conversation
