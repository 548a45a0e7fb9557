"""Engine kinds, each registered once: how a lane opens its adapter, and which of the
pipeline's policies it switches on once its engine answers.

    kind           adapter              once the engine answers
    llama-server   LlamaServerAdapter   identity, repair, slot pinning, the slot queue, parking
    embedded       EmbeddedAdapter      the same (llama-cpp-python in process)
    ollama         OllamaAdapter        identity, repair, cached-token estimates, the model
                                        lifecycle; Ollama picks its own slots (no pinning, no
                                        queue, no parking) and serves its native /api/* too

The same functions run for every lane of every topology (``proxy.pipeline.router``): one engine,
several, and several replicas sharing state in Redis. An adapter is looked up by its
``name``, never by its class.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from prefixpin.adapters.base import Adapter, EngineInfo
from prefixpin.adapters.h1 import EngineBounds, engine_transport
from prefixpin.adapters.http import EngineClient, EngineKey
from prefixpin.adapters.llama_server import LlamaServerAdapter
from prefixpin.adapters.ollama import OllamaAdapter, detect_engine
from prefixpin.proxy.engine.engine_facts import ServerFlags, local_server_flags
from prefixpin.proxy.engine.lane import Lane, SharedState
from prefixpin.proxy.engine.ollama import OllamaPlanner
from prefixpin.proxy.ops.logs import log_event
from prefixpin.proxy.ops.metrics import Metrics
from prefixpin.proxy.parking import ParkManager, open_parking
from prefixpin.proxy.parking.anchor import Anchorer
from prefixpin.proxy.parking.limits import EngineLimits, limits_from
from prefixpin.proxy.parking.openings import Openings
from prefixpin.proxy.pipeline.records import Load, Planner
from prefixpin.proxy.pipeline.service import LanePolicies
from prefixpin.proxy.pipeline.shared import SharedStatePlanner
from prefixpin.proxy.pipeline.system_turns import refuses_mid_system
from prefixpin.proxy.pipeline.validation import Api
from prefixpin.proxy.session.affinity import AffinityPlanner
from prefixpin.proxy.session.implicit import Fingerprinter, load_fingerprinter
from prefixpin.proxy.session.placement import SlotPool
from prefixpin.proxy.session.repair import RepairConfig, Repairer
from prefixpin.proxy.session.sessions import Session, SessionStore
from prefixpin.proxy.session.tokens import TokenCounter
from prefixpin.proxy.settings import Settings


@dataclass(frozen=True, slots=True)
class LaneContext:
    """What switching a lane's policies on needs besides the lane itself."""

    settings: Settings
    store: SessionStore
    metrics: Metrics
    logger: logging.Logger
    shared: SharedState | None  # --redis


SessionsOn = Callable[[LaneContext, Lane, EngineInfo], Awaitable[None]]
# Why an engine's prompt cache crosses slots, from its flags (None: not readable here) and
# /props; None when it does not.
SharedCacheRule = Callable[[ServerFlags | None, Mapping[str, Any]], str | None]


@dataclass(frozen=True, slots=True)
class EngineKind:
    name: str  # the adapter's name
    sessions_on: SessionsOn
    shared_cache: SharedCacheRule
    # The client wire formats (proxy.codecs) this engine serves through the pipeline; a
    # route of a format no lane serves is a 404 (proxy.listen.isolation.ApiNotServedError).
    serves: frozenset[Api] = frozenset({"openai"})
    # Its flags are llama-server's, read from its command line when it runs on this host.
    local_flags: bool = False


ENGINES: dict[str, EngineKind] = {}


def register(kind: EngineKind) -> EngineKind:
    if kind.name in ENGINES:
        raise ValueError(f"engine kind {kind.name!r} registered twice")
    ENGINES[kind.name] = kind
    return kind


def kind_of(adapter: Adapter) -> EngineKind:
    try:
        return ENGINES[adapter.name]
    except KeyError:
        raise ValueError(f"no engine kind registered for adapter {adapter.name!r}") from None


