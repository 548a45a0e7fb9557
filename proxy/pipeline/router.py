"""The one request path for every topology: a single engine is a router with one lane;
several engines, and several replicas sharing state in Redis, are the same router with more
lanes.

    request ─► read + parse once (the route's wire format) ─► namespace
            ─► placement (several lanes: proxy.engine.backends) ─► the lane's ProxyService
               (identity, repair, slot pinning, the queue, parking, join in flight,
               heartbeats, figures: proxy.pipeline.service and the planners of proxy.engine.engines)

Each lane runs one task: probe its engine until it answers, switch on what its engine kind
supports (``proxy.engine.engines``), then watch it. Paths the pipeline does not own go to the first
lane that answers (``proxy.listen.passthrough``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import traceback
from collections.abc import Mapping
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response

from prefixpin.adapters.base import Adapter
from prefixpin.core.cpu import crash_advice
from prefixpin.core.errors import (
    BodiesFullError,
    ProxyError,
    UpstreamError,
)
from prefixpin.proxy.codecs import Codec
from prefixpin.proxy.engine.backends import Choice, Homes, MemoryHomes, Placer, session_identity
from prefixpin.proxy.engine.engines import (
    LaneContext,
    http_client,
    kind_of,
    label_of,
    open_embedded_adapter,
    open_url_adapter,
    read_engine,
    redetect,
)
from prefixpin.proxy.engine.lane import Lane, SharedState
from prefixpin.proxy.engine.ollama import lifecycle
from prefixpin.proxy.engine.watch import probe_until_ready
from prefixpin.proxy.listen.isolation import ApiNotServedError, NamespaceNotServedError, refusal
from prefixpin.proxy.listen.tenants import Tenants
from prefixpin.proxy.ops.logs import log_event
from prefixpin.proxy.ops.metrics import Metrics
from prefixpin.proxy.pipeline.body_memo import BodyMemo
from prefixpin.proxy.pipeline.inflight import InFlight
from prefixpin.proxy.pipeline.records import Incoming
from prefixpin.proxy.pipeline.shared import SharedStateError
from prefixpin.proxy.pipeline.system_turns import SystemTurns
from prefixpin.proxy.pipeline.validation import BodyBudget, ClientRequest, read_body
from prefixpin.proxy.session.affinity import planned_body
from prefixpin.proxy.session.history import DigestMemo
from prefixpin.proxy.session.sessions import SessionStore
from prefixpin.proxy.settings import EMBEDDED, Settings

# Bodies up to this size are parsed on the loop (a long agent history is ~150 kB: a few ms);
# larger ones in a thread.
PARSE_ON_LOOP_BYTES = 1 << 20


class Router:
    def __init__(self, ctx: LaneContext, lanes: list[Lane], placer: Placer,
                 inflight: InFlight, tenants: Tenants, bodies: BodyBudget) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.metrics = ctx.metrics
        self.log = ctx.logger
        self.store = ctx.store
        self.shared = ctx.shared
        self.lanes = lanes
        self.placer = placer
        self.inflight = inflight
        self.errors: tuple[type[BaseException], ...] = (
            ctx.shared.cluster.errors if ctx.shared is not None else ())
        self.first_probe = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.tenants = tenants
        self.bodies = bodies  # --max-bodies: every body's bytes while it is read and parsed
        self.digests = DigestMemo()  # the messages of recent requests (Incoming.of)
        self.resent = BodyMemo()  # the parses of recent bodies, for the turns resending them
        self.system_turns = SystemTurns()  # mid-conversation system messages, rewritten

    # -- the request path -------------------------------------------------------------

    async def handle(self, request: Request, codec: Codec) -> Response:
        """A request on a route of the pipeline, answered in its wire format (its codec),
        errors included."""
        try:
            lanes = [lane for lane in self.lanes
                     if codec.engine_api in kind_of(lane.adapter).serves]
            if not lanes:  # never forwarded: see ApiNotServedError
                raise ApiNotServedError(f"{request.method} {request.url.path}: no engine "
                                        f"behind this port serves the {codec.api} API")
            headers = headers_of(request)
            namespace = self._namespace(headers, codec)  # before the body is read
            raw, client = await self._parse(request, headers, codec)
            if client.lifecycle:  # Ollama's model load or unload, to a lane that answers
                # and that this namespace may use: an unload empties every session's cache
                lanes = self._lanes_for(namespace, client, lanes)
                lane = next((ln for ln in lanes if ln.up), lanes[0])
                return await lifecycle(lane.adapter.http, lane.models,
                                       request, client, raw,
                                       engine_key=self.tenants.configured)
            return await self._serve(request, headers, namespace, client, codec, lanes)
        except ProxyError as exc:
            # The frames the error came through hold what they read (a body, its parse):
            # let go of them now, not when the collector finds the cycle they make with it.
            traceback.clear_frames(exc.__traceback__)
            return codec.error_response(exc)

    def _namespace(self, headers: Mapping[str, str], codec: Codec) -> str:
        try:
            return self.tenants.namespace_of(headers)
        except ProxyError:
            self.metrics.requests.labels(codec.endpoint, "unauthorized", codec.api).inc()
            raise

    async def _parse(self, request: Request, headers: Mapping[str, str],
                     codec: Codec) -> tuple[bytes, ClientRequest]:
        """The body read and parsed once, for the whole request path. Its bytes count in
        ``self.bodies`` (``--max-bodies``) until this returns, whatever way it returns."""
        try:
            with self.bodies.reservation() as held:
                raw = await read_body(request.stream(), headers.get("content-length"),
                                      self.settings.max_body_bytes, held,
                                      max_values=self.settings.max_json_values)
                # The route's own path (``scope["path"]``: what ``request.url.path`` gives
                # for every route of the pipeline, without building the whole URL).
                path = request.scope["path"]
                if len(raw) <= PARSE_ON_LOOP_BYTES:
                    return raw, codec.parse(raw, path, max_messages=self.settings.max_messages,
                                            memo=self.resent)
                # A large body's checks are Python code: in a thread, the loop keeps
                # serving every other tenant between its bytecodes.
                return raw, await asyncio.to_thread(codec.parse, raw, path,
                                                    max_messages=self.settings.max_messages,
                                                    memo=self.resent)
        except ProxyError as exc:
            busy = isinstance(exc, BodiesFullError)
            self.metrics.requests.labels(codec.endpoint, "bodies_full" if busy
                                         else "client_error", codec.api).inc()
            if exc.limit is not None:
                self.metrics.limit_refusals.labels(exc.limit).inc()
            raise

    async def _serve(self, request: Request, headers: Mapping[str, str], namespace: str,
                     client: ClientRequest, codec: Codec, lanes: list[Lane]) -> Response:
        try:
            lanes = self._lanes_for(namespace, client, lanes)
            placement, moved = None, False
            lane = lanes[0]
            if len(lanes) > 1:
                choice = await self._place(namespace, client, headers, lanes)
                lane, placement, moved = choice.lane, choice.reason, choice.moved
        except self.errors as exc:
            self.metrics.requests.labels(client.endpoint, "upstream_error", client.api).inc()
            raise SharedStateError(f"shared state (Redis) unreachable: {exc}") from None
        except ProxyError:
            self.metrics.requests.labels(client.endpoint, "client_error", client.api).inc()
            raise
        if lane.mid_system_in_place and (
                rewritten := self.system_turns.in_place(client.body.get("messages"))):
            client = dataclasses.replace(client, body={**client.body, "messages": rewritten})
        incoming = Incoming.of(client, codec, headers, namespace, placement, moved,
                               memo=self.digests)
        return await lane.handle(request, incoming)

    def _gated(self, lane: Lane) -> bool:
        """Whether ``lane`` serves none of several tenants: its cache crosses slots, and
        the operator neither dedicated it (``namespace=``) nor allowed the sharing."""
        return (lane.shared_cache is not None and not lane.namespaces
                and not self.settings.allow_shared_cache and self.tenants.count > 1)

    def _lanes_for(self, namespace: str, client: ClientRequest,
                   lanes: list[Lane]) -> list[Lane]:
        """The lanes ``namespace`` may be placed on (``proxy.listen.isolation``): not dedicated
        to other namespaces, and no prompt cache shared with other tenants."""
        mine = [ln for ln in lanes if not ln.namespaces or namespace in ln.namespaces]
        if not mine:
            raise NamespaceNotServedError(
                f"namespace {namespace} is not served here: every backend for this API is "
                "dedicated to other namespaces (namespace= in the --upstreams-file)")
        allowed: list[Lane] = []
        refused: list[tuple[str, str]] = []
        for lane in mine:
            if self._gated(lane):
                refused.append((lane.label, lane.shared_cache or ""))
            else:
                allowed.append(lane)
        if not allowed:
            log_event(self.log, logging.WARNING, "namespace refused", namespace=namespace,
                      endpoint=client.endpoint, reason="shared prompt cache",
                      upstreams=[label for label, _ in refused])
            raise refusal(namespace, refused)
        return allowed

    async def _place(self, namespace: str, client: ClientRequest,
                     headers: Mapping[str, str], lanes: list[Lane]) -> Choice:
        # an infill request is placed by its context chunks, as it is planned (its prompt
        # is the cursor's line)
        identity = session_identity(namespace, planned_body(client.path, client.body), headers)
        choice = await self.placer.choose(identity, lanes)  # Redis errors: see _serve
        if choice.moved:
            log_event(self.log, logging.WARNING, "session moved", identity=identity,
                      upstream=choice.lane.label, reason=choice.reason)
        return choice

    def lane_for_passthrough(self) -> Lane:
        """Paths the proxy does not own go to the first lane that answers (in the order
        the upstreams were given)."""
        return next((lane for lane in self.lanes if lane.up), self.lanes[0])

    # -- views ------------------------------------------------------------------------

    async def health(self) -> list[dict[str, Any]]:
        """Every lane probed now (concurrently, each within the probe deadline)."""
        return list(await asyncio.gather(*(self._lane_health(lane) for lane in self.lanes)))

    async def _lane_health(self, lane: Lane) -> dict[str, Any]:
        backend = lane.backend
        entry: dict[str, Any] = {"label": lane.label, "engine": backend.adapter.name}
        found = await lane.watch.check()  # the watch learns what the check learns
        if (fault := backend.adapter.fault()) is not None:
            entry["fault"] = fault
        if isinstance(found, UpstreamError):
            entry.update(status="unreachable", error=found.message,
                         down_since=lane.watch.down_since, hint=crash_advice())
        else:
            entry.update(status="ok", model=found.model, slots=found.n_slots,
                         n_ctx_slot=found.n_ctx_slot, build=found.build)
        entry.update(self._isolation_view(lane))
        return entry

    def _isolation_view(self, lane: Lane) -> dict[str, Any]:
        """Whether the lane's prompt cache crosses slots (the reason), whether it then
        serves no tenant (several configured, none dedicated), and the namespaces a
        dedicated backend serves."""
        return {"shared_cache": lane.shared_cache, "gated": self._gated(lane),
                "namespaces": sorted(lane.namespaces) or None}

    def sessions_view(self) -> dict[str, Any]:
        backends = []
        for lane in self.lanes:
            pool = lane.pool
            backends.append({
                "upstream": lane.label, "engine": lane.adapter.name,
                "up": lane.up,
                "slots": [{"slot": e.index, "session": e.occupant, "kind": e.kind,
                           "tokens": e.tokens, "busy": e.busy} for e in pool.entries]
                if pool else [],
                "parking": lane.parking.parked_view() if lane.parking is not None else None,
                **self._isolation_view(lane),
            })
        return {"affinity": any(lane.pool is not None for lane in self.lanes),
                "placement": self.settings.placement if len(self.lanes) > 1 else None,
                "backends": backends, "slots": backends[0]["slots"],
                "parking": backends[0]["parking"],
                "namespaces": {ns: [s.view() for s in sessions]
                               for ns, sessions in self.store.namespaces().items()}}

    @property
    def replica(self) -> str | None:
        return self.shared.cluster.replica if self.shared is not None else None

    # -- lanes --------------------------------------------------------------------------

    def start(self) -> None:
        for lane in self.lanes:
            task = asyncio.create_task(self._run_lane(lane), name=f"prefixpin-lane-{lane.label}")
            task.add_done_callback(self._lane_ended)
            self._tasks.append(task)

    def _lane_ended(self, task: asyncio.Task[None]) -> None:
        """A lane's task ends only at shutdown; anything else is a bug, said loudly (the
        lane keeps serving with whatever policies were on)."""
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.log.error("lane task failed", exc_info=exc,
                           extra={"fields": {"task": task.get_name()}})
            self.first_probe.set()

    async def _run_lane(self, lane: Lane) -> None:
        """Probe the lane's engine until it answers, switch on what its kind supports,
        then watch it; a clean exit parks the lane's idle slots."""
        settings, logger, backend = self.settings, self.log, lane.backend

        async def not_ready() -> None:
            if all(not ln.ready for ln in self.lanes):
                self.first_probe.set()  # nothing answers yet: serve (and fail) meanwhile
            backend.adapter = await redetect(settings, backend.adapter, logger, lane.label)

        info = await probe_until_ready(backend, self.metrics, settings.probe_timeout_s,
                                       logger, not_ready)
        await read_engine(lane, info, logger)
        try:
            if settings.affinity:
                await kind_of(backend.adapter).sessions_on(self.ctx, lane, info)
            else:
                log_event(logger, logging.INFO, "affinity off", upstream=lane.label,
                          reason="PREFIXPIN_AFFINITY=0")
            lane.ready = True
            self.first_probe.set()
            await lane.watch.run()
        finally:
            if lane.anchorer is not None:
                await lane.anchorer.aclose()
            if lane.openings is not None:
                await lane.openings.aclose()
            if lane.parking is not None:  # a clean shutdown parks idle slots
                await lane.parking.aclose(lane.pool)

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for lane in self.lanes:
            await lane.aclose()
        if self.shared is not None:
            await self.inflight.aclose()  # type: ignore[attr-defined]
            await self.shared.cluster.aclose()


