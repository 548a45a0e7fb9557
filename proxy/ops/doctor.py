"""``prefixpin doctor``: which llama-server settings defeat prompt caching, and the fix.

What it reads, strongest evidence first:

1. The server's own command line and ``LLAMA_ARG_*`` environment, when the upstream is a
   loopback address and ``/proc`` shows which process listens on its port (same host, and
   permission to read it); the binary's ``--help`` then gives this build's defaults.
2. HTTP: ``/health``, ``/props``, ``/slots``, ``/metrics``, ``/v1/models``, and a
   ``POST /slots/0?action=<invalid>``: without ``--slot-save-path`` it answers 501 before
   looking at the action; with it, 400 "Invalid action". It never erases anything.
3. Behaviour: a few tiny completions pinned to the two emptiest idle slots (about 150
   prompt tokens in all; ``--no-probe`` turns them off). They show whether the build
   streams ``prompt_progress``, whether a resent prompt is reused (``--no-cache-prompt``),
   whether starting a request clears the other idle slots (unified KV with idle-slot
   caching, as ``-np auto`` sets up) and whether such a slot comes back from host RAM,
   and whether a prompt that shares only a prefix reuses it (sliding-window models without
   ``--swa-full`` and recurrent models cannot roll back). ``--probe-context-shift`` adds
   one request that fills a slot to its end, the only way to see context shift over HTTP.
   ``--probe-shared-cache`` shows whether the host prompt cache (``--cache-ram``) crosses
   slots: a ~200-token prompt cached on one slot, pushed out of it, then asked for on
   another slot; a cache hit there means tenants on this server can read each other's
   cached prefixes (``proxy.listen.isolation``). ``--probe-eviction`` measures, in tokens, what
   survives on one slot: A's next turn on a warm slot, after an unrelated prompt pushed A
   out (the host prompt cache), and after a save, erase and restore (``--slot-save-path``),
   both as an exact extension of what the slot evaluated and as the chat template renders
   the next turn (templates that rewrite the last assistant turn, such as Qwen3.5's, part
   from the slot there; hybrid/recurrent and sliding-window memory cannot roll back).
4. The GGUF metadata, when ``/props.model_path`` is a readable file here: sliding window,
   recurrent layers, and the KV bytes a full slot takes (to judge ``--cache-ram``).

Collecting is I/O (1 and 4 are ``proxy.engine.engine_facts``, which parking reads too); ``diagnose``
and ``recommend`` are pure functions of what was collected, ``render_text`` prints them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx

from prefixpin.core.cpu import AMX_CRASH, crash_advice, has_amx
from prefixpin.core.errors import UpstreamUnavailableError
from prefixpin.proxy.engine.engine_facts import (
    FLAG_SPECS,
    KV_TYPE_BYTES,
    ModelFacts,
    ServerFlags,
    read_engine_facts,
)
from prefixpin.proxy.session.tokens import common_prefix
from prefixpin.proxy.settings import environment

Status = Literal["problem", "warning", "ok", "unknown"]

DEFAULT_UPSTREAM = "http://127.0.0.1:8080"
DEFAULT_MIN_CTX = 8192
EXIT_OK, EXIT_PROBLEMS, EXIT_UNREACHABLE = 0, 1, 2

# An action llama-server does not know: it answers 400 "Invalid action" after checking
# --slot-save-path (501 when missing), and erases, saves or restores nothing.
SLOT_ACTION_PROBE = "prefixpin-doctor-probe"

# Probe prompt sizes in tokens. The first one is big enough that its KV state (SmolLM2:
# ~23 KiB a token) exceeds a 1 MiB --cache-ram, small enough to cost nothing on a GPU.
PROBE_TOKENS, SECOND_TOKENS, EDIT_KEEP, EDIT_TAIL = 64, 16, 32, 8
SHARED_TOKENS = 200  # --probe-shared-cache: the prefix one "tenant" leaves in the cache
CONTEXT_SHIFT_PREDICT = 12

# --probe-eviction: a small chat (a ~200-token system prompt, one user turn) and its next
# turn. A few predicted tokens give A a reply to extend; the slot file keeps its fixed name,
# so a second run overwrites the first one's instead of adding to the directory.
EVICTION_SYSTEM = {"role": "system", "content": (
    "You are the assistant of a small bakery. Answer questions about opening hours, "
    "bread, cakes and orders politely and briefly. ") * 8}
EVICTION_USER = {"role": "user", "content": "Do you bake rye bread on Sundays?"}
EVICTION_NEXT = {"role": "user", "content": "And on Mondays?"}
EVICTION_PREDICT = 4
EVICTION_FILE = "prefixpin-doctor-eviction.bin"
# Stands in for the assistant's reply when rendering the next turn: what the template puts
# after it is the next turn as it renders it, whatever the reply.
REPLY_MARK = "prefixpin-doctor-reply-mark"
# The steps, in the order they run and print.
WARM, WARM_NEXT, EVICTED, RESTORED, RESTORED_NEXT = (
    "warm", "warm-next-turn", "evicted", "restored", "restored-next-turn")
STEP_WORDS = {
    WARM: "warm slot, exact extension",
    WARM_NEXT: "warm slot, next chat turn",
    EVICTED: "pushed out by another prompt, exact extension",
    RESTORED: "saved, erased and restored, exact extension",
    RESTORED_NEXT: "saved, erased and restored, next chat turn",
}


# ---------------------------------------------------------------- probes over HTTP

@dataclass(frozen=True, slots=True)
class Survival:
    """One --probe-eviction step: of ``prompt`` tokens, ``cached`` came from the cache
    (timings.cache_n); ``reusable`` is how many of them matched what the slot had evaluated
    before, the most it could have kept."""

    cached: int
    prompt: int
    reusable: int

    @property
    def kept(self) -> bool:
        return self.reusable > 0 and self.cached >= self.reusable // 2

    def words(self) -> str:
        return (f"cached {self.cached} of {self.prompt} prompt tokens "
                f"({self.reusable} reusable)")


@dataclass(frozen=True, slots=True)
class _Turn:
    """A's first request as the slot evaluated it, and the two ways its next turn comes."""

    held: list[int]  # A's prompt and its reply but the last token (sampled, not evaluated)
    exact: list[int]  # A's prompt, its reply's tokens, the next user turn: token for token
    natural: list[int]  # the whole chat rendered again by the template, next turn included


