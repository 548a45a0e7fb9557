"""Slots: N contexts over one model, llama-server's slot choice, and slot state files
(llama.cpp's, then the slot's newest context checkpoint: ``checkpoints``).

Each ``Slot`` owns a ``SlotContext`` and a one-thread executor: everything that touches
its context (a generation, a save, a restore, an erase) runs there, so one slot never does
two things at once and the event loop never blocks on llama.cpp. ``SlotPool`` runs on the
event loop only; it hands out idle slots the way llama-server's ``get_available_slot``
does and parks a request whose slot is busy until it is released (llama-server "defers").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prefixpin.adapters.embedded.errors import ApiError, EngineBackendError
from prefixpin.adapters.embedded.model.checkpoints import (
    Checkpoint,
    CheckpointFileError,
    append_checkpoints,
    read_checkpoints,
)
from prefixpin.adapters.embedded.model.context import SlotContext
from prefixpin.adapters.embedded.model.generate import SlotState, SlotStats, common_prefix
from prefixpin.adapters.embedded.model.llama import LlamaModel

# --slot-prompt-similarity default: reuse a slot only if it holds > 10 % of the new prompt.
SLOT_PROMPT_SIMILARITY = 0.10
# server_tokens::serialize: LLAMA_TOKEN_NULL marker, format version, tokens, media count.
_PACKED_MARKER, _PACKED_VERSION = -1, 1


class Slot:
    """One llama_context, its cached tokens, and its worker thread."""

    def __init__(self, slot_id: int, context: SlotContext) -> None:
        self.id = slot_id
        self.context = context
        self.state = SlotState()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"slot-{slot_id}")
        self.busy = False
        self.t_last_used = -1  # never used: chosen first by LRU
        self.id_task: int | None = None
        self.params: dict[str, Any] = {}

    def to_json(self) -> dict[str, Any]:
        """The slot as llama-server's GET /slots lists it (server_slot::to_json)."""
        report: dict[str, Any] = {
            "id": self.id,
            "n_ctx": self.context.n_ctx,
            "speculative": False,
            "is_processing": self.busy,
        }
        if self.id_task is None:
            return report
        state, stats = self.state, self.state.stats
        if not self.busy:
            # llama-server resets a slot's stats when it releases it (server_slot::reset)
            state, stats = SlotState(tokens=state.tokens), SlotStats()
        report.update({
            "id_task": self.id_task,
            "n_prompt_tokens": len(state.tokens),
            "n_prompt_tokens_processed": stats.n_prompt_processed,
            "n_prompt_tokens_cache": stats.n_prompt_cached,
            "params": self.params,
            "next_token": [{
                "has_next_token": state.has_next_token,
                "has_new_line": state.has_new_line,
                "n_remain": state.n_remain,
                "n_decoded": stats.n_gen,
            }],
        })
        return report

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        self.context.close()


def wrap_slot_id(id_slot: int, n_slots: int) -> int:
    """llama-server's get_slot_by_id: ``id_slot % slots.size()`` in size_t arithmetic."""
    return (id_slot % 2**64) % n_slots


class SlotPool:
    """Slot assignment on the event loop: pinned, most similar, or least recently used."""

    def __init__(self, slots: Sequence[Slot]) -> None:
        self.slots = list(slots)
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def n_waiting(self) -> int:
        """Requests parked until a slot frees (llama-server's deferred tasks)."""
        return len(self._waiters)

    def choose(self, prompt: Sequence[int] | None, id_slot: int) -> Slot | None:
        """The slot llama-server would pick now; it may be busy only when pinned."""
        if id_slot != -1:
            return self.slots[wrap_slot_id(id_slot, len(self.slots))]
        idle = [slot for slot in self.slots if not slot.busy]
        if prompt:
            best, best_sim = None, 0.0
            for slot in idle:
                if not slot.state.tokens:
                    continue
                sim = common_prefix(slot.state.tokens, prompt) / len(prompt)
                if sim > best_sim and sim > SLOT_PROMPT_SIMILARITY:
                    best, best_sim = slot, sim
            if best is not None:
                return best
        chosen: Slot | None = None
        for slot in idle:  # "<=": among equals the last one wins, as in llama-server
            if chosen is None or slot.t_last_used <= chosen.t_last_used:
                chosen = slot
        return chosen

    async def acquire(self, prompt: Sequence[int] | None, id_slot: int) -> Slot:
        """Wait until the chosen slot is idle, then mark it busy."""
        loop = asyncio.get_running_loop()
        while True:
            slot = self.choose(prompt, id_slot)
            if slot is not None and not slot.busy:
                slot.busy = True
                return slot
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def release(self, slot: Slot) -> None:
        slot.busy = False
        slot.t_last_used = time.monotonic_ns()
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


