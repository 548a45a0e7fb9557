"""The embedded engine itself and its Starlette app: llama.cpp (llama-cpp-python) in the
engine's worker process, speaking llama-server's HTTP.

``create_engine_app(config)`` returns a Starlette app that answers the llama-server
endpoints the proxy uses, with the same paths, JSON shapes and cache figures, so the proxy
drives it with the llama-server adapter (``adapters.embedded.client``):

    GET  /health /v1/health /props /models /v1/models /slots /metrics
    POST /v1/chat/completions /chat/completions /v1/completions
    POST /tokenize /detokenize /apply-template /slots/{id}?action=save|restore|erase

Model: one ``llama_model`` (weights mmapped once) and ``n_slots`` ``llama_context``\\ s of
``n_ctx`` tokens each. Every slot keeps the tokens in its KV cache and reuses the longest
common prefix with the next prompt; a prompt that is fully cached still re-evaluates its
last token (``cache_n == n_prompt - 1``), as llama-server does.

Threads: each slot has one worker thread; a generation, save, restore or erase on a slot
runs there, one at a time. The event loop only schedules: it picks slots, parks requests
for a busy slot, relays events. A client disconnect sets the job's cancel flag, checked
between prefill batches and between generated tokens, so the slot frees within one batch
(``n_batch`` tokens) and keeps what was processed.

Deliberate differences from llama-server (b1-0c1e570, vendored in llama-cpp-python 0.3.36):

- no host-RAM prompt cache (``--cache-ram``): a slot chosen by LRU just loses its tokens;
  compare with a llama-server started with ``--cache-ram 0``;
- slots are separate contexts (llama-server's ``--no-kv-unified`` with ``-np N``) and
  sliding-window models get a full-size SWA cache (``--swa-full``), so any common prefix is
  reusable and no context checkpoints exist;
- one completion per request (``n`` > 1 and multi-prompt ``/v1/completions`` are refused);
- output is not parsed for tool calls or reasoning: generated text is ``content``;
  no ``logprobs``, grammars, ``response_format``, penalties, mirostat or speculative decoding;
- ``/props`` and per-slot ``params`` list only the settings this engine has; ``/metrics`` is
  always on with a small subset of llama-server's counters;
- ``/v1/models`` adds ``architecture`` (GGUF ``general.architecture``) to ``data[0]``, as
  newer llama-server builds do;
- the default ``n_batch`` is 512, not 2048, so a disconnect stops prefill sooner;
- malformed JSON is a 400 ``invalid_request_error`` (llama-server: a 500 ``server_error``);
- slot files use llama-server's token packing, but the KV part follows the context layout
  (llama-server keeps every slot in one context), so files do not move between the two;
- the slot's process-local ``id_task`` counts completions only.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal, TextIO

from starlette.applications import Starlette

from prefixpin.adapters.embedded.api.facts import METRIC_HELP
from prefixpin.adapters.embedded.api.http import build_routes
from prefixpin.adapters.embedded.api.request import CompletionOptions
from prefixpin.adapters.embedded.cpu_paths import choose_cpu_paths
from prefixpin.adapters.embedded.errors import (
    ApiError,
    ContextSizeError,
    EngineBackendError,
    ModelLoadError,
)
from prefixpin.adapters.embedded.model.context import SlotContext
from prefixpin.adapters.embedded.model.generate import GenerationTask
from prefixpin.adapters.embedded.model.job import Job
from prefixpin.adapters.embedded.model.llama import (
    LlamaModel,
    check_gguf_file,
    llama_log,
    load_bindings,
)
from prefixpin.adapters.embedded.model.slots import (
    Slot,
    SlotPool,
    erase_slot,
    restore_slot,
    save_slot,
    wrap_slot_id,
)

__all__ = ["EmbeddedEngine", "EngineConfig", "create_engine_app"]

_LOG = logging.getLogger("prefixpin.embedded")
_PATH_FIELDS = frozenset({"model_path", "slot_save_path"})


def _default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How to run the embedded engine.

    ``n_ctx`` is per slot (llama-server's ``-c`` divided by ``-np``); ``slot_save_path`` is
    llama-server's ``--slot-save-path`` (slot save/restore/erase answer 501 without it);
    ``model_alias`` is ``--alias`` (default: ``model_path`` as given, like llama-server).
    """

    model_path: Path
    n_slots: int = 2
    n_ctx: int = 4096
    n_batch: int = 512
    n_threads: int | None = None
    slot_save_path: Path | None = None
    model_alias: str | None = None
    repack: Literal["auto", "on", "off"] = "auto"  # llama.cpp's extra buffer types (cpu_paths)
    verbose: bool = False  # llama.cpp's own log on stderr (else: logger prefixpin.embedded.llama)
    show_progress: bool = True  # model loading progress on stderr

    def to_json(self) -> str:
        """The config as the worker process reads it (``from_json``)."""
        return json.dumps({key: str(value) if key in _PATH_FIELDS and value is not None
                           else value for key, value in asdict(self).items()})

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        raw: dict[str, Any] = json.loads(text)
        known = {field.name for field in fields(cls)}
        values: dict[str, Any] = {
            key: Path(value) if key in _PATH_FIELDS and value is not None else value
            for key, value in raw.items() if key in known}
        return cls(**values)

    def __post_init__(self) -> None:
        for name in ("n_slots", "n_ctx", "n_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_threads is not None and self.n_threads < 1:
            raise ValueError(f"EngineConfig.n_threads must be >= 1, got {self.n_threads}")


class _LoadProgress:
    """Model loading progress on a terminal line (or start/end lines when not a TTY)."""

    def __init__(self, stream: TextIO | None, name: str) -> None:
        self.stream, self.name, self.shown = stream, name, -1
        self.tty = bool(stream and stream.isatty())

    def __call__(self, fraction: float) -> None:
        percent = int(fraction * 100)
        if self.stream is None or percent == self.shown:
            return
        if self.tty:
            end = "\n" if percent >= 100 else ""
            self.stream.write(f"\r[prefixpin] loading {self.name}: {percent:3d}%{end}")
        elif self.shown < 0 or percent >= 100:
            self.stream.write(f"[prefixpin] loading {self.name}: {percent}%\n")
        self.shown = percent
        self.stream.flush()


class EmbeddedEngine:
    """One model, ``n_slots`` slot contexts and their worker threads.

    Construction loads the model synchronously (from async code, in a thread);
    ``aclose()`` stops running jobs and frees everything.
    """

    def __init__(self, config: EngineConfig, *, progress_stream: TextIO | None = None) -> None:
        self.config = config
        lib = load_bindings()
        llama_log(lib).echo = config.verbose
        check_gguf_file(config.model_path)
        self.cpu = choose_cpu_paths(config.repack, bytes(lib.llama_print_system_info()).decode())
        _LOG.info("%s", self.cpu.line())
        stream = (progress_stream or sys.stderr) if config.show_progress else None
        self.model = LlamaModel(lib, config.model_path,
                                _LoadProgress(stream, config.model_path.name),
                                use_extra_bufts=self.cpu.repack)
        self.info = self.model.info
        self.pool = SlotPool(self._create_slots(config))
        # jinja2 comes with the embedded extra: imported once that extra is known present
        from prefixpin.adapters.embedded.model.chat import ChatTemplate

        self.template = ChatTemplate(self.info.chat_template, bos_token=self.info.bos_token,
                                     eos_token=self.info.eos_token,
                                     vocab_adds_bos=self.info.add_bos)
        # llama-server names the model by the -m path as given when no --alias is set
        self.model_name = config.model_alias or str(config.model_path)
        self.media_marker = f"<__media_{secrets.token_urlsafe(30)[:32]}__>"
        self.build_info = (f"embedded llama-cpp-python {_llama_cpp_version()} "
                           f"(repack {'on' if self.cpu.repack else 'off'})")
        self.start_time = time.time()  # a restarted worker's differs, even within a second
        self.counters: dict[str, float] = dict.fromkeys(METRIC_HELP, 0)
        self._jobs: set[Job] = set()
        self._next_task = 0
        self._closed = False

    def _create_slots(self, config: EngineConfig) -> list[Slot]:
        threads = config.n_threads or _default_threads()
        slots: list[Slot] = []
        try:
            for slot_id in range(config.n_slots):
                context = SlotContext(self.model, n_ctx=config.n_ctx, n_batch=config.n_batch,
                                      n_threads=threads)
                context.warm_up(self.model.warm_up_tokens())
                slots.append(Slot(slot_id, context))
        except EngineBackendError as exc:
            for slot in slots:
                slot.close()
            self.model.close()
            raise ModelLoadError(f"cannot create slot contexts: {exc}") from None
        return slots

    @property
    def n_ctx_slot(self) -> int:
        return self.pool.slots[0].context.n_ctx

    def next_task_id(self) -> int:
        self._next_task += 1
        return self._next_task

    # -- completions ------------------------------------------------------------------

    async def start(self, prompt: Sequence[int], options: CompletionOptions) -> Job:
        """Wait for a slot (llama-server's choice), then start generating on its thread."""
        self._check_open()
        if len(prompt) >= self.n_ctx_slot:
            raise ContextSizeError(len(prompt), self.n_ctx_slot)
        slot = await self.pool.acquire(prompt, options.id_slot)
        self._check_open()  # closed while this request waited for the slot
        task = GenerationTask(
            id_task=self.next_task_id(), prompt=prompt, n_predict=options.n_predict,
            sampling=options.sampling, stop=options.stop, cache_prompt=options.cache_prompt,
            report_progress=options.stream and options.return_progress)
        slot.id_task, slot.params = task.id_task, options.params_json()
        job = Job(self.model, slot, task, on_release=self.finish_job)
        self._jobs.add(job)
        return job

    def finish_job(self, job: Job) -> None:
        self._jobs.discard(job)
        stats = job.slot.state.stats
        counters = self.counters
        counters["prompt_tokens_total"] += stats.n_prompt_processed
        counters["prompt_tokens_cached_total"] += stats.n_prompt_cached
        counters["prompt_seconds_total"] += stats.t_prompt_ms() / 1e3
        counters["tokens_predicted_total"] += stats.n_gen
        counters["tokens_predicted_seconds_total"] += stats.t_gen_ms() / 1e3
        self.pool.release(job.slot)

    # -- slot actions -----------------------------------------------------------------

    def slot_file(self, filename: str) -> Path:
        if self.config.slot_save_path is None:
            raise ApiError("This server does not support slots action. Start it with "
                           "`--slot-save-path`", "not_supported_error")
        return self.config.slot_save_path / filename

    async def save_slot(self, id_slot: int, path: Path) -> tuple[int, int, float]:
        return await self._on_slot(id_slot, lambda slot: save_slot(slot, path))

    async def restore_slot(self, id_slot: int, path: Path) -> tuple[int, int, float]:
        return await self._on_slot(id_slot, lambda slot: restore_slot(slot, self.model, path))

    async def erase_slot(self, id_slot: int) -> int:
        erased, _, _ = await self._on_slot(id_slot, lambda slot: (erase_slot(slot), 0))
        return erased

    async def _on_slot(self, id_slot: int,
                       action: Callable[[Slot], tuple[int, int]]) -> tuple[int, int, float]:
        """Run ``action(slot)`` on the slot's thread once it is idle; adds elapsed ms."""
        self._check_open()
        index = wrap_slot_id(id_slot, len(self.pool.slots))
        slot = await self.pool.acquire(None, index)
        try:
            self._check_open()
            started = time.perf_counter()
            n_tokens, n_bytes = await asyncio.get_running_loop().run_in_executor(
                slot.executor, action, slot)
            return n_tokens, n_bytes, (time.perf_counter() - started) * 1000.0
        finally:
            self.pool.release(slot)

    # -- lifecycle --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ApiError("the embedded engine is shut down", "unavailable_error")

    async def aclose(self) -> None:
        """Stop running generations (within one batch), join the slot threads, free memory.

        Later requests get a 503; calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        for job in list(self._jobs):
            job.cancel.set()
        await asyncio.to_thread(self._close_sync)

    def _close_sync(self) -> None:
        for slot in self.pool.slots:
            slot.close()
        self.model.close()


def _llama_cpp_version() -> str:
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def create_engine_app(config: EngineConfig, *, engine: EmbeddedEngine | None = None) -> Starlette:
    """A Starlette app serving llama-server's HTTP API from an in-process engine.

    Without ``engine`` the model is loaded now (``ModelLoadError`` on a bad file) and
    freed when the app's lifespan ends; a given ``engine`` stays the caller's to close.
    The engine is available as ``app.state.engine``.
    """
    owned = engine is None
    running = engine if engine is not None else EmbeddedEngine(config)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if owned:
                await running.aclose()

    app = Starlette(routes=build_routes(running), lifespan=lifespan)
    app.state.engine = running
    return app
