"""The request path for completions, from parsed body to relayed answer and recorded figures.

    parse + validate ─► plan (identity, repair, placement) ─► generation ─► relay
                                                              └─► on finish: figures,
                                                                  metrics, log, commit

Planning is delegated to a ``Planner``: the pass-through planner here forwards the body as
is; session affinity, history repair and parking plug in as richer planners.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from prefixpin.adapters.base import UpstreamCall, UpstreamStream
from prefixpin.core.errors import (
    ClientError,
    GenerationCancelledError,
    ProxyError,
    QueueTimeoutError,
    UpstreamUnavailableError,
)
from prefixpin.core.figures import Figures, figures_from
from prefixpin.proxy.codecs import Codec
from prefixpin.proxy.listen.tenants import CREDENTIAL_HEADERS
from prefixpin.proxy.ops.logs import get_logger, log_event
from prefixpin.proxy.ops.metrics import Metrics
from prefixpin.proxy.pipeline.generation import Generation
from prefixpin.proxy.pipeline.inflight import InFlight, JoinIntent, inflight_key
from prefixpin.proxy.pipeline.records import Backend, Incoming, Load, Outcome, Plan, Planner
from prefixpin.proxy.pipeline.relay import respond
from prefixpin.proxy.pipeline.validation import ClientRequest
from prefixpin.proxy.session.placement import Lease, QueueFullError, QueueGate, SlotPool
from prefixpin.proxy.session.tokens import scope as token_scope
from prefixpin.proxy.settings import Settings

if TYPE_CHECKING:
    from prefixpin.proxy.engine.ollama import OllamaPlanner
    from prefixpin.proxy.parking import ParkManager
    from prefixpin.proxy.parking.anchor import Anchorer
    from prefixpin.proxy.parking.openings import Openings

# A request on a slot that reuses this many tokens fewer than the slot's previous prompt is
# a prefix break: the engine re-read a conversation it already held.
PREFIX_BREAK_SLACK = 256

# A client's request headers that reach the engine: its credentials (llama-server's
# --api-key takes `Authorization: Bearer` or, Anthropic's way, `X-Api-Key`) and its tracing.
FORWARDED_HEADERS = ("authorization", "x-api-key", "x-request-id", "traceparent")



class PassThroughPlanner:
    """Forward the client's body as it came; no identity, no repair, no placement."""

    async def plan(self, incoming: Incoming, backend: Backend) -> Plan:
        return Plan(path=incoming.client.path, body=incoming.client.body)

    async def on_lease(self, plan: Plan, lease: Lease) -> None:
        return None

    def commit(self, plan: Plan, outcome: Outcome) -> None:
        return None


@dataclass(frozen=True, slots=True)
class RequestRecord:
    plan: Plan
    client: ClientRequest
    figures: Figures
    outcome: str
    ttft: float | None
    error: str | None


@dataclass(slots=True)
class SlotLedger:
    """Per engine slot, the prompt size of its last request: the yardstick for prefix breaks."""

    prompts: dict[tuple[str, int], int] = field(default_factory=dict)

    def record(self, upstream: str, slot: int, figures: Figures) -> int | None:
        """Record the slot's new prompt; return how many tokens short of the last one it fell
        (None when this is not a prefix break)."""
        previous = self.prompts.get((upstream, slot))
        if figures.prompt_tokens is not None:
            self.prompts[(upstream, slot)] = figures.prompt_tokens
        if previous is None or figures.cached_tokens is None:
            return None
        shortfall = previous - figures.cached_tokens
        return shortfall if shortfall > PREFIX_BREAK_SLACK else None

    def forget(self, upstream: str) -> None:
        for key in [key for key in self.prompts if key[0] == upstream]:
            del self.prompts[key]


@dataclass(frozen=True, slots=True)
class LanePolicies:
    """What a lane does with its engine's requests, built whole by its engine kind's
    factory once the engine answers (``proxy.engine.engines``) and swapped as one
    (``Lane.adopt``): the planner, the slot pool, parking and what rides on it, the model
    lifecycle, and where placement reads the lane's load (None: from the pool)."""

    planner: Planner
    pool: SlotPool | None = None
    parking: ParkManager | None = None
    anchorer: Anchorer | None = None
    openings: Openings | None = None
    models: OllamaPlanner | None = None
    load_of: Callable[[], Awaitable[Load]] | None = None