# ------------------------------------------------------------------ adapters

# How long a connection to an engine is kept idle for the next request (see http_client).
ENGINE_KEEPALIVE_S = 1.0


def http_client(settings: Settings, url: str,
                transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
    """The client of one engine. With an engine key (``--engine-api-key``, or the
    upstreams file's ``api_key=`` for this URL) the proxy's own requests carry it
    (``adapters.http.EngineKey``); a client's requests carry the client's credentials."""
    key = settings.engine_key_for(url)
    auth = EngineKey(key, httpx.URL(url).path) if key is not None else None
    # A connection that ends a request well while others to the engine run is kept for the
    # next (adapters.h1 closes one that ended the only request running): no cap, as there
    # are never more than requests ran at once, one per engine slot and the probes; a cap
    # below the slots (it was 64) closed a quarter of them at 256 streams, each new one a
    # connect and a teardown on both sides. Kept a second, not httpx's 5 s: until its own
    # 5 s timeout, llama-server wakes a thread every 10 ms per idle connection.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None,
                          keepalive_expiry=ENGINE_KEEPALIVE_S)
    if transport is None:
        # httptools' parser under httpx for plain-HTTP engines (adapters.h1): an engine's
        # streamed answer is read at a fraction of h11's cost per event.
        transport = engine_transport(limits, http=settings.engine_http,
                                     bounds=engine_bounds(settings))
    return EngineClient(base_url=url, transport=transport, auth=auth,
                        timeout=settings.upstream_timeout(), limits=limits)


def engine_bounds(settings: Settings) -> EngineBounds:
    return EngineBounds(head_bytes=settings.engine_head_bytes,
                        interim_responses=settings.engine_interim_responses,
                        head_within_s=settings.engine_head_timeout_s,
                        read_share=settings.engine_read_share)


async def open_url_adapter(settings: Settings, http: httpx.AsyncClient,
                           logger: logging.Logger) -> Adapter:
    """llama-server or Ollama at a URL: as ``--engine`` says, else as the engine answers
    (an engine not answering yet is taken for llama-server and asked again later)."""
    engine = settings.engine if settings.engine in ("ollama", "llama-server") else None
    if settings.engine == "auto":
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(settings.probe_timeout_s):
                engine = await detect_engine(http)
        if engine is None:
            log_event(logger, logging.WARNING, "engine not detected",
                      upstream=label_of(str(http.base_url)), assumed="llama-server",
                      hint="--engine ollama|llama-server skips detection")
    return OllamaAdapter(http) if engine == "ollama" else LlamaServerAdapter(http)


async def redetect(settings: Settings, adapter: Adapter, logger: logging.Logger,
                   label: str) -> Adapter:
    """``--engine auto`` and the engine did not answer as the one assumed: ask again which
    engine it is (an Ollama that started after the proxy was first taken for llama-server)."""
    if settings.engine != "auto" or adapter.name not in ("llama-server", "ollama"):
        return adapter
    engine = None
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(settings.probe_timeout_s):
            engine = await detect_engine(adapter.http)
    if engine is None or engine == adapter.name:
        return adapter
    log_event(logger, logging.INFO, "engine detected", upstream=label, engine=engine)
    return OllamaAdapter(adapter.http) if engine == "ollama" else LlamaServerAdapter(adapter.http)


async def open_embedded_adapter(settings: Settings) -> Adapter:
    # Imported here: the embedded engine needs the `embedded` extra (llama-cpp-python).
    from prefixpin.adapters.embedded import EmbeddedAdapter, EngineConfig

    if settings.model is None:
        raise ValueError("the embedded engine needs settings.model (the CLI resolves it)")
    config = EngineConfig(model_path=settings.model, n_slots=settings.slots,
                          n_ctx=settings.ctx_size, n_threads=settings.threads,
                          repack=settings.repack, slot_save_path=settings.slot_dir())
    return await EmbeddedAdapter.open(config, settings.upstream_timeout())


