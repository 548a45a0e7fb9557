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
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import blake3
import httpx
from starlette.requests import Request
from starlette.responses import Response

from adapters.base import EngineInfo
from adapters.llama_server import LlamaServerAdapter
from proxy.affinity import AffinityPlanner
from core.errors import ProxyError
from proxy.history import digest
from proxy.identity import explicit_identity, namespace_of
from proxy.implicit import Fingerprinter, load_fingerprinter
from proxy.inflight import InFlight
from proxy.logs import log_event
from proxy.metrics import Metrics
from proxy.placement import Lease, SlotPool
from proxy.repair import Repairer
from proxy.service import Backend, Outcome, Plan, Planner, ProxyService
from proxy.sessions import SessionStore
from proxy.settings import Settings
from proxy.validation import ClientRequest, Endpoint, parse_request, read_body
from proxy.watch import EngineWatch, probe_until_ready

PLACEMENT_STATE = "prefixpin_placement"  # request.state attribute the lane planner reads
MIN_WEIGHT_SHARE = 0.05
RAW_PROMPT_ANCHOR = 1024

RepairerFactory = Callable[[Settings, Fingerprinter | None, logging.Logger], Repairer | None]


class SharedStateError(ProxyError):
    """Redis (the state replicas share) did not answer: the request is refused rather than
    decided on state this replica cannot check."""

    status_code = 503
    error_type = "server_busy"
    code = "shared_state_unavailable"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "2"}


@dataclass(frozen=True, slots=True)
class Load:
    """What placement weighs: slots, those leased now, requests waiting for one."""

    slots: int
    busy: int
    queued: int


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


@dataclass(slots=True)
class Lane:
    """One backend: its own service (adapter, slot pool, planner), watch and label."""

    label: str
    url: str
    service: ProxyService
    watch: EngineWatch | None = None
    ready: bool = False
    load_of: Callable[[], Awaitable[Load]] | None = None

    @property
    def up(self) -> bool:
        return self.ready and (self.watch is None or self.watch.reachable)

    def down_reason(self) -> str:
        if not self.ready:
            return "engine not answering since start-up"
        return "engine unreachable (health check)"

    @property
    def slots(self) -> int:
        info = self.service.backend.info
        return max(1, info.n_slots) if info is not None else 1

    async def load(self) -> Load:
        if self.load_of is not None:
            return await self.load_of()
        pool = self.service.pool
        if pool is None:
            return Load(self.slots, len(self.service.generations), 0)
        return Load(len(pool.entries), sum(1 for e in pool.entries if e.busy), pool.waiting)


@dataclass(frozen=True, slots=True)
class Choice:
    lane: Lane
    reason: str
    moved: bool = False


@dataclass(slots=True)
class Placer:
    settings: Settings
    lanes: list[Lane]
    homes: Homes
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    async def choose(self, identity: str) -> Choice:
        up = [lane for lane in self.lanes if lane.up]
        if not up:
            return Choice(self.lanes[0], "no backend answering: tried the first")
        mode = self.settings.placement
        if mode == "round-robin":
            lane = up[next(self._turn) % len(up)]
            return Choice(lane, f"round-robin: {lane.label}")
        if mode == "least-loaded":
            loads = await _loads(up)
            lane = min(up, key=lambda ln: ((loads[ln.label].busy + loads[ln.label].queued)
                                           / loads[ln.label].slots, ln.label))
            return Choice(lane, f"least-loaded: {lane.label}")
        return await self._affinity(identity, up)

    async def _affinity(self, identity: str, up: list[Lane]) -> Choice:
        by_label = {lane.label: lane for lane in self.lanes}
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


