"""Several backends: each session lives on one engine and stays there while its cache is
useful (``--upstream`` repeated, or ``--upstreams-file``).

    request ─► session identity ─► placement ─► that backend's lane: its own adapter, slot
                                                pool, engine watch, planner and metrics label

Identity: namespace + explicit session key; without a key, namespace + the digests of the
first two messages (system prompt and first user turn), or of a raw prompt's first 1024
characters. Sub-agents with their own key are their own identity.

Placement (``--placement affinity``, the default):

1. an identity with a *home* (the backend its session was placed on) stays there while that
   backend answers its health checks and has fewer than ``--overload-queue`` requests
   waiting for a slot;
2. a home backend that is down (its engine watch lost it) or overloaded: the session moves
   to the next backend in its rendezvous order that is neither, re-primes there, and its
   decision reason says so (``re-primed on B: backend A down (...)``); it then stays on B;
3. a new identity: backends in rendezvous (highest-random-weight) order of the identity,
   each weighted by its slots times its free share (``slots * max(0.05, 1 - occupancy)``,
   occupancy = live sessions homed there / slots); the first one whose live sessions are
   below ``slots * --overload-occupancy`` takes it, else the first in order.

Every replica computes the same order from the same identity and (with ``--redis``) reads
the same homes, loads and slot tables, so replicas agree without talking to each other.
``round-robin`` and ``least-loaded`` (fewest leased + queued slots per slot) are the bench's
baselines: same lanes and slot affinity inside a backend, only the backend choice differs.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import blake3

from prefixpin.proxy.pipeline.records import Load
from prefixpin.proxy.session.history import digest
from prefixpin.proxy.session.identity import explicit_identity
from prefixpin.proxy.settings import Settings

if TYPE_CHECKING:
    from prefixpin.proxy.engine.lane import Lane

MIN_WEIGHT_SHARE = 0.05
RAW_PROMPT_ANCHOR = 1024

class Homes(Protocol):
    async def get(self, identity: str) -> str | None: ...

    async def assign(self, identity: str, ranked: Sequence[tuple[str, float]]) -> str: ...

    async def touch(self, identity: str, label: str) -> None: ...

    async def counts(self, labels: Sequence[str]) -> dict[str, int]: ...


class MemoryHomes:
    """One process's homes (no Redis): identity -> backend, and last use per backend."""

    def __init__(self, live_s: float, clock: Callable[[], float] | None = None) -> None:
        import time

        self.live_s = live_s
        self._clock = clock or time.monotonic
        self._home: dict[str, str] = {}
        self._used: dict[str, dict[str, float]] = {}

    async def get(self, identity: str) -> str | None:
        return self._home.get(identity)

    async def assign(self, identity: str, ranked: Sequence[tuple[str, float]]) -> str:
        chosen = next((label for label, capacity in ranked
                       if self._live(label) < capacity), ranked[0][0])
        old = self._home.get(identity)
        if old is not None and old != chosen:
            self._used.get(old, {}).pop(identity, None)
        await self.touch(identity, chosen)
        return chosen

    async def touch(self, identity: str, label: str) -> None:
        self._home[identity] = label
        self._used.setdefault(label, {})[identity] = self._clock()

    async def counts(self, labels: Sequence[str]) -> dict[str, int]:
        return {label: self._live(label) for label in labels}

    def _live(self, label: str) -> int:
        cutoff = self._clock() - self.live_s
        used = self._used.get(label, {})
        for identity in [i for i, at in used.items() if at < cutoff]:
            del used[identity]
        return len(used)


def session_identity(namespace: str, body: Mapping[str, Any],
                     headers: Mapping[str, str]) -> str:
    """What places a session: a short hex digest (it names Redis keys)."""
    explicit = explicit_identity(body, headers)
    hasher = blake3.blake3(namespace.encode() + b"\0")
    if explicit is not None:
        hasher.update(b"key\0" + explicit.key.encode())
    elif isinstance(messages := body.get("messages"), list) and messages:
        hasher.update(b"messages\0")
        for message in messages[:2]:
            hasher.update(digest(message))
    else:
        prompt = body.get("prompt")
        text = prompt if isinstance(prompt, str) else repr(prompt)
        hasher.update(b"prompt\0" + text[:RAW_PROMPT_ANCHOR].encode())
    return hasher.hexdigest()[:32]


