"""Did the run reproduce the regime it claims? Checked on the wire, not from client rules.

A request *extends* the previous request of its session when its tools are equal and its
messages start with exactly the previous messages. Anything else rewrote history. The
check compares that with what each client claims turn by turn, and refuses runs that
claim a rewriting class but never rewrote (too few turns) or rewrote without saying so.
The other regimes are checked on the engine and the results: more sessions than slots,
and a resend that really happened.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from bench.clients.base import Request
from bench.scenarios import Scenario
from bench.transcript import JSON


class SlotCounter(Protocol):
    def total_slots(self) -> int: ...


class RegimeError(RuntimeError):
    """The run did not reproduce the client behaviour its scenario claims."""


@dataclass(frozen=True, slots=True)
class Observed:
    session: str
    step: int
    claimed: bool
    rewrote: bool
    first_difference: str  # "" for an extension


def first_difference(previous: JSON, current: JSON) -> str:
    """Where ``current`` stops extending ``previous`` ("" when it extends it)."""
    if previous.get("tools") != current.get("tools"):
        return "tools"
    before, after = previous["messages"], current["messages"]
    if len(after) < len(before):
        return f"messages shortened from {len(before)} to {len(after)}"
    for index, (old, new) in enumerate(zip(before, after, strict=False)):
        if old != new:
            fields = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
            return f"message {index} ({old.get('role')}): {', '.join(fields)}"
    return ""


def observe(requests: Iterable[Request]) -> list[Observed]:
    """Each request against the previous request of the same session, in send order."""
    previous: dict[str, Request] = {}
    observed = []
    for request in requests:
        before = previous.get(request.session)
        where = first_difference(before.body, request.body) if before else ""
        observed.append(Observed(request.session, request.step, request.claims_rewrite,
                                 rewrote=bool(where), first_difference=where))
        previous[request.session] = request
    return observed


def verify(scenario: str, rewrites: bool, requests: list[Request]) -> list[Observed]:
    """Raise ``RegimeError`` unless the wire shows exactly the rewrites the client claims."""
    observed = observe(requests)
    problems = [_mismatch(o) for o in observed if o.claimed != o.rewrote]
    if rewrites and not any(o.rewrote for o in observed):
        problems.append("no request rewrote the history it extends; run more --turns")
    if problems:
        raise RegimeError(f"scenario {scenario}: " + "; ".join(problems))
    return observed


def _mismatch(o: Observed) -> str:
    if o.claimed:
        return f"{o.session} step {o.step} claims a rewrite but extends the previous request"
    return f"{o.session} step {o.step} rewrote history without claiming it ({o.first_difference})"


def check_slots(scenario: Scenario, engine: SlotCounter) -> None:
    if scenario.needs_more_sessions_than_slots:
        slots = engine.total_slots()
        if len(scenario.sessions) <= slots:
            raise RegimeError(f"scenario {scenario.name} needs more sessions than slots: "
                              f"{len(scenario.sessions)} sessions, {slots} slots")


def check_resends(scenario: Scenario, rows: list[dict[str, Any]], baseline: str) -> None:
    if scenario.needs_resend and not any(r["attempts"] > 1 for r in rows
                                         if r["arm"] == baseline):
        raise RegimeError(f"scenario {scenario.name}: no request of the baseline arm "
                          f"{baseline} timed out and was resent; the prefill was too short")
