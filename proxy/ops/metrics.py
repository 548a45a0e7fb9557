"""Prometheus figures, on a registry the app owns (never the global one).

Label values are bounded: endpoint, outcome and api (the client's wire format:
openai, ollama, anthropic, responses, llama) come from fixed sets, upstream is the
configured backend label, slot is an engine slot index, source is ``measured`` (the
engine's own cached count) or ``estimated`` (the proxy's estimate from its record of the
session, for an engine that reports none: Ollama before 0.33.3).
"""

from __future__ import annotations

from typing import Any, TypeVar

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

TOKEN_BUCKETS = (0, 16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072,
                 262144)
FRACTION_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)

T = TypeVar("T")


class _KnownChildren:
    """``labels`` of a label set seen before, without prometheus_client's checks, string
    conversion and lock (~1.5 us, some ten times per request): its child straight from the
    parent's own dict. A new label set, or values that are not all strings, go the usual
    way (and are then stored in that dict)."""

    def labels(self: T, *labelvalues: Any, **labelkwargs: Any) -> T:
        if not labelkwargs:
            try:
                child = self._metrics.get(labelvalues)  # type: ignore[attr-defined]
            except AttributeError:  # a child (no labels of its own): the usual error
                child = None
            if child is not None:
                return child  # type: ignore[no-any-return]
        return super().labels(*labelvalues, **labelkwargs)  # type: ignore[misc, no-any-return]


class Counter(_KnownChildren, prometheus_client.Counter):
    pass


class Gauge(_KnownChildren, prometheus_client.Gauge):
    pass


