"""Sessions in front of Ollama, on both of its APIs: what applies of the cache layer when the
engine chooses its own slots, and Ollama's model lifecycle.

Ollama runs llama-server underneath but picks the slot itself and never takes ``id_slot``,
so there is no slot pinning, no slot queue and no parking. Everything else applies to
``/v1/chat/completions``, ``/v1/completions``, ``/api/chat`` and ``/api/generate`` alike:
identity (namespaces, explicit keys, fingerprints with ``--tokenizer``), bytes decide,
history repair (native messages included: ``thinking``, object tool-call arguments,
``images``), join in flight and figures.

Cached tokens come from Ollama when it reports them (0.33.3 and later). When it does not,
the proxy estimates them from its record of the session: a request that extends (or
repeats) the session's committed history reuses the committed prompt's tokens, anything
else 0. The estimate is labelled (``source="estimated"`` on the cached-token metrics, a
``cached_tokens_estimated`` log field) and never reaches a client's usage.

Model lifecycle. ``keep_alive`` goes to Ollama as sent. A model that was unloaded (expiry,
``keep_alive: 0``, eviction by another model, a restart) loses every slot's cache; the
proxy notices a load from ``load_duration`` (a cold load takes hundreds of milliseconds, a
warm request a few), from a cached count of 0 on a request that extended its session, from
an unload or load request passing through, or from the engine becoming unreachable. Every
session on that model is then marked *cold*: its committed history is kept (bytes still
decide and repair still applies), its cache is assumed gone (the next estimate is 0).

What a client sees while Ollama loads a model or prefills a long prompt (Ollama itself
sends nothing at all then, not even the response headers):

    /api/chat, /api/generate, streaming   status 200 and headers within --first-byte ms,
        a space at once and one every --heartbeat s, then Ollama's NDJSON lines unchanged
        (the spaces start the first line: every Ollama client parses it as usual). A
        failure after that is Ollama's late-error line {"error": "..."} (ollama-python:
        ResponseError with status_code -1), not its status.
    /api/*, stream: false                  nothing until the one JSON body, as from Ollama.
    /v1/*, streaming                       status 200, headers and ": prefixpin" at once, then
        ": waiting for the engine" every --heartbeat s, then Ollama's SSE events.
    /v1/*, not streaming                   nothing until the one JSON body, as from Ollama.

An error Ollama reports before the first-byte deadline keeps its status and body on every
API (a missing model is Ollama's own 404).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

import httpx
from starlette.requests import Request
from starlette.responses import Response

from prefixpin.adapters.http import map_httpx_errors
from prefixpin.core.errors import UpstreamError
from prefixpin.core.figures import Figures
from prefixpin.proxy.listen.passthrough import forward
from prefixpin.proxy.listen.tenants import CREDENTIAL_HEADERS
from prefixpin.proxy.ops.logs import log_event
from prefixpin.proxy.ops.metrics import Metrics
from prefixpin.proxy.pipeline.records import Backend, Incoming, Outcome, Plan
from prefixpin.proxy.pipeline.validation import ClientRequest
from prefixpin.proxy.session.affinity import AffinityPlanner
from prefixpin.proxy.session.placement import Lease
from prefixpin.proxy.session.sessions import Session

# A load takes hundreds of milliseconds (a runner process starts and reads the weights);
# a warm request's load_duration is a few milliseconds (0.35.1 recordings: 0.78 s and
# 2.13 s cold, 1.07 ms and 2.9 ms warm). A load is at least this, and this many times the
# model's warm figure.
COLD_LOAD_MIN_MS = 100.0
COLD_LOAD_FACTOR = 20.0

_GO_DURATION = re.compile(r"[+-]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|μs|ms|s|m|h)")


def model_key(name: object) -> str:
    """Ollama's model name as it resolves it: ``llama3`` is ``llama3:latest``."""
    text = name if isinstance(name, str) else ""
    return text if ":" in text.rsplit("/", 1)[-1] else f"{text}:latest"


def unloads(keep_alive: object) -> bool:
    """``keep_alive`` of zero (``0``, ``"0"``, ``"0s"``, ``"0m0s"``): unload when idle."""
    if isinstance(keep_alive, bool):
        return False
    if isinstance(keep_alive, int | float):
        return keep_alive == 0
    if not isinstance(keep_alive, str):
        return False
    if keep_alive.strip() in ("0", "+0", "-0"):
        return True
    if not _GO_DURATION.fullmatch(keep_alive):
        return False
    return all(float(number) == 0 for number in _DURATION_PART.findall(keep_alive))


