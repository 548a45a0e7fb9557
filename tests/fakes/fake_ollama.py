"""A fake Ollama server that speaks Ollama's real wire formats, for tests of the Ollama adapter.

Ollama cannot be installed here, so this replays what Ollama sends, as recorded in
``tests/fixtures/ollama/`` (each fixture cites the Ollama source, docs or recording it came
from; ``docs/ollama-wire.md`` explains them). The fake is faithful where a proxy can tell:

* Native ``/api/chat`` and ``/api/generate`` stream NDJSON (``application/x-ndjson``) and the
  OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions`` stream SSE, with the same
  keys, key order, omitted-when-empty fields, terminal frames and error shapes as Ollama.
* Like gin's ``c.Stream`` in ``server/routes.go`` ``streamResponse``, nothing at all is sent, not
  even the response headers, until the first chunk exists: a model load, a queue wait or a long
  prefill is silence on the wire. An error before that point still gets its real HTTP status;
  an error after it is one more NDJSON line (native) or a bare empty chunk (``/v1``).
* The "model" is a canned reply streamed token by token; a deterministic tokenizer and a
  per-model prefix cache (llama-server's longest-common-prefix slot reuse) make
  ``prompt_eval_count`` and the cached counts behave as Ollama's llama-server runner reports
  them, for the configured ``version``: ``prompt_eval_cached_count`` and
  ``usage.prompt_tokens_details.cached_tokens`` exist from 0.33.3 (PR ollama/ollama#17943).
* Models load on first use (reported in ``load_duration``), stay loaded for ``keep_alive`` and
  lose their cache when unloaded or evicted.

Test seams: ``fake_ollama_state(app)`` returns the ``FakeOllama`` engine, which records every
generation request and takes ``Fault``s to inject. ``FakeOllamaConfig.sleep`` and ``clock``
replace real waiting and time so tests need not sleep.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import re
import time
import zlib
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

JSONObject = dict[str, Any]

OLD_VERSION = "0.33.2"
"""The last release without cached-token fields (per ollama/ollama#8008 comments)."""
NEW_VERSION = "0.35.1"
"""A release with them (the version the third-party recordings in the fixtures came from)."""

CACHED_COUNT_SINCE = (0, 33, 3)  # PR #17943
FULL_PROMPT_COUNT_SINCE = (0, 30, 1)  # PR #16428: prompt_eval_count = cache_n + prompt_n

NDJSON = "application/x-ndjson"
GO_JSON = "application/json; charset=utf-8"  # gin's c.JSON
PLAIN_JSON = "application/json"  # the /v1 middleware's own writers
SSE = "text/event-stream"
FOREVER = float("inf")


# ------------------------------------------------------------------------- configuration

@dataclass(frozen=True)
class FakeModel:
    """An installed model. ``thinking`` set makes it a thinking model (it thinks by default)."""

    name: str
    reply: str = "Hello! I am a small fake model and I always answer the same way."
    thinking: str | None = None
    tool_arguments: Mapping[str, Any] = field(default_factory=dict)
    family: str = "llama"
    parameter_size: str = "135M"
    quantization_level: str = "Q4_1"
    size: int = 101_000_000
    context_length: int = 8192
    modified_at: str = "2026-09-01T10:00:00.123456789Z"

    @property
    def capabilities(self) -> list[str]:
        return ["completion", "tools"] + (["thinking"] if self.thinking is not None else [])


FaultKind = Literal["error_before_headers", "error_mid_stream", "drop_mid_stream"]


@dataclass(frozen=True)
class Fault:
    """One injected failure, consumed by the next generation request it matches.

    ``error_before_headers``: the runner fails after the load, before the first token (Ollama
    then answers ``status`` with a JSON error, even for ``stream: true``).
    ``error_mid_stream``: the runner fails after ``after_chunks`` chunks (an ``{"error"}`` line
    on NDJSON; on ``/v1`` Ollama's middleware turns it into an empty chunk and stops).
    ``drop_mid_stream``: the connection is cut after ``after_chunks`` chunks.
    """

    kind: FaultKind
    message: str = "an error was encountered while running the model: fake fault"
    status: int = 500
    after_chunks: int = 1
    path: str | None = None


async def _real_sleep(seconds: float) -> None:
    await anyio.sleep(seconds)


@dataclass(frozen=True)
class FakeOllamaConfig:
    version: str = NEW_VERSION
    models: tuple[FakeModel, ...] = (
        FakeModel("fake-smol:latest"),
        FakeModel("fake-think:latest", reply="The answer is 5.",
                  thinking="Two plus three is five, so the answer is 5."),
    )
    prefill_seconds_per_token: float = 0.0002
    decode_seconds_per_token: float = 0.001
    load_seconds: float = 0.05
    batch_tokens: int = 512  # llama-server's default n_batch: prefill progresses in these steps
    num_parallel: int = 1  # slots per loaded model (OLLAMA_NUM_PARALLEL)
    max_loaded_models: int = 3  # OLLAMA_MAX_LOADED_MODELS
    default_keep_alive_seconds: float = 300.0  # OLLAMA_KEEP_ALIVE default 5m
    faults: tuple[Fault, ...] = ()
    clock: Callable[[], float] = time.monotonic  # keep_alive expiry runs on this clock
    sleep: Callable[[float], Awaitable[None]] = _real_sleep


# ------------------------------------------------------------------------------- errors

class ApiError(Exception):
    """A request Ollama refuses before generating; rendered per API at the route boundary."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _MiddlewareError(ApiError):
    """Refused by Ollama's /v1 middleware itself (gin c.JSON: charset, no trailing newline)."""


# --------------------------------------------------------------------------- wire helpers

def _version_tuple(version: str) -> tuple[int, ...]:
    numbers = re.findall(r"\d+", version.split("-")[0])
    return tuple(int(n) for n in numbers[:3])


def go_json(value: Any) -> bytes:
    """json.Marshal's bytes: compact, UTF-8, and HTML-escaped as Go escapes <, > and &."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                          ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escaped)
    return text.encode()


def go_timestamp(ns: int | None = None) -> str:
    """time.Time's JSON form in UTC: RFC 3339 with nanoseconds, trailing zeros trimmed."""
    ns = time.time_ns() if ns is None else ns
    seconds, fraction = divmod(ns, 1_000_000_000)
    stamp = datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    digits = f"{fraction:09d}".rstrip("0")
    return f"{stamp}.{digits}Z" if digits else f"{stamp}Z"


_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0,
             "m": 60.0, "h": 3600.0}