def label_of(url: str) -> str:
    return httpx.URL(url).netloc.decode() or url


# ------------------------------------------------------------------ the prompt cache across slots

OLLAMA_SHARED = ("Ollama shares cached prefixes across requests (its runner is llama-server "
                 "with a host prompt cache, and it takes no id_slot)")
FLAGS_UNREADABLE = ("assumed shared: llama-server's flags are not readable here (not on this "
                    "host, or another user's process), and its host prompt cache (--cache-ram, "
                    "8192 MiB by default) is shared by all slots")


def shared_cache_reason(adapter_name: str, flags: ServerFlags | None,
                        props: Mapping[str, Any]) -> str | None:
    """Why this engine's prompt cache crosses slots, or None when it does not (the rule
    its kind registered)."""
    return ENGINES[adapter_name].shared_cache(flags, props)


def _no_shared_cache(flags: ServerFlags | None, props: Mapping[str, Any]) -> str | None:
    """The embedded engine: one ``llama_context`` per slot and no host cache (a slot reuses
    only its own tokens: ``adapters.embedded.model.generate``)."""
    return None


def _ollama_shared_cache(flags: ServerFlags | None, props: Mapping[str, Any]) -> str | None:
    return OLLAMA_SHARED


def _llama_server_shared_cache(flags: ServerFlags | None,
                               props: Mapping[str, Any]) -> str | None:
    """``--cache-ram`` above 0 (its default) or -1 (no limit) saves a slot about to be
    overwritten into one RAM cache every slot loads from. Read from its command line when
    local, else from ``/props.cache_ram`` (MiB) when the engine says it (the test fake
    does), else assumed shared (the safe default)."""
    if flags is not None:
        cache_ram = flags.number("cache_ram")
        if cache_ram == 0:
            return None
        size = f"{cache_ram:g}" if cache_ram is not None else "8192"
        given = (f"--cache-ram {size} on the {flags.source}" if flags.is_set("cache_ram")
                 else f"--cache-ram not on the {flags.source}: default {size} MiB")
        return f"llama-server's host prompt cache is shared by all slots ({given})"
    declared = props.get("cache_ram")
    if isinstance(declared, int) and not isinstance(declared, bool):
        if declared == 0:
            return None
        return ("llama-server's host prompt cache is shared by all slots "
                f"(/props cache_ram {declared})")
    return FLAGS_UNREADABLE


async def read_engine(lane: Lane, info: EngineInfo, logger: logging.Logger) -> None:
    """What the lane's engine says of itself beyond its probe, read once per engine start
    (its flags in a thread: /proc, its --help) and shared by the shared-cache gate and
    parking: ``lane.flags`` and ``lane.shared_cache``; again after each restart (the
    flags may change)."""
    await _read_engine(lane, info, logger)

    async def restarted(before: EngineInfo, after: EngineInfo) -> None:
        await _read_engine(lane, after, logger)

    lane.watch.on_restart.append(restarted)


async def _read_engine(lane: Lane, info: EngineInfo, logger: logging.Logger) -> None:
    kind = kind_of(lane.adapter)
    lane.flags = None
    if kind.local_flags and lane.url is not None:
        lane.flags = await asyncio.to_thread(local_server_flags, lane.url)
    lane.mid_system_in_place = await refuses_mid_system(lane.adapter)
    if lane.mid_system_in_place:
        log_event(logger, logging.INFO, "system messages in place", upstream=lane.label,
                  reason="the chat template refuses a system message after the first: each "
                         "is rendered where it stands, as a <system-reminder> user turn")
    reason = lane.shared_cache = kind.shared_cache(lane.flags, info.props)
    if reason is None:
        log_event(logger, logging.INFO, "prompt cache per slot", upstream=lane.label,
                  engine=kind.name)
    else:
        log_event(logger, logging.WARNING if reason == FLAGS_UNREADABLE else logging.INFO,
                  "shared prompt cache", upstream=lane.label, engine=kind.name, reason=reason,
                  hint="a second namespace is refused here unless the backend is dedicated "
                       "to it (--upstreams-file namespace=) or --allow-shared-cache is given")


