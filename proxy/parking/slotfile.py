"""The engine's slot file, read back and checked (sans-IO parsing, small blocking helpers).

The file is the engine's own (``llama_state_seq_save_file``): u32 magic ``ggsq``, u32
version 3, u32 count, ``count`` int32s of llama-server's packed token list (``-1``, format
version 1, the number of tokens, the tokens, the number of media chunks), then the KV state
of the slot's sequence (``src/llama-context.cpp`` state_seq_save_file,
``tools/server/server-common.cpp`` server_tokens::serialize; the embedded engine packs its
tokens the same way). The proxy cannot look into the KV part, so it checks what it can see:
the size the engine reported, the token list read back from the file, and (``--park-verify
full``, the default) a blake3 digest of the whole file. A missing, truncated or mismatched
file is removed with a logged reason and the request re-prefills: never a wrong resume.
"""

from __future__ import annotations

import contextlib
import shutil
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import blake3

PARK_PREFIX = "pp-"  # every file parking writes (and may sweep) starts so
SLOT_FILE_MAGIC = 0x67677371  # 'ggsq' (LLAMA_STATE_SEQ_MAGIC)
SLOT_FILE_VERSION = 3  # LLAMA_STATE_SEQ_VERSION
_HEADER = struct.Struct("<III")  # magic, version, packed token count
_PACKED_MARKER, _PACKED_VERSION = -1, 1  # server_tokens::serialize
DIGEST_BYTES = 16

FileFault = Literal["missing", "truncated", "mismatched", "corrupted"]


class SlotFileError(Exception):
    def __init__(self, fault: FileFault, reason: str) -> None:
        super().__init__(reason)
        self.fault: FileFault = fault
        self.reason = reason


def unpack_tokens(packed: Sequence[int]) -> list[int]:
    """server_tokens::deserialize for text-only slots (a plain list from older builds)."""
    if not packed or packed[0] != _PACKED_MARKER:
        return list(packed)
    if len(packed) < 3 or packed[1] & 0xFFFFFFFF != _PACKED_VERSION:
        raise SlotFileError("mismatched", "unknown packed token list version")
    count = packed[2] & 0xFFFFFFFF
    if len(packed) != 3 + count + 1:
        raise SlotFileError("mismatched", f"packed token list of {len(packed)} items does not "
                                          f"hold {count} tokens")
    if packed[3 + count] != 0:
        raise SlotFileError("mismatched", "the slot holds media chunks")
    return list(packed[3: 3 + count])


def parse_header(head: bytes, size: int) -> int:
    """The packed token count from a slot file's first 12 bytes (sans-IO)."""
    if len(head) < _HEADER.size:
        raise SlotFileError("truncated", f"{size} bytes: shorter than a slot file header")
    magic, version, count = _HEADER.unpack_from(head)
    if magic != SLOT_FILE_MAGIC or version != SLOT_FILE_VERSION:
        raise SlotFileError("mismatched", f"not a slot state file (magic {magic:#x}, "
                                          f"version {version})")
    if _HEADER.size + 4 * count > size:
        raise SlotFileError("truncated", f"token list of {count} runs past the end of "
                                         f"{size} bytes")
    return int(count)


def read_slot_tokens(path: Path) -> list[int]:
    """The token list a slot file holds, read back from the file itself."""
    try:
        with path.open("rb") as file:
            size = path.stat().st_size
            count = parse_header(file.read(_HEADER.size), size)
            raw = file.read(4 * count)
    except FileNotFoundError:
        raise SlotFileError("missing", f"{path.name} is gone") from None
    except OSError as exc:
        raise SlotFileError("missing", f"{path.name} is unreadable: {exc}") from None
    if len(raw) != 4 * count:
        raise SlotFileError("truncated", f"{path.name}: token list cut short")
    return unpack_tokens(struct.unpack(f"<{count}i", raw))


def tokens_digest(tokens: Sequence[int]) -> bytes:
    packed = struct.pack(f"<{len(tokens)}i", *tokens)
    return bytes(blake3.blake3(packed).digest(length=DIGEST_BYTES))


def file_digest(path: Path) -> bytes:
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    hasher.update_mmap(str(path))
    return bytes(hasher.digest(length=DIGEST_BYTES))


# ---------------------------------------------------------------- files on disk (blocking)

def size_of(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def stat_identity(path: Path) -> tuple[int, ...] | None:
    """What changes whenever the file is written or replaced: device, inode, size, and
    modification and change times in nanoseconds (None: not there)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def age_of(path: Path, now: float) -> float | None:
    """Seconds since ``path`` was last written (None: gone)."""
    try:
        return now - path.stat().st_mtime
    except OSError:
        return None


def unlink(path: Path) -> None:
    # A file that cannot go now (gone already, permissions) is an orphan for the next sweep.
    with contextlib.suppress(OSError):
        path.unlink()


def free_bytes(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None