class OllamaPlanner:
    """Session affinity without slots: the affinity planner decides (identity, bytes,
    repair), this adds the cached-token estimate and the model lifecycle."""

    def __init__(self, inner: AffinityPlanner, metrics: Metrics, logger: logging.Logger,
                 upstream: str) -> None:
        self.inner = inner
        self.store = inner.store
        self.metrics = metrics
        self.log = logger
        self.upstream = upstream
        self._warm_load_ms: dict[str, float] = {}  # per model, the smallest warm load seen

    async def plan(self, incoming: Incoming, backend: Backend) -> Plan:
        plan = await self.inner.plan(incoming, backend)
        plan.want = None  # Ollama chooses the slot
        session = self.store.get(plan.session) if plan.session else None
        if session is None:
            return plan
        state = session.engine_cache
        model = model_key(plan.body.get("model"))
        reusable = 0
        if state.cold is not None:
            plan.notes["cache"] = f"cold: {state.cold}"
        elif session.last_decision == "resumed" and state.model == model:
            reusable = session.prompt_tokens
        plan.cached_estimate = _Estimate(self, model, reusable)
        plan.engine_resumed = reusable > 0
        return plan

    async def on_lease(self, plan: Plan, lease: Lease) -> None:
        return None  # never called: no slot leases in front of Ollama

    def commit(self, plan: Plan, outcome: Outcome) -> None:
        self.inner.commit(plan, outcome)
        session = self.store.get(plan.session) if plan.session else None
        if session is None or not outcome.ok:
            return
        model = model_key(plan.body.get("model"))
        state = session.engine_cache
        state.model = model
        figures = outcome.figures
        if self.cold_load(model, figures):
            plan.notes["cache"] = f"cold: model loaded ({figures.load_ms:.0f} ms)"
            self.lost(model, f"model {model} was loaded again (load_duration "
                      f"{figures.load_ms:.0f} ms)", "model_loaded", keep=session)
        elif figures.load_ms is not None:
            warm = self._warm_load_ms.get(model, figures.load_ms)
            self._warm_load_ms[model] = min(warm, figures.load_ms)
        if plan.engine_resumed and figures.cached_tokens == 0:
            plan.notes["cache"] = "cold: a resumed session got no cached tokens"
            self.lost(model, f"model {model} reported 0 cached tokens for a session it held",
                      "cached_dropped", keep=session)
        state.cold = None  # Ollama now holds this session's prompt
        if unloads(plan.body.get("keep_alive")):
            self.lost(model, f"keep_alive 0 unloaded {model} after the request", "unloaded")

    def cold_load(self, model: str, figures: Figures) -> bool:
        """``load_duration`` says the model was loaded for this request."""
        if figures.load_ms is None:
            return False
        warm = self._warm_load_ms.get(model)
        threshold = COLD_LOAD_MIN_MS if warm is None else max(COLD_LOAD_MIN_MS,
                                                              COLD_LOAD_FACTOR * warm)
        return figures.load_ms >= threshold

    def lost(self, model: str | None, reason: str, kind: str, *,
             keep: Session | None = None) -> None:
        """Every session of this lane on ``model`` (on any model, for None) but ``keep`` is
        cold now; other lanes' sessions keep what their engines hold."""
        marked = 0
        for session in self.store:
            state = session.engine_cache
            if session is keep or session.backend not in (self.upstream, None) or (
                    model is not None and state.model != model):
                continue
            if state.cold is None:
                marked += 1
            state.cold = reason
            session.last_decision, session.last_reason = "cold", reason
        if marked:
            self.metrics.cache_lost.labels(self.upstream, kind).inc(marked)
            log_event(self.log, logging.INFO, "cache lost", upstream=self.upstream,
                      model=model, sessions=marked, reason=reason)

    def engine_lost(self, reason: str) -> None:
        """The engine stopped answering: if it restarted, every cache is gone."""
        self.lost(None, reason, "engine_unreachable")


class _Estimate:
    """The cached tokens a request is estimated to reuse, decided once its figures are in:
    nothing when the model had to be loaded for it, never the whole prompt (the engine
    always evaluates the last prompt token)."""

    def __init__(self, planner: OllamaPlanner, model: str, reusable: int) -> None:
        self._planner = planner
        self._model = model
        self._reusable = reusable

    def __call__(self, figures: Figures) -> int:
        if self._planner.cold_load(self._model, figures):
            return 0
        return max(0, min(self._reusable, (figures.prompt_tokens or 0) - 1))


# ------------------------------------------------------------------------ native routes

async def lifecycle(http: httpx.AsyncClient, planner: OllamaPlanner | None, request: Request,
                    client: ClientRequest, raw: bytes, *, engine_key: bool = False) -> Response:
    """A model load or unload request (``/api/chat`` with no messages, ``/api/generate``
    with an empty prompt) goes to Ollama as it came (``engine_key``, configured tenants:
    with the engine's key, never the tenant's); a load or an unload empties the model's
    cache, which the planner is told."""
    body = client.body
    model = model_key(body.get("model"))
    loaded = await _is_loaded(http, model)
    response = await forward(request, http, raw,
                             drop_headers=CREDENTIAL_HEADERS if engine_key else (),
                             operator=engine_key)
    if planner is not None and response.status_code < 400:
        if unloads(body.get("keep_alive")):
            planner.lost(model, f"unload of {model} requested (keep_alive 0)", "unloaded")
        elif not loaded:
            planner.lost(model, f"load of {model} requested while it was not loaded",
                         "model_loaded")
    return response


async def _is_loaded(http: httpx.AsyncClient, model: str) -> bool:
    """Whether ``/api/ps`` lists the model (False when it cannot be read: assume a load)."""
    try:
        with map_httpx_errors("GET /api/ps"):
            response = await http.get("/api/ps")
        models = response.json().get("models") if response.status_code == 200 else None
    except (UpstreamError, ValueError, AttributeError):
        return False
    return isinstance(models, list) and any(
        isinstance(m, Mapping) and model in (m.get("name"), m.get("model")) for m in models)