def headers_of(request: Request) -> dict[str, str]:
    """The request's headers as a plain dict, built once: names as the server gives them
    (lower case), the first value of a repeated header (what Starlette's ``Headers.get``
    returns). The request path looks up some twenty of them, each a scan of the whole
    header list on Starlette's ``Headers``."""
    return {name.decode("latin-1"): value.decode("latin-1")
            for name, value in reversed(request.scope["headers"])}


async def open_router(settings: Settings, metrics: Metrics, logger: logging.Logger, *,
                      bodies: BodyBudget,
                      transports: Mapping[str, httpx.AsyncBaseTransport] | None = None,
                      transport: httpx.AsyncBaseTransport | None = None) -> Router:
    """A lane for every upstream (or the embedded engine when none is given), the shared
    stores (Redis when configured), and a task per lane that brings its policies up.
    ``bodies``: the tenant listener's budget of request-body bytes (``--max-bodies``).

    ``transports``: per upstream URL, and ``transport`` for any other, for tests and
    benches that serve engines in process."""
    tenants = Tenants(settings.tenants_file, logger)  # a bad file: an error at start
    shared: SharedState | None = None
    homes: Homes
    if settings.redis is not None:
        # Imported here: only a replica configured with Redis needs the `redis` package.
        from prefixpin.proxy.cluster.core import Cluster
        from prefixpin.proxy.cluster.homes import RedisHomes
        from prefixpin.proxy.cluster.inflight import ClusterInFlight
        from prefixpin.proxy.cluster.sessions import SharedSessions, new_session_id

        cluster = Cluster(settings.redis, settings.redis_prefix, settings.replica_id, logger)
        await cluster.start()
        store = SessionStore.from_settings(settings, new_id=new_session_id)
        shared = SharedState(cluster, SharedSessions(
            cluster, store, logger,
            max_per_namespace=settings.max_shared_sessions_per_namespace))
        homes = RedisHomes(cluster, settings.live_session_s)
        inflight: InFlight = ClusterInFlight(cluster, logger, grace_s=settings.retry_grace_s)
        await inflight.start()  # type: ignore[attr-defined]
    else:
        store = SessionStore.from_settings(settings)
        homes = MemoryHomes(settings.live_session_s)
        inflight = InFlight()
    ctx = LaneContext(settings, store, metrics, logger, shared)
    adapters = await _open_adapters(settings, logger, transports or {}, transport,
                                    shared.cluster.replica if shared is not None else None)
    lanes = [Lane.open(settings, ctx.metrics, ctx.logger, label=label, url=url, adapter=adapter,
                       inflight=inflight,
                       engine_credentials=engine_credentials(settings, url))
             for label, url, adapter in adapters]
    problem = _lanes_problem(settings, lanes)
    if problem is not None:
        for _, _, adapter in adapters:
            await adapter.aclose()
        raise ValueError(problem)
    router = Router(ctx, lanes, Placer(settings, homes), inflight, tenants, bodies)
    router.start()
    return router