class ProxyService:
    """One lane's request path: its engine (``backend``) and its policies. The policies
    start as pass-through with no slots; the lane swaps in what its engine supports once
    the engine answers (``proxy.engine.engines``)."""

    def __init__(self, settings: Settings, backend: Backend, metrics: Metrics, *,
                 logger: logging.Logger | None = None, inflight: InFlight | None = None,
                 on_upstream_lost: Callable[[], None] | None = None) -> None:
        self.settings = settings
        self.backend = backend
        self.metrics = metrics
        self.policies = LanePolicies(PassThroughPlanner())
        self.ledger = SlotLedger()
        self.log = logger or get_logger()
        self.generations: set[Generation] = set()
        # Shared by every lane (and, with --redis, every replica): a retry joins the
        # generation already running wherever it runs.
        self.inflight = inflight if inflight is not None else InFlight()
        # Requests waiting for a slot on this lane, bounded per namespace and in all.
        self.queue_gate = QueueGate(
            max_queued=settings.max_queued_per_lane,
            max_queued_per_namespace=settings.max_queued_per_namespace,
            retry_after_s=max(1, int(settings.queue_timeout_s / 10)))
        self._background: set[asyncio.Task[None]] = set()
        # Called when a generation loses its engine connection (the engine watch probes at
        # once: a killed engine's sessions are marked unverified within a probe).
        self.on_upstream_lost = on_upstream_lost

    @property
    def planner(self) -> Planner:
        return self.policies.planner

    def streaming_since(self) -> float | None:
        """When the oldest engine stream still being read got its answer's head
        (``time.monotonic``), or None: the watch needs no probe while one stays open."""
        return self._oldest_head(prefilling=False)

    def prefilling_since(self) -> float | None:
        """When the oldest engine stream being read that has no output yet (the engine
        prefills its prompt) got its answer's head, or None: the watch puts a probe off."""
        return self._oldest_head(prefilling=True)

    def _oldest_head(self, *, prefilling: bool) -> float | None:
        heads = [g.timeline.head for g in self.generations if not g.answered
                 and not (prefilling and g.timeline.first_output is not None)]
        return min((head for head in heads if head is not None), default=None)

    @property
    def pool(self) -> SlotPool | None:
        return self.policies.pool

    async def handle(self, request: Request, incoming: Incoming) -> Response:
        """One parsed request (the router read and parsed it) through plan, generation and
        relay; ``request`` is only the client connection the answer goes to."""
        arrival = time.monotonic()
        client, codec = incoming.client, incoming.codec
        try:
            key = request_key(incoming)
            claimed = await self.inflight.claim(key, JoinIntent.of(incoming.headers))
            if isinstance(claimed, Generation):
                return await self._join(request, client, codec, claimed, arrival)
            reservation = claimed
            try:
                with token_scope(incoming.namespace):  # token counts cached per tenant
                    plan = await self.planner.plan(incoming, self.backend)
            except BaseException:
                self.inflight.release(key, reservation)
                raise
        except ProxyError as exc:
            self.metrics.requests.labels(client.endpoint, _outcome(exc), client.api).inc()
            raise
        plan.headers = {**_forwarded_headers(incoming.headers, self.backend.engine_credentials),
                        **plan.headers}
        generation = self._start(plan, client, codec, arrival, incoming.namespace)
        self.inflight.add(key, generation, reservation)
        generation.on_done(lambda g: self.inflight.remove(key, g))
        return await self._respond(request, client, codec, generation, arrival)

    async def _join(self, request: Request, client: ClientRequest, codec: Codec,
                    generation: Generation, arrival: float) -> Response:
        """Attach to the identical generation already running: no second engine request."""
        self.metrics.joins.labels(client.endpoint, client.api).inc()
        log_event(self.log, logging.INFO, "joined in flight", api=client.api,
                  endpoint=client.endpoint,
                  stream=client.stream, frames_so_far=len(generation.frames))
        return await self._respond(request, client, codec, generation, arrival)

    async def _respond(self, request: Request, client: ClientRequest, codec: Codec,
                       generation: Generation, arrival: float) -> Response:
        return await respond(
            request, client, codec, generation, arrival=arrival,
            first_byte_s=self.settings.first_byte_ms / 1000,
            heartbeat_s=self.settings.heartbeat_s, on_heartbeat=self.metrics.heartbeats.inc,
            fill_cached=self.backend.adapter.capabilities.measured_cache)

    async def aclose(self) -> None:
        for generation in list(self.generations):
            await generation.aclose()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    def _start(self, plan: Plan, client: ClientRequest, codec: Codec, arrival: float,
               namespace: str) -> Generation:
        def finished(generation: Generation) -> None:
            self.generations.discard(generation)
            self.metrics.inflight.set(len(self.generations))

        generation = Generation(
            lambda g: self._open(plan, g, namespace), grace_s=self.settings.retry_grace_s,
            on_settled=lambda g: self._record(plan, client, codec, g, arrival),
            max_frames=self.settings.max_reply_events,
            max_bytes=self.settings.max_reply_bytes,
            keep_events=self.settings.keep_reply_events)
        generation.on_done(finished)
        self.generations.add(generation)
        self.metrics.inflight.set(len(self.generations))
        generation.start()
        return generation

    @asynccontextmanager
    async def _open(self, plan: Plan, generation: Generation,
                    namespace: str) -> AsyncIterator[UpstreamStream]:
        """Take the plan's slot lease (waiting, with heartbeats, while it is busy: a 429 if
        too many wait already), then open the engine request; the lease is held until the
        engine's answer is fully read."""
        adapter = self.backend.adapter
        if plan.want is None or self.pool is None:
            call = adapter.prepare(plan.path, plan.body, slot=None)
            async with adapter.open_stream(_for_generation(call, plan.headers,
                                                           generation)) as upstream:
                yield upstream
            return
        waited = time.monotonic()

        def on_wait(text: str) -> None:
            generation.waiting = text

        gate = self.queue_gate
        gate.admit(namespace, would_wait=self.pool.would_wait(plan.want))
        with gate.queued(namespace) as leased:
            async with self.pool.lease(plan.want, timeout_s=self.settings.queue_timeout_s,
                                       on_wait=on_wait) as lease:
                leased()
                # The lease is granted: restore what the planner restores, open the request.
                generation.waiting = None
                self.metrics.queue_wait.observe(time.monotonic() - waited)
                plan.slot = lease.slot
                await self.planner.on_lease(plan, lease)
                call = adapter.prepare(plan.path, plan.body, slot=lease.slot)
                async with adapter.open_stream(_for_generation(call, plan.headers,
                                                               generation)) as upstream:
                    yield upstream

    def _record(self, plan: Plan, client: ClientRequest, codec: Codec,
                generation: Generation, arrival: float) -> None:
        """Figures go to the metrics at once; the log line waits for the slot to be known."""
        figures = figures_from(generation.frames, generation.progress)
        outcome = _generation_outcome(generation)
        if isinstance(generation.error, UpstreamUnavailableError) and self.on_upstream_lost:
            self.on_upstream_lost()
        self.metrics.requests.labels(client.endpoint, outcome, client.api).inc()
        estimated = _estimated_cached(plan, figures) if outcome == "ok" else None
        if estimated is not None:
            plan.notes["cached_tokens_estimated"] = estimated
        if figures.load_ms is not None:
            plan.notes["load_ms"] = round(figures.load_ms, 1)
        if figures.prompt_tokens is not None and outcome == "ok":
            self._observe_cache(self.backend.label, client.api, figures, estimated)
        timeline = generation.timeline
        ttft = timeline.first_output - arrival if timeline.first_output is not None else None
        if ttft is not None:
            self.metrics.ttft.labels(client.endpoint, client.api).observe(ttft)
        reply = (codec.reply(generation.frames) if outcome == "ok" and generation.reply_kept
                 else None)
        if not generation.reply_kept:
            plan.notes["reply_not_committed"] = "its frames past --keep-reply-events do not fold"
        self.planner.commit(plan, Outcome(outcome == "ok", figures,
                                          round(ttft * 1000, 1) if ttft is not None else None,
                                          reply))
        record = RequestRecord(plan, client, figures, outcome, ttft,
                               generation.error.message if generation.error else None)
        if plan.slot is None and outcome == "ok" and self.backend.adapter.capabilities.slots:
            task = asyncio.get_running_loop().create_task(self._locate_then_log(record))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        else:
            self._log_request(record, plan.slot)

    async def _locate_then_log(self, record: RequestRecord) -> None:
        slot = None
        with contextlib.suppress(ProxyError, TimeoutError):
            slot = await asyncio.wait_for(self._locate_slot(record.figures), 2.0)
        self._log_request(record, slot)

    async def _locate_slot(self, figures: Figures) -> int | None:
        """Which slot served a request that was not pinned, read back from /slots.

        A slot holds the prompt plus the generated tokens but the last; among idle slots
        holding exactly that many, the one that took the newest task is ours.
        """
        if figures.prompt_tokens is None:
            return None
        held = figures.prompt_tokens + max(0, (figures.completion_tokens or 0) - 1)
        slots = await self.backend.adapter.list_slots()
        matches = [s for s in slots if not s.is_processing and s.n_prompt_tokens == held]
        return max(matches, key=lambda s: s.id_task).id if matches else None

    def _log_request(self, record: RequestRecord, slot: int | None) -> None:
        upstream, figures, plan = self.backend.label, record.figures, record.plan
        shortfall = None
        if slot is not None and record.outcome == "ok":
            self.metrics.slot_cached_tokens.labels(upstream, str(slot)).set(
                figures.cached_tokens or 0)
            shortfall = self.ledger.record(upstream, slot, figures)
        if self.log.isEnabledFor(logging.INFO):  # its fields are built only to be written
            fields: dict[str, Any] = {
                "api": record.client.api, "endpoint": record.client.endpoint,
                "outcome": record.outcome, "upstream": upstream, "slot": slot,
                "session": plan.session, "stream": record.client.stream,
                "prompt_tokens": figures.prompt_tokens, "cached_tokens": figures.cached_tokens,
                "ttft_ms": round(record.ttft * 1000, 1) if record.ttft is not None else None,
                "prefill_ms": figures.prompt_ms, **plan.log_fields(),
            }
            if record.error is not None and record.outcome != "ok":
                fields["error"] = record.error
            log_event(self.log, logging.INFO, "request", **fields)
        if shortfall is not None:
            self.metrics.prefix_breaks.labels(upstream, break_cause(plan)).inc()
            log_event(self.log, logging.WARNING, "prefix break", upstream=upstream, slot=slot,
                      session=plan.session, shortfall=shortfall,
                      cached_tokens=figures.cached_tokens, prompt_tokens=figures.prompt_tokens)

    def _observe_cache(self, upstream: str, api: str, figures: Figures,
                       estimated: int | None) -> None:
        """Cached tokens labelled by source: the engine's own count, else the planner's
        estimate; neither known, no cached figure at all (an unknown is not a 0)."""
        self.metrics.prompt_tokens.labels(upstream).observe(figures.prompt_tokens or 0)
        source, cached = "measured", figures.cached_tokens
        if cached is None and estimated is not None:
            source, cached = "estimated", estimated
        if cached is not None:
            self.metrics.cached_tokens.labels(upstream, source).observe(cached)
            if figures.prompt_tokens:
                self.metrics.cached_fraction.labels(upstream, source, api).observe(
                    cached / figures.prompt_tokens)
        if figures.prompt_ms is not None:
            self.metrics.prefill.labels(upstream).observe(figures.prompt_ms / 1000)