class LanePlanner:
    """A lane's planner: notes the placement in the decision, keeps a moved session's
    reason honest, and (with Redis) reads sessions before planning and writes them at
    commit."""

    def __init__(self, inner: Planner, label: str, store: SessionStore,
                 shared: Any | None = None, refresh: Callable[[], Awaitable[None]] | None = None
                 ) -> None:
        self.inner = inner
        self.label = label
        self.store = store
        self.shared = shared  # proxy.cluster.sessions.SharedSessions
        self.refresh = refresh
        self.errors: tuple[type[BaseException], ...] = (
            shared.cluster.errors if shared is not None else ())

    async def plan(self, client: ClientRequest, request: Request, backend: Backend) -> Plan:
        try:
            if self.shared is not None:
                explicit = explicit_identity(client.body, request.headers)
                await self.shared.hydrate(namespace_of(request.headers),
                                          explicit.key if explicit else None)
            if self.refresh is not None:
                await self.refresh()  # the slot table, as other replicas left it
        except self.errors as exc:
            raise SharedStateError(f"shared state (Redis) unreachable: {exc}") from None
        plan = await self.inner.plan(client, request, backend)
        choice: Choice | None = getattr(request.state, PLACEMENT_STATE, None)
        if choice is not None:
            plan.notes["placement"] = choice.reason
            session = self.store.get(plan.session) if plan.session else None
            if session is not None and choice.moved:
                session.last_reason = f"{session.last_reason}; {choice.reason}"
                plan.notes["reason"] = session.last_reason
        return plan

    async def on_lease(self, plan: Plan, lease: Lease) -> None:
        await self.inner.on_lease(plan, lease)

    def commit(self, plan: Plan, outcome: Outcome) -> None:
        self.inner.commit(plan, outcome)
        session = self.store.get(plan.session) if plan.session else None
        if session is None or not outcome.ok:
            return
        session.backend = self.label
        if self.shared is not None:
            self.shared.publish(session)


class Router:
    """The routed request path: placement first, then the chosen lane's service."""

    def __init__(self, settings: Settings, lanes: list[Lane], placer: Placer,
                 store: SessionStore, metrics: Metrics, logger: logging.Logger,
                 inflight: InFlight, cluster: Any | None = None) -> None:
        self.settings = settings
        self.lanes = lanes
        self.placer = placer
        self.store = store
        self.metrics = metrics
        self.log = logger
        self.inflight = inflight
        self.cluster = cluster  # proxy.cluster.core.Cluster
        self.errors: tuple[type[BaseException], ...] = (
            cluster.errors if cluster is not None else ())
        self.first_probe = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def lane_for_passthrough(self) -> Lane:
        """Paths the proxy does not own go to the first backend that answers (in the order
        the upstreams were given)."""
        return next((lane for lane in self.lanes if lane.up), self.lanes[0])

    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        try:
            raw = await read_body(request.stream(), request.headers.get("content-length"),
                                  self.settings.max_body_bytes)
            client = parse_request(raw, endpoint, request.url.path,
                                   max_messages=self.settings.max_messages)
        except ProxyError:
            self.metrics.requests.labels(endpoint, "client_error").inc()
            raise
        identity = session_identity(namespace_of(request.headers), client.body,
                                    request.headers)
        try:
            choice = await self.placer.choose(identity)
        except self.errors as exc:
            self.metrics.requests.labels(endpoint, "upstream_error").inc()
            raise SharedStateError(f"shared state (Redis) unreachable: {exc}") from None
        setattr(request.state, PLACEMENT_STATE, choice)
        if choice.moved:
            log_event(self.log, logging.WARNING, "session moved", identity=identity,
                      upstream=choice.lane.label, reason=choice.reason)
        return await choice.lane.service.handle(request, endpoint, raw=raw)

    def start(self, run_lane: Callable[[Lane], Coroutine[Any, Any, None]]) -> None:
        for lane in self.lanes:
            self._tasks.append(asyncio.create_task(run_lane(lane),
                                                   name=f"prefixpin-lane-{lane.label}"))

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for lane in self.lanes:
            await lane.service.aclose()
            await lane.service.backend.adapter.aclose()
        if self.cluster is not None:
            await self.inflight.aclose()  # type: ignore[attr-defined]
            await self.cluster.aclose()

    def health(self) -> list[dict[str, Any]]:
        out = []
        for lane in self.lanes:
            info = lane.service.backend.info
            entry: dict[str, Any] = {"label": lane.label,
                                     "engine": lane.service.backend.adapter.name,
                                     "status": "ok" if lane.up else "unreachable"}
            if info is not None:
                entry.update(model=info.model, slots=info.n_slots, n_ctx_slot=info.n_ctx_slot)
            out.append(entry)
        return out


def label_of(url: str) -> str:
    return httpx.URL(url).netloc.decode() or url