_GO_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def parse_keep_alive(value: Any) -> float | None:
    """api.Duration.UnmarshalJSON: seconds as a number, or a Go duration string; < 0 is forever."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ApiError(400, f"Unsupported type: '{type(value).__name__}'")
    if isinstance(value, int | float):
        return FOREVER if value < 0 else float(value)
    return _parse_go_duration(value)


def _parse_go_duration(text: str) -> float:
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text.lstrip("+"))
    if body == "0":
        return 0.0
    parts = _GO_DURATION.findall(body)
    if not body or "".join(number + unit for number, unit in parts) != body:
        missing_unit = bool(re.fullmatch(r"\d+(\.\d*)?", body))
        reason = "missing unit in duration" if missing_unit else "invalid duration"
        raise ApiError(400, f'time: {reason} "{text}"')
    seconds = sign * sum(float(number) * _GO_UNITS[unit] for number, unit in parts)
    return FOREVER if seconds < 0 else seconds


_TOKEN = re.compile(r"<\|[^|>]+\|>|</?[a-z_]+>| ?\w+| ?[^\w\s]|\s+")


def tokenize(text: str) -> list[str]:
    """A deterministic stand-in for a BPE tokenizer: special tokens, words with their leading
    space, single punctuation marks and whitespace runs. It only has to be stable."""
    return _TOKEN.findall(text)


def token_id(token: str) -> int:
    return zlib.crc32(token.encode()) % 150_000


def normalize_model_name(name: str) -> str:
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def _common_prefix(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    for left, right in zip(a, b, strict=False):
        if left != right:
            break
        n += 1
    return n


# ------------------------------------------------------------------------ prompt and reply

def render_chat(messages: Sequence[JSONObject], tools: Sequence[JSONObject]) -> str:
    """A ChatML-style template. Like many real templates it drops earlier ``thinking``."""
    parts = []
    if tools:
        parts.append("<|im_start|>system\n# Tools\n"
                     + json.dumps(tools, sort_keys=True, separators=(",", ":")) + "<|im_end|>\n")
    for message in messages:
        body = str(message.get("content") or "")
        for call in message.get("tool_calls") or []:
            function = call.get("function", {})
            body += _tool_call_text(str(function.get("name", "")), function.get("arguments", {}))
        parts.append(f"<|im_start|>{message.get('role', 'user')}\n{body}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def render_generate(prompt: str, system: str | None) -> str:
    system_turn = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return f"{system_turn}<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def _tool_call_text(name: str, arguments: Any) -> str:
    payload = json.dumps({"name": name, "arguments": arguments}, sort_keys=True,
                         separators=(",", ":"))
    return f"<tool_call>{payload}</tool_call>"


PieceKind = Literal["content", "thinking", "tool_call"]


@dataclass(frozen=True)
class _Piece:
    """One streamed chunk's worth of generation, and the tokens it adds to the slot."""

    kind: PieceKind
    text: str
    tokens: tuple[str, ...]
    tool_call: JSONObject | None = None


def plan_reply(model: FakeModel, *, think: bool, tools: Sequence[JSONObject],
               last_role: str, num_predict: int | None,
               call_id: str) -> tuple[list[_Piece], str]:
    """What the model "generates" for this request, and the done_reason."""
    if tools and last_role != "tool":
        return [_tool_call_piece(model, tools[0], call_id)], "stop"
    pieces = []
    if think and model.thinking is not None:
        pieces += [_Piece("thinking", token, (token,)) for token in tokenize(model.thinking)]
    pieces += [_Piece("content", token, (token,)) for token in tokenize(model.reply)]
    if num_predict is not None and 0 <= num_predict < len(pieces):
        return pieces[:num_predict], "length"
    return pieces, "stop"


def _tool_call_piece(model: FakeModel, tool: JSONObject, call_id: str) -> _Piece:
    name = str(tool.get("function", {}).get("name", "tool"))
    arguments = dict(model.tool_arguments)
    call = {"id": call_id, "function": {"index": 0, "name": name, "arguments": arguments}}
    text = _tool_call_text(name, arguments)
    return _Piece("tool_call", "", tuple(tokenize(text)), call)


# --------------------------------------------------------------------------- engine state

@dataclass
class _Slot:
    tokens: list[str] = field(default_factory=list)
    busy: bool = False
    last_used: int = 0


@dataclass
class _Runner:
    """A loaded model: llama-server's slots and the scheduler's expiry."""

    model: FakeModel
    slots: list[_Slot]
    semaphore: anyio.Semaphore
    ready: anyio.Event
    session_seconds: float = 0.0  # the scheduler's sessionDuration: the idle time allowed
    active: int = 0
    expires_at: float = FOREVER  # on FakeOllamaConfig.clock; FOREVER while in use
    loaded: bool = False


@dataclass
class RequestRecord:
    """What the fake saw and did for one generation request (for assertions in tests)."""

    path: str
    model: str
    prompt_tokens: int
    cold_load: bool = False
    cached_tokens: int = 0
    evaluated_tokens: int = 0
    eval_count: int = 0
    outcome: str = "pending"  # done | error | dropped | cancelled


@dataclass(frozen=True)
class _Job:
    path: str
    shape: Literal["chat", "generate"]
    model: FakeModel
    requested_name: str
    prompt: tuple[str, ...]
    pieces: tuple[_Piece, ...]
    done_reason: str
    keep_alive: float | None
    include_context: bool = False


@dataclass(frozen=True)
class _Chunk:
    body: JSONObject


@dataclass(frozen=True)
class _Failure:
    status: int
    message: str


@dataclass(frozen=True)
class _Drop:
    pass


_Event = _Chunk | _Failure | _Drop