# ------------------------------------------------------------------ policies

def repairer_for(settings: Settings, fingerprinter: Fingerprinter | None,
                 logger: logging.Logger) -> Repairer | None:
    if not settings.repair:
        log_event(logger, logging.INFO, "repair off", reason="PREFIXPIN_REPAIR=0")
        return None
    config = RepairConfig.from_switches(settings.repair_switches(),
                                        settings.repair_volatile_rules)
    config = dataclasses.replace(config, budget_fraction=settings.repair_budget)
    counter = TokenCounter(fingerprinter.tokenizer if fingerprinter else None)
    log_event(logger, logging.INFO, "repair on", policies=sorted(config.enabled),
              exact_token_counts=counter.exact)
    return Repairer(config, counter.count_messages)


def _shared(ctx: LaneContext, planner: Planner,
            refresh: Callable[[], Awaitable[None]] | None = None) -> Planner:
    """With --redis, the planner reads the shared session table before planning and
    writes it at commit."""
    if ctx.shared is None:
        return planner
    return SharedStatePlanner(planner, ctx.shared.sessions, refresh)


async def slot_sessions_on(ctx: LaneContext, lane: Lane, info: EngineInfo) -> None:
    """Engines that let the proxy choose the slot: affinity, the queue and parking."""
    settings, logger, adapter = ctx.settings, ctx.logger, lane.adapter
    if not adapter.capabilities.slots:
        log_event(logger, logging.INFO, "affinity off", upstream=lane.label,
                  reason=f"{info.engine} does not let the proxy choose slots")
        return
    fingerprinter = await load_fingerprinter(settings.tokenizer, info.props, logger)
    shared = ctx.shared
    limits = await asyncio.to_thread(limits_from, info, lane.flags)
    anchorer = anchorer_for(ctx, lane, limits)
    parking = await open_parking(settings, adapter, info, ctx.store, ctx.metrics, logger,
                                 lane=lane.label, flags=lane.flags, limits=limits,
                                 cluster=shared.cluster if shared is not None else None,
                                 shared_sessions=shared.sessions if shared else None,
                                 anchorer=anchorer)
    on_evict = parking.park if parking is not None else None
    pool: SlotPool
    refresh: Callable[[], Awaitable[None]] | None = None
    load_of: Callable[[], Awaitable[Load]] | None = None
    if shared is not None:
        from prefixpin.proxy.cluster.slots import SharedSlotPool

        shared_pool = SharedSlotPool(shared.cluster, lane.label, info.n_slots, logger,
                                     on_evict=on_evict)
        await shared_pool.adopt_engine(info)
        pool, refresh, load_of = shared_pool, shared_pool.recent, shared_pool.load
    else:
        pool = SlotPool(info.n_slots, on_evict=on_evict)
    openings = openings_for(ctx, lane, limits, parking)
    planner = AffinityPlanner(ctx.store, pool, ctx.metrics, fingerprinter, logger,
                              repairer_for(settings, fingerprinter, logger),
                              budget_tokens=info.n_ctx_slot or None, parking=parking,
                              anchorer=anchorer, openings=openings)
    lane.adopt(LanePolicies(_shared(ctx, planner, refresh), pool=pool, parking=parking,
                            anchorer=anchorer, openings=openings, load_of=load_of))

    async def restarted(before: EngineInfo, after: EngineInfo) -> None:
        if anchorer is not None:
            anchorer.renderings.engine_restarted()
        if shared is not None:
            await shared_pool.adopt_engine(after)
        await planner.engine_restarted(before, after)

    def lost(reason: str) -> None:
        for session in ctx.store:
            if session.backend in (lane.label, None):
                session.last_decision, session.last_reason = "unverified", reason

    lane.watch.on_restart.append(restarted)
    lane.watch.on_lost.append(lost)
    log_event(logger, logging.INFO, "affinity on", upstream=lane.label, slots=info.n_slots,
              implicit=fingerprinter is not None, shared=shared is not None,
              parking=parking is not None)