def rendezvous(identity: str, weights: Mapping[str, float]) -> list[str]:
    """Labels in weighted highest-random-weight order for ``identity``: each label scores
    ``-w / ln(u)``, ``u`` uniform in (0, 1) from a hash of identity and label, so a label's
    chance of ranking first is proportional to its weight, and removing a label moves only
    the identities that ranked it first."""
    def score(label: str) -> float:
        h = int.from_bytes(blake3.blake3(f"{identity}\0{label}".encode()).digest(8), "big")
        u = (h + 0.5) / 2.0**64
        return -max(weights[label], 1e-9) / math.log(u)

    return sorted(weights, key=lambda label: (-score(label), label))


@dataclass(frozen=True, slots=True)
class Choice:
    lane: Lane
    reason: str
    moved: bool = False


@dataclass(slots=True)
class Placer:
    settings: Settings
    homes: Homes
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    async def choose(self, identity: str, lanes: Sequence[Lane]) -> Choice:
        """Among ``lanes`` (every lane, or those serving the request's API)."""
        up = [lane for lane in lanes if lane.up]
        if not up:
            return Choice(lanes[0], "no backend answering: tried the first")
        mode = self.settings.placement
        if mode == "round-robin":
            lane = up[next(self._turn) % len(up)]
            return Choice(lane, f"round-robin: {lane.label}")
        if mode == "least-loaded":
            loads = await _loads(up)
            lane = min(up, key=lambda ln: ((loads[ln.label].busy + loads[ln.label].queued)
                                           / loads[ln.label].slots, ln.label))
            return Choice(lane, f"least-loaded: {lane.label}")
        return await self._affinity(identity, up, lanes)

    async def _affinity(self, identity: str, up: list[Lane], lanes: Sequence[Lane]) -> Choice:
        by_label = {lane.label: lane for lane in lanes}
        limit = self.settings.overload_queue
        home = await self.homes.get(identity)
        lane = by_label.get(home) if home is not None else None
        if lane is not None and lane.up:  # the common case: one backend's load is enough
            queued = (await lane.load()).queued
            if queued < limit:
                await self.homes.touch(identity, lane.label)
                return Choice(lane, f"stays on {lane.label}")
        loads = await _loads(up)
        if lane is not None:
            if lane.up:
                why = (f"backend {lane.label} overloaded ({loads[lane.label].queued} requests "
                       f"queued >= --overload-queue {limit})")
                others = [ln for ln in up if ln is not lane and loads[ln.label].queued < limit]
                if not others:
                    await self.homes.touch(identity, lane.label)
                    return Choice(lane, f"stays on {lane.label}: every backend is overloaded")
            else:
                why = f"backend {lane.label} down ({lane.down_reason()})"
                others = [ln for ln in up if ln is not lane]
            chosen = await self._place(identity, others, loads)
            return Choice(chosen, f"re-primed on {chosen.label}: {why}", moved=True)
        candidates = [ln for ln in up if loads[ln.label].queued < limit] or up
        chosen = await self._place(identity, candidates, loads)
        return Choice(chosen, f"placed on {chosen.label} (rendezvous)")

    async def _place(self, identity: str, candidates: list[Lane],
                     loads: dict[str, Load]) -> Lane:
        labels = [lane.label for lane in candidates]
        live = await self.homes.counts(labels)
        slots = {label: loads[label].slots for label in labels}
        weights = {label: slots[label] * max(MIN_WEIGHT_SHARE,
                                              1 - live[label] / slots[label])
                   for label in labels}
        order = rendezvous(identity, weights)
        share = self.settings.overload_occupancy
        chosen = await self.homes.assign(identity, [(label, slots[label] * share)
                                                    for label in order])
        return next(lane for lane in candidates if lane.label == chosen)


async def _loads(lanes: list[Lane]) -> dict[str, Load]:
    values = await asyncio.gather(*(lane.load() for lane in lanes))
    return dict(zip([lane.label for lane in lanes], values, strict=True))