class FakeOllama:
    """The engine behind the routes: models, runners, slots, faults and the request log."""

    def __init__(self, config: FakeOllamaConfig) -> None:
        self.config = config
        self.models = {normalize_model_name(m.name): m for m in config.models}
        self.requests: list[RequestRecord] = []
        self._runners: dict[str, _Runner] = {}
        self._faults: deque[Fault] = deque(config.faults)
        self._tokens_by_id: dict[int, str] = {}
        self._counter = itertools.count(1)
        version = _version_tuple(config.version)
        self.reports_cached_count = version >= CACHED_COUNT_SINCE
        self.counts_cached_in_prompt = version >= FULL_PROMPT_COUNT_SINCE

    # ---- test seams

    def inject(self, fault: Fault) -> None:
        self._faults.append(fault)

    def is_loaded(self, name: str) -> bool:
        self._expire_idle()
        return normalize_model_name(name) in self._runners

    def unload(self, name: str) -> bool:
        """Drop a model and its cache now, as ``keep_alive: 0`` or an expiry would."""
        return self._runners.pop(normalize_model_name(name), None) is not None

    def slot_tokens(self, name: str) -> list[list[str]]:
        runner = self._runners.get(normalize_model_name(name))
        return [list(slot.tokens) for slot in runner.slots] if runner else []

    # ---- lookups used by the routes

    def find_model(self, requested: str) -> FakeModel:
        if not requested:
            raise ApiError(400, "model is required")
        model = self.models.get(normalize_model_name(requested))
        if model is None:
            raise ApiError(404, f"model '{requested}' not found")
        return model

    def next_id(self) -> int:
        return next(self._counter)

    def call_id(self) -> str:
        digest = hashlib.sha256(str(self.next_id()).encode()).hexdigest()
        return "call_" + "".join(c for c in digest if c.isalnum())[:8]

    def context_ids(self, tokens: Sequence[str]) -> list[int]:
        ids = [token_id(token) for token in tokens]
        self._tokens_by_id.update(zip(ids, tokens, strict=True))
        return ids

    def context_text(self, ids: Sequence[int]) -> str:
        return "".join(self._tokens_by_id.get(i, "") for i in ids)

    def loaded_runners(self) -> list[_Runner]:
        self._expire_idle()
        return [runner for runner in self._runners.values() if runner.loaded]

    # ---- scheduling

    def _expire_idle(self) -> None:
        now = self.config.clock()
        for name, runner in list(self._runners.items()):
            if runner.active == 0 and runner.expires_at <= now:
                del self._runners[name]

    def _evict_for_room(self) -> None:
        idle = [(r.expires_at, n) for n, r in self._runners.items() if r.active == 0]
        while len(self._runners) >= self.config.max_loaded_models and idle:
            idle.sort()
            del self._runners[idle.pop(0)[1]]

    async def load(self, model: FakeModel, keep_alive: float | None) -> tuple[_Runner, bool]:
        """Return the model's runner, loading it first if needed (True when this call loaded).

        As server/sched.go does, a request's keep_alive replaces the runner's session duration
        only when it is given; a new runner starts from the server default.
        """
        self._expire_idle()
        name = normalize_model_name(model.name)
        runner = self._runners.get(name)
        cold = runner is None
        if runner is None:
            self._evict_for_room()
            slots = [_Slot() for _ in range(self.config.num_parallel)]
            runner = _Runner(model, slots, anyio.Semaphore(self.config.num_parallel),
                             anyio.Event(), self.config.default_keep_alive_seconds)
            self._runners[name] = runner  # concurrent requests wait for this same load
        if keep_alive is not None:
            runner.session_seconds = keep_alive
        runner.active += 1
        try:
            if cold:
                with anyio.CancelScope(shield=True):  # a load, once started, finishes
                    await self.config.sleep(self.config.load_seconds)
                runner.loaded = True
                runner.ready.set()
            else:
                await runner.ready.wait()
        except BaseException:
            runner.active -= 1
            raise
        return runner, cold

    def release(self, runner: _Runner) -> None:
        runner.active -= 1
        if runner.active > 0:
            return
        if runner.session_seconds == 0:
            self.unload(runner.model.name)
        else:
            runner.expires_at = self.config.clock() + runner.session_seconds

    def take_fault(self, path: str) -> Fault | None:
        for fault in self._faults:
            if fault.path is None or fault.path == path:
                self._faults.remove(fault)
                return fault
        return None

    # ---- generation

    async def run(self, job: _Job, fault: Fault | None) -> AsyncGenerator[_Event, None]:
        """The native chunks for one job; errors become ``_Failure``, cuts ``_Drop``."""
        started = time.perf_counter_ns()
        record = RequestRecord(job.path, job.requested_name, len(job.prompt))
        self.requests.append(record)
        runner, record.cold_load = await self.load(job.model, job.keep_alive)
        load_ns = time.perf_counter_ns() - started
        if record.cold_load:  # a real load's cost, even when the test's sleep is instant
            load_ns = max(load_ns, round(self.config.load_seconds * 1e9))
        try:
            async with self._slot(runner, job.prompt) as slot:
                # llama-server re-evaluates at least the last prompt token to get logits
                cached = max(0, min(_common_prefix(slot.tokens, job.prompt),
                                    len(job.prompt) - 1))
                record.cached_tokens = cached
                record.evaluated_tokens = len(job.prompt) - cached
                if fault is not None and fault.kind == "error_before_headers":
                    record.outcome = "error"
                    yield _Failure(fault.status, fault.message)
                    return
                await self._prefill(slot, job.prompt, cached)
                for index, piece in enumerate(job.pieces):
                    if fault is not None and index == fault.after_chunks:
                        record.outcome = "error" if fault.kind == "error_mid_stream" else "dropped"
                        yield (_Failure(fault.status, fault.message)
                               if fault.kind == "error_mid_stream" else _Drop())
                        return
                    decode = len(piece.tokens) * self.config.decode_seconds_per_token
                    await self.config.sleep(decode)
                    slot.tokens.extend(piece.tokens)
                    record.eval_count += len(piece.tokens)
                    yield _Chunk(self._piece_chunk(job, piece))
                metrics = self._metrics(record, started, load_ns)
                record.outcome = "done"
                yield _Chunk(self._done_chunk(job, slot, metrics))
        finally:
            if record.outcome == "pending":
                record.outcome = "cancelled"
            self.release(runner)

    @contextlib.asynccontextmanager
    async def _slot(self, runner: _Runner, prompt: Sequence[str]) -> AsyncIterator[_Slot]:
        async with runner.semaphore:
            free = [slot for slot in runner.slots if not slot.busy]
            # llama-server: the slot sharing the longest prefix, else the least recently used
            slot = max(free, key=lambda s: (_common_prefix(s.tokens, prompt), -s.last_used))
            slot.busy = True
            try:
                yield slot
            finally:
                slot.busy = False
                slot.last_used = self.next_id()

    async def _prefill(self, slot: _Slot, prompt: Sequence[str], cached: int) -> None:
        # llama-server keeps the common prefix, drops the rest and evaluates batch by batch;
        # a cancelled request leaves what was evaluated so far in the slot.
        del slot.tokens[cached:]
        position = cached
        while position < len(prompt):
            end = min(position + self.config.batch_tokens, len(prompt))
            await self.config.sleep((end - position) * self.config.prefill_seconds_per_token)
            slot.tokens.extend(prompt[position:end])
            position = end

    def _metrics(self, record: RequestRecord, started: int, load_ns: int) -> JSONObject:
        """api.Metrics in Go field order; zero values are omitted (omitempty).

        The prompt and eval durations are model time (tokens x configured cost), like
        llama-server's own timings; total and load durations are measured, never less than
        the modelled work, so an instant test ``sleep`` still reports coherent numbers.
        """
        config = self.config
        prompt_ns = max(1, round(record.evaluated_tokens * config.prefill_seconds_per_token * 1e9))
        eval_ns = (max(1, round(record.eval_count * config.decode_seconds_per_token * 1e9))
                   if record.eval_count else 0)
        total_ns = max(time.perf_counter_ns() - started, load_ns + prompt_ns + eval_ns)
        prompt_count = (record.prompt_tokens if self.counts_cached_in_prompt
                        else record.evaluated_tokens)
        cached = record.cached_tokens if self.reports_cached_count else None
        values: list[tuple[str, int | None]] = [
            ("total_duration", total_ns), ("load_duration", load_ns),
            ("prompt_eval_count", prompt_count), ("prompt_eval_cached_count", cached),
            ("prompt_eval_duration", prompt_ns), ("eval_count", record.eval_count),
            ("eval_duration", eval_ns),
        ]
        # prompt_eval_cached_count is a *int: present (even 0) whenever the runner reports it
        return {key: value for key, value in values
                if value is not None and (value != 0 or key == "prompt_eval_cached_count")}

    def _piece_chunk(self, job: _Job, piece: _Piece) -> JSONObject:
        head: JSONObject = {"model": job.requested_name, "created_at": go_timestamp()}
        if job.shape == "generate":
            body = {"response": piece.text if piece.kind == "content" else ""}
            if piece.kind == "thinking":
                body["thinking"] = piece.text
            return head | body | {"done": False}
        message: JSONObject = {"role": "assistant",
                               "content": piece.text if piece.kind == "content" else ""}
        if piece.kind == "thinking":
            message["thinking"] = piece.text
        if piece.tool_call is not None:
            message["tool_calls"] = [piece.tool_call]
        return head | {"message": message, "done": False}

    def _done_chunk(self, job: _Job, slot: _Slot, metrics: JSONObject) -> JSONObject:
        head: JSONObject = {"model": job.requested_name, "created_at": go_timestamp()}
        tail = {"done": True, "done_reason": job.done_reason}
        if job.shape == "chat":
            return head | {"message": {"role": "assistant", "content": ""}} | tail | metrics
        context = {"context": self.context_ids(slot.tokens)} if job.include_context else {}
        return head | {"response": ""} | tail | context | metrics