async def open_router(settings: Settings, metrics: Metrics, logger: logging.Logger,
                      make_client: Callable[[str], httpx.AsyncClient],
                      repairer: RepairerFactory) -> Router:
    """Lanes for every upstream, the shared stores (Redis when configured), and a task per
    lane that probes its engine and switches its policies on."""
    cluster: Any | None = None
    shared_sessions: Any | None = None
    if settings.redis is not None:
        # Imported here: only a replica configured with Redis needs the `redis` package.
        from proxy.cluster.core import Cluster
        from proxy.cluster.homes import RedisHomes
        from proxy.cluster.inflight import ClusterInFlight
        from proxy.cluster.sessions import SharedSessions, new_session_id

        cluster = Cluster(settings.redis, settings.redis_prefix, settings.replica_id, logger)
        await cluster.start()
        store = SessionStore(new_id=new_session_id)
        shared_sessions = SharedSessions(cluster, store, logger)
        homes: Homes = RedisHomes(cluster, settings.live_session_s)
        inflight: InFlight = ClusterInFlight(cluster, logger, grace_s=settings.retry_grace_s)
        await inflight.start()  # type: ignore[attr-defined]
    else:
        store = SessionStore()
        homes = MemoryHomes(settings.live_session_s)
        inflight = InFlight()
    lanes = []
    for url in settings.backend_urls():
        label = label_of(url)
        adapter = LlamaServerAdapter(make_client(url))
        service = ProxyService(settings, Backend(label=label, adapter=adapter), metrics,
                               logger=logger)
        service.inflight = inflight
        lanes.append(Lane(label, url, service))
    if len({lane.label for lane in lanes}) != len(lanes):
        raise ValueError("two upstreams with the same host:port")
    placer = Placer(settings, lanes, homes)
    router = Router(settings, lanes, placer, store, metrics, logger, inflight, cluster)

    async def run_lane(lane: Lane) -> None:
        await _run_lane(router, lane, shared_sessions, repairer)

    router.start(run_lane)
    return router


async def _run_lane(router: Router, lane: Lane, shared_sessions: Any | None,
                    repairer: RepairerFactory) -> None:
    """Probe the lane's engine until it answers, switch affinity on, then watch it."""
    settings, logger = router.settings, router.log
    backend = lane.service.backend

    def not_ready() -> None:
        if all(not ln.ready for ln in router.lanes):
            router.first_probe.set()  # nothing answers yet: serve (and fail) anyway

    info = await probe_until_ready(lane.service, settings.probe_timeout_s, logger, not_ready)
    watch = EngineWatch(lane.service, settings.health_interval_s, logger)
    lane.watch = watch
    lane.service.on_upstream_lost = watch.suspect
    if settings.affinity and backend.adapter.capabilities.slots:
        await _affinity_on(router, lane, info, shared_sessions, repairer)
    else:
        log_event(logger, logging.INFO, "affinity off", upstream=lane.label,
                  reason="PREFIXPIN_AFFINITY=0" if not settings.affinity
                  else f"{info.engine} does not let the proxy choose slots")
    lane.ready = True
    router.first_probe.set()
    await watch.run()


async def _affinity_on(router: Router, lane: Lane, info: EngineInfo,
                       shared_sessions: Any | None, repairer: RepairerFactory) -> None:
    settings, logger = router.settings, router.log
    fingerprinter = await load_fingerprinter(settings.tokenizer, info.props, logger)
    pool: SlotPool
    refresh: Callable[[], Awaitable[None]] | None = None
    if router.cluster is not None:
        from proxy.cluster.slots import SharedSlotPool

        shared_pool = SharedSlotPool(router.cluster, lane.label, info.n_slots, logger)
        await shared_pool.adopt_engine(info)
        pool, refresh = shared_pool, shared_pool.recent
        lane.load_of = shared_pool.load
    else:
        pool = SlotPool(info.n_slots)
    lane.service.pool = pool
    planner = AffinityPlanner(router.store, pool, router.metrics, fingerprinter, logger,
                              repairer(settings, fingerprinter, logger),
                              budget_tokens=info.n_ctx_slot or None)
    lane.service.planner = LanePlanner(planner, lane.label, router.store, shared_sessions,
                                       refresh)
    assert lane.watch is not None

    async def restarted(before: EngineInfo, after: EngineInfo) -> None:
        if router.cluster is not None:
            await pool.adopt_engine(after)  # type: ignore[attr-defined]
        await planner.engine_restarted(before, after)

    def lost(reason: str) -> None:
        for session in router.store:
            if session.backend == lane.label:
                session.last_decision, session.last_reason = "unverified", reason

    lane.watch.on_restart.append(restarted)
    lane.watch.on_lost.append(lost)
    log_event(logger, logging.INFO, "affinity on", upstream=lane.label, slots=info.n_slots,
              implicit=fingerprinter is not None, shared=router.cluster is not None)
