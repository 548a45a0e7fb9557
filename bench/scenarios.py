"""The bench scenarios: a client, the sessions it replays, and the order of its requests.

``default_turns`` keeps each scenario to a few minutes per run on two CPU cores (SmolLM2
prefills ~200 tok/s cold): scenarios whose direct arm re-prefills everything every turn
get fewer turns. ``--turns`` overrides it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bench.clients.base import Client, Request
from bench.clients.compaction import CompactionClient
from bench.clients.extend_only import ExtendOnlyClient
from bench.clients.interleaved import SESSIONS, InterleavedClient
from bench.clients.prune import PruneClient
from bench.clients.reasoning_strip import ReasoningStripClient
from bench.clients.sliding_window import SlidingWindowClient
from bench.clients.timeout_resend import TimeoutResendClient, resume_step
from bench.clients.tools_reorder import ToolsReorderClient
from bench.clients.volatile_system import VolatileSystemClient
from bench.transcript import Transcript

ALL = 20  # every step of a session (the transcripts have 12-14)


def _from_start(transcript: Transcript) -> int:
    return 0


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    client: Client
    sessions: tuple[str, ...]
    default_turns: int
    first_step: Callable[[Transcript], int] = _from_start
    interleave: bool = False  # round-robin across sessions instead of one after another
    needs_more_sessions_than_slots: bool = False
    needs_resend: bool = False

    def schedule(self, transcripts: dict[str, Transcript], turns: int) -> list[Request]:
        """Every request of one rep, in the order they are sent."""
        per_session = []
        for name in self.sessions:
            transcript = transcripts[name]
            first = self.first_step(transcript)
            last = min(first + turns, len(transcript.steps))
            per_session.append([self.client.request(transcript, step)
                                for step in range(first, last)])
        if not self.interleave:
            return [request for requests in per_session for request in requests]
        rounds = max(len(requests) for requests in per_session)
        return [requests[i] for i in range(rounds) for requests in per_session
                if i < len(requests)]


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("extend-only", ExtendOnlyClient(), ("session-00",), ALL),
    Scenario("reasoning-strip", ReasoningStripClient(), ("session-00",), ALL),
    Scenario("think-strip", ReasoningStripClient(), ("session-00-think",), ALL),
    Scenario("sliding-window", SlidingWindowClient(), ("session-00",), ALL),
    Scenario("prune", PruneClient(), ("session-00",), ALL),
    Scenario("compaction", CompactionClient(), ("session-00",), ALL),
    # These two re-prefill the whole prompt every turn without help: 5 turns is ~11k tokens.
    Scenario("volatile-system", VolatileSystemClient(), ("session-00",), 5),
    Scenario("tools-reorder", ToolsReorderClient(), ("session-00",), 5),
    Scenario("interleaved", InterleavedClient(),
             tuple(f"session-{i:02d}" for i in range(SESSIONS)), 4,
             interleave=True, needs_more_sessions_than_slots=True),
    Scenario("timeout-resend", TimeoutResendClient(), ("session-01",), 3,
             first_step=resume_step, needs_resend=True),
)}