# ----------------------------------------------------------------------- request parsing

@dataclass(frozen=True)
class _ChatRequest:
    model: str
    messages: list[JSONObject]
    tools: list[JSONObject]
    stream: bool
    think: Any
    keep_alive: float | None
    num_predict: int | None


@dataclass(frozen=True)
class _GenerateRequest:
    model: str
    prompt: str
    system: str | None
    raw: bool
    context: list[int]
    stream: bool
    think: Any
    keep_alive: float | None
    num_predict: int | None


async def _json_body(request: Request, *, error: type[ApiError] = ApiError) -> JSONObject:
    raw = await request.body()
    if not raw.strip():
        raise error(400, "missing request body")
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise error(400, f"invalid character in JSON body: {exc.msg}") from exc
    if not isinstance(body, dict):
        raise error(400, "json: cannot unmarshal into Go value of type api.ChatRequest")
    return body


def _num_predict(options: Any) -> int | None:
    value = options.get("num_predict") if isinstance(options, dict) else None
    return int(value) if isinstance(value, int | float) and value >= 0 else None


def parse_native_chat(body: JSONObject) -> _ChatRequest:
    messages = []
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            raise ApiError(400, "json: cannot unmarshal message")
        messages.append(message | {"role": str(message.get("role", "")).lower()})
    return _ChatRequest(
        model=str(body.get("model") or ""), messages=messages, tools=list(body.get("tools") or []),
        stream=body.get("stream") is not False, think=body.get("think"),
        keep_alive=parse_keep_alive(body.get("keep_alive")),
        num_predict=_num_predict(body.get("options")))


def parse_native_generate(body: JSONObject) -> _GenerateRequest:
    return _GenerateRequest(
        model=str(body.get("model") or ""), prompt=str(body.get("prompt") or ""),
        system=body.get("system") or None, raw=bool(body.get("raw")),
        context=[int(i) for i in body.get("context") or []],
        stream=body.get("stream") is not False, think=body.get("think"),
        keep_alive=parse_keep_alive(body.get("keep_alive")),
        num_predict=_num_predict(body.get("options")))


_EFFORT_TO_THINK: dict[str, Any] = {"": None, "none": False, "minimal": "low", "low": "low",
                                    "medium": "medium", "high": "high", "max": "max",
                                    "xhigh": "max", "ultra": "max"}