async def _open_adapters(settings: Settings, logger: logging.Logger,
                         transports: Mapping[str, httpx.AsyncBaseTransport],
                         transport: httpx.AsyncBaseTransport | None, replica: str | None
                         ) -> list[tuple[str, str | None, Adapter]]:
    urls = settings.backend_urls()
    if not urls:  # the embedded engine; a test's in-process engine over its transport
        urls = ["http://engine.invalid"] if transport is not None else [EMBEDDED]

    async def one(url: str) -> tuple[str, str | None, Adapter]:
        if url == EMBEDDED:
            return _embedded_label(replica), None, await open_embedded_adapter(settings)
        http = http_client(settings, url, transports.get(url, transport))
        return label_of(url), url, await open_url_adapter(settings, http, logger)

    return list(await asyncio.gather(*(one(url) for url in urls)))


def _lanes_problem(settings: Settings, lanes: list[Lane]) -> str | None:
    if len({lane.label for lane in lanes}) != len(lanes):
        return "two upstreams with the same host:port"
    stray = set(settings.upstream_namespaces) - {lane.url for lane in lanes}
    if stray:
        return f"namespaces given for backends that are not upstreams: {sorted(stray)}"
    return None


def engine_credentials(settings: Settings, url: str | None) -> dict[str, str] | None:
    """With configured tenants, what a client's request carries to the engine instead of
    its own key: the engine's key, or nothing; None without tenants (the client's own)."""
    if settings.tenants_file is None:
        return None
    key = settings.engine_key_for(url) if url is not None else None
    return {"authorization": f"Bearer {key}"} if key is not None else {}


def _embedded_label(replica: str | None) -> str:
    """An embedded engine is its own process's: with replicas, each has its own lane."""
    return EMBEDDED if replica is None else f"{EMBEDDED}-{replica}"