def break_cause(plan: Plan) -> str:
    """Why a request reused far less than its slot held, from what its planner decided:
    the slot was not read from cache (another namespace, unknown contents), another history
    took it, the session's own history was rewritten, or the engine did not reuse what the
    proxy believed it held."""
    if plan.cache_blocked:
        return "cache_blocked"
    if plan.decision in ("new", "declined"):
        return "other_history"
    if plan.decision == "rewound":
        return "rewound"
    if plan.decision is None:
        return "unplanned"
    return "engine"


def request_key(incoming: Incoming) -> bytes:
    """The in-flight key: another wire format (codec) or engine path is another answer,
    another session another history to record; neither is ever joined. (Every route of a
    codec asks the engine on one path: ``/completions`` joins ``/v1/completions``.)"""
    client = incoming.client
    identity = incoming.identity
    session = None if identity is None else f"{identity.key}\0{identity.parent or ''}"
    return inflight_key(incoming.namespace, incoming.codec.name, client.path, session,
                        client.body, incoming.digests)


def _estimated_cached(plan: Plan, figures: Figures) -> int | None:
    """The planner's estimate of the cached tokens, when the engine reported none."""
    estimate = plan.cached_estimate
    if figures.cached_tokens is not None or estimate is None:
        return None
    return max(0, min(estimate(figures), figures.prompt_tokens or 0))


def _forwarded_headers(headers: Mapping[str, str],
                       engine_credentials: Mapping[str, str] | None) -> dict[str, str]:
    if engine_credentials is None:
        return {name: headers[name] for name in FORWARDED_HEADERS if name in headers}
    return {**{name: headers[name] for name in FORWARDED_HEADERS
               if name in headers and name not in CREDENTIAL_HEADERS}, **engine_credentials}


def _for_generation(call: UpstreamCall, headers: Mapping[str, str],
                    generation: Generation) -> UpstreamCall:
    """``call`` with the plan's headers, whose head goes straight to ``generation``."""
    return UpstreamCall(call.path, call.body, {**headers, **call.headers},
                        on_head=generation.engine_answered)


def _outcome(exc: ProxyError) -> str:
    if isinstance(exc, GenerationCancelledError):
        return "cancelled"
    if isinstance(exc, ClientError):
        return "client_error"
    if isinstance(exc, QueueTimeoutError):
        return "queue_timeout"
    if isinstance(exc, QueueFullError):
        return "queue_full"
    return "upstream_error"


def _generation_outcome(generation: Generation) -> str:
    if generation.completed:
        return "ok"
    if generation.error is None:
        return "cancelled"
    return _outcome(generation.error)
