"""Honest figures and reasons: whatever an engine reports and whatever a client sends, the
proxy's cache figures never underflow or overstate (no negative counts, never more cached
than prompted, no NaN timings) and its reasons never say what is not so ("diverged at
message 5 of 4", a char index past the message, "resumed" for a history that diverged).

Property tests over every path that produces them: the figures of a generation (usage,
timings, progress, and none of them), the usage added to a frame or a folded body, the
prefill progress in heartbeats, the slot ledger's prefix breaks, history verdicts for
chat and raw prompts, and the affinity planner's decisions over random conversations
(its early returns included: resume, rewind, decline, no candidate).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixpin.adapters.base import Capabilities, Frame, FrameKind, Progress
from prefixpin.adapters.openai_sse import parse_progress
from prefixpin.core.figures import Figures, figures_from, with_cached_tokens
from prefixpin.proxy.codecs import codec_of
from prefixpin.proxy.listen.tenants import ANONYMOUS
from prefixpin.proxy.ops.metrics import Metrics
from prefixpin.proxy.pipeline.aggregate import aggregate
from prefixpin.proxy.pipeline.generation import Generation
from prefixpin.proxy.pipeline.records import Backend, Incoming, Outcome
from prefixpin.proxy.pipeline.relay import _ensure_usage, heartbeat_text
from prefixpin.proxy.pipeline.service import PREFIX_BREAK_SLACK, SlotLedger
from prefixpin.proxy.pipeline.validation import parse_request
from prefixpin.proxy.session.affinity import AffinityPlanner
from prefixpin.proxy.session.history import Committed, DigestMemo, canonical, decide, digest
from prefixpin.proxy.session.placement import SlotPool
from prefixpin.proxy.session.repair import RepairConfig, Repairer
from prefixpin.proxy.session.sessions import SessionStore

PROPERTY = settings(max_examples=300, deadline=None)

# What an engine may put where a count belongs: counts, but also negatives, floats, NaN,
# strings, booleans, nulls and containers.
JUNK = (st.integers(-10**9, 10**9) | st.floats() | st.text(max_size=5) | st.booleans()
        | st.none() | st.lists(st.integers(), max_size=2) | st.dictionaries(
            st.text(max_size=3), st.integers(), max_size=2))
COUNT = st.integers(0, 10**6)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A value from ``strategy``, junk, or the key left out (``...``)."""
    return strategy | JUNK | st.just(...)


