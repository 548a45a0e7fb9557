"""A lane: one engine behind the router, with its own request path, slot pool, planner,
parking and watch. A single engine is a router with one lane; several engines, and several
replicas sharing state in Redis, are the same router with more lanes (``proxy.pipeline.router``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response

from prefixpin.adapters.base import Adapter, EngineInfo
from prefixpin.proxy.engine.watch import EngineWatch
from prefixpin.proxy.ops.metrics import Metrics
from prefixpin.proxy.pipeline.generation import Generation
from prefixpin.proxy.pipeline.inflight import InFlight
from prefixpin.proxy.pipeline.records import Backend, Incoming, Load
from prefixpin.proxy.pipeline.service import LanePolicies, ProxyService
from prefixpin.proxy.session.placement import SlotPool
from prefixpin.proxy.settings import Settings

if TYPE_CHECKING:  # the redis package is only needed with --redis
    from prefixpin.proxy.cluster.core import Cluster
    from prefixpin.proxy.cluster.sessions import SharedSessions
    from prefixpin.proxy.engine.engine_facts import ServerFlags
    from prefixpin.proxy.engine.ollama import OllamaPlanner
    from prefixpin.proxy.parking import ParkManager
    from prefixpin.proxy.parking.anchor import Anchorer
    from prefixpin.proxy.parking.openings import Openings


NOT_PROBED = ("assumed shared: the engine has not answered yet (llama-server's host prompt "
              "cache, --cache-ram, is on by default and every Ollama shares cached prefixes)")


@dataclass(frozen=True, slots=True)
class SharedState:
    """What replicas share (``--redis``): the connection, and the session table on it."""

    cluster: Cluster
    sessions: SharedSessions


@dataclass(slots=True)
class Lane:
    """One engine, whole: its adapter and what it reported (``backend``), its request path
    (``service``: the pipeline with the policies its kind switched on), its watch, and what
    the router reads of it. Built by ``Lane.open``; the rest of the proxy reads the engine
    through the lane, never through its parts."""

    label: str  # host:port of the engine, or "embedded"
    url: str | None  # None: the in-process engine
    service: ProxyService
    watch: EngineWatch
    ready: bool = False  # the engine answered once and its policies are on
    # A dedicated backend (--upstreams-file namespace=): only these namespaces are placed
    # here; empty: any namespace.
    namespaces: frozenset[str] = frozenset()
    # Why the engine's prompt cache crosses slots (a tenant could then read another's
    # cached prefixes), or None when it does not: known once the engine answers
    # (``proxy.engine.engines.read_engine``), assumed until then.
    shared_cache: str | None = NOT_PROBED
    # The engine's flags from its command line (llama-server on this host), read once per
    # engine start by ``proxy.engine.engines.read_engine``; None: not readable here.
    flags: ServerFlags | None = None
    # The engine's chat template refuses a system message after the first position (Qwen3.x):
    # such messages are rendered in place as user turns (``proxy.pipeline.system_turns``).
    mid_system_in_place: bool = False

    @classmethod
    def open(cls, settings: Settings, metrics: Metrics, logger: logging.Logger, *,
             label: str, url: str | None, adapter: Adapter, inflight: InFlight,
             engine_credentials: dict[str, str] | None) -> Lane:
        """The lane of one engine, built whole: its backend, watch and request path (its
        policies pass-through until the engine answers and its kind switches them on)."""
        backend = Backend(label=label, adapter=adapter, engine_credentials=engine_credentials)
        service = ProxyService(settings, backend, metrics, logger=logger, inflight=inflight)
        watch = EngineWatch(backend, metrics, interval_s=settings.health_interval_s,
                            probe_timeout_s=settings.probe_timeout_s, logger=logger,
                            streaming_since=service.streaming_since,
                            prefilling_since=service.prefilling_since)
        service.on_upstream_lost = watch.suspect

        async def forget_prompts(before: EngineInfo, after: EngineInfo) -> None:
            service.ledger.forget(label)  # a restarted engine's slots hold nothing

        watch.on_restart.append(forget_prompts)
        lane = cls(label, url, service, watch)
        if url is None:  # the embedded engine keeps no prompt cache across slots
            lane.shared_cache = None
        else:
            lane.namespaces = frozenset(settings.upstream_namespaces.get(url, ()))
        return lane

    @property
    def backend(self) -> Backend:
        """The engine's adapter (swapped when a restarted engine is another kind) and
        what it last reported."""
        return self.service.backend

    @property
    def adapter(self) -> Adapter:
        return self.service.backend.adapter

    @property
    def policies(self) -> LanePolicies:
        return self.service.policies

    @property
    def pool(self) -> SlotPool | None:
        return self.service.pool

    @property
    def generations(self) -> set[Generation]:
        return self.service.generations

    async def handle(self, request: Request, incoming: Incoming) -> Response:
        return await self.service.handle(request, incoming)

    async def aclose(self) -> None:
        """The request path's generations, then the engine connection."""
        await self.service.aclose()
        await self.adapter.aclose()

    @property
    def up(self) -> bool:
        """Placement's view: a lane whose engine just dropped a stream is taken for down
        until the watch's probe, already under way, says otherwise (a crashed engine
        must not get the next new session in the meantime)."""
        return self.ready and self.watch.reachable and not self.watch.suspected

    def down_reason(self) -> str:
        if not self.ready:
            return "engine not answering since start-up"
        if self.watch.reachable:
            return "engine dropped a stream (being probed)"
        return "engine unreachable (health check)"

    def adopt(self, policies: LanePolicies) -> None:
        """Switch the lane's request path to ``policies``, all at once."""
        self.service.policies = policies

    @property
    def parking(self) -> ParkManager | None:
        return self.policies.parking

    @property
    def anchorer(self) -> Anchorer | None:  # recurrent/hybrid memory: idle slots anchored
        return self.policies.anchorer

    @property
    def openings(self) -> Openings | None:  # new sessions start from their namespace's opening
        return self.policies.openings

    @property
    def models(self) -> OllamaPlanner | None:  # an engine with a model lifecycle (Ollama)
        return self.policies.models

    @property
    def slots(self) -> int:
        info = self.backend.info
        return max(1, info.n_slots) if info is not None else 1

    async def load(self) -> Load:
        if (load_of := self.policies.load_of) is not None:  # the shared slot table's
            return await load_of()
        pool = self.pool
        if pool is None:
            return Load(self.slots, len(self.generations), 0)
        return Load(len(pool.entries), pool.busy, pool.waiting)
