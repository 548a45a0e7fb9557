"""Slot contexts and samplers over one ``LlamaModel`` (llama-cpp-python's ctypes layer).

A ``SlotContext`` is a ``llama_context`` with its own KV cache holding one sequence
(seq id 0) and a reusable batch; it is used by one thread at a time (its slot's worker).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixpin.adapters.embedded.errors import EngineBackendError
from prefixpin.adapters.embedded.model.checkpoints import Checkpoint
from prefixpin.adapters.embedded.model.llama import LlamaModel

# llama.h: LLAMA_DEFAULT_SEED, "pick a random seed".
DEFAULT_SEED = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """llama-server's default sampler chain, reduced to the fields the engine honours."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = DEFAULT_SEED


class Sampler:
    """A llama.cpp sampler chain: top-k, top-p, min-p, temperature, then a seeded draw.

    Temperature <= 0 is greedy, as in llama.cpp's temperature sampler.
    """

    def __init__(self, lib: Any, params: SamplingParams) -> None:
        self.lib = lib
        self._chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        for sampler in self._stages(params):
            lib.llama_sampler_chain_add(self._chain, sampler)

    def _stages(self, params: SamplingParams) -> list[Any]:
        lib = self.lib
        if params.temperature <= 0.0:
            return [lib.llama_sampler_init_greedy()]
        return [
            lib.llama_sampler_init_top_k(params.top_k),
            lib.llama_sampler_init_top_p(params.top_p, 1),
            lib.llama_sampler_init_min_p(params.min_p, 1),
            lib.llama_sampler_init_temp(params.temperature),
            lib.llama_sampler_init_dist(params.seed & 0xFFFFFFFF),
        ]

    def sample(self, context: SlotContext) -> int:
        """Draw from the logits of the last decoded token (and accept it into the chain)."""
        return int(self.lib.llama_sampler_sample(self._chain, context.handle, -1))

    def close(self) -> None:
        if self._chain:
            self.lib.llama_sampler_free(self._chain)
            self._chain = None


class SlotContext:
    """A ``llama_context`` holding one sequence, with a reusable batch of ``n_batch`` tokens."""

    def __init__(self, model: LlamaModel, *, n_ctx: int, n_batch: int, n_threads: int) -> None:
        lib = model.lib
        self.lib = lib
        self.n_batch = n_batch
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = min(n_batch, 512)
        params.n_seq_max = 1
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        # A full-size SWA cache lets a sliding-window model rewind to any common prefix,
        # as llama-server's --swa-full does; full-attention models ignore it.
        params.swa_full = True
        params.no_perf = True
        context = lib.llama_init_from_model(model.handle, params)
        if not context:
            raise EngineBackendError(f"llama.cpp could not create a context of {n_ctx} tokens")
        self._context = context
        self.n_ctx = int(lib.llama_n_ctx(context))
        self._memory = lib.llama_get_memory(context)
        # Recurrent/hybrid memory rolls back only to checkpoints (``checkpoints``).
        self.needs_checkpoints = model.has_recurrent_memory()
        self._batch = lib.llama_batch_init(n_batch, 0, 1)

    @property
    def handle(self) -> Any:
        return self._context

    def decode(self, tokens: Sequence[int], start_pos: int, *, logits_last: bool) -> None:
        """Decode up to ``n_batch`` tokens at positions ``start_pos...`` of sequence 0."""
        batch = self._batch
        count = len(tokens)
        for index, token in enumerate(tokens):
            batch.token[index] = token
            batch.pos[index] = start_pos + index
            batch.n_seq_id[index] = 1
            batch.seq_id[index][0] = 0
            batch.logits[index] = 0
        if logits_last and count:
            batch.logits[count - 1] = 1
        batch.n_tokens = count
        status = int(self.lib.llama_decode(self._context, batch))
        if status != 0:
            raise EngineBackendError(f"llama_decode failed with status {status}")

    def warm_up(self, tokens: Sequence[int]) -> None:
        """Decode a token or two and forget them, as llama-server does at startup: the first
        decode pages the mmapped weights in, which would otherwise land on a request."""
        self.decode(tokens, 0, logits_last=True)
        self.clear()

    def keep_first(self, n_keep: int) -> bool:
        """Drop the KV cells at positions >= n_keep; False if memory cannot do a partial cut."""
        return bool(self.lib.llama_memory_seq_rm(self._memory, 0, n_keep, -1))

    def clear(self) -> None:
        self.lib.llama_memory_clear(self._memory, True)

    def checkpoint_size(self) -> int:
        """Bytes of the sequence's partial (recurrent) state as it stands."""
        return int(self.lib.llama_state_seq_get_size_ext(
            self._context, 0, self.lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY))

    def take_checkpoint(self, n_tokens: int) -> Checkpoint:
        """The partial state now that the first ``n_tokens`` tokens are decoded."""
        size = self.checkpoint_size()
        data = bytearray(size)
        buffer = (ctypes.c_uint8 * size).from_buffer(data)
        written = int(self.lib.llama_state_seq_get_data_ext(
            self._context, buffer, size, 0, self.lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY))
        del buffer  # the bytearray cannot be resized while a ctypes view exports it
        if written != size:
            raise EngineBackendError(f"checkpoint copied {written} of {size} bytes")
        return Checkpoint(n_tokens, data)

    def roll_back_to(self, checkpoint: Checkpoint) -> bool:
        """Load the checkpoint's partial state and drop the cells after it; False if the
        memory took neither (the caller then starts over)."""
        size = len(checkpoint.data)
        buffer = (ctypes.c_uint8 * size).from_buffer(checkpoint.data)
        read = int(self.lib.llama_state_seq_set_data_ext(
            self._context, buffer, size, 0, self.lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY))
        del buffer
        return read == size and self.keep_first(checkpoint.n_tokens)

    def save_state(self, path: Path, packed_tokens: Sequence[int]) -> int:
        """Write the sequence's KV state plus ``packed_tokens``; returns bytes written."""
        tokens = (self.lib.llama_token * max(1, len(packed_tokens)))(*packed_tokens)
        written = int(self.lib.llama_state_seq_save_file(
            self._context, str(path).encode(), 0, tokens, len(packed_tokens)))
        if written == 0:
            raise EngineBackendError("Unable to save slot")
        return written

    def load_state(self, path: Path, capacity: int) -> tuple[int, list[int]]:
        """Read a state file into sequence 0; returns (bytes read, packed tokens)."""
        buffer = (self.lib.llama_token * max(1, capacity))()
        count = ctypes.c_size_t(0)
        read = int(self.lib.llama_state_seq_load_file(
            self._context, str(path).encode(), 0, buffer, capacity, ctypes.byref(count)))
        if read == 0:
            raise EngineBackendError("No available space in KV cache or invalid slot save file")
        return read, list(buffer[: count.value])

    def close(self) -> None:
        if self._context:
            self.lib.llama_batch_free(self._batch)
            self.lib.llama_free(self._context)
            self._context = None