def mapping(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    def build(values: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in values.items() if v is not ...}
    return st.fixed_dictionaries({k: maybe(v) for k, v in fields.items()}).map(build) | JUNK


USAGE = mapping(prompt_tokens=COUNT, completion_tokens=COUNT,
                prompt_tokens_details=mapping(cached_tokens=COUNT))
TIMINGS = mapping(prompt_n=COUNT, cache_n=COUNT, predicted_n=COUNT,
                  prompt_ms=st.floats(0, 10**6))
PROGRESS_JSON = mapping(total=COUNT, cache=COUNT, processed=COUNT, time_ms=st.floats(0, 1e6))


@st.composite
def engine_frames(draw: st.DrawFn) -> tuple[list[Frame], Progress | None]:
    """The data-bearing frames of a generation as an engine might send them."""
    frames = []
    for _ in range(draw(st.integers(0, 3))):
        data = {k: v for k, v in (("usage", draw(maybe(USAGE))),
                                  ("timings", draw(maybe(TIMINGS)))) if v is not ...}
        data["choices"] = draw(st.sampled_from([[], [{"index": 0, "delta": {}}]]))
        kind = FrameKind.USAGE if data["choices"] == [] else FrameKind.CHUNK
        frames.append(Frame(kind, b"data: " + json.dumps(data).encode() + b"\n\n", data))
    progress = parse_progress(draw(PROGRESS_JSON))
    return frames, progress


def assert_honest(figures: Figures) -> None:
    for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
        value = getattr(figures, name)
        assert value is None or (type(value) is int and value >= 0), (name, figures)
    if figures.cached_tokens is not None and figures.prompt_tokens is not None:
        assert figures.cached_tokens <= figures.prompt_tokens, figures
    if figures.prompt_ms is not None:
        assert math.isfinite(figures.prompt_ms), figures
        assert figures.prompt_ms >= 0, figures
    fraction = figures.cached_fraction
    assert fraction is None or 0.0 <= fraction <= 1.0, figures


@PROPERTY
@given(engine_frames())
def test_figures_never_underflow_or_overstate_whatever_the_engine_sends(
        case: tuple[list[Frame], Progress | None]) -> None:
    """Counts are non-negative integers, cached never exceeds prompt, timings are finite;
    an engine sending junk in a field makes that figure unknown, never a crash."""
    frames, progress = case
    assert_honest(figures_from(frames, progress))


@PROPERTY
@given(prompt=COUNT, cached=COUNT, completion=COUNT, prompt_ms=st.floats(0, 1e6))
def test_consistent_engine_figures_are_reported_as_they_are(
        prompt: int, cached: int, completion: int, prompt_ms: float) -> None:
    """Honest both ways: when the engine's own figures are consistent, they are the
    proxy's figures exactly (clamping never hides a true value)."""
    cached = min(cached, prompt)
    data = {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                     "prompt_tokens_details": {"cached_tokens": cached}},
            "timings": {"prompt_ms": prompt_ms, "cache_n": cached,
                        "prompt_n": prompt - cached, "predicted_n": completion}}
    figures = figures_from([Frame(FrameKind.USAGE, b"", data)], None)
    assert figures == Figures(prompt, cached, prompt_ms, completion)


@PROPERTY
@given(engine_frames())
def test_usage_added_to_a_frame_is_never_more_than_the_prompt(
        case: tuple[list[Frame], Progress | None]) -> None:
    """The usage chunk a client asked for gets cached_tokens when the engine left it
    out: within [0, prompt tokens], and the frame is still one JSON event."""
    frames, progress = case
    for frame in frames:
        out = with_cached_tokens(frame, frames, progress)
        payload = json.loads(out.raw[len(b"data: "):])
        usage = payload.get("usage")
        if out is frame:
            continue  # the engine's own frame, passed on byte for byte
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        prompt = figures_from([*frames, frame], progress).prompt_tokens
        assert type(cached) is int
        assert 0 <= cached <= (prompt if prompt is not None else cached)


@PROPERTY
@given(engine_frames())
def test_a_folded_body_gets_consistent_usage(case: tuple[list[Frame], Progress | None]) -> None:
    """A non-streaming client's usage: never a crash; what the proxy fills in (a total,
    cached tokens) agrees with the counts beside it; the engine's own fields stay."""
    frames, progress = case
    body = aggregate(frames, chat=True)
    engine = dict(body.get("usage") or {})
    engine_details = engine.get("prompt_tokens_details")
    _ensure_usage(body, cast(Generation, SimpleNamespace(frames=frames, progress=progress)))
    usage = body["usage"]
    kept = {k: v for k, v in engine.items() if k != "prompt_tokens_details"}
    assert {k: usage[k] for k in kept} == kept
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if "total_tokens" not in engine and "total_tokens" in usage:
        assert usage["total_tokens"] == int(prompt) + int(completion)
    if not (isinstance(engine_details, Mapping) and "cached_tokens" in engine_details):
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 0
        if type(prompt) is int and prompt >= 0:
            assert cached <= prompt


@PROPERTY
@given(PROGRESS_JSON, st.booleans())
def test_progress_reports_and_heartbeats_stay_within_the_prompt(
        raw: Any, generating: bool) -> None:
    """A progress report says at most the whole prompt was processed or cached; the
    heartbeat text built from it says the same."""
    progress = parse_progress(raw)
    if progress is None:
        return
    assert 0 <= progress.cache <= progress.total
    assert 0 <= progress.processed <= progress.total
    assert math.isfinite(progress.time_ms)
    generation = SimpleNamespace(waiting=None, timeline=SimpleNamespace(
        first_output=1.0 if generating else None))
    text = heartbeat_text(progress, cast(Generation, generation))
    if match := re.fullmatch(r"prefill (\d+)/(\d+) cached (\d+)", text):
        processed, total, cache = map(int, match.groups())
        assert processed <= total
        assert cache <= total