@dataclass(slots=True)
class ProbeResults:
    first_slot: int = 0
    second_slot: int = 0
    prompt_tokens_sent: int = 0
    return_progress: bool | None = None
    cache_prompt: bool | None = None
    idle_slots_cleared: bool | None = None
    idle_slot_restored: bool | None = None
    rollback: bool | None = None
    context_shift: bool | None = None
    shared_cache: bool | None = None  # a prefix cached on one slot was reused on another
    shared_cache_n: int | None = None  # cache_n of that request
    shared_cache_slots: tuple[int, int] = (0, 0)  # (where it was cached, where it was asked)
    eviction: dict[str, Survival] = field(default_factory=dict)  # --probe-eviction, by step
    eviction_slot: int | None = None
    errors: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Observations:
    upstream: str
    props: dict[str, Any]
    health: int
    slots: list[dict[str, Any]] | None
    slots_status: int
    metrics_status: int
    slot_action_status: int
    slot_action_message: str
    model_meta: dict[str, Any] | None
    flags: ServerFlags | None
    model: ModelFacts | None
    model_note: str
    probes: ProbeResults | None

    @property
    def total_slots(self) -> int:
        return int(self.props.get("total_slots") or len(self.slots or []) or 1)

    @property
    def slot_ctx(self) -> int | None:
        n = (self.props.get("default_generation_settings") or {}).get("n_ctx")
        return int(n) if isinstance(n, int) else None


class _Client:
    """A thin httpx wrapper: every connection failure becomes UpstreamUnavailableError."""

    def __init__(self, base: str, timeout: float, api_key: str | None = None) -> None:
        # Every request doctor sends is its own: with the engine's --api-key, it carries it.
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.http = httpx.Client(base_url=base.rstrip("/"), timeout=timeout, headers=headers)

    def get(self, path: str) -> httpx.Response:
        try:
            return self.http.get(path)
        except httpx.TransportError as exc:
            raise UpstreamUnavailableError(f"{self.http.base_url}{path}: {exc}") from exc

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        try:
            return self.http.post(path, json=body)
        except httpx.TransportError as exc:
            raise UpstreamUnavailableError(f"{self.http.base_url}{path}: {exc}") from exc

    @contextlib.contextmanager
    def stream(self, path: str, body: dict[str, Any]) -> Iterator[httpx.Response]:
        try:
            # llama-server closes the connection after a stream; a pooled reuse of it
            # would fail the next request with "Server disconnected".
            with self.http.stream("POST", path, json=body,
                                  headers={"Connection": "close"}) as response:
                yield response
        except httpx.TransportError as exc:
            raise UpstreamUnavailableError(f"{self.http.base_url}{path}: {exc}") from exc

    def close(self) -> None:
        self.http.close()