def anchorer_for(ctx: LaneContext, lane: Lane, limits: EngineLimits) -> Anchorer | None:
    """Anchoring (``proxy.parking.anchor``) where the engine cannot roll a slot back over
    a re-rendered reply: a recurrent/hybrid model; said at start."""
    adapter = lane.adapter
    if not limits.exact_extension_only or not adapter.capabilities.render:
        return None
    if not ctx.settings.anchor:
        log_event(ctx.logger, logging.INFO, "anchoring off", upstream=lane.label,
                  memory=limits.memory, reason="PREFIXPIN_ANCHOR=0")
        return None
    store = ctx.store

    async def session_of(session_id: str) -> Session | None:
        return store.get(session_id)

    log_event(ctx.logger, logging.INFO, "anchoring on", upstream=lane.label,
              memory=limits.memory)
    return Anchorer(adapter, ctx.metrics, ctx.logger, session_of)


def openings_for(ctx: LaneContext, lane: Lane, limits: EngineLimits,
                 parking: ParkManager | None) -> Openings | None:
    """Openings (``proxy.parking.openings``) need the engine's save directory (parking) and
    its template, and a restore the engine reuses; said at start."""
    adapter = lane.adapter
    if parking is None or not adapter.capabilities.render:
        return None
    if not ctx.settings.openings:
        log_event(ctx.logger, logging.INFO, "openings off", upstream=lane.label,
                  reason="PREFIXPIN_OPENINGS=0")
        return None
    if limits.restores_reprocessed:
        log_event(ctx.logger, logging.INFO, "openings off", upstream=lane.label,
                  reason=f"the model uses {limits.memory}: a restored slot is re-processed")
        return None
    log_event(ctx.logger, logging.INFO, "openings on", upstream=lane.label,
              min_tokens=ctx.settings.opening_min_tokens)
    return Openings(adapter, parking.config.files_dir, ctx.metrics, ctx.logger,
                    filenames=parking.filenames, min_tokens=ctx.settings.opening_min_tokens,
                    max_bytes=parking.config.max_bytes // 4, lane=lane.label)


async def ollama_sessions_on(ctx: LaneContext, lane: Lane, info: EngineInfo) -> None:
    """Sessions, repair, estimates and the model lifecycle in front of Ollama (no slots:
    a pool of none, and no slot is ever leased)."""
    settings, logger = ctx.settings, ctx.logger
    fingerprinter = await load_fingerprinter(settings.tokenizer, info.props, logger)
    inner = AffinityPlanner(ctx.store, SlotPool(0), ctx.metrics, fingerprinter, logger,
                            repairer_for(settings, fingerprinter, logger))
    planner = OllamaPlanner(inner, ctx.metrics, logger, lane.label)
    lane.adopt(LanePolicies(_shared(ctx, planner), models=planner))
    lane.watch.on_lost.append(planner.engine_lost)
    log_event(logger, logging.INFO, "sessions on", upstream=lane.label, engine="ollama",
              slots="chosen by Ollama", implicit=fingerprinter is not None,
              cached_tokens="measured" if lane.adapter.capabilities.measured_cache
              else "estimated unless Ollama reports them")


register(EngineKind("llama-server", slot_sessions_on, _llama_server_shared_cache,
                    local_flags=True, serves=frozenset({"openai", "llama"})))
register(EngineKind("embedded", slot_sessions_on, _no_shared_cache))
register(EngineKind("ollama", ollama_sessions_on, _ollama_shared_cache,
                    serves=frozenset({"openai", "ollama"})))