@PROPERTY
@given(st.lists(st.tuples(st.integers(0, 3), maybe(COUNT), maybe(COUNT)), max_size=30))
def test_prefix_breaks_are_never_negative_nor_more_than_the_slot_held(
        records: list[tuple[int, Any, Any]]) -> None:
    """The slot ledger's shortfall is past the slack and at most the previous prompt."""
    ledger = SlotLedger()
    for slot, prompt, cached in records:
        figures = figures_from([Frame(FrameKind.USAGE, b"", {"choices": [], "usage": {
            "prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": cached}}})],
                               None)
        previous = ledger.prompts.get(("engine", slot))
        shortfall = ledger.record("engine", slot, figures)
        if shortfall is not None:
            assert previous is not None
            assert PREFIX_BREAK_SLACK < shortfall <= previous
        assert all(v >= 0 for v in ledger.prompts.values())


# -- history verdicts -------------------------------------------------------------------

MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]),
                                 "content": st.text("ab<>/thk", max_size=6)})


@st.composite
def history_pairs(draw: st.DrawFn) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A committed history and the next request: extended, repeated, cut, edited, with
    messages dropped or inserted."""
    committed = draw(st.lists(MESSAGE, min_size=1, max_size=6))
    incoming = [dict(m) for m in committed]
    for _ in range(draw(st.integers(0, 3))):
        edit = draw(st.sampled_from(["append", "drop", "insert", "edit", "cut"]))
        position = draw(st.integers(0, max(0, len(incoming) - 1)))
        if edit == "append" or not incoming:
            incoming.append(draw(MESSAGE))
        elif edit == "drop" and len(incoming) > 1:
            del incoming[position]
        elif edit == "insert":
            incoming.insert(position, draw(MESSAGE))
        elif edit == "edit":
            incoming[position] = {**incoming[position], "content": draw(st.text("abz",
                                                                               max_size=6))}
        elif edit == "cut":
            incoming = incoming[:position + 1]
    return committed, incoming


def assert_reason_true(reason: str, committed: list[Any], incoming: list[Any]) -> None:
    """Every number a chat verdict's reason states is so."""
    if match := re.search(r"diverged at message (\d+)(?:, char (\d+))? \(of committed "
                          r"(\d+) messages", reason):
        index, char = int(match.group(1)), match.group(2)
        assert int(match.group(3)) == len(committed), reason
        assert index <= min(len(committed), len(incoming)), reason
        assert committed[:index] == incoming[:index], reason
        if index < min(len(committed), len(incoming)):
            assert committed[index] != incoming[index], reason
            if char is not None:
                old, new = canonical(committed[index]), canonical(incoming[index])
                assert int(char) <= min(len(old), len(new)), reason
                assert old[:int(char)] == new[:int(char)], reason
        else:
            assert len(incoming) < len(committed), reason  # "shorter"
    elif reason.startswith("extends"):
        assert incoming[:len(committed)] == committed, reason
        assert len(incoming) > len(committed), reason
    elif reason.startswith("identical"):
        assert incoming == committed, reason
    else:
        pytest.fail(f"unexpected reason {reason!r}")


@PROPERTY
@given(history_pairs())
def test_chat_verdict_reasons_state_only_what_is_so(
        pair: tuple[list[dict[str, Any]], list[dict[str, Any]]]) -> None:
    """'diverged at message i, char c (of committed n messages)': n is the committed
    count, the histories agree before i and differ at i, the char index is inside both."""
    committed, incoming = pair
    verdict = decide(Committed.of_chat({"messages": committed}), {"messages": incoming})
    assert_reason_true(verdict.reason(), committed, incoming)
    assert verdict.resumable == (incoming[:len(committed)] == committed)


