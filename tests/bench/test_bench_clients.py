"""Each replay client really produces the rewrite it claims, and extend-only none."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from bench.clients.base import MAX_TOKENS, Client, Request
from bench.clients.compaction import BUDGET_TOKENS, CompactionClient, message_tokens
from bench.clients.extend_only import ExtendOnlyClient
from bench.clients.prune import CLEARED, PruneClient
from bench.clients.reasoning_strip import ReasoningStripClient
from bench.clients.sliding_window import KEEP_LAST, TRIM_TO, SlidingWindowClient
from bench.clients.timeout_resend import RESUME_AT_TOKENS, TimeoutResendClient, resume_step
from bench.clients.tools_reorder import ToolsReorderClient
from bench.clients.volatile_system import VolatileSystemClient
from bench.rewrite_check import observe, verify
from bench.scenarios import SCENARIOS
from bench.transcript import Transcript, load_named


@pytest.fixture(scope="module")
def session() -> Transcript:
    return load_named("session-00")


def all_requests(client: Client, transcript: Transcript) -> list[Request]:
    return [client.request(transcript, step) for step in range(len(transcript.steps))]


def rewritten_steps(requests: list[Request]) -> list[int]:
    return [o.step for o in observe(requests) if o.rewrote]


def test_extend_only_never_rewrites(session: Transcript) -> None:
    """Every request is the previous one plus new messages, and says so."""
    requests = all_requests(ExtendOnlyClient(), session)
    assert rewritten_steps(requests) == []
    assert not any(r.claims_rewrite for r in requests)
    verify("extend-only", False, requests)
    assert requests[-1].body["messages"] == session.history_before(len(session.steps) - 1)


@pytest.mark.parametrize("client", [ReasoningStripClient(), SlidingWindowClient(),
                                    PruneClient(), CompactionClient(), VolatileSystemClient(),
                                    ToolsReorderClient()], ids=lambda c: c.name)
def test_rewriting_clients_claim_exactly_what_the_wire_shows(
        client: Client, session: Transcript) -> None:
    """Claims match the independent wire check turn by turn, with at least one rewrite."""
    requests = all_requests(client, session)
    verify(client.name, True, requests)
    assert rewritten_steps(requests)
    assert [r.step for r in requests if r.claims_rewrite] == rewritten_steps(requests)


@pytest.mark.parametrize("name", ["session-00", "session-00-think"])
def test_reasoning_strip_keeps_only_the_newest_reasoning(name: str) -> None:
    """Only the newest assistant message keeps reasoning_content or its <think> block."""
    transcript = load_named(name)
    client = ReasoningStripClient()
    for step in range(2, len(transcript.steps)):
        assistants = [m for m in client.messages(transcript, step) if m["role"] == "assistant"]
        reasoning = [bool(m.get("reasoning_content")) or "<think>" in (m.get("content") or "")
                     for m in assistants]
        assert reasoning == [False] * (len(assistants) - 1) + [True]
    assert len(rewritten_steps(all_requests(client, transcript))) == len(transcript.steps) - 2


def test_sliding_window_cuts_old_results_relative_to_the_end(session: Transcript) -> None:
    """Results before the last 6 messages are 400-char prefixes; the window is untouched."""
    client = SlidingWindowClient()
    trimmed_somewhere = False
    for step in range(len(session.steps)):
        sent, true = client.messages(session, step), session.history_before(step)
        for index, (message, original) in enumerate(zip(sent, true, strict=True)):
            if message["role"] != "tool" or index >= len(sent) - KEEP_LAST:
                assert message == original
                continue
            assert message["content"] == original["content"][:TRIM_TO]
            trimmed_somewhere |= len(original["content"]) > TRIM_TO
    assert trimmed_somewhere


def test_prune_clears_old_outputs_and_protects_the_last_two_user_turns(
        session: Transcript) -> None:
    """Cleared outputs become the exact marker; the last two user turns are never cleared."""
    client = PruneClient()
    last = client.messages(session, len(session.steps) - 1)
    cleared = [m for m in last if m["role"] == "tool" and m["content"] == CLEARED]
    assert cleared
    users = [i for i, m in enumerate(last) if m["role"] == "user"]
    assert all(m["content"] != CLEARED for m in last[users[-2]:] if m["role"] == "tool")
    rewrites = rewritten_steps(all_requests(client, session))
    assert 0 < len(rewrites) < len(session.steps) // 2  # rare, as in OpenCode


def test_compaction_drops_the_oldest_messages_within_budget(session: Transcript) -> None:
    """System kept, tail within budget, never starts on a tool result, cut moves forward."""
    client = CompactionClient()
    dropped = []
    for step in range(len(session.steps)):
        sent, true = client.messages(session, step), session.history_before(step)
        assert sent[0] == true[0]
        assert sent[1:] == true[len(true) - len(sent) + 1:]
        if len(sent) < len(true):
            assert sent[1]["role"] != "tool"
            assert sum(message_tokens(m) for m in sent[1:]) <= BUDGET_TOKENS
        dropped.append(len(true) - len(sent))
    assert dropped[-1] > 0
    assert dropped == sorted(dropped)


def test_volatile_system_changes_only_the_first_line(session: Transcript) -> None:
    """Each request's system prompt starts with a fresh cch= nonce; the rest is unchanged."""
    client = VolatileSystemClient()
    systems = [client.messages(session, step)[0]["content"] for step in range(4)]
    firsts = [s.split("\n", 1)[0] for s in systems]
    assert len(set(firsts)) == 4
    assert all("cch=" in line for line in firsts)
    assert {s.split("\n", 1)[1] for s in systems} == {session.messages[0]["content"]}


