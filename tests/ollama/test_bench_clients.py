"""Every rewriting client of the bench, replayed through prefixpin in front of Ollama, on
both of Ollama's APIs: what reaches Ollama is each session's committed history plus the
new turn, whatever the client did to its history, and Ollama serves that prefix from its
cache. With PREFIXPIN_REPAIR=0 the same replay shows the rewrites reaching Ollama.

The bench clients build OpenAI-shaped requests (``/v1/chat/completions``); for
``/api/chat`` each is converted as an Ollama-native client would send it: reasoning in
``thinking``, tool-call arguments as objects without ids (as ollama-python sends them),
tool results named by ``tool_name``, options for sampling.

Ollama cannot be installed here: the engine is the recorded-format fake
(``tests.fakes.fake_ollama``), whose prefix cache reports what llama-server under Ollama
would reuse.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from bench.clients.base import Client
from bench.clients.compaction import CompactionClient
from bench.clients.prune import PruneClient
from bench.clients.reasoning_strip import ReasoningStripClient
from bench.clients.sliding_window import SlidingWindowClient
from bench.clients.tools_reorder import ToolsReorderClient
from bench.clients.volatile_system import VolatileSystemClient
from bench.rewrite_check import observe
from bench.transcript import Transcript, load_named
from tests.fakes.fake_ollama import FakeModel

from .conftest import MODELS, fake_config, proxy_rig

pytestmark = pytest.mark.anyio

REWRITING = [ReasoningStripClient(), SlidingWindowClient(), PruneClient(), CompactionClient(),
             VolatileSystemClient(), ToolsReorderClient()]
BENCH_MODEL = FakeModel("bench:latest", reply="Checked.")


def to_native(body: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI chat body as an Ollama-native client sends it."""
    names: dict[str, str] = {}
    messages = []
    for message in body["messages"]:
        content = message.get("content")
        out: dict[str, Any] = {"role": message["role"],
                               "content": content if isinstance(content, str) else ""}
        if message.get("reasoning_content"):
            out["thinking"] = message["reasoning_content"]
        calls = []
        for call in message.get("tool_calls") or []:
            function = call["function"]
            names[call.get("id", "")] = function["name"]
            calls.append({"function": {"name": function["name"],
                                       "arguments": json.loads(function["arguments"] or "{}")}})
        if calls:
            out["tool_calls"] = calls
        if message["role"] == "tool":
            out["tool_name"] = names.get(message.get("tool_call_id", ""), "")
        messages.append(out)
    return {"model": body["model"], "messages": messages, "tools": body["tools"],
            "stream": True,
            "options": {"num_predict": body["max_tokens"], "temperature": body["temperature"]}}


async def replay(client: Client, transcript: Transcript, api: str, *, repair: bool
                 ) -> tuple[list[dict[str, Any]], list[Any], str]:
    config = fake_config(models=(*MODELS, BENCH_MODEL))
    path = "/api/chat" if api == "native" else "/v1/chat/completions"
    async with proxy_rig(config, recorder=True, repair=repair) as rig:
        for step in range(len(transcript.steps)):
            request = client.request(transcript, step)
            body = to_native(request.body) if api == "native" else request.body
            response = await rig.client.post(path, headers=request.headers, json=body)
            assert response.status_code == 200, response.text
            assert b"error" not in response.content
        assert rig.recorder is not None
        forwarded = [body for p, body in rig.recorder.bodies if p == path]
        return forwarded, list(rig.ollama.requests), await rig.metrics()


def extends_previous(forwarded: list[dict[str, Any]]) -> list[bool]:
    """Per step after the first: its forwarded messages start with the previous ones, and
    its tools are the previous ones (the tools render into the prompt's start)."""
    return [later["messages"][:len(earlier["messages"])] == earlier["messages"]
            and later.get("tools") == earlier.get("tools")
            for earlier, later in itertools.pairwise(forwarded)]


@pytest.fixture(scope="module")
def transcript() -> Transcript:
    return load_named("session-00")


@pytest.mark.parametrize("api", ["v1", "native"])
@pytest.mark.parametrize("client", REWRITING, ids=lambda c: c.name)
async def test_each_rewriting_client_reaches_ollama_repaired(
        client: Client, api: str, transcript: Transcript) -> None:
    requests = [client.request(transcript, step) for step in range(len(transcript.steps))]
    rewrites = [o.step for o in observe(requests) if o.rewrote]
    assert rewrites  # the client really rewrites this transcript

    forwarded, served, metrics = await replay(client, transcript, api, repair=True)
    assert len(forwarded) == len(transcript.steps)
    assert all(extends_previous(forwarded))
    assert "prefixpin_repairs_total{" in metrics
    for previous, record in itertools.pairwise(served):
        # Everything Ollama held from the previous turn's prompt is reused.
        assert record.cached_tokens >= previous.prompt_tokens - 2, (previous, record)

    plain, served_plain, _ = await replay(client, transcript, api, repair=False)
    broken = [step + 1 for step, ok in enumerate(extends_previous(plain)) if not ok]
    assert broken  # the rewrites reach Ollama unrepaired
    assert set(broken) <= set(rewrites)
    reused, reused_plain = (sum(r.cached_tokens for r in s) for s in (served, served_plain))
    if isinstance(client, ReasoningStripClient):
        # The fake's template drops earlier reasoning, as many real templates do: there
        # the strip costs nothing, and repair keeps the bytes stable all the same.
        assert reused == reused_plain
    else:
        assert reused > reused_plain