@PROPERTY
@given(committed=st.text("ab", min_size=1, max_size=8), incoming=st.text("ab", max_size=10))
def test_prompt_verdict_reasons_speak_of_characters_not_messages(
        committed: str, incoming: str) -> None:
    """A raw prompt has no messages: its reason names the first differing character,
    within both prompts, and never 'message 0 of committed 0 messages'."""
    verdict = decide(Committed.of_completion({"prompt": committed}), {"prompt": incoming})
    reason = verdict.reason()
    assert "message" not in reason, reason
    if incoming == committed:
        assert verdict.identical
    elif incoming.startswith(committed):
        assert verdict.extends
    else:
        match = re.search(r"prompt diverged at char (\d+) \(of committed (\d+) chars", reason)
        assert match, reason
        char = int(match.group(1))
        assert int(match.group(2)) == len(committed)
        assert char <= min(len(committed), len(incoming))
        assert committed[:char] == incoming[:char]


# -- the planner's decisions ------------------------------------------------------------

class _Adapter:
    name = "stub"
    capabilities = Capabilities(slots=True)


@pytest.mark.parametrize("repair", [False, True])
@settings(max_examples=60, deadline=None)
@given(turns=st.lists(st.tuples(st.sampled_from(["A", "B", None]), history_pairs()),
                      min_size=1, max_size=6))
def test_planner_decisions_and_reasons_agree(
        repair: bool,
        turns: list[tuple[str | None, tuple[list[dict[str, Any]], list[dict[str, Any]]]]],
        ) -> None:
    """Over random conversations (keyed and keyless, extended, repeated and rewritten):
    'resumed' only with a reason that extends or repeats the committed history, every
    decline's and rewind's reason true of the two histories it names."""
    asyncio.run(_run_planner(repair, turns))


async def _run_planner(repair: bool, turns: list[tuple[str | None, tuple[
        list[dict[str, Any]], list[dict[str, Any]]]]]) -> None:
    store = SessionStore()
    repairer = Repairer(RepairConfig.from_switches({}), lambda m: 10 * len(m)) if repair \
        else None
    planner = AffinityPlanner(store, SlotPool(2), Metrics(), None, logging.getLogger("t"),
                              repairer)
    backend = Backend("engine", cast(Any, _Adapter()))
    for key, (first, second) in turns:
        for messages in (first, second):
            headers = {"x-session-id": key} if key else {}
            client = parse_request(json.dumps({"messages": messages}).encode(), "chat",
                                   "/v1/chat/completions", max_messages=100)
            before = {s.id: s.committed for s in store}
            plan = await planner.plan(Incoming.of(client, codec_of(client), headers, ANONYMOUS,
                                                  memo=DigestMemo()),
                                      backend)
            session = store.get(plan.session or "")
            assert session is not None
            _check_decision(session.last_decision, session.last_reason, before, session.id,
                            plan.body["messages"])
            planner.commit(plan, Outcome(True, Figures(10, 5, 1.0, 1), 1.0))


def _check_decision(decision: str, reason: str, before: Mapping[str, Committed | None],
                    session_id: str, forwarded: list[Any]) -> None:
    if decision == "resumed":
        committed = before.get(session_id)
        assert committed is not None, reason
        assert reason.startswith(("extends", "identical")), reason
        assert tuple(digest(m) for m in forwarded[:len(committed.digests)]) \
            == committed.digests, reason
    elif decision == "rewound":
        committed = before.get(session_id)
        assert committed is not None, reason
        assert_reason_true(reason.split(";")[0], list(committed.messages), forwarded)
    elif decision == "declined":
        match = re.match(r"declined (s\d+): (.*)", reason)
        assert match, reason
        declined = before.get(match.group(1))
        assert declined is not None, reason
        if not match.group(2).startswith("request fields"):
            assert_reason_true(match.group(2), list(declined.messages), forwarded)
    else:
        assert (decision, reason) == ("new", "no candidate")
