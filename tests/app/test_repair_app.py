"""History repair through the proxy, in process against the fake engine: what the engine
receives is the session's committed history plus the new turn, whatever the client did to
the history; with PREFIXPIN_REPAIR=0 it receives the rewrite. And no repair ever brings one
session's bytes into another session's request."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.app.conftest import running_proxy
from tests.rig.models import ensure_model

pytestmark = pytest.mark.anyio

Message = dict[str, Any]
SECRET = "the build token is 7f3a-91cc"
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"p": 1, "q": 2}}},
         {"type": "function", "function": {"name": "grep", "parameters": {}}}]


def history() -> list[Message]:
    return [
        {"role": "system", "content": "You are a coding agent.\nDate: 2026-11-29 10:00:00"},
        {"role": "user", "content": "Find the bug."},
        {"role": "assistant", "content": "", "reasoning_content": "Read the file.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "read", "arguments": '{"path": "a.py", "limit": 50}'}}]},
        {"role": "tool", "tool_call_id": "call_1",
         "content": f"# {SECRET}\n" + "def f(x):\n    return x\n" * 60},
        {"role": "assistant", "content": "<think>The loop is off by one.</think>Found it."},
        {"role": "user", "content": "Fix it."},
    ]


def strip_reasoning(m: list[Message]) -> None:
    m[2].pop("reasoning_content")


def reserialize_args(m: list[Message]) -> None:
    m[2]["tool_calls"][0]["function"]["arguments"] = '{"limit":50,"path":"a.py"}'


def trim_result(m: list[Message]) -> None:
    m[3]["content"] = m[3]["content"][:400]


def clear_result(m: list[Message]) -> None:
    m[3]["content"] = "[Old tool result content cleared]"


def strip_think(m: list[Message]) -> None:
    m[4]["content"] = "Found it."


def new_date(m: list[Message]) -> None:
    m[0]["content"] = "You are a coding agent.\nDate: 2026-11-29 10:07:31"


def drop_window(m: list[Message]) -> None:
    del m[1:4]


REWRITES: dict[str, Callable[[list[Message]], None]] = {
    "reasoning": strip_reasoning, "tool_calls": reserialize_args, "tool_results": trim_result,
    "cleared": clear_result, "think": strip_think, "volatile": new_date, "window": drop_window,
}


async def two_turns(rewrite: Callable[[list[Message]], None], tools: list[Any], *,
                    second_headers: dict[str, str] | None = None,
                    **settings: Any) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    headers = {"x-session-id": "main", "authorization": "Bearer team-a"}
    async with running_proxy(**settings) as (client, engine):
        first = history()
        await client.post("/v1/chat/completions", headers=headers,
                          json={"messages": first, "tools": TOOLS, "max_tokens": 2})
        second = copy.deepcopy(first)
        rewrite(second)
        second += [{"role": "assistant", "content": "Hello from"},
                   {"role": "user", "content": "And the tests?"}]
        response = await client.post("/v1/chat/completions",
                                      headers=second_headers or headers,
                                      json={"messages": second, "tools": tools,
                                            "max_tokens": 2})
        metrics = (await client.admin.get("/metrics")).text
    return engine.requests, response.json(), metrics


@pytest.mark.parametrize("name", sorted(REWRITES))
async def test_the_engine_sees_the_committed_history_plus_the_new_turn(name: str) -> None:
    """Each client rewrite is repaired: turn 2's forwarded messages start with exactly
    turn 1's, and the engine serves them from the slot's cache."""
    requests, response, metrics = await two_turns(REWRITES[name], TOOLS)
    assert requests[1]["messages"][:6] == requests[0]["messages"]
    assert requests[1]["id_slot"] == requests[0]["id_slot"]
    assert response["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert "prefixpin_repairs_total{policy=" in metrics


async def test_reordered_tools_are_forwarded_in_the_first_order() -> None:
    """The tool list in another order: the engine gets the session's first serialization."""
    requests, _, _ = await two_turns(lambda m: None, TOOLS[::-1])
    assert requests[1]["tools"] == TOOLS


@pytest.mark.parametrize("name", ["reasoning", "tool_results", "window"])
async def test_without_repair_the_rewrite_reaches_the_engine(name: str) -> None:
    """PREFIXPIN_REPAIR=0: the rewritten history is forwarded as the client sent it."""
    requests, _, metrics = await two_turns(REWRITES[name], TOOLS, repair=False)
    assert requests[1]["messages"][:6] != requests[0]["messages"]
    assert "prefixpin_repairs_total{" not in metrics


@pytest.mark.parametrize("name", ["reasoning", "tool_results"])
async def test_a_single_policy_can_be_switched_off(name: str) -> None:
    """Each policy has its own switch (PREFIXPIN_REPAIR_<POLICY>=0)."""
    switches: dict[str, Any] = {f"repair_{name}": False}
    requests, _, _ = await two_turns(REWRITES[name], TOOLS, **switches)
    assert requests[1]["messages"][:6] != requests[0]["messages"]


@pytest.mark.parametrize("headers", [
    {"x-session-id": "main", "authorization": "Bearer team-b"},  # another tenant
    {"x-session-id": "other", "authorization": "Bearer team-a"},  # another session
    {"authorization": "Bearer team-a"},  # no key: never matches a keyed session
])
async def test_no_repair_brings_another_sessions_bytes(
        headers: dict[str, str], tenant_file: Callable[..., Path]) -> None:
    """A history that would match after repair, sent by another namespace or session, is
    forwarded as sent: the first session's tool result never reaches it."""
    # --allow-shared-cache: another tenant on the fake (its cache assumed shared) would be
    # refused before repair; this test is about what repair does.
    requests, _, _ = await two_turns(clear_result, TOOLS, second_headers=headers,
                                     allow_shared_cache=True,
                                     tenants_file=tenant_file("team-a", "team-b"))
    assert SECRET in str(requests[0]["messages"])
    assert SECRET not in str(requests[1]["messages"])


async def test_keyless_sessions_are_repaired_after_fingerprint_nomination() -> None:
    """Without a session key, the fingerprint nominates the session (the trimmed tool
    result does not change it) and bytes decide after repair."""
    messages = history()
    async with running_proxy(tokenizer=ensure_model("smollm2")) as (client, engine):
        await client.post("/v1/chat/completions",
                          json={"messages": messages, "tools": TOOLS, "max_tokens": 2})
        second = copy.deepcopy(messages)
        trim_result(second)
        second += [{"role": "assistant", "content": "Hello from"},
                   {"role": "user", "content": "Next."}]
        await client.post("/v1/chat/completions",
                          json={"messages": second, "tools": TOOLS, "max_tokens": 2})
        session = (await client.admin.get("/sessions")).json()["namespaces"]["anon"][0]
    assert engine.requests[1]["messages"][:6] == engine.requests[0]["messages"]
    assert session["last_decision"] == "resumed"