def parse_openai_chat(body: JSONObject) -> _ChatRequest:
    """openai.FromChatRequest: a list content becomes one message per part; stream defaults off."""
    raw_messages = body.get("messages") or []
    if not raw_messages:
        raise _MiddlewareError(400, "[] is too short - 'messages'")
    messages = []
    for message in raw_messages:
        messages += _openai_message(message)
    effort = (body.get("reasoning") or {}).get("effort") or body.get("reasoning_effort") or ""
    if effort not in _EFFORT_TO_THINK:
        raise _MiddlewareError(400, f'invalid reasoning value: "{effort}"')
    max_tokens = body.get("max_tokens")
    return _ChatRequest(
        model=str(body.get("model") or ""), messages=messages, tools=list(body.get("tools") or []),
        stream=bool(body.get("stream")), think=_EFFORT_TO_THINK[effort], keep_alive=None,
        num_predict=int(max_tokens) if isinstance(max_tokens, int) else None)


def _openai_message(message: JSONObject) -> list[JSONObject]:
    role = str(message.get("role", "")).lower()
    content = message.get("content")
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", {})
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except json.JSONDecodeError as exc:
            raise _MiddlewareError(400, "invalid tool call arguments") from exc
        calls.append({"function": {"name": function.get("name", ""), "arguments": arguments}})
    extra: JSONObject = {"tool_calls": calls} if calls else {}
    if isinstance(content, list):
        texts = [part.get("text", "") for part in content if part.get("type") == "text"]
        messages = [{"role": role, "content": text} for text in texts]
        if messages and extra:
            messages[-1] |= extra
        return messages
    if content is None and not calls:
        raise _MiddlewareError(400, "invalid message content type: <nil>")
    return [{"role": role, "content": content or ""} | extra]


def parse_openai_completion(body: JSONObject) -> _GenerateRequest:
    max_tokens = body.get("max_tokens")
    return _GenerateRequest(
        model=str(body.get("model") or ""), prompt=str(body.get("prompt") or ""), system=None,
        raw=False, context=[], stream=bool(body.get("stream")), think=None, keep_alive=None,
        num_predict=int(max_tokens) if isinstance(max_tokens, int) else None)


def _wants_usage(body: JSONObject) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def _think_enabled(model: FakeModel, think: Any, requested: str) -> bool:
    """ChatHandler: thinking models think unless told not to; others refuse think: true."""
    if model.thinking is None:
        if think not in (None, False):
            raise ApiError(400, f'"{requested}" does not support thinking')
        return False
    return think is not False


# ------------------------------------------------------------------------------ writers

@dataclass(frozen=True)
class _Reply:
    status: int
    content_type: str
    body: bytes


class _Writer(Protocol):
    """Turns native chunks into one API's bytes, streamed or folded into one body."""

    stream_content_type: str

    def frame(self, chunk: JSONObject) -> bytes: ...

    def late_failure(self, failure: _Failure) -> bytes: ...

    def early_failure(self, failure: _Failure) -> _Reply: ...

    def complete(self, chunks: list[JSONObject]) -> _Reply: ...


def fold_chat(chunks: list[JSONObject], *, collect_tool_calls: bool) -> JSONObject:
    """writeChatResponse: the last chunk, with content and thinking concatenated."""
    folded = dict(chunks[-1])
    message: JSONObject = {"role": "assistant",
                           "content": "".join(c["message"].get("content", "") for c in chunks)}
    thinking = "".join(c["message"].get("thinking", "") for c in chunks)
    if thinking:
        message["thinking"] = thinking
    calls = [call for c in chunks for call in c["message"].get("tool_calls", [])]
    if calls and collect_tool_calls:
        message["tool_calls"] = calls
    folded["message"] = message
    return folded


def fold_generate(chunks: list[JSONObject]) -> JSONObject:
    folded = dict(chunks[-1])
    folded["response"] = "".join(c.get("response", "") for c in chunks)
    thinking = "".join(c.get("thinking", "") for c in chunks)
    head = {k: folded.pop(k) for k in ("model", "created_at", "response")}
    return head | ({"thinking": thinking} if thinking else {}) | folded


class NativeWriter:
    stream_content_type = NDJSON

    def __init__(self, shape: Literal["chat", "generate"], *, has_tools: bool = False) -> None:
        self._shape = shape
        self._has_tools = has_tools

    def frame(self, chunk: JSONObject) -> bytes:
        return go_json(chunk) + b"\n"

    def late_failure(self, failure: _Failure) -> bytes:
        return go_json({"error": failure.message}) + b"\n"  # json.NewEncoder(w).Encode

    def early_failure(self, failure: _Failure) -> _Reply:
        return _Reply(failure.status, GO_JSON, go_json({"error": failure.message}))

    def complete(self, chunks: list[JSONObject]) -> _Reply:
        folded = (fold_chat(chunks, collect_tool_calls=self._has_tools) if self._shape == "chat"
                  else fold_generate(chunks))
        return _Reply(200, GO_JSON, go_json(folded))