def pack_tokens(tokens: Sequence[int]) -> list[int]:
    """server_tokens::serialize, so state files move between llama-server and this engine."""
    return [_PACKED_MARKER, _PACKED_VERSION, len(tokens), *tokens, 0]


def unpack_tokens(packed: Sequence[int]) -> list[int]:
    if not packed or packed[0] != _PACKED_MARKER:
        return list(packed)  # a plain token list, as older llama-server versions wrote
    version = packed[1] & 0xFFFFFFFF if len(packed) > 1 else 0
    if version != _PACKED_VERSION:
        raise ApiError("Unable to restore slot: Unsupported server tokens state version")
    count = packed[2] if len(packed) > 2 else -1
    if count < 0 or len(packed) < 4 + count:
        raise ApiError("Unable to restore slot: truncated server tokens state")
    if packed[3 + count] != 0:
        raise ApiError("Unable to restore slot: Cannot restore media tokens without an mmproj")
    return list(packed[3 : 3 + count])


def save_slot(slot: Slot, path: Path) -> tuple[int, int]:
    """Write tokens + KV state, then the newest context checkpoint (``checkpoints``);
    returns (tokens saved, bytes written). Slot thread only."""
    tokens = slot.state.tokens
    newest = slot.state.checkpoints.newest()
    try:
        written = slot.context.save_state(path, pack_tokens(tokens))
        written += append_checkpoints(path, [newest] if newest is not None else [])
    except EngineBackendError as exc:
        raise ApiError(str(exc), "server_error") from exc
    except OSError as exc:
        raise ApiError(f"Unable to save slot: {exc.strerror}", "server_error") from exc
    return len(tokens), written


def restore_slot(slot: Slot, model: LlamaModel, path: Path) -> tuple[int, int]:
    """Load a state file into the slot; returns (tokens restored, bytes read). Slot thread only."""
    context = slot.context
    context.clear()
    slot.state.tokens = []
    slot.state.checkpoints.clear()
    try:
        read, packed = context.load_state(path, context.n_ctx + 8)
        tokens = unpack_tokens(packed)
        if len(tokens) > context.n_ctx:
            raise ApiError("Unable to restore slot: Restored prompt does not fit in the slot "
                           "context")
        if not all(model.is_valid_token(token) for token in tokens):
            raise ApiError("Unable to restore slot: Invalid tokens in slot save file")
        checkpoints, trailer = read_checkpoints(path, read)
        check_checkpoints(checkpoints, len(tokens), context)
    except (EngineBackendError, CheckpointFileError, OSError) as exc:
        context.clear()
        raise ApiError(f"Unable to restore slot: {exc}") from exc
    except ApiError:
        context.clear()
        raise
    slot.state.tokens = tokens
    slot.state.checkpoints.replace(checkpoints)
    return len(tokens), read + trailer


def check_checkpoints(checkpoints: Sequence[Checkpoint], n_tokens: int,
                      context: SlotContext) -> None:
    """Each checkpoint restored must lie within the slot's tokens and be a partial state of
    this memory's size (a file of another model is refused, not rolled back to)."""
    if checkpoints and not context.needs_checkpoints:
        raise CheckpointFileError("context checkpoints for a model without recurrent memory")
    size = context.checkpoint_size() if checkpoints else 0
    for checkpoint in checkpoints:
        if not 0 < checkpoint.n_tokens <= n_tokens:
            raise CheckpointFileError(f"a checkpoint at token {checkpoint.n_tokens} of "
                                      f"{n_tokens}")
        if len(checkpoint.data) != size:
            raise CheckpointFileError(f"a checkpoint of {len(checkpoint.data)} bytes, the "
                                      f"model's state takes {size}")


def erase_slot(slot: Slot) -> int:
    """Forget the slot's cache; returns how many tokens it held. Slot thread only."""
    erased = len(slot.state.tokens)
    slot.context.clear()
    slot.state.tokens = []
    slot.state.checkpoints.clear()
    return erased