def _json_or_empty(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return {}


def _error_message(response: httpx.Response) -> str:
    body = _json_or_empty(response)
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", ""))
    return response.text[:200]


class _Prober:
    """The tiny completions. Each is pinned (``id_slot``) to one of the two emptiest idle
    slots, so a busy server loses at most those two slots' cached prompts."""

    def __init__(self, client: _Client, slots: list[dict[str, Any]] | None, total: int) -> None:
        self.client = client
        self.results = ProbeResults()
        self.first, self.second = _probe_slots(slots, total)
        self.results.first_slot, self.results.second_slot = self.first, self.second

    def run(self, *, context_shift: bool, slot_ctx: int | None,
            shared_cache: bool = False, eviction: bool = False,
            slot_files: bool = False) -> ProbeResults:
        try:
            self._run_all(context_shift, slot_ctx)
            if shared_cache:
                self._shared_cache()
            if eviction:
                self._eviction(slot_files)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            # A probe that fails leaves its finding unknown; the error is reported.
            self.results.errors.append(f"{type(exc).__name__}: {exc}")
        return self.results

    def _run_all(self, context_shift: bool, slot_ctx: int | None) -> None:
        r = self.results
        first = self._tokens("prefixpin doctor probe: the quick brown fox", PROBE_TOKENS)
        second = self._tokens("a different second probe prompt, seven", SECOND_TOKENS)
        tail = self._tokens("and then the prompt changes here", EDIT_TAIL)
        r.return_progress = self._streams_progress(first, self.first)
        r.cache_prompt = self._cached(first, self.first) >= len(first) // 2
        holder = self.first
        if self.second != self.first:
            self._cached(second, self.second)
            left = self._slot_tokens(self.first)
            r.idle_slots_cleared = None if left is None else left == 0
            if r.idle_slots_cleared and r.cache_prompt:
                # The second slot holds another prompt: llama-server saves it to host RAM
                # and looks the request up there (the pinned slot is not empty).
                r.idle_slot_restored = self._cached(first, self.second) >= len(first) // 2
                holder = self.second
        if r.cache_prompt:
            edited = first[:EDIT_KEEP] + tail
            r.rollback = self._cached(edited, holder) >= EDIT_KEEP // 2
        if context_shift and slot_ctx:
            r.context_shift = self._shifts_context(first, holder, slot_ctx)

    def _shared_cache(self) -> None:
        """A prefix cached on one slot, then pushed out of it by an unrelated prompt (which
        makes llama-server save it to its host RAM cache, when it has one), then asked for
        on the other slot, itself holding something unrelated: a cache hit there came from
        a cache all slots read."""
        r = self.results
        prefix = self._tokens("Shared cache probe. You are the assistant of tenant A; its "
                              "private instructions follow, word by word:", SHARED_TOKENS)
        unrelated = self._tokens("zebra quartz violin harbor eleven", SHARED_TOKENS)
        filler = self._tokens("mango seventy lantern", SECOND_TOKENS)
        tail = self._tokens("and the question is what comes next", EDIT_TAIL)
        self._complete(prefix, self.first)
        self._complete(unrelated, self.first)  # the prefix leaves its slot
        asked = self.second
        if asked != self.first:
            self._complete(filler, asked)
        cached = self._cached(prefix + tail, asked)
        r.shared_cache_n, r.shared_cache_slots = cached, (self.first, asked)
        r.shared_cache = cached >= len(prefix) // 2

    def _eviction(self, slot_files: bool) -> None:
        """A -> B -> A on one slot. Each step starts from A's first request, so that what
        the slot held before it is known. With --slot-save-path (every slot action needs
        it, erase included) the slot is erased at the end."""
        slot, steps = self.first, self.results.eviction
        self.results.eviction_slot = slot
        suffix = self._next_turn_suffix()
        turn = self._first_turn(slot, suffix)
        steps[WARM] = self._survival(turn.exact, turn.held, slot)
        turn = self._first_turn(slot, suffix)
        steps[WARM_NEXT] = self._survival(turn.natural, turn.held, slot)
        turn = self._first_turn(slot, suffix)
        self._complete(self._tokens("zebra quartz violin harbor eleven", SHARED_TOKENS), slot,
                       cache_prompt=True)
        steps[EVICTED] = self._survival(turn.exact, turn.held, slot)
        if slot_files:
            turn = self._first_turn(slot, suffix)
            self._slot_action(slot, "save")
            for step, prompt in ((RESTORED, turn.exact), (RESTORED_NEXT, turn.natural)):
                # Erased first: what the request then finds came from the file alone.
                self._slot_action(slot, "erase")
                self._slot_action(slot, "restore")
                steps[step] = self._survival(prompt, turn.held, slot)
            self._slot_action(slot, "erase")

    def _first_turn(self, slot: int, suffix: list[int]) -> _Turn:
        prompt = self._rendered([EVICTION_SYSTEM, EVICTION_USER])
        data = self._complete(prompt, slot, n_predict=EVICTION_PREDICT, return_tokens=True,
                              cache_prompt=True)
        reply = [int(t) for t in data["tokens"]]
        said = {"role": "assistant", "content": str(data.get("content") or "")}
        natural = self._rendered([EVICTION_SYSTEM, EVICTION_USER, said, EVICTION_NEXT])
        return _Turn(prompt + reply[:-1], prompt + reply + suffix, natural)

    def _next_turn_suffix(self) -> list[int]:
        """What the template writes after an assistant reply: its end and the next user
        turn, up to the generation prompt."""
        said = {"role": "assistant", "content": REPLY_MARK}
        text = self._template([EVICTION_SYSTEM, EVICTION_USER, said, EVICTION_NEXT])
        if REPLY_MARK not in text:
            raise ValueError("the chat template does not render the assistant's reply")
        return self._tokenize(text.rsplit(REPLY_MARK, 1)[1], add_special=False)

    def _template(self, messages: list[dict[str, str]]) -> str:
        response = self.client.post("/apply-template", {"messages": messages})
        response.raise_for_status()
        return str(response.json()["prompt"])

    def _rendered(self, messages: list[dict[str, str]]) -> list[int]:
        # As llama-server tokenizes a text prompt: with BOS, special tokens parsed.
        return self._tokenize(self._template(messages), add_special=True)

    def _tokenize(self, text: str, *, add_special: bool) -> list[int]:
        response = self.client.post("/tokenize", {"content": text, "add_special": add_special,
                                                  "parse_special": True})
        response.raise_for_status()
        return [t if isinstance(t, int) else int(t["id"]) for t in response.json()["tokens"]]

    def _survival(self, prompt: list[int], held: list[int], slot: int) -> Survival:
        # cache_prompt as a client asks for it: what the engine keeps, whatever its default.
        timings = self._complete(prompt, slot, cache_prompt=True)["timings"]
        cached = int(timings["cache_n"])
        return Survival(cached, cached + int(timings["prompt_n"]), common_prefix(prompt, held))

    def _slot_action(self, slot: int, action: str) -> None:
        response = self.client.post(f"/slots/{slot}?action={action}",
                                    {"filename": EVICTION_FILE})
        response.raise_for_status()

    def _tokens(self, text: str, n: int) -> list[int]:
        words = (text + " ") * (n // 2 + 4)
        response = self.client.post("/tokenize", {"content": words})
        response.raise_for_status()
        tokens = [t if isinstance(t, int) else int(t["id"]) for t in response.json()["tokens"]]
        if len(tokens) < n:
            raise ValueError(f"/tokenize gave {len(tokens)} tokens, wanted {n}")
        return tokens[:n]

    def _complete(self, prompt: list[int], slot: int, **extra: Any) -> dict[str, Any]:
        self.results.prompt_tokens_sent += len(prompt)
        body = {"prompt": prompt, "n_predict": 1, "id_slot": slot, "temperature": 0, **extra}
        response = self.client.post("/completion", body)
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data

    def _cached(self, prompt: list[int], slot: int) -> int:
        return int(self._complete(prompt, slot)["timings"]["cache_n"])

    def _streams_progress(self, prompt: list[int], slot: int) -> bool:
        self.results.prompt_tokens_sent += len(prompt)
        body = {"prompt": prompt, "n_predict": 1, "id_slot": slot, "temperature": 0,
                "stream": True, "return_progress": True}
        seen = False
        with self.client.stream("/completion", body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data: ") and '"prompt_progress"' in line:
                    seen = True
        return seen

    def _slot_tokens(self, slot: int) -> int | None:
        response = self.client.get("/slots")
        if response.status_code != 200:
            return None
        for entry in response.json():
            if entry.get("id") == slot:
                return int(entry.get("n_prompt_tokens") or 0)
        return None

    def _shifts_context(self, seed: list[int], slot: int, slot_ctx: int) -> bool | None:
        """Fill the slot to 4 tokens short of its end and ask for more: without context
        shift generation stops at the end of the context."""
        length = slot_ctx - 4
        prompt = (seed * (length // len(seed) + 1))[:length]
        data = self._complete(prompt, slot, n_predict=CONTEXT_SHIFT_PREDICT, ignore_eos=True)
        predicted = int(data["timings"]["predicted_n"])
        return predicted >= CONTEXT_SHIFT_PREDICT



def _probe_slots(slots: list[dict[str, Any]] | None, total: int) -> tuple[int, int]:
    if not slots:
        return 0, min(1, total - 1)
    ranked = sorted(slots, key=lambda s: (bool(s.get("is_processing")),
                                          int(s.get("n_prompt_tokens") or 0), int(s["id"])))
    first = int(ranked[0]["id"])
    second = int(ranked[1]["id"]) if len(ranked) > 1 else first
    return first, second


def collect(upstream: str, *, probe: bool = True, local: bool = True,
            probe_context_shift: bool = False, probe_shared_cache: bool = False,
            probe_eviction: bool = False, timeout: float = 120.0,
            api_key: str | None = None) -> Observations:
    """Read everything doctor judges. Raises UpstreamUnavailableError when the server
    cannot be reached or is not ready. ``api_key``: the server's --api-key."""
    client = _Client(upstream, timeout, api_key)
    try:
        health = client.get("/health")
        if health.status_code != 200:
            raise UpstreamUnavailableError(
                f"{upstream}/health answered {health.status_code}: {_error_message(health)}")
        props_response = client.get("/props")
        if props_response.status_code == 401:  # /health is public even with --api-key
            raise UpstreamUnavailableError(
                f"{upstream}/props answered 401: {_error_message(props_response)} (the "
                "server runs with --api-key: give it as --engine-api-key or "
                "PREFIXPIN_ENGINE_API_KEY)")
        props = _json_or_empty(props_response)
        slots_response = client.get("/slots")
        slots = slots_response.json() if slots_response.status_code == 200 else None
        metrics = client.get("/metrics")
        action = client.post(f"/slots/0?action={SLOT_ACTION_PROBE}", {})
        models = _json_or_empty(client.get("/v1/models"))
        meta = next(iter(models.get("data") or [{}])).get("meta") if isinstance(models, dict) \
            else None
        facts = read_engine_facts(upstream if local else None,
                                  props if isinstance(props, dict) else {})
        flags, model, model_note = facts.flags, facts.model, facts.model_note
        results = None
        if probe:
            total = int(props.get("total_slots") or len(slots or []) or 1)
            slot_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
            results = _Prober(client, slots, total).run(
                context_shift=probe_context_shift, slot_ctx=slot_ctx,
                shared_cache=probe_shared_cache, eviction=probe_eviction,
                slot_files=_slot_files_on(action.status_code, _error_message(action)))
        return Observations(upstream, props if isinstance(props, dict) else {},
                            health.status_code, slots, slots_response.status_code,
                            metrics.status_code, action.status_code, _error_message(action),
                            meta, flags, model, model_note, results)
    finally:
        client.close()


# ---------------------------------------------------------------- the judgement

@dataclass(frozen=True, slots=True)
class Finding:
    key: str
    status: Status
    flag: str  # the llama-server flag this is about (the fix, or the culprit)
    summary: str
    fix: str = ""
    evidence: str = ""


def diagnose(obs: Observations, *, min_ctx: int = DEFAULT_MIN_CTX) -> list[Finding]:
    findings = [
        _metrics(obs), _slots_endpoint(obs), _slot_save_path(obs), _cache_prompt(obs),
        _unified_idle_slots(obs), _rollback(obs), _context_shift(obs), _return_progress(obs),
        _slot_context(obs, min_ctx), _slot_similarity(obs), _shared_cache(obs),
        cpu_paths_finding(obs, amx=has_amx()),
    ]
    eviction = _eviction(obs)  # opt-in: no finding unless --probe-eviction ran
    return findings if eviction is None else [*findings, eviction]


def cpu_paths_finding(obs: Observations, *, amx: bool) -> Finding:
    """An upstream on this host, on a CPU with AMX, with weight repacking on. This CPU's
    flags say something only of a server whose command line was read here (this host)."""
    if obs.flags is None:
        return Finding("cpu-paths", "unknown", "--no-repack",
                       "the server's command line is not readable here, so its host's CPU is "
                       "not known: on a CPU with AMX (amx_int8), start it with --no-repack")
    if not amx:
        return Finding("cpu-paths", "ok", "--repack",
                       "no AMX on this CPU: llama.cpp's repacked kernels are safe here")
    evidence = _flag_evidence(obs, "repack")
    if obs.flags is not None and obs.flags.boolean("repack") is False:
        return Finding("cpu-paths", "ok", "--no-repack", "AMX kernels off (--no-repack)",
                       evidence=evidence)
    return Finding("cpu-paths", "warning", "--no-repack", AMX_CRASH,
                   "add --no-repack (or LLAMA_ARG_REPACK=0), or build llama.cpp with "
                   "-DGGML_NATIVE=OFF", evidence)


def _flag_evidence(obs: Observations, key: str) -> str:
    flags = obs.flags
    if flags is None or flags.value(key) is None:
        return ""
    if flags.is_set(key):
        spec, value = FLAG_SPECS[key], flags.value(key)
        if spec.kind in ("bool", "switch"):
            given = spec.names[-1] if value else (spec.negs or spec.names)[-1]
            return f"{given}{'' if value or spec.negs else ' off'} on the {flags.source}"
        return f"{spec.names[-1]} {value} on the {flags.source}"
    return (f"{FLAG_SPECS[key].names[-1]} not on the {flags.source}: this build's default "
            f"is {flags.value(key)}")


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _metrics(obs: Observations) -> Finding:
    if obs.metrics_status == 200:
        return Finding("metrics", "ok", "--metrics", "/metrics is on",
                       evidence="GET /metrics answered 200")
    if obs.metrics_status == 501:
        return Finding("metrics", "problem", "--metrics",
                       "llama-server runs without --metrics: its own cache counters "
                       "(llamacpp:prompt_tokens_cached_total) cannot be scraped",
                       "add --metrics", "GET /metrics answered 501")
    return Finding("metrics", "unknown", "--metrics", "could not tell whether /metrics is on",
                   evidence=f"GET /metrics answered {obs.metrics_status}")


def _slots_endpoint(obs: Observations) -> Finding:
    if obs.slots is not None:
        return Finding("slots-endpoint", "ok", "--slots", "/slots is on",
                       evidence="GET /slots answered 200")
    return Finding("slots-endpoint", "problem", "--no-slots",
                   "/slots is off: prefixpin cannot see which slot holds which session",
                   "remove --no-slots", f"GET /slots answered {obs.slots_status}")


def _slot_files_on(status: int, message: str) -> bool:
    """The invalid slot action got past the --slot-save-path check."""
    return status == 400 and "action" in message.lower()


def _slot_save_path(obs: Observations) -> Finding:
    evidence = (f"POST /slots/0?action={SLOT_ACTION_PROBE} answered {obs.slot_action_status} "
                f"{obs.slot_action_message!r}")
    if obs.slot_action_status == 501 and "slot-save-path" in obs.slot_action_message:
        return Finding("slot-save-path", "problem", "--slot-save-path",
                       "no --slot-save-path: slots cannot be saved to disk, so a session "
                       "evicted from its slot (or a restart) means a full re-prefill",
                       "add --slot-save-path DIR (an existing directory on a fast disk)",
                       evidence)
    if _slot_files_on(obs.slot_action_status, obs.slot_action_message):
        return Finding("slot-save-path", "ok", "--slot-save-path",
                       "--slot-save-path is set: slots can be parked on disk", evidence=evidence)
    return Finding("slot-save-path", "unknown", "--slot-save-path",
                   "could not tell whether --slot-save-path is set", evidence=evidence)


def _cache_prompt(obs: Observations) -> Finding:
    probed = obs.probes.cache_prompt if obs.probes else None
    from_flags = obs.flags.boolean("cache_prompt") if obs.flags else None
    on = probed if probed is not None else from_flags
    evidence = (f"the same {PROBE_TOKENS}-token prompt sent twice to one slot was "
                f"{'reused' if probed else 'recomputed'}") if probed is not None else \
        _flag_evidence(obs, "cache_prompt")
    if on is None:
        return Finding("cache-prompt", "unknown", "--cache-prompt",
                       "could not tell whether prompt caching is on (no probe ran)")
    if on:
        return Finding("cache-prompt", "ok", "--cache-prompt", "prompt caching is on",
                       evidence=evidence)
    return Finding("cache-prompt", "problem", "--no-cache-prompt",
                   "prompt caching is off (--no-cache-prompt): every request re-reads its "
                   "whole prompt", "remove --no-cache-prompt", evidence)


def _slot_kv_mib(obs: Observations) -> float | None:
    if obs.model is None or obs.model.kv_elements_per_token is None or obs.slot_ctx is None:
        return None
    kinds = [str(obs.flags.value(k) or "f16") if obs.flags else "f16"
             for k in ("cache_type_k", "cache_type_v")]
    per_element = sum(KV_TYPE_BYTES.get(kind.lower(), 2.0) for kind in kinds) / 2
    return obs.model.kv_elements_per_token * per_element * obs.slot_ctx / 2**20


def _unified_idle_slots(obs: Observations) -> Finding:
    """-np auto means 4 slots on one unified KV pool, and with idle-slot caching (on by
    default) every new request saves the other idle slots to host RAM and clears them: a
    session survives a switch only if it fits --cache-ram."""
    flags, probes = obs.flags, obs.probes
    auto = flags.np_auto() if flags else False
    cache_ram = flags.number("cache_ram") if flags else None
    cleared, evidence = _idle_slots_cleared(obs)
    if cleared is None:
        return Finding("np-unified-idle", "unknown", "-np",
                       "could not tell whether idle slots are cleared when a request starts "
                       "(needs /slots and two slots, or the server's command line)")
    if not cleared:
        return Finding("np-unified-idle", "ok", "-np",
                       f"idle slots keep their KV cache ({obs.total_slots} slots)",
                       evidence=_join(*evidence))
    name = "-np auto" if auto or (flags is None and obs.total_slots == 4) else "--kv-unified"
    slot_mib = _slot_kv_mib(obs)
    restored = probes.idle_slot_restored if probes else None
    if restored is not None:
        evidence.append(f"a {PROBE_TOKENS}-token prompt cleared that way "
                        f"{'came back from host RAM' if restored else 'was gone'}")
    if slot_mib is not None:
        evidence.append(f"a full slot holds about {slot_mib:.0f} MiB of KV")
    if cache_ram is not None:
        evidence.append(_flag_evidence(obs, "cache_ram"))
    ram = ("no limit" if cache_ram == -1 else f"{cache_ram:.0f} MiB" if cache_ram is not None
           else "its size is not visible over HTTP; 8192 MiB by default")
    too_small = (slot_mib is not None and cache_ram is not None and cache_ram != -1
                 and slot_mib > cache_ram)
    lost = restored is False or too_small
    summary = (f"{name}: {obs.total_slots} slots share one KV pool (unified KV), and each new "
               "request saves the other idle slots to host RAM and clears them; a session "
               f"comes back only if it fits in --cache-ram ({ram})"
               + ("; here idle sessions are lost" if lost else ""))
    need = f" to at least {slot_mib + 1:.0f} MiB" if slot_mib is not None else ""
    fix = (f"give -np explicitly (e.g. -np {obs.total_slots}: unified KV is then off and idle "
           f"slots keep their KV), or add --no-cache-idle-slots, or raise --cache-ram{need}")
    return Finding("np-unified-idle", "problem" if lost else "warning", name, summary, fix,
                   _join(*evidence))


def _idle_slots_cleared(obs: Observations) -> tuple[bool | None, list[str]]:
    flags, probes = obs.flags, obs.probes
    if probes and probes.idle_slots_cleared is not None:
        verb = "emptied" if probes.idle_slots_cleared else "left alone"
        return probes.idle_slots_cleared, [
            f"a request on slot {probes.second_slot} {verb} idle slot {probes.first_slot}"]
    if flags is None:
        return None, []
    if not flags.unified_kv():
        return False, [_flag_evidence(obs, "n_parallel") or "unified KV not requested"]
    cleared = flags.clears_idle_slots()
    if cleared is None:
        return None, []
    return cleared, [x for x in (_flag_evidence(obs, "n_parallel"),
                                 _flag_evidence(obs, "cache_idle_slots")) if x]


def _rollback(obs: Observations) -> Finding:
    """Sliding-window (without --swa-full) and recurrent models cannot go back to an
    earlier position: a prompt that changes before its last few tokens is re-read."""
    model = obs.model
    swa_full = obs.flags.boolean("swa_full") if obs.flags else None
    probed = obs.probes.rollback if obs.probes else None
    seen = "" if probed is None else (
        f"a prompt sharing its first {EDIT_KEEP} tokens with the previous one on the same "
        f"slot reused {'them' if probed else 'none of them'}")
    swa_evidence = _flag_evidence(obs, "swa_full")
    fix = "add --swa-full (costs VRAM: the sliding-window layers then keep the whole context)"
    if (full_kv := _slot_kv_mib(obs)) is not None and obs.slot_ctx is not None:
        fix = ("add --swa-full: the sliding-window layers then keep the whole context, so "
               f"each slot's KV cache grows to at most {full_kv:.0f} MiB (every layer at "
               f"{obs.slot_ctx} tokens), in exchange for reusing any shared prefix and "
               "restoring parked sessions")
    if model is not None and model.recurrent:
        return Finding("checkpoints", "ok" if probed else "warning", "-cms",
                       f"{model.architecture} has recurrent layers: an edited history falls "
                       "back to the nearest context checkpoint (every -cms tokens, 8192 by "
                       "default) or to a full re-prefill",
                       "lower -cms (e.g. -cms 1024) and raise -ctxcp for finer rollback, at "
                       "the cost of host RAM", _join(obs.model_note, seen))
    if model is not None and model.sliding_window == 0:
        return Finding("swa-full", "ok", "--swa-full",
                       f"{model.architecture} uses full attention: any shared prefix is reused",
                       evidence=_join(obs.model_note, seen))
    what = (f"{model.architecture} uses sliding-window attention ({model.sliding_window} "
            "tokens)") if model is not None else "the model"
    if swa_full is False or probed is False:
        cause = "without --swa-full" if model is not None else (
            "cannot reuse a prefix once the prompt changes: a sliding-window model (Gemma "
            "2/3, ...) without --swa-full, or a recurrent/hybrid model")
        return Finding("swa-full", "problem", "--swa-full",
                       f"{what} {cause}: a prompt that changes anywhere but in its last few "
                       "tokens is re-read from the start (unless a context checkpoint sits "
                       "before the change)", fix, _join(obs.model_note, swa_evidence, seen))
    if swa_full or probed:
        return Finding("swa-full", "ok", "--swa-full",
                       f"{what}: a shared prefix is reused after an edit",
                       evidence=_join(swa_evidence, seen))
    return Finding("swa-full", "unknown", "--swa-full",
                   f"{what}: could not tell whether a shared prefix is reused after an edit",
                   fix if model is not None else "", obs.model_note)


def _context_shift(obs: Observations) -> Finding:
    from_flags = obs.flags.boolean("ctx_shift") if obs.flags else None
    probed = obs.probes.context_shift if obs.probes else None
    on = from_flags if from_flags is not None else probed
    if from_flags is not None:
        evidence = _flag_evidence(obs, "ctx_shift")
    elif probed is not None:
        ending = "kept generating" if probed else "stopped there"
        evidence = f"a request filling its slot to the end {ending}"
    else:
        evidence = ""
    fix = "remove --context-shift (or add --no-context-shift)"
    if on is None:
        return Finding("context-shift", "unknown", "--context-shift",
                       "context shift is not visible over HTTP; run doctor on the server's "
                       "host, or with --probe-context-shift (fills one slot to its end)",
                       fix)
    if on:
        return Finding("context-shift", "problem", "--context-shift",
                       "context shift is on: a generation that reaches the end of the slot "
                       "drops half of the history and rewrites the slot, so the next turn "
                       "re-reads the prompt from the first dropped token", fix, evidence)
    return Finding("context-shift", "ok", "--context-shift", "context shift is off",
                   evidence=evidence)


def _return_progress(obs: Observations) -> Finding:
    probed = obs.probes.return_progress if obs.probes else None
    build = obs.props.get("build_info", "unknown build")
    if probed is None:
        return Finding("return-progress", "unknown", "(build)",
                       "could not tell whether this build streams prompt_progress",
                       evidence=f"build {build}")
    if probed:
        return Finding("return-progress", "ok", "(build)",
                       "the build streams prompt_progress (cache hit known before prefill)",
                       evidence=f"build {build}: a streaming request with return_progress "
                       "got prompt_progress events")
    return Finding("return-progress", "problem", "(build)",
                   f"this llama-server build ({build}) is too old for return_progress: "
                   "prefixpin cannot see the cache hit or prefill progress before the "
                   "first token", "upgrade llama-server",
                   "a streaming request with return_progress got no prompt_progress")


def _slot_context(obs: Observations, min_ctx: int) -> Finding:
    ctx = obs.slot_ctx
    if ctx is None:
        return Finding("slot-context", "unknown", "-c", "the context per slot is not known")
    evidence = f"/props default_generation_settings.n_ctx = {ctx}"
    if ctx < min_ctx:
        return Finding("slot-context", "problem", "-c",
                       f"each slot holds only {ctx} tokens: agent sessions outgrow it, get "
                       "rejected or compacted, and lose their cached prefix",
                       f"raise -c to slots × at least {min_ctx} (-c is shared by the slots "
                       "unless the KV is unified)", evidence)
    return Finding("slot-context", "ok", "-c", f"{ctx} tokens per slot", evidence=evidence)


def _slot_similarity(obs: Observations) -> Finding:
    sps = obs.flags.number("slot_similarity") if obs.flags else None
    if sps is None:
        return Finding("slot-similarity", "unknown", "-sps",
                       "slot prompt similarity (-sps) is not visible over HTTP")
    evidence = _flag_evidence(obs, "slot_similarity")
    if sps == 0:
        return Finding("slot-similarity", "warning", "-sps",
                       "-sps 0: requests without id_slot go to the least recently used slot, "
                       "not to the one holding their prefix, and every request copies slot "
                       "state through host RAM", "drop -sps 0 (default 0.10)", evidence)
    return Finding("slot-similarity", "ok", "-sps", f"slot prompt similarity {sps:g}",
                   evidence=evidence)


def _shared_cache(obs: Observations) -> Finding:
    """llama-server's host prompt cache is shared by all slots: with several tenants on
    one server, one can learn from ``cached_tokens`` whether it guessed another's prefix."""
    from prefixpin.proxy.listen.isolation import FIX

    probes = obs.probes
    probed = probes.shared_cache if probes else None
    cache_ram = obs.flags.number("cache_ram") if obs.flags else None
    evidence = _flag_evidence(obs, "cache_ram")
    if probes is not None and probed is not None:
        cached_on, asked_on = probes.shared_cache_slots
        seen = (f"a {SHARED_TOKENS}-token prefix cached on slot {cached_on}, then pushed out "
                f"of it, was asked for on slot {asked_on}: cache_n {probes.shared_cache_n}")
        evidence = _join(evidence, seen)
    shared = probed if probed is not None else (None if obs.flags is None else cache_ram != 0)
    if shared is None:
        return Finding("shared-cache", "unknown", "--cache-ram",
                       "could not tell whether the host prompt cache (--cache-ram, 8192 MiB "
                       "by default) is shared by all slots; prefixpin assumes it is and "
                       "serves one namespace (bearer token) on this server. Run doctor on "
                       "the server's host, or with --probe-shared-cache", FIX)
    if not shared:
        return Finding("shared-cache", "ok", "--cache-ram",
                       "no prompt cache crosses slots: several tenants can share this server",
                       evidence=evidence)
    return Finding("shared-cache", "warning", "--cache-ram",
                   "the host prompt cache (--cache-ram) is shared by all slots: a tenant "
                   "whose prompt starts with a guess of another's system prompt reads from "
                   "cached_tokens whether it guessed right, so prefixpin serves one namespace "
                   "(bearer token) on this server and refuses the others", FIX, evidence)


def _memory_kind(obs: Observations) -> str:
    """The model's memory, as the GGUF tells it: what decides what a slot can give back."""
    model = obs.model
    if model is None:
        return "the model"
    if model.recurrent:
        return f"{model.architecture} (hybrid/recurrent memory)"
    if model.sliding_window:
        swa_full = obs.flags.boolean("swa_full") if obs.flags else None
        after = "" if swa_full is None else (
            ", with --swa-full" if swa_full else ", without --swa-full")
        return (f"{model.architecture} (sliding-window attention, {model.sliding_window} "
                f"tokens{after})")
    return f"{model.architecture} (full attention)"


def _eviction(obs: Observations) -> Finding | None:
    """What --probe-eviction measured, judged: the worst loss first. A restore that keeps
    nothing even for an exact extension is a setting (--swa-full); one that keeps only an
    exact extension is the memory's nature (a slot file carries no context checkpoints)."""
    steps = obs.probes.eviction if obs.probes else {}
    if not steps:
        return None
    kind = _memory_kind(obs)
    evidence = _join(*(f"{STEP_WORDS[k]}: {v.words()}" for k, v in steps.items()))
    kept = {k: v.kept for k, v in steps.items()}
    model = obs.model
    sliding = model is not None and model.sliding_window > 0 and not model.recurrent
    if kept.get(WARM) is False:
        return Finding("eviction", "problem", "--cache-prompt",
                       f"{kind}: even a warm slot re-reads the next turn from the start "
                       "(requests asked for cache_prompt)", evidence=evidence)
    if kept.get(RESTORED) is False:
        if sliding or model is None:
            return Finding("eviction", "problem", "--swa-full",
                           f"{kind}: a restored slot keeps nothing, even for an exact "
                           "extension (a slot file holds only the sliding window's last "
                           "cells, and no context checkpoints)",
                           "add --swa-full (costs VRAM: the sliding-window layers then keep "
                           "the whole context)", evidence)
        return Finding("eviction", "problem", "--slot-save-path",
                       f"{kind}: a restored slot keeps nothing, even for an exact extension",
                       evidence=evidence)
    if kept.get(RESTORED_NEXT) is False:
        return Finding("eviction", "warning", "--slot-save-path",
                       f"{kind}: a restored slot is re-processed from token 0 unless the "
                       "request extends it exactly (a slot file carries no context "
                       "checkpoints, and this memory cannot roll back to where the "
                       "template's next turn parts from it)",
                       "keep such sessions resident (enough slots and --cache-ram), or "
                       "send the next turn as an exact extension of the previous prompt "
                       "and reply", evidence)
    if kept.get(EVICTED) is False and RESTORED not in steps:
        return Finding("eviction", "warning", "--cache-ram",
                       f"{kind}: a session pushed out of its slot by another prompt is "
                       "re-read in full (no host prompt cache: --cache-ram 0, or too small); "
                       "slot files (--slot-save-path) were not measured",
                       "add --slot-save-path (prefixpin parks sessions there), or raise "
                       "--cache-ram", evidence)
    if kept.get(WARM_NEXT) is False:
        return Finding("eviction", "warning", "-cms",
                       f"{kind}: the next chat turn is re-read from the start, even on a "
                       "warm slot (the template rewrites the last turn and no context "
                       "checkpoint sits before it)",
                       "lower -cms (e.g. -cms 1024) and raise -ctxcp", evidence)
    restored = " and after a restore from a slot file" if RESTORED in steps else (
        " (restores not measured: no --slot-save-path)")
    # --cache-ram 0 is a choice (proxy.listen.isolation): the slot files then bring sessions back.
    where = (f"on a warm slot, after eviction{restored}" if kept.get(EVICTED) else
             f"on a warm slot{restored}, not after eviction (no host prompt cache: "
             "--cache-ram 0, or too small)")
    return Finding("eviction", "ok", "--slot-save-path",
                   f"{kind}: a session's cached prompt survives {where}", evidence=evidence)


# ---------------------------------------------------------------- the recommendation

def recommend(obs: Observations, *, min_ctx: int = DEFAULT_MIN_CTX) -> list[str]:
    """A llama-server command line that keeps caches warm, built from what was seen."""
    flags = obs.flags
    model = (flags.value("model") if flags else None) or obs.props.get("model_path") or "MODEL.gguf"
    parts = urlsplit(obs.upstream)
    loopback = parts.hostname in ("127.0.0.1", "localhost", "::1")
    host = str(flags.value("host")) if flags and flags.is_set("host") \
        else "127.0.0.1" if loopback else "0.0.0.0"
    port = str(flags.value("port") if flags and flags.is_set("port") else parts.port or 8080)
    slots = obs.total_slots
    unified = bool(flags and (flags.boolean("kv_unified") or (flags.number("n_parallel") or 0) < 0))
    per_slot = obs.slot_ctx or min_ctx
    if unified or (obs.probes and obs.probes.idle_slots_cleared):
        per_slot = per_slot // slots  # the unified pool was shared: split it
    per_slot = max(per_slot, min_ctx)
    if obs.model and obs.model.n_ctx_train:
        per_slot = min(per_slot, obs.model.n_ctx_train)
    save_path = str(flags.value("slot_save_path")) if flags and flags.is_set("slot_save_path") \
        else "/var/cache/llama/slots"
    command = ["llama-server", "-m", str(model), "--host", host, "--port", port,
               "-np", str(slots), "-c", str(slots * per_slot), "--slot-save-path", save_path,
               "--metrics", "--no-context-shift"]
    if obs.model is None or obs.model.sliding_window:
        command.append("--swa-full")
    if obs.model and obs.model.recurrent:
        command += ["-cms", "1024"]
    if flags is not None and has_amx():  # the server runs on this host, with AMX
        command.append("--no-repack")
    return command


# ---------------------------------------------------------------- output

@dataclass(slots=True)
class Report:
    upstream: str
    reachable: bool
    findings: list[Finding]
    command: list[str]
    server: dict[str, Any]
    sources: list[str]
    error: str = ""
    # --probe-eviction's figures in tokens, by step: {"cached", "prompt", "reusable"}
    eviction: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        if not self.reachable:
            return EXIT_UNREACHABLE
        return EXIT_PROBLEMS if any(f.status == "problem" for f in self.findings) else EXIT_OK

    def to_json(self) -> dict[str, Any]:
        return {"upstream": self.upstream, "reachable": self.reachable, "error": self.error,
                "server": self.server, "sources": self.sources,
                "findings": [asdict(f) for f in self.findings],
                "recommended_command": self.command, "eviction": self.eviction,
                "exit_code": self.exit_code}


def build_report(obs: Observations, *, min_ctx: int = DEFAULT_MIN_CTX) -> Report:
    sources = ["HTTP: /health /props /slots /metrics /v1/models, "
               f"POST /slots/0?action={SLOT_ACTION_PROBE}"]
    if obs.flags:
        sources.append(obs.flags.source + (" (and its --help for defaults)"
                                           if obs.flags.known else ""))
    if obs.probes:
        sources.append(f"probes: tiny completions on slot(s) "
                       f"{obs.probes.first_slot} and {obs.probes.second_slot} "
                       f"({obs.probes.prompt_tokens_sent} prompt tokens in all)")
        sources += [f"probe error: {e}" for e in obs.probes.errors]
    sources.append(obs.model_note)
    server = {"build_info": obs.props.get("build_info"), "model_path": obs.props.get(
        "model_path"), "total_slots": obs.total_slots, "slot_ctx": obs.slot_ctx,
        "architecture": obs.model.architecture if obs.model else None}
    eviction = {k: asdict(v) for k, v in obs.probes.eviction.items()} if obs.probes else {}
    if obs.probes and obs.probes.eviction_slot is not None:
        sources.append(f"eviction probe on slot {obs.probes.eviction_slot}"
                       + (f" (erased after; slot file {EVICTION_FILE})"
                          if RESTORED in obs.probes.eviction else ""))
    return Report(obs.upstream, True, diagnose(obs, min_ctx=min_ctx),
                  recommend(obs, min_ctx=min_ctx), server, sources, eviction=eviction)


MARKS: dict[Status, str] = {"problem": "PROBLEM", "warning": "warning", "ok": "ok",
                            "unknown": "unknown"}


def render_text(report: Report) -> str:
    if not report.reachable:
        return (f"prefixpin doctor: cannot reach llama-server at {report.upstream}: "
                f"{report.error}\n{crash_advice()}\n")
    s = report.server
    lines = [f"prefixpin doctor: {report.upstream}",
             f"  build {s['build_info']}, {s['total_slots']} slot(s) × {s['slot_ctx']} tokens, "
             f"model {s['model_path']}", "  read from: " + "; ".join(report.sources), ""]
    order = {"problem": 0, "warning": 1, "unknown": 2, "ok": 3}
    for f in sorted(report.findings, key=lambda f: order[f.status]):
        lines.append(f"{MARKS[f.status]:<8} {f.flag:<17} {f.summary}")
        if f.fix and f.status != "ok":
            lines.append(f"{'':<8} {'':<17} fix: {f.fix}")
        if f.evidence:
            lines.append(f"{'':<8} {'':<17} seen: {f.evidence}")
    if report.eviction:
        lines += ["", "What survives on one slot (--probe-eviction), in prompt tokens:"]
        lines += [f"  {STEP_WORDS.get(step, step) + ':':<48} cached {v['cached']:>6} of "
                  f"{v['prompt']:>6} ({v['reusable']} reusable)"
                  for step, v in report.eviction.items()]
    problems = sum(f.status == "problem" for f in report.findings)
    lines += ["", f"{problems} setting(s) defeat prompt caching." if problems else
              "Nothing found that defeats prompt caching.",
              "", "Recommended llama-server command line:", "  " + shlex.join(report.command)]
    return "\n".join(lines) + "\n"


def run(upstream: str, *, probe: bool = True, local: bool = True,
        probe_context_shift: bool = False, probe_shared_cache: bool = False,
        probe_eviction: bool = False, min_ctx: int = DEFAULT_MIN_CTX,
        timeout: float = 120.0, api_key: str | None = None) -> Report:
    try:
        obs = collect(upstream, probe=probe, local=local,
                      probe_context_shift=probe_context_shift,
                      probe_shared_cache=probe_shared_cache, probe_eviction=probe_eviction,
                      timeout=timeout, api_key=api_key)
    except UpstreamUnavailableError as exc:
        return Report(upstream, False, [], [], {}, [], error=exc.message)
    return build_report(obs, min_ctx=min_ctx)


# ---------------------------------------------------------------- command line

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--upstream", default=environment("PREFIXPIN_UPSTREAM")
                        or DEFAULT_UPSTREAM, help=f"llama-server base URL (default "
                        f"$PREFIXPIN_UPSTREAM or {DEFAULT_UPSTREAM})")
    parser.add_argument("--engine-api-key", default=environment("PREFIXPIN_ENGINE_API_KEY"),
                        help="the server's --api-key, sent as Authorization: Bearer "
                        "(default $PREFIXPIN_ENGINE_API_KEY)")
    parser.add_argument("--json", action="store_true", help="print a JSON report")
    parser.add_argument("--no-probe", dest="probe", action="store_false",
                        help="send no completions (flags that need them stay unknown)")
    parser.add_argument("--probe-context-shift", action="store_true",
                        help="also fill one slot to its end to see whether context shift is on")
    parser.add_argument("--probe-shared-cache", action="store_true",
                        help="also show whether the host prompt cache crosses slots: a "
                        f"{SHARED_TOKENS}-token prompt cached on one slot, pushed out, then "
                        "asked for on another (about 600 prompt tokens; evicts those two "
                        "slots' prompts into the server's host cache)")
    parser.add_argument("--probe-eviction", action="store_true",
                        help="also measure, in tokens, what a session keeps on this engine "
                        "and model: on a warm slot, after another prompt pushed it out (host "
                        "prompt cache), and after a save, erase and restore (with "
                        "--slot-save-path). Uses one idle slot (about 2500 prompt tokens, "
                        "mostly cached); with --slot-save-path it erases that slot at the "
                        f"end and leaves the slot file {EVICTION_FILE} there")
    parser.add_argument("--no-local", dest="local", action="store_false",
                        help="do not read the server process's command line from /proc")
    parser.add_argument("--min-ctx", type=int, default=DEFAULT_MIN_CTX,
                        help=f"smallest acceptable context per slot (default {DEFAULT_MIN_CTX})")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait for each request (default 120)")


def main_from_args(args: argparse.Namespace) -> int:
    report = run(args.upstream, probe=args.probe, local=args.local,
                 probe_context_shift=args.probe_context_shift,
                 probe_shared_cache=args.probe_shared_cache,
                 probe_eviction=args.probe_eviction, min_ctx=args.min_ctx,
                 timeout=args.timeout, api_key=args.engine_api_key)
    if args.json:
        sys.stdout.write(json.dumps(report.to_json(), indent=2) + "\n")
    else:
        sys.stdout.write(render_text(report))
    return report.exit_code