def openai_error(status: int, message: str) -> JSONObject:
    kind = {400: "invalid_request_error", 404: "not_found_error"}.get(status, "api_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _usage(done: JSONObject) -> JSONObject:
    prompt, completion = done.get("prompt_eval_count", 0), done.get("eval_count", 0)
    usage: JSONObject = {"prompt_tokens": prompt, "completion_tokens": completion,
                         "total_tokens": prompt + completion}
    if "prompt_eval_cached_count" in done:
        usage["prompt_tokens_details"] = {"cached_tokens": done["prompt_eval_cached_count"]}
    return usage


def _unix(created_at: str) -> int:
    return int(datetime.fromisoformat(created_at.split(".")[0].rstrip("Z") + "+00:00").timestamp())


def _openai_tool_calls(calls: list[JSONObject]) -> list[JSONObject]:
    return [{"id": call.get("id", ""), "index": call["function"].get("index", 0),
             "type": "function",
             "function": {"name": call["function"]["name"],
                          "arguments": go_json(call["function"]["arguments"]).decode()}}
            for call in calls]


class OpenAIChatWriter:
    """middleware.ChatWriter over the native chat chunks."""

    stream_content_type = SSE

    def __init__(self, completion_id: str, *, include_usage: bool) -> None:
        self._id = completion_id
        self._include_usage = include_usage
        self._created: int | None = None
        self._first_sent = False
        self._tool_call_sent = False

    def _chunk(self, model: str, choices: list[JSONObject],
               usage: JSONObject | None = None) -> bytes:
        chunk: JSONObject = {"id": self._id, "object": "chat.completion.chunk",
                             "created": self._created, "model": model,
                             "system_fingerprint": "fp_ollama", "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        return b"data: " + go_json(chunk) + b"\n\n"

    def _delta_chunk(self, model: str, message: JSONObject, *, content: bool,
                     reasoning: bool, tool_calls: bool) -> bytes:
        delta: JSONObject = {"role": "assistant"} if not self._first_sent else {}
        if content:
            delta["content"] = message.get("content", "")
        if reasoning and message.get("thinking"):
            delta["reasoning"] = message["thinking"]
        if tool_calls and message.get("tool_calls"):
            delta["tool_calls"] = _openai_tool_calls(message["tool_calls"])
            self._tool_call_sent = True
        self._first_sent = True
        return self._chunk(model, [{"index": 0, "delta": delta, "finish_reason": None}])

    def frame(self, chunk: JSONObject) -> bytes:
        if self._created is None:
            self._created = _unix(chunk["created_at"])
        model, message = chunk["model"], chunk["message"]
        out = b""
        empty_trailer = chunk["done"] and self._first_sent and not (
            message.get("content") or message.get("thinking") or message.get("tool_calls"))
        if not empty_trailer:
            mixed = bool(message.get("thinking")) and bool(
                message.get("content") or message.get("tool_calls"))
            if mixed:  # ToStreamChunks splits reasoning from content/tool calls
                out += self._delta_chunk(model, message, content=False, reasoning=True,
                                         tool_calls=False)
                out += self._delta_chunk(model, message, content=True, reasoning=False,
                                         tool_calls=True)
            else:
                out += self._delta_chunk(model, message, content=True, reasoning=True,
                                         tool_calls=True)
        if chunk["done"]:
            reason = chunk.get("done_reason") or "stop"
            if reason == "stop" and self._tool_call_sent:
                reason = "tool_calls"
            out += self._chunk(model, [{"index": 0, "delta": {}, "finish_reason": reason}])
            if self._include_usage:
                out += self._chunk(model, [], _usage(chunk))
            out += b"data: [DONE]\n\n"
        return out

    def late_failure(self, failure: _Failure) -> bytes:
        # The {"error"} object reaches ChatWriter.Write with status 200, is unmarshalled as an
        # empty api.ChatResponse and goes out as an ordinary chunk; the error text is lost.
        return self._chunk("", [{"index": 0, "delta": {"content": ""}, "finish_reason": None}])

    def early_failure(self, failure: _Failure) -> _Reply:
        return _Reply(failure.status, PLAIN_JSON,
                      go_json(openai_error(failure.status, failure.message)) + b"\n")

    def complete(self, chunks: list[JSONObject]) -> _Reply:
        done = fold_chat(chunks, collect_tool_calls=True)
        message = done["message"]
        calls = _openai_tool_calls(message.get("tool_calls", []))
        out_message: JSONObject = {"role": message["role"], "content": message["content"]}
        if message.get("thinking"):
            out_message["reasoning"] = message["thinking"]
        if calls:
            out_message["tool_calls"] = calls
        reason = done.get("done_reason") or None
        if reason == "stop" and calls:
            reason = "tool_calls"
        body = {"id": self._id, "object": "chat.completion", "created": _unix(done["created_at"]),
                "model": done["model"], "system_fingerprint": "fp_ollama",
                "choices": [{"index": 0, "message": out_message, "finish_reason": reason}],
                "usage": _usage(done)}
        return _Reply(200, PLAIN_JSON, go_json(body) + b"\n")


class OpenAICompletionWriter:
    """middleware.CompleteWriter over the native generate chunks."""

    stream_content_type = SSE

    def __init__(self, completion_id: str, *, include_usage: bool) -> None:
        self._id = completion_id
        self._include_usage = include_usage

    def _chunk(self, model: str, choices: list[JSONObject], usage: JSONObject | None) -> bytes:
        chunk: JSONObject = {"id": self._id, "object": "text_completion",
                             "created": int(time.time()), "choices": choices, "model": model,
                             "system_fingerprint": "fp_ollama"}
        if usage is not None:
            chunk["usage"] = usage
        return b"data: " + go_json(chunk) + b"\n\n"

    def _zero_usage(self) -> JSONObject | None:
        return ({"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
                if self._include_usage else None)

    def frame(self, chunk: JSONObject) -> bytes:
        choice = {"text": chunk.get("response", ""), "index": 0,
                  "finish_reason": chunk.get("done_reason") or None}
        out = self._chunk(chunk["model"], [choice], self._zero_usage())
        if chunk["done"]:
            if self._include_usage:
                out += self._chunk(chunk["model"], [], _usage(chunk))
            out += b"data: [DONE]\n\n"
        return out

    def late_failure(self, failure: _Failure) -> bytes:
        return self._chunk("", [{"text": "", "index": 0, "finish_reason": None}],
                           self._zero_usage())

    def early_failure(self, failure: _Failure) -> _Reply:
        return _Reply(failure.status, PLAIN_JSON,
                      go_json(openai_error(failure.status, failure.message)) + b"\n")

    def complete(self, chunks: list[JSONObject]) -> _Reply:
        done = fold_generate(chunks)
        body = {"id": self._id, "object": "text_completion", "created": _unix(done["created_at"]),
                "model": done["model"], "system_fingerprint": "fp_ollama",
                "choices": [{"text": done["response"], "index": 0,
                             "finish_reason": done.get("done_reason") or None}],
                "usage": _usage(done)}
        return _Reply(200, PLAIN_JSON, go_json(body) + b"\n")


# ------------------------------------------------------------------------------ responses

async def _send_reply(send: Send, reply: _Reply) -> None:
    await send({"type": "http.response.start", "status": reply.status,
                "headers": [(b"content-type", reply.content_type.encode()),
                            (b"content-length", str(len(reply.body)).encode())]})
    await send({"type": "http.response.body", "body": reply.body})


def reply_response(reply: _Reply) -> Response:
    return Response(reply.body, status_code=reply.status, media_type=reply.content_type)


class DeferredResponse(Response):
    """Ollama's response timing: nothing is sent, headers included, until the first chunk.

    A failure before then is answered with its own status; a client disconnect cancels the
    generation (the slot keeps what was prefilled so far), as Ollama cancels on request context.
    """

    def __init__(self, events: AsyncGenerator[_Event, None], writer: _Writer, *,
                 stream: bool) -> None:
        super().__init__()
        self._events = events
        self._writer = writer
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def cancel_on_disconnect() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                group.cancel_scope.cancel()

            group.start_soon(cancel_on_disconnect)
            try:
                async with contextlib.aclosing(self._events) as events:
                    await (self._respond_stream(events, send) if self._stream
                           else self._respond_whole(events, send))
            finally:
                group.cancel_scope.cancel()

    async def _respond_whole(self, events: AsyncGenerator[_Event, None], send: Send) -> None:
        chunks: list[JSONObject] = []
        async for event in events:
            if isinstance(event, _Failure):
                await _send_reply(send, self._writer.early_failure(event))
                return
            if isinstance(event, _Drop):
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", GO_JSON.encode())]})
                return  # the connection is cut with the body unfinished
            chunks.append(event.body)
        await _send_reply(send, self._writer.complete(chunks))

    async def _respond_stream(self, events: AsyncGenerator[_Event, None], send: Send) -> None:
        first: _Event | None = await anext(events, None)
        if isinstance(first, _Failure):
            await _send_reply(send, self._writer.early_failure(first))
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", self._writer.stream_content_type.encode())]})
        event: _Event | None = first
        while event is not None:
            if isinstance(event, _Drop):
                return  # no final body message: the server closes the connection mid-body
            data = (self._writer.late_failure(event) if isinstance(event, _Failure)
                    else self._writer.frame(event.body))
            await send({"type": "http.response.body", "body": data, "more_body": True})
            if isinstance(event, _Failure):
                break
            event = await anext(events, None)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


# --------------------------------------------------------------------------------- routes

def fake_ollama_state(app: Starlette) -> FakeOllama:
    engine: FakeOllama = app.state.fake_ollama
    return engine


def _engine(request: Request) -> FakeOllama:
    engine: FakeOllama = request.app.state.fake_ollama
    return engine


def _native_error(exc: ApiError) -> Response:
    return Response(go_json({"error": exc.message}), status_code=exc.status, media_type=GO_JSON)


def _openai_error_response(exc: ApiError) -> Response:
    if isinstance(exc, _MiddlewareError):  # gin's AbortWithStatusJSON
        return Response(go_json(openai_error(exc.status, exc.message)), status_code=exc.status,
                        media_type=GO_JSON)
    return Response(go_json(openai_error(exc.status, exc.message)) + b"\n",
                    status_code=exc.status, media_type=PLAIN_JSON)


def _chat_job(engine: FakeOllama, request: _ChatRequest, path: str) -> tuple[_Job, bool]:
    model = engine.find_model(request.model)
    think = _think_enabled(model, request.think, request.model)
    prompt = tokenize(render_chat(request.messages, request.tools))
    last_role = request.messages[-1].get("role", "user") if request.messages else "user"
    pieces, reason = plan_reply(model, think=think, tools=request.tools, last_role=last_role,
                                num_predict=request.num_predict, call_id=engine.call_id())
    return _Job(path, "chat", model, request.model, tuple(prompt), tuple(pieces), reason,
                request.keep_alive), bool(request.tools)


def _generate_job(engine: FakeOllama, request: _GenerateRequest, path: str) -> _Job:
    model = engine.find_model(request.model)
    think = _think_enabled(model, request.think, request.model)
    text = request.prompt if request.raw else render_generate(request.prompt, request.system)
    prompt = tokenize(engine.context_text(request.context) + text)
    pieces, reason = plan_reply(model, think=think, tools=[], last_role="user",
                                num_predict=request.num_predict, call_id="")
    return _Job(path, "generate", model, request.model, tuple(prompt), tuple(pieces), reason,
                request.keep_alive, include_context=not request.raw)


async def _lifecycle_reply(engine: FakeOllama, requested: str, keep_alive: float | None,
                           shape: Literal["chat", "generate"]) -> Response:
    """Empty messages/prompt: keep_alive 0 unloads at once, anything else loads (no metrics)."""
    model = engine.find_model(requested)
    if keep_alive == 0:
        engine.unload(model.name)
        reason = "unload"
    else:
        runner, _ = await engine.load(model, keep_alive)
        engine.release(runner)
        reason = "load"
    head: JSONObject = {"model": requested, "created_at": go_timestamp()}
    body = ({"message": {"role": "assistant", "content": ""}} if shape == "chat"
            else {"response": ""})
    return Response(go_json(head | body | {"done": True, "done_reason": reason}),
                    media_type=GO_JSON)


async def api_chat(request: Request) -> Response:
    engine = _engine(request)
    try:
        chat = parse_native_chat(await _json_body(request))
        if not chat.messages:
            return await _lifecycle_reply(engine, chat.model, chat.keep_alive, "chat")
        job, has_tools = _chat_job(engine, chat, "/api/chat")
    except ApiError as exc:
        return _native_error(exc)
    events = engine.run(job, engine.take_fault(job.path))
    return DeferredResponse(events, NativeWriter("chat", has_tools=has_tools), stream=chat.stream)


async def api_generate(request: Request) -> Response:
    engine = _engine(request)
    try:
        generate = parse_native_generate(await _json_body(request))
        if not generate.prompt:  # GenerateHandler: an empty prompt loads (or unloads)
            return await _lifecycle_reply(engine, generate.model, generate.keep_alive, "generate")
        job = _generate_job(engine, generate, "/api/generate")
    except ApiError as exc:
        return _native_error(exc)
    events = engine.run(job, engine.take_fault(job.path))
    return DeferredResponse(events, NativeWriter("generate"), stream=generate.stream)


async def v1_chat_completions(request: Request) -> Response:
    engine = _engine(request)
    try:
        body = await _json_body(request, error=_MiddlewareError)
        chat = parse_openai_chat(body)
        job, _ = _chat_job(engine, chat, "/v1/chat/completions")
    except ApiError as exc:
        return _openai_error_response(exc)
    writer = OpenAIChatWriter(f"chatcmpl-{engine.next_id() % 999}",
                              include_usage=_wants_usage(body))
    return DeferredResponse(engine.run(job, engine.take_fault(job.path)), writer,
                            stream=chat.stream)


async def v1_completions(request: Request) -> Response:
    engine = _engine(request)
    try:
        body = await _json_body(request, error=_MiddlewareError)
        completion = parse_openai_completion(body)
        job = _generate_job(engine, completion, "/v1/completions")
    except ApiError as exc:
        return _openai_error_response(exc)
    writer = OpenAICompletionWriter(f"cmpl-{engine.next_id() % 999}",
                                    include_usage=_wants_usage(body))
    return DeferredResponse(engine.run(job, engine.take_fault(job.path)), writer,
                            stream=completion.stream)


def _digest(model: FakeModel) -> str:
    return hashlib.sha256(model.name.encode()).hexdigest()


def _details(model: FakeModel) -> JSONObject:
    return {"parent_model": "", "format": "gguf", "family": model.family,
            "families": [model.family], "parameter_size": model.parameter_size,
            "quantization_level": model.quantization_level}


def _go_json_response(value: Any, status: int = 200) -> Response:
    return Response(go_json(value), status_code=status, media_type=GO_JSON)


async def api_version(request: Request) -> Response:
    return _go_json_response({"version": _engine(request).config.version})


async def root(request: Request) -> Response:
    return Response("Ollama is running", media_type="text/plain; charset=utf-8")


async def api_tags(request: Request) -> Response:
    models = [{"name": normalize_model_name(m.name), "model": normalize_model_name(m.name),
               "modified_at": m.modified_at, "size": m.size, "digest": _digest(m),
               "details": _details(m), "capabilities": m.capabilities}
              for m in _engine(request).models.values()]
    return _go_json_response({"models": models})


async def api_show(request: Request) -> Response:
    engine = _engine(request)
    try:
        body = await _json_body(request)
        requested = str(body.get("model") or body.get("name") or "")
        if not requested:
            raise ApiError(400, "model is required")
        model = engine.models.get(normalize_model_name(requested))
        if model is None:
            raise ApiError(404, f"model '{requested}' not found")
    except ApiError as exc:
        return _native_error(exc)
    arch = model.family
    template = "{{ range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
    return _go_json_response({
        "license": "Fake model licence: use it for tests only.",
        "modelfile": f"# Modelfile generated by \"ollama show\"\nFROM {model.name}\n"
                     f"TEMPLATE \"\"\"{template}\"\"\"\n",
        "template": template,
        "system": "You are a fake model.",
        "details": _details(model),
        "model_info": {"general.architecture": arch, "general.parameter_count": 134_515_008,
                       f"{arch}.context_length": model.context_length,
                       f"{arch}.embedding_length": 576,
                       f"{arch}.attention.layer_norm_rms_epsilon": 0.00001,
                       "tokenizer.ggml.tokens": []},
        "capabilities": model.capabilities,
        "modified_at": model.modified_at})


async def api_ps(request: Request) -> Response:
    engine = _engine(request)
    now, wall = engine.config.clock(), time.time()
    entries = []
    for runner in engine.loaded_runners():
        remaining = min(runner.expires_at - now, 100 * 365 * 86400.0)
        model = runner.model
        entries.append((remaining, {
            "name": normalize_model_name(model.name), "model": normalize_model_name(model.name),
            "size": model.size, "digest": _digest(model), "details": _details(model),
            "expires_at": go_timestamp(int((wall + remaining) * 1e9)), "size_vram": 0,
            "context_length": model.context_length}))
    entries.sort(key=lambda entry: -entry[0])  # longest remaining first, as PsHandler sorts
    return _go_json_response({"models": [entry for _, entry in entries]})


def _openai_model(model: FakeModel, model_id: str) -> JSONObject:
    return {"id": model_id, "object": "model", "created": _unix(model.modified_at),
            "owned_by": model_id.split("/")[0] if "/" in model_id else "library"}


async def v1_models(request: Request) -> Response:
    models = list(_engine(request).models.values())
    data = [_openai_model(m, normalize_model_name(m.name)) for m in models] or None
    return Response(go_json({"object": "list", "data": data}) + b"\n", media_type=PLAIN_JSON)


async def v1_model(request: Request) -> Response:
    requested = request.path_params["model"]
    model = _engine(request).models.get(normalize_model_name(requested))
    if model is None:
        return _openai_error_response(ApiError(404, f"model '{requested}' not found"))
    return Response(go_json(_openai_model(model, requested)) + b"\n", media_type=PLAIN_JSON)


async def not_found(request: Request, exc: Exception) -> Response:
    return Response("404 page not found", status_code=404, media_type="text/plain")


def create_fake_ollama(config: FakeOllamaConfig | None = None) -> Starlette:
    """The fake as an ASGI app; its engine is ``fake_ollama_state(app)``."""
    routes = [
        Route("/", root, methods=["GET", "HEAD"]),
        Route("/api/version", api_version, methods=["GET", "HEAD"]),
        Route("/api/tags", api_tags, methods=["GET", "HEAD"]),
        Route("/api/show", api_show, methods=["POST"]),
        Route("/api/ps", api_ps, methods=["GET"]),
        Route("/api/chat", api_chat, methods=["POST"]),
        Route("/api/generate", api_generate, methods=["POST"]),
        Route("/v1/chat/completions", v1_chat_completions, methods=["POST"]),
        Route("/v1/completions", v1_completions, methods=["POST"]),
        Route("/v1/models", v1_models, methods=["GET"]),
        Route("/v1/models/{model:path}", v1_model, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={404: not_found})
    app.state.fake_ollama = FakeOllama(config or FakeOllamaConfig())
    return app