class Histogram(_KnownChildren, prometheus_client.Histogram):
    pass


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("prefixpin_requests", "Requests by endpoint, outcome and the "
                                "client's wire format (api)", ["endpoint", "outcome", "api"],
                                registry=r)
        self.prompt_tokens = Histogram("prefixpin_prompt_tokens", "Prompt tokens per request",
                                       ["upstream"], buckets=TOKEN_BUCKETS, registry=r)
        self.cached_tokens = Histogram("prefixpin_cached_tokens",
                                       "Prompt tokens served from the engine's cache "
                                       "(source: measured by the engine, or estimated)",
                                       ["upstream", "source"], buckets=TOKEN_BUCKETS,
                                       registry=r)
        self.cached_fraction = Histogram("prefixpin_cached_fraction",
                                         "Cached tokens / prompt tokens per request "
                                         "(source: measured by the engine, or estimated; "
                                         "api: the client's wire format)",
                                         ["upstream", "source", "api"], buckets=FRACTION_BUCKETS,
                                         registry=r)
        self.ttft = Histogram("prefixpin_ttft_seconds",
                              "Request arrival to first generated output",
                              ["endpoint", "api"], buckets=SECONDS_BUCKETS, registry=r)
        self.prefill = Histogram("prefixpin_prefill_seconds",
                                 "Engine prompt processing time (timings.prompt_ms)",
                                 ["upstream"], buckets=SECONDS_BUCKETS, registry=r)
        self.heartbeats = Counter("prefixpin_heartbeats", "SSE heartbeat comments (and, on "
                                  "Ollama's native API, keep-alive spaces) sent", registry=r)
        self.slot_cached_tokens = Gauge("prefixpin_slot_cached_tokens",
                                        "Cached tokens of the last request on each slot",
                                        ["upstream", "slot"], registry=r)
        self.prefix_breaks = Counter("prefixpin_prefix_breaks",
                                     "Requests that reused far less than their slot held",
                                     ["upstream", "cause"], registry=r)
        self.upstream_up = Gauge("prefixpin_upstream_up", "1 when the engine answered its probe",
                                 ["upstream"], registry=r)
        self.joins = Counter("prefixpin_inflight_joins",
                             "Requests that joined an identical generation already running",
                             ["endpoint", "api"], registry=r)
        self.repairs = Counter("prefixpin_repairs",
                               "History repairs applied, by policy", ["policy"], registry=r)
        self.queue_wait = Histogram("prefixpin_queue_wait_seconds",
                                    "Time a request waited for its engine slot",
                                    buckets=SECONDS_BUCKETS, registry=r)
        self.affinity_decisions = Counter("prefixpin_affinity_decisions",
                                          "Affinity decisions by identity tier and outcome",
                                          ["tier", "outcome"], registry=r)
        self.affinity_declines = Counter("prefixpin_affinity_declines",
                                         "Candidates declined because their bytes differed, "
                                         "by the first difference's cause", ["cause"],
                                         registry=r)
        self.slot_evictions = Counter("prefixpin_slot_evictions",
                                      "Slots handed from one session to another, by reason",
                                      ["upstream", "reason"], registry=r)
        self.slots_occupied = Gauge("prefixpin_slots_occupied",
                                    "Engine slots holding a known session's history",
                                    ["upstream"], registry=r)
        self.sessions = Gauge("prefixpin_sessions", "Sessions the proxy tracks", registry=r)
        self.parks = Counter("prefixpin_parks", "Evicted sessions saved to disk (parked), or "
                             "not, by outcome", ["outcome"], registry=r)
        self.restores = Counter("prefixpin_restores", "Parked sessions restored into a slot, "
                                "or declined, by outcome", ["outcome"], registry=r)
        self.anchors = Counter("prefixpin_anchors", "Slots made to hold their session's next "
                               "request's opening before parking (recurrent/hybrid memory), "
                               "by outcome", ["outcome"], registry=r)
        self.snapshots = Counter("prefixpin_snapshots", "Prompt-end snapshots of hybrid "
                                 "sessions (a parked file a changed last reply still "
                                 "extends): taken, kept, skipped, failed, restored",
                                 ["outcome"], registry=r)
        self.tokenizations = Counter("prefixpin_tokenizations", "Renderings of a "
                                     "conversation tokenized for anchors and snapshots: "
                                     "spliced (the engine tokenized only the text past a "
                                     "turn marker an earlier rendering shares), first (a "
                                     "computation's first, nothing to splice onto), whole "
                                     "(an earlier rendering did not fit: logged)",
                                     ["outcome"], registry=r)
        self.template_renderings = Counter(
            "prefixpin_template_renderings", "Renderings of a conversation by the engine's "
            "template for anchors, snapshots and the rendered-prompt comparison of a rewritten "
            "history: window (the engine rendered the turns from "
            "the last user message on, spliced onto the session's previous rendering), first "
            "(nothing to splice onto), whole (a window did not fit: logged)",
            ["outcome"], registry=r)
        self.limit_refusals = Counter("prefixpin_limit_refusals", "Connections and requests "
                                      "refused at a bound (connections, head_timeout, "
                                      "body_timeout, head_size, body_chunks, body_size, "
                                      "json_values, bodies: --max-bodies, the bodies read "
                                      "at once)",
                                      ["limit"], registry=r)
        self.openings = Counter("prefixpin_openings", "New sessions' openings (system prompt "
                                "and tools) saved for their namespace's next sessions or "
                                "restored into a new session's slot, by outcome", ["outcome"],
                                registry=r)
        self.opening_bytes = Gauge("prefixpin_opening_bytes", "Bytes of saved openings",
                                   ["upstream"], registry=r)
        self.park_seconds = Histogram("prefixpin_park_seconds",
                                      "Saving and checking one parked session",
                                      buckets=SECONDS_BUCKETS, registry=r)
        self.restore_seconds = Histogram("prefixpin_restore_seconds",
                                         "Checking and restoring one parked session",
                                         buckets=SECONDS_BUCKETS, registry=r)
        self.park_bytes = Gauge("prefixpin_park_bytes", "Bytes of parked session files",
                                registry=r)
        self.parked_files = Gauge("prefixpin_parked_files", "Parked session files", registry=r)
        self.park_removals = Counter("prefixpin_park_removals",
                                     "Parked files removed, by reason", ["reason"], registry=r)
        self.park_revivals = Counter("prefixpin_park_revivals",
                                     "Sessions rebuilt from the park index (no live session "
                                     "held their history)", registry=r)
        self.inflight = Gauge("prefixpin_inflight_generations",
                              "Upstream generations running now", registry=r)
        self.cache_lost = Counter("prefixpin_cache_lost",
                                  "Sessions whose engine cache is assumed gone (Ollama: a "
                                  "model load seen in load_duration, an unload asked for, "
                                  "the engine unreachable)", ["upstream", "reason"], registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
