"""Context checkpoints: a slot's recurrent state at a point of its prompt, to roll back to.

Recurrent and hybrid memory (Qwen3.5/3.6, Qwen3-Next, Nemotron-H) holds one state per
sequence, the state after its last token: it cannot drop its last tokens and go on from an
earlier one (``llama_memory_seq_rm`` refuses a partial cut). llama-server keeps *context
checkpoints* for this (``tools/server/server-context.cpp``): the sequence's partial state
(``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``: the recurrent part; attention cells can be cut
anywhere) copied a few tokens before each prompt's end. A next request that leaves the
slot's tokens after that point loads it back, cuts the attention cells after it, and
prefills from there. This engine does the same (``SlotContext.take_checkpoint``,
``roll_back_to``), and writes the newest checkpoint into the slot's state file after
llama.cpp's own part (which llama.cpp's loader reads alone, leaving the rest), so that a
slot restored from its file rolls back as a live one does: what llama.cpp's PRs #20819
and #26004 propose for llama-server.

Only the newest checkpoint goes into the file: the proxy restores a parked file only for a
request that repeats all its committed messages, so what can differ is the last reply,
which starts after the last prompt's checkpoint.

The trailer, little-endian: u32 magic ``ppck``, u32 version, u32 count, then per
checkpoint u32 token count, u64 byte count and the bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

# The template's generation prompt, rendered again as a past turn, can differ in its last
# tokens (Qwen3.5's opens its reply with "<think>\n", a past reply has none): llama-server
# checkpoints 4 tokens before the prompt's end for that, and so does this engine.
CHECKPOINT_BEFORE_END = 4
# Per slot, in memory: each is a whole recurrent state (the tiny test model's: 117 kB).
MAX_CHECKPOINTS = 3
TRAILER_MAGIC = 0x6B637070  # 'ppck'
TRAILER_VERSION = 1
_HEADER = struct.Struct("<III")
_RECORD = struct.Struct("<IQ")


class CheckpointFileError(Exception):
    """The checkpoint trailer of a slot file is damaged."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """The sequence's partial state once its first ``n_tokens`` tokens were decoded."""

    n_tokens: int
    data: bytearray


class Checkpoints:
    """A slot's checkpoints, oldest first, each taken on the slot's current tokens."""

    def __init__(self, items: Iterable[Checkpoint] = (), bound: int = MAX_CHECKPOINTS) -> None:
        self.bound = bound
        self._items: list[Checkpoint] = []
        for item in items:
            self.add(item)

    def __len__(self) -> int:
        return len(self._items)

    def add(self, checkpoint: Checkpoint) -> None:
        self.forget_after(checkpoint.n_tokens - 1)
        self._items.append(checkpoint)
        del self._items[: max(0, len(self._items) - self.bound)]

    def latest_within(self, n_tokens: int) -> Checkpoint | None:
        """The newest checkpoint of at most ``n_tokens`` tokens."""
        within = [item for item in self._items if item.n_tokens <= n_tokens]
        return within[-1] if within else None

    def newest(self) -> Checkpoint | None:
        return self._items[-1] if self._items else None

    def forget_after(self, n_tokens: int) -> None:
        """The slot's tokens past ``n_tokens`` are gone: so are the checkpoints past them."""
        self._items = [item for item in self._items if item.n_tokens <= n_tokens]

    def clear(self) -> None:
        self._items.clear()

    def replace(self, items: Iterable[Checkpoint]) -> None:
        self.clear()
        for item in items:
            self.add(item)


def encode_trailer(checkpoints: Sequence[Checkpoint]) -> bytes:
    parts = [_HEADER.pack(TRAILER_MAGIC, TRAILER_VERSION, len(checkpoints))]
    for checkpoint in checkpoints:
        parts.append(_RECORD.pack(checkpoint.n_tokens, len(checkpoint.data)))
        parts.append(bytes(checkpoint.data))
    return b"".join(parts)


def decode_trailer(raw: bytes | bytearray) -> list[Checkpoint]:
    """The checkpoints a trailer holds; it must be read to its last byte."""
    if len(raw) < _HEADER.size:
        raise CheckpointFileError(f"{len(raw)} bytes after the state: no checkpoint trailer")
    magic, version, count = _HEADER.unpack_from(raw)
    if magic != TRAILER_MAGIC or version != TRAILER_VERSION:
        raise CheckpointFileError(f"unknown trailer (magic {magic:#x}, version {version})")
    offset, found = _HEADER.size, []
    for _ in range(count):
        if offset + _RECORD.size > len(raw):
            raise CheckpointFileError("checkpoint trailer cut short")
        n_tokens, size = _RECORD.unpack_from(raw, offset)
        offset += _RECORD.size
        if offset + size > len(raw):
            raise CheckpointFileError("checkpoint data cut short")
        found.append(Checkpoint(n_tokens, bytearray(raw[offset : offset + size])))
        offset += size
    if offset != len(raw):
        raise CheckpointFileError(f"{len(raw) - offset} bytes past the checkpoint trailer")
    return found


def append_checkpoints(path: Path, checkpoints: Sequence[Checkpoint]) -> int:
    """Write the trailer after the state llama.cpp wrote; returns its bytes (0: none)."""
    if not checkpoints:
        return 0
    trailer = encode_trailer(checkpoints)
    with path.open("ab") as file:
        file.write(trailer)
    return len(trailer)


def read_checkpoints(path: Path, state_bytes: int) -> tuple[list[Checkpoint], int]:
    """The checkpoints written after the ``state_bytes`` llama.cpp read, and the trailer's
    bytes; none in a file without a trailer (llama-server's)."""
    with path.open("rb") as file:
        file.seek(state_bytes)
        raw = file.read()
    if not raw:
        return [], 0
    return decode_trailer(raw), len(raw)
