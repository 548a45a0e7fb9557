"""The harness's own regime checks: a run that does not rewrite cannot claim to."""

from __future__ import annotations

from typing import ClassVar

import pytest

from bench.arms import Arm, rep_order
from bench.clients.base import Client, Request
from bench.clients.extend_only import ExtendOnlyClient
from bench.clients.reasoning_strip import ReasoningStripClient
from bench.clients.sliding_window import SlidingWindowClient
from bench.rewrite_check import (
    RegimeError,
    check_resends,
    check_slots,
    first_difference,
    verify,
)
from bench.scenarios import SCENARIOS
from bench.transcript import Message, Transcript, load_named


@pytest.fixture(scope="module")
def session() -> Transcript:
    return load_named("session-00")


class ClaimsButExtends(ExtendOnlyClient):
    """A broken client: says it rewrites history on every turn but only extends it."""

    name: ClassVar[str] = "claims-but-extends"
    rewrites: ClassVar[bool] = True

    def claims_rewrite(self, transcript: Transcript, step: int) -> bool:
        return True


class SilentRewriter(Client):
    """A broken client: rewrites the first user message every turn and never says so."""

    name: ClassVar[str] = "silent"

    def messages(self, transcript: Transcript, step: int) -> list[Message]:
        messages = super().messages(transcript, step)
        messages[1]["content"] += f" (attempt {step})"
        return messages


def requests_of(client: Client, transcript: Transcript, turns: int) -> list[Request]:
    return [client.request(transcript, step) for step in range(turns)]


def test_a_claimed_rewrite_that_only_extends_fails_the_run(session: Transcript) -> None:
    """Claiming a rewrite the wire does not show raises, naming the turn."""
    with pytest.raises(RegimeError, match="step 1 claims a rewrite but extends"):
        verify("x", True, requests_of(ClaimsButExtends(), session, 5))


def test_a_rewriting_scenario_with_no_rewrite_fails_the_run(session: Transcript) -> None:
    """Too few turns for the client to rewrite anything: the run is refused."""
    requests = requests_of(ReasoningStripClient(), session, 2)
    with pytest.raises(RegimeError, match="no request rewrote"):
        verify("reasoning-strip", True, requests)


def test_an_unclaimed_rewrite_fails_the_run(session: Transcript) -> None:
    """Rewriting history without claiming it is also a wrong regime."""
    with pytest.raises(RegimeError, match=r"rewrote history without claiming it \(message 1"):
        verify("silent", False, requests_of(SilentRewriter(), session, 3))


def test_a_real_rewrite_passes_and_is_located(session: Transcript) -> None:
    """The sliding-window client passes and the check names the first changed message."""
    observed = verify("sliding-window", True, requests_of(SlidingWindowClient(), session, 8))
    rewrites = [o for o in observed if o.rewrote]
    assert rewrites
    assert all(o.first_difference.startswith("message ") and "(tool): content" in
               o.first_difference for o in rewrites)


def test_first_difference_cases() -> None:
    """Tools first, then shortened lists, then the first differing message and fields."""
    message = {"role": "user", "content": "a"}
    base = {"tools": [1], "messages": [message]}
    assert first_difference(base, {"tools": [1], "messages": [message, {}]}) == ""
    assert first_difference(base, {"tools": [2], "messages": base["messages"]}) == "tools"
    assert "shortened" in first_difference(base, {"tools": [1], "messages": []})
    edited = {"tools": [1], "messages": [{"role": "user", "content": "b"}]}
    assert first_difference(base, edited) == "message 0 (user): content"


def test_sessions_are_compared_with_their_own_previous_request() -> None:
    """Interleaved sessions are each an extension of themselves, not of each other."""
    scenario = SCENARIOS["interleaved"]
    transcripts = {name: load_named(name) for name in scenario.sessions}
    observed = verify("interleaved", False, scenario.schedule(transcripts, 2))
    assert not any(o.rewrote for o in observed)


class FakeEngine:
    def __init__(self, slots: int) -> None:
        self.slots = slots

    def total_slots(self) -> int:
        return self.slots


def test_interleaving_needs_more_sessions_than_slots() -> None:
    """Six sessions on eight slots is not the eviction regime: refused."""
    scenario = SCENARIOS["interleaved"]
    check_slots(scenario, FakeEngine(2))
    with pytest.raises(RegimeError, match="more sessions than slots"):
        check_slots(scenario, FakeEngine(8))


def test_timeout_scenario_needs_a_resend_in_the_baseline_arm() -> None:
    """A timeout run in which nothing timed out did not reproduce the regime."""
    scenario = SCENARIOS["timeout-resend"]
    rows = [{"arm": "direct", "attempts": 1}, {"arm": "proxy", "attempts": 3}]
    with pytest.raises(RegimeError, match="no request of the baseline arm direct"):
        check_resends(scenario, rows, "direct")
    check_resends(scenario, [*rows, {"arm": "direct", "attempts": 2}], "direct")


def test_reps_rotate_the_arm_order() -> None:
    """No arm always goes first: A B, B A, A B, ..."""
    arms = [Arm("a", "u"), Arm("b", "v")]
    orders = [[arm.name for arm in rep_order(arms, rep)] for rep in range(4)]
    assert orders == [["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]]