def _names(tools: list[dict[str, Any]]) -> list[str]:
    return [tool["function"]["name"] for tool in tools]


def test_tools_reorder_permutes_tools_and_reserializes_old_arguments(
        session: Transcript) -> None:
    """The tool order changes every request; older call arguments are compact, sorted JSON."""
    client = ToolsReorderClient()
    orders = [_names(client.tools(session, step)) for step in range(len(session.steps))]
    assert all(a != b for a, b in itertools.pairwise(orders))
    assert all(sorted(order) == sorted(_names(list(session.tools))) for order in orders)
    step = len(session.steps) - 1
    sent, true = client.messages(session, step), session.history_before(step)
    newest = max(i for i, m in enumerate(true) if m["role"] == "assistant")
    changed = 0
    for index, (message, original) in enumerate(zip(sent, true, strict=True)):
        for call, raw in zip(message.get("tool_calls", []), original.get("tool_calls", []),
                             strict=True):
            args, model_args = call["function"]["arguments"], raw["function"]["arguments"]
            if index == newest:
                assert args == model_args
                continue
            assert args == json.dumps(json.loads(model_args), sort_keys=True,
                                      separators=(",", ":"))
            changed += args != model_args
    assert changed > 0


def test_interleaved_schedule_round_robins_more_sessions_than_slots() -> None:
    """Six sessions take turns one request at a time, each extending only its own history."""
    scenario = SCENARIOS["interleaved"]
    transcripts = {name: load_named(name) for name in scenario.sessions}
    requests = scenario.schedule(transcripts, 3)
    assert len(scenario.sessions) == 6
    assert [r.session for r in requests[:6]] == list(scenario.sessions)
    assert [r.step for r in requests] == [0] * 6 + [1] * 6 + [2] * 6
    verify("interleaved", False, requests)


def test_timeout_client_resumes_late_and_resends(session: Transcript) -> None:
    """The first request is a long prompt; every request carries the resend policy."""
    step = resume_step(session)
    assert step > 0
    request = TimeoutResendClient().request(session, step)
    assert request.first_token_timeout_s is not None
    assert request.max_attempts > 1
    history = request.body["messages"]
    assert sum(message_tokens(m) for m in history) >= RESUME_AT_TOKENS * 0.6
    assert request.body == ExtendOnlyClient().request(session, step).body


def test_requests_are_deterministic_greedy_short_streams(session: Transcript) -> None:
    """Same input, same body; streaming with usage, greedy, a few tokens, session headers."""
    for scenario in SCENARIOS.values():
        transcript = load_named(scenario.sessions[0])
        first = scenario.client.request(transcript, 3)
        assert first == scenario.client.request(transcript, 3)
        body = first.body
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["temperature"] == 0
        assert body["max_tokens"] == MAX_TOKENS
        assert first.headers["x-session-id"] == f"ses_{transcript.name}"
