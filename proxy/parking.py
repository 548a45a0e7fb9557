"""Parking: a session that loses its slot is saved to disk, and restored when it returns.

    SlotPool hands slot 0 (holding session A) to session C
      └─► on_evict ─► ParkManager.park: POST /slots/0?action=save {"filename": "pp-….bin"}
                      ─► check the file (size, token list, digest) ─► park index row
    A returns, and bytes decide that the request extends what A's file holds
      └─► on_lease ─► ParkManager.restore: check the file again
                      ─► POST /slots/N?action=restore ─► the request goes out on slot N

The file is the engine's own (``llama_state_seq_save_file``): u32 magic ``ggsq``, u32
version 3, u32 count, ``count`` int32s of llama-server's packed token list (``-1``, format
version 1, the number of tokens, the tokens, the number of media chunks), then the KV state
of the slot's sequence (``src/llama-context.cpp`` state_seq_save_file,
``tools/server/server-common.cpp`` server_tokens::serialize; the embedded engine packs its
tokens the same way). The proxy cannot look into the KV part, so it checks what it can see:
the size the engine reported, the token list read back from the file, and (``--park-verify
full``, the default) a blake3 digest of the whole file. A missing, truncated or mismatched
file is removed with a logged reason and the request re-prefills: never a wrong resume.

The index is a sqlite file (WAL) in the park directory: per parked history its namespace,
explicit key, committed history (messages and their digests, so a session can be rebuilt
after a proxy restart; the content is the tenant's own and is only ever matched inside its
namespace), token count, file, bytes, digests, model, and times of creation and last use.
A row is written only after the engine's file was checked, and deleted before its file,
so a crash leaves at most an orphan file, swept at start-up.

What survives what:
- a llama-server restart: every parked file (same model), not the sessions that were in
  their slots at the moment of the restart (they re-prefill once);
- a proxy restart: every parked file, and the sessions resident in idle slots at a clean
  shutdown (they are parked on the way out); a request with no live session finds its
  history in the index (same namespace; same explicit key, or none and the committed
  messages repeated exactly as its prefix) and resumes by restoring.

Engine limits: a file is restored only into a request whose messages repeat the parked
history exactly and add to it (or resend it); a rewound or diverged request never restores.
A restore clears the slot's context checkpoints (research note §3). Measured with Gemma 3
(sliding window, no ``--swa-full``): llama-server reuses such a slot only through a
checkpoint, so it re-processes a restored slot from the first token even for an exact
extension; parking is off for such a model when the engine's flags are readable, and pauses
itself after two restores the engine did not reuse when they are not. For recurrent/hybrid
memory a restore only helps when the request's tokens extend all the file's tokens, which
is checked (the engine's template and tokenizer) before restoring.

llama-server's own host-RAM cache (``--cache-ram``) keeps working beside this: it copies a
slot's state when a pinned request displaces it and can load it back by itself; parking
writes to disk only what the proxy evicts and restores only into the slot it hands to a
returning session, so the two never act on the same slot at once. Parking needs
``--park-dir`` to be the engine's ``--slot-save-path`` as this proxy sees it (the embedded
engine uses ``Settings.slot_dir()``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import shutil
import sqlite3
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import blake3

from adapters.base import Adapter, EngineInfo
from core.errors import ProxyError
from proxy.history import Committed, decide, digest, shape_digest
from proxy.logs import log_event
from proxy.metrics import Metrics
from proxy.placement import Eviction, SlotPool
from proxy.sessions import Kind, Session, SessionStore
from proxy.settings import Settings

PARK_PREFIX = "pp-"
INDEX_NAME = "park-index.sqlite3"
SCHEMA_VERSION = 1
SLOT_FILE_MAGIC = 0x67677371  # 'ggsq' (LLAMA_STATE_SEQ_MAGIC)
SLOT_FILE_VERSION = 3  # LLAMA_STATE_SEQ_VERSION
_HEADER = struct.Struct("<III")  # magic, version, packed token count
_PACKED_MARKER, _PACKED_VERSION = -1, 1  # server_tokens::serialize
DIGEST_BYTES = 16
PROBE_TIMEOUT_S = 10.0
EXIT_PARK_TIMEOUT_S = 30.0
SESSION_NOTES = 4096  # per-session notes kept (the session store's default bound)
NOT_REUSED_LIMIT = 2  # restores in a row the engine re-processed before parking pauses
DISK_HEADROOM = 1.1  # free space wanted before a save, over the estimated file size

FileFault = Literal["missing", "truncated", "mismatched", "corrupted"]


# ---------------------------------------------------------------- the engine's slot file

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


# ---------------------------------------------------------------- the park index

@dataclass(frozen=True, slots=True)
class ParkRecord:
    park_id: str
    namespace: str
    key: str | None
    kind: Kind
    committed: Committed
    prompt_tokens: int  # the committed prompt, as the engine counted it
    n_tokens: int  # tokens in the file (prompt + generated but the last)
    filename: str
    size: int  # bytes
    tokens_digest: bytes
    content_digest: bytes | None
    model: str
    created: float
    last_use: float


_SCHEMA = """
CREATE TABLE IF NOT EXISTS parked (
    park_id TEXT PRIMARY KEY,
    namespace TEXT NOT NULL,
    session_key TEXT,
    kind TEXT NOT NULL,
    messages TEXT NOT NULL,
    digests BLOB NOT NULL,
    shape TEXT NOT NULL,
    prompt TEXT,
    body TEXT,
    prompt_tokens INTEGER NOT NULL,
    n_tokens INTEGER NOT NULL,
    filename TEXT NOT NULL UNIQUE,
    bytes INTEGER NOT NULL,
    tokens_digest BLOB NOT NULL,
    content_digest BLOB,
    model TEXT NOT NULL,
    created REAL NOT NULL,
    last_use REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS parked_by_key ON parked (namespace, session_key);
CREATE INDEX IF NOT EXISTS parked_by_use ON parked (last_use);
"""
_COLUMNS = ("park_id", "namespace", "session_key", "kind", "messages", "digests", "shape",
            "prompt", "body", "prompt_tokens", "n_tokens", "filename", "bytes", "tokens_digest",
            "content_digest", "model", "created", "last_use")


class ParkIndex:
    """The park index: one sqlite connection, used from the event loop thread only."""

    def __init__(self, connection: sqlite3.Connection) -> None:
        self._db = connection

    @classmethod
    def open(cls, path: Path) -> ParkIndex:
        path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            db.execute("DROP TABLE IF EXISTS parked")  # its files become orphans: swept
        db.executescript(_SCHEMA)
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        return cls(db)

    def close(self) -> None:
        self._db.close()

    def insert(self, record: ParkRecord) -> None:
        row = (record.park_id, record.namespace, record.key, record.kind,
               *_history_columns(record.committed), record.prompt_tokens, record.n_tokens,
               record.filename, record.size, record.tokens_digest, record.content_digest,
               record.model, record.created, record.last_use)
        marks = ", ".join("?" for _ in _COLUMNS)
        self._db.execute(f"INSERT INTO parked ({', '.join(_COLUMNS)}) VALUES ({marks})", row)

    def update_history(self, park_id: str, committed: Committed, prompt_tokens: int) -> None:
        self._db.execute(
            "UPDATE parked SET messages = ?, digests = ?, shape = ?, prompt = ?, body = ?, "
            "prompt_tokens = ? WHERE park_id = ?", (*_history_columns(committed),
                                                      prompt_tokens, park_id))

    def delete(self, park_id: str) -> None:
        self._db.execute("DELETE FROM parked WHERE park_id = ?", (park_id,))

    def touch(self, park_id: str, at: float) -> None:
        self._db.execute("UPDATE parked SET last_use = ? WHERE park_id = ?", (at, park_id))

    def get(self, park_id: str) -> ParkRecord | None:
        rows = self._select("WHERE park_id = ?", (park_id,))
        return rows[0] if rows else None

    def under(self, namespace: str, key: str | None) -> list[ParkRecord]:
        if key is None:
            return self._select("WHERE namespace = ? AND session_key IS NULL", (namespace,))
        return self._select("WHERE namespace = ? AND session_key = ?", (namespace, key))

    def oldest_first(self) -> list[ParkRecord]:
        return self._select("ORDER BY last_use", ())

    def total_bytes(self) -> int:
        return int(self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM parked").fetchone()[0])

    def count(self) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM parked").fetchone()[0])

    def filenames(self) -> set[str]:
        return {row[0] for row in self._db.execute("SELECT filename FROM parked")}

    def invalid_ids(self) -> list[str]:
        """Rows that do not decode (hand-edited, or written by a future version)."""
        bad = []
        for row in self._db.execute(f"SELECT {', '.join(_COLUMNS)} FROM parked"):
            try:
                _record(row)
            except (ValueError, TypeError, KeyError):
                bad.append(str(row[0]))
        return bad

    def _select(self, where: str, args: tuple[Any, ...]) -> list[ParkRecord]:
        records = []
        for row in self._db.execute(f"SELECT {', '.join(_COLUMNS)} FROM parked {where}", args):
            with contextlib.suppress(ValueError, TypeError, KeyError):
                records.append(_record(row))
        return records


def _history_columns(committed: Committed) -> tuple[str, bytes, str, str | None, str | None]:
    """messages, digests, shape, prompt, body: the committed history as stored."""
    return (json.dumps(list(committed.messages), ensure_ascii=False),
            b"".join(committed.digests),
            json.dumps([[name, value.hex()] for name, value in committed.shape]),
            committed.prompt,
            json.dumps(committed.body, ensure_ascii=False) if committed.body else None)


def _record(row: Sequence[Any]) -> ParkRecord:
    (park_id, namespace, key, kind, messages_json, digests, shape_json, prompt, body_json,
     prompt_tokens, n_tokens, filename, size, tokens_dig, content_dig, model, created,
     last_use) = row
    messages = tuple(json.loads(messages_json))
    blob = bytes(digests)
    split = tuple(blob[i: i + DIGEST_BYTES] for i in range(0, len(blob), DIGEST_BYTES))
    if split != tuple(digest(m) for m in messages):
        raise ValueError("message digests do not match the stored messages")
    if kind not in ("main", "side"):
        raise ValueError(f"unknown kind {kind!r}")
    shape = tuple((str(name), bytes.fromhex(value)) for name, value in json.loads(shape_json))
    body = json.loads(body_json) if body_json is not None else None
    if body is not None and shape_digest(body) != shape:
        raise ValueError("request fields do not match their stored digests")
    committed = Committed(messages, split, shape, prompt, body)
    return ParkRecord(str(park_id), str(namespace), key, kind, committed, int(prompt_tokens),
                      int(n_tokens), str(filename), int(size), bytes(tokens_dig),
                      bytes(content_dig) if content_dig is not None else None, str(model),
                      float(created), float(last_use))


# ---------------------------------------------------------------- what the engine allows

@dataclass(frozen=True, slots=True)
class EngineLimits:
    sliding_window: int = 0  # 0: full attention, or --swa-full
    recurrent: bool = False  # hybrid / recurrent memory: no rollback without checkpoints
    cache_ram_mib: float | None = None  # llama-server's host-RAM cache; None: unknown / none
    clears_idle_slots: bool = False  # unified KV + --cache-idle-slots empties idle slots
    slot_save_path: Path | None = None  # from the engine's command line, when readable
    flags_known: bool = False  # the engine's command line was read (--swa-full is known)
    source: str = "engine probe"

    @property
    def restores_reprocessed(self) -> bool:
        """Sliding window without --swa-full: llama-server re-processes every prompt on a
        restored slot, even an exact extension (measured with Gemma 3: every reuse of a
        sliding-window slot goes through a context checkpoint, and a restore clears them)."""
        return self.sliding_window > 0

    @property
    def exact_extension_only(self) -> bool:
        """Recurrent/hybrid memory: a restored slot serves a prompt only if the prompt's
        tokens extend *all* the tokens it holds (any rewind needs a checkpoint)."""
        return self.recurrent and not self.sliding_window

    @property
    def memory(self) -> str:
        if self.sliding_window:
            return f"sliding-window attention ({self.sliding_window} tokens)"
        return "recurrent/hybrid memory" if self.recurrent else "full attention"

    def notes(self) -> list[str]:
        out = []
        if self.restores_reprocessed:
            swa = ("without --swa-full" if self.flags_known
                   else "and llama-server may run without --swa-full (its flags are not "
                        "readable here): if restores are not reused, parking stops itself")
            out.append(f"the model uses {self.memory} {swa}: a restored slot has no context "
                       "checkpoints and llama-server re-processes it from the first token")
        if self.exact_extension_only:
            out.append(f"the model uses {self.memory}: a restored slot has no context "
                       "checkpoints, so a file is restored only when the request's tokens "
                       "extend all the tokens it holds")
        if self.cache_ram_mib:
            ram = "no limit" if self.cache_ram_mib < 0 else f"{self.cache_ram_mib:.0f} MiB"
            out.append(f"llama-server keeps its own host-RAM prompt cache (--cache-ram {ram}); "
                       "parking keeps what outlives it (restarts, more than fits in RAM)")
        if self.clears_idle_slots:
            out.append("llama-server empties idle slots (unified KV with --cache-idle-slots): "
                       "a slot may be empty by the time it is parked; such parks are skipped")
        return out


def engine_limits(settings: Settings, info: EngineInfo) -> EngineLimits:
    """Sliding window, recurrent memory and the RAM cache: from the engine's command line
    and GGUF when this host can read them (blocking: run it in a thread)."""
    if info.engine == "embedded":
        return EngineLimits(source="embedded engine (full-size SWA cache, no RAM cache)")
    from proxy.doctor import local_server_flags, model_facts

    flags = local_server_flags(settings.upstream) if settings.upstream else None
    window, recurrent, source = info.n_swa, False, "engine probe"
    model_path = info.props.get("model_path")
    if isinstance(model_path, str) and Path(model_path).is_file():
        from fingerprint._gguf import GgufFormatError, read_metadata

        with contextlib.suppress(OSError, GgufFormatError, ValueError):
            facts = model_facts(read_metadata(model_path))
            window, recurrent, source = facts.sliding_window, facts.recurrent, "GGUF metadata"
    if flags is None:
        return EngineLimits(window, recurrent, source=source)
    if flags.is_set("swa_full"):
        window = 0
    cache_ram = flags.number("cache_ram")
    unified = bool(flags.boolean("kv_unified")) or (flags.number("n_parallel") or -1) < 0
    idle = flags.boolean("cache_idle_slots")
    save_path = flags.value("slot_save_path")
    return EngineLimits(
        window, recurrent, cache_ram if cache_ram != 0 else None,
        clears_idle_slots=bool(unified and idle and cache_ram != 0),
        slot_save_path=Path(save_path) if isinstance(save_path, str) and save_path else None,
        flags_known=True, source=f"{source} and {flags.source}")


# ---------------------------------------------------------------- the manager

@dataclass(frozen=True, slots=True)
class ParkConfig:
    files_dir: Path  # the engine's --slot-save-path, as this proxy sees it
    max_bytes: int
    min_tokens: int
    verify_content: bool


@dataclass(frozen=True, slots=True)
class RestoreResult:
    outcome: str  # restored | diverged | other_model | missing | truncated | mismatched |
    #               corrupted | failed | not_parked
    note: str
    tokens: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.outcome == "restored"


def random_filename() -> str:
    return f"{PARK_PREFIX}{secrets.token_hex(10)}.bin"


class ParkManager:
    """Parks evicted sessions, restores returning ones, keeps the index within budget."""

    def __init__(self, index: ParkIndex, config: ParkConfig, adapter: Adapter,
                 store: SessionStore, metrics: Metrics, logger: logging.Logger, *, model: str,
                 limits: EngineLimits | None = None,
                 filenames: Callable[[], str] = random_filename) -> None:
        self.index = index
        self.config = config
        self.adapter = adapter
        self.store = store
        self.metrics = metrics
        self.log = logger
        self.model = model
        self.limits = limits or EngineLimits()
        self.filenames = filenames
        self.suspended: str | None = None  # why parking is paused (engine lost its save path)
        self._record_of: dict[str, str] = {}  # session id -> park id
        self._owner_of: dict[str, str] = {}  # park id -> session id
        self._unparked: dict[str, str] = {}  # session id -> why it has no file
        self._bytes_per_token: float | None = None
        self._restored: dict[str, int] = {}  # session id -> tokens restored, until its commit
        self._late_commit: dict[str, str] = {}  # session id -> park id awaiting its commit
        self._not_reused = 0  # restores in a row the engine re-processed anyway
        self._update_gauges()

    # -- eviction: save ---------------------------------------------------------------

    async def park(self, eviction: Eviction) -> None:
        """SlotPool's ``on_evict``: save the slot before it changes hands. Never raises."""
        session = self.store.get(eviction.session_id)
        if session is None or session.committed is None:
            return
        skip = self._not_worth(session)
        if skip is not None:
            outcome, reason = skip
            self._skipped(session, eviction.slot, outcome, reason, logging.DEBUG)
            return
        current = self._current(session.id)
        if (current is not None and eviction.tokens == current.n_tokens
                and _same_history(current.committed, session.committed)):
            # The slot holds what the file holds (restored, nothing committed since).
            self.metrics.parks.labels("unchanged").inc()
            self.index.touch(current.park_id, time.time())
            return
        started = time.monotonic()
        filename = self.filenames()
        try:
            result = await self.adapter.save_slot(eviction.slot, filename)
        except ProxyError as exc:
            self._skipped(session, eviction.slot, "failed", f"save failed: {exc.message}",
                          logging.WARNING)
            return
        path = self.config.files_dir / filename
        try:
            record = await self._checked_record(session, path, result.n_tokens, result.n_bytes)
        except SlotFileError as exc:
            await asyncio.to_thread(_unlink, path)
            self._skipped(session, eviction.slot, "failed", f"saved file unusable: {exc.reason}",
                          logging.WARNING)
            return
        if record.n_tokens < session.prompt_tokens:
            await asyncio.to_thread(_unlink, path)
            self._skipped(session, eviction.slot, "empty",
                          f"the slot held {record.n_tokens} tokens, fewer than the session's "
                          f"{session.prompt_tokens}: the engine emptied it", logging.WARNING)
            return
        self._adopt_new(session, record)
        # The slot can hold a turn whose commit has not run yet (the slot is free once the
        # engine's answer is read; the commit follows): the file then holds more than the
        # committed history says, and that turn's commit brings the row up to date.
        late = record.n_tokens > eviction.tokens
        if late:
            _bounded_set(self._late_commit, session.id, record.park_id)
        seconds = time.monotonic() - started
        self.metrics.parks.labels("parked").inc()
        self.metrics.park_seconds.observe(seconds)
        log_event(self.log, logging.INFO, "parked", session=session.id, slot=eviction.slot,
                  reason=eviction.reason, tokens=record.n_tokens, bytes=record.size,
                  file=record.filename, ms=round(seconds * 1000, 1), awaiting_commit=late)
        await self._enforce_budget(keep=record.park_id)

    def _not_worth(self, session: Session) -> tuple[str, str] | None:
        if self.suspended is not None:
            return "off", self.suspended
        if session.prompt_tokens < self.config.min_tokens:
            return "small", (f"{session.prompt_tokens} tokens, under --park-min-tokens "
                             f"{self.config.min_tokens}")
        estimate = self._estimate_bytes(session.prompt_tokens)
        if estimate is not None and estimate > self.config.max_bytes:
            return "budget", (f"about {estimate} bytes, over the whole --park-max-bytes "
                              f"{self.config.max_bytes}")
        if estimate is not None:
            free = _free_bytes(self.config.files_dir)
            if free is not None and free < estimate * DISK_HEADROOM:
                return "disk_full", f"{free} bytes free on the park disk, about {estimate} needed"
        return None

    async def _checked_record(self, session: Session, path: Path, n_tokens: int,
                              n_bytes: int) -> ParkRecord:
        size = await asyncio.to_thread(_size_of, path)
        if size is None:
            raise SlotFileError("missing", f"the engine wrote {path.name}, but it is not in "
                                           f"{self.config.files_dir} (--park-dir must be the "
                                           "engine's --slot-save-path as this proxy sees it)")
        if size != n_bytes:
            raise SlotFileError("truncated", f"{size} bytes on disk, the engine wrote {n_bytes}")
        tokens = await asyncio.to_thread(read_slot_tokens, path)
        if len(tokens) != n_tokens:
            raise SlotFileError("mismatched", f"{len(tokens)} tokens in the file, the engine "
                                              f"saved {n_tokens}")
        content = (await asyncio.to_thread(file_digest, path)
                   if self.config.verify_content else None)
        committed = session.committed
        assert committed is not None
        now = time.time()
        return ParkRecord(
            park_id=secrets.token_hex(8), namespace=session.namespace, key=session.key,
            kind=session.kind, committed=committed, prompt_tokens=session.prompt_tokens,
            n_tokens=len(tokens), filename=path.name, size=size,
            tokens_digest=tokens_digest(tokens), content_digest=content, model=self.model,
            created=now, last_use=now)

    def _adopt_new(self, session: Session, record: ParkRecord) -> None:
        self.index.insert(record)
        previous = self._current(session.id)
        self.adopt(session.id, record)
        self._unparked.pop(session.id, None)
        if record.n_tokens:
            self._bytes_per_token = record.size / record.n_tokens
        if previous is not None:
            self._remove(previous, "replaced")
        self._update_gauges()

    def _skipped(self, session: Session, slot: int, outcome: str, reason: str,
                 level: int) -> None:
        self.metrics.parks.labels(outcome).inc()
        _bounded_set(self._unparked, session.id,
                     f"not parked when evicted from slot {slot}: {reason}")
        log_event(self.log, level, "park skipped", session=session.id, slot=slot,
                  outcome=outcome, reason=reason)

    # -- return: restore --------------------------------------------------------------

    async def restore(self, session: Session, body: Mapping[str, Any],
                      slot: int) -> RestoreResult | None:
        """Before a session's request goes to a slot that does not hold it: restore its
        parked file if the request extends (or resends) exactly what the file holds.
        None when there is nothing to say (the session was never parked)."""
        record = self._current(session.id)
        if record is None:
            why = self._unparked.pop(session.id, None)
            return RestoreResult("not_parked", why) if why else None
        if self.suspended is not None:
            return RestoreResult("not_parked", f"parking paused: {self.suspended}")
        verdict = decide(record.committed, body)
        if not verdict.resumable:
            return self._declined(session, record, "diverged",
                                  f"the request does not extend the parked history "
                                  f"({verdict.reason()})", level=logging.INFO)
        if record.model != self.model:
            return self._declined(session, record, "other_model",
                                  f"parked under model {record.model}, the engine runs "
                                  f"{self.model}", level=logging.INFO)
        started = time.monotonic()
        path = self.config.files_dir / record.filename
        try:
            tokens = await asyncio.to_thread(_check_file, path, record,
                                             self.config.verify_content)
        except SlotFileError as fault:
            self._remove(record, "invalid")
            return self._declined(session, record, fault.fault, fault.reason,
                                  level=logging.WARNING)
        if self.limits.exact_extension_only:
            rewind = await self._rewinds_tokens(body, tokens)
            if rewind is not None:
                return self._declined(session, record, "diverged", rewind, level=logging.INFO)
        try:
            result = await self.adapter.restore_slot(slot, record.filename)
        except ProxyError as exc:
            self._remove(record, "invalid")
            return self._declined(session, record, "failed", f"restore failed: {exc.message}",
                                  level=logging.WARNING)
        if result.n_tokens != record.n_tokens:
            # The engine validated the tokens it loaded, and its KV matches them: the reuse
            # is still right, only less than planned. Say so and drop the row.
            self._remove(record, "invalid")
            return self._declined(session, record, "mismatched",
                                  f"the engine restored {result.n_tokens} tokens, the file "
                                  f"held {record.n_tokens}", level=logging.WARNING)
        seconds = time.monotonic() - started
        self.index.touch(record.park_id, time.time())
        _bounded_set(self._restored, session.id, result.n_tokens)
        self.metrics.restores.labels("restored").inc()
        self.metrics.restore_seconds.observe(seconds)
        note = f"restored {result.n_tokens} tokens in {seconds * 1000:.0f} ms"
        log_event(self.log, logging.INFO, "restored", session=session.id, slot=slot,
                  tokens=result.n_tokens, bytes=record.size, file=record.filename,
                  ms=round(seconds * 1000, 1), engine_ms=round(result.ms, 1))
        return RestoreResult("restored", note, result.n_tokens, seconds)

    async def _rewinds_tokens(self, body: Mapping[str, Any], held: list[int]) -> str | None:
        """Why the request's prompt does not extend every token the file holds (the
        engine would re-process it all: no checkpoint survives a restore), or None."""
        try:
            text = (await self.adapter.apply_template(body) if "messages" in body
                    else body.get("prompt"))
            if not isinstance(text, str):
                return "the request's prompt is not text: its tokens cannot be compared"
            prompt = await self.adapter.tokenize(text, add_special=True)
        except ProxyError as exc:
            return f"cannot compare the request's tokens with the file's ({exc.message})"
        shared = _common_prefix(prompt, held)
        if shared == len(held) and len(prompt) > len(held):
            return None
        return (f"the request's tokens leave the parked ones at token {shared} of "
                f"{len(held)}; with {self.limits.memory} a restored slot would be "
                "re-processed from the start")

    def _declined(self, session: Session, record: ParkRecord, outcome: str, reason: str, *,
                  level: int) -> RestoreResult:
        self.metrics.restores.labels(outcome).inc()
        log_event(self.log, level, "restore declined", session=session.id,
                  file=record.filename, outcome=outcome, reason=f"{reason}; re-prefilling")
        return RestoreResult(outcome, f"not restored: {reason}")

    # -- the index as a session directory ---------------------------------------------

    def lookup(self, namespace: str, key: str | None, body: Mapping[str, Any],
               digests: Sequence[bytes]) -> ParkRecord | None:
        """A parked history no live session owns whose committed history the request
        repeats exactly as its prefix (longest first): what a proxy restart left behind."""
        best: ParkRecord | None = None
        if self.suspended is not None:
            return None
        for record in self.index.under(namespace, key):
            if record.model != self.model or self._owned_by_live(record.park_id):
                continue
            committed = record.committed
            if committed.prompt is None and not _digest_prefix(committed.digests, digests):
                continue
            if not decide(committed, body, digests).resumable:
                continue
            if best is None or len(committed.digests) > len(best.committed.digests):
                best = record
        return best

    def adopt(self, session_id: str, record: ParkRecord) -> None:
        """``session_id`` now owns ``record`` (a new park, or a session rebuilt from it)."""
        old = self._owner_of.get(record.park_id)
        if old is not None and old != session_id:
            self._record_of.pop(old, None)
        self._record_of[session_id] = record.park_id
        self._owner_of[record.park_id] = session_id

    def revived(self, session: Session, record: ParkRecord) -> None:
        """A session rebuilt from the index (no live session had this history)."""
        self.adopt(session.id, record)
        self.metrics.park_revivals.inc()
        log_event(self.log, logging.INFO, "revived from the park index", session=session.id,
                  key=session.key, messages=len(record.committed.messages),
                  tokens=record.n_tokens, file=record.filename)

    def touch(self, session_id: str) -> None:
        """A committed turn: the session's parked file stays recent for the LRU budget, and
        a restore is judged by what the engine reused of it."""
        park_id = self._record_of.get(session_id)
        if park_id is not None:
            self.index.touch(park_id, time.time())
        session = self.store.get(session_id)
        late = self._late_commit.pop(session_id, None)
        if late is not None and late == park_id and session is not None:
            self._catch_up(session, late)
        restored = self._restored.pop(session_id, None)
        if restored is not None and session is not None and session.turns:
            self._judge_reuse(session, restored, session.turns[-1].cached_tokens)

    def _catch_up(self, session: Session, park_id: str) -> None:
        """The turn the parked file already holds has committed: the row takes its history
        (the file holds at least that prompt, so the history is still a prefix of it)."""
        record = self.index.get(park_id)
        if record is None or session.committed is None:
            return
        if session.prompt_tokens > record.n_tokens:
            return  # the file holds less than this commit's prompt: keep the older history
        self.index.update_history(park_id, session.committed, session.prompt_tokens)
        log_event(self.log, logging.DEBUG, "park caught up", session=session.id,
                  file=record.filename, messages=len(session.committed.messages))

    def _judge_reuse(self, session: Session, restored: int, cached: int | None) -> None:
        """An engine that re-processes restored slots (a sliding-window model without
        --swa-full, whose flags this proxy could not read) makes every park a waste: after
        two such restores in a row, parking pauses and says why."""
        if cached is None:
            return
        if cached * 100 >= restored:
            self._not_reused = 0
            return
        self._not_reused += 1
        self.metrics.restores.labels("not_reused").inc()
        log_event(self.log, logging.WARNING, "restore not reused", session=session.id,
                  restored=restored, cached=cached)
        if self._not_reused >= NOT_REUSED_LIMIT and self.suspended is None:
            self.suspended = (f"the engine re-processed {self._not_reused} restored slots in a "
                              "row (sliding-window model without --swa-full?)")
            log_event(self.log, logging.WARNING, "parking paused", reason=self.suspended)

    def parked_view(self) -> dict[str, Any]:
        records = self.index.oldest_first()
        return {
            "on": self.suspended is None, "paused": self.suspended,
            "dir": str(self.config.files_dir), "budget_bytes": self.config.max_bytes,
            "bytes": sum(r.size for r in records), "files": len(records),
            "limits": self.limits.notes(),
            "parked": [{"session": self._owner_of.get(r.park_id), "key": r.key,
                        "namespace": r.namespace, "kind": r.kind, "tokens": r.n_tokens,
                        "messages": len(r.committed.messages), "bytes": r.size,
                        "last_use": round(r.last_use, 3)} for r in reversed(records)],
        }

    # -- budget, removal, start-up sweep ------------------------------------------------

    async def _enforce_budget(self, keep: str) -> None:
        total = self.index.total_bytes()
        for record in self.index.oldest_first():
            if total <= self.config.max_bytes:
                break
            if record.park_id == keep:
                continue
            self._remove(record, "budget")
            total -= record.size
        if total > self.config.max_bytes:  # the new file alone is over the budget
            kept = self.index.get(keep)
            if kept is not None:
                self._remove(kept, "budget")

    def _remove(self, record: ParkRecord, reason: str) -> None:
        """Row first, then the file: a crash in between leaves an orphan file (swept)."""
        self.index.delete(record.park_id)
        _unlink(self.config.files_dir / record.filename)
        owner = self._owner_of.pop(record.park_id, None)
        if owner is not None and self._record_of.get(owner) == record.park_id:
            # (a replaced file's owner already points at its new file: that link stays)
            del self._record_of[owner]
            if reason == "budget":
                _bounded_set(self._unparked, owner, "its parked file was removed to stay "
                                                    "within --park-max-bytes")
        self.metrics.park_removals.labels(reason).inc()
        if reason != "replaced":
            log_event(self.log, logging.INFO, "park removed", file=record.filename,
                      session=owner, reason=reason, bytes=record.size)
        self._update_gauges()

    def sweep(self) -> None:
        """Start-up: drop rows that do not decode or whose file is gone, delete orphan
        files (a save the proxy never recorded), then apply the budget."""
        for park_id in self.index.invalid_ids():
            self.index.delete(park_id)
            self.metrics.park_removals.labels("invalid").inc()
        for record in self.index.oldest_first():
            if _size_of(self.config.files_dir / record.filename) != record.size:
                self._remove(record, "invalid")
        known = self.index.filenames()
        for path in self.config.files_dir.glob(f"{PARK_PREFIX}*.bin"):
            if path.name not in known and path.is_file():
                _unlink(path)
                self.metrics.park_removals.labels("orphan").inc()
        total = self.index.total_bytes()
        for record in self.index.oldest_first():
            if total <= self.config.max_bytes:
                break
            self._remove(record, "budget")
            total -= record.size
        self._update_gauges()

    # -- engine restarts and shutdown ----------------------------------------------------

    async def engine_restarted(self, before: EngineInfo, after: EngineInfo) -> None:
        """Parked files outlive the engine; only a model change or a lost --slot-save-path
        makes them unusable (kept on disk, restored again if the model comes back)."""
        if after.model != self.model:
            log_event(self.log, logging.WARNING, "parking: engine model changed",
                      before=self.model, after=after.model,
                      reason="files parked under the old model are not restored")
            self.model = after.model
        if not after.slot_save_path:
            self.suspended = "the engine restarted without --slot-save-path"
            log_event(self.log, logging.WARNING, "parking paused", reason=self.suspended)
        elif self.suspended is not None:  # perhaps restarted with --slot-save-path, --swa-full
            self.suspended = None
            self._not_reused = 0
            log_event(self.log, logging.INFO, "parking resumed", reason="engine restarted")
        self._update_gauges()

    async def aclose(self, pool: SlotPool | None) -> None:
        """Clean shutdown: park what idle slots hold (a restarted proxy restores it), then
        close the index."""
        try:
            if pool is not None and self.suspended is None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(EXIT_PARK_TIMEOUT_S):
                        await self.park_resident(pool)
        finally:
            self.index.close()

    async def park_resident(self, pool: SlotPool) -> None:
        for entry in pool.entries:
            if entry.occupant is None or entry.busy:
                continue
            entry.busy = True  # nobody takes the slot while it is saved
            try:
                await self.park(Eviction(entry.index, entry.occupant, entry.kind,
                                         entry.tokens, "shutdown"))
            finally:
                entry.busy = False

    # -- helpers --------------------------------------------------------------------------

    def _current(self, session_id: str) -> ParkRecord | None:
        park_id = self._record_of.get(session_id)
        if park_id is None:
            return None
        record = self.index.get(park_id)
        if record is None:
            self._record_of.pop(session_id, None)
            self._owner_of.pop(park_id, None)
        return record

    def _owned_by_live(self, park_id: str) -> bool:
        owner = self._owner_of.get(park_id)
        return owner is not None and self.store.get(owner) is not None

    def _estimate_bytes(self, tokens: int) -> int | None:
        return int(tokens * self._bytes_per_token) if self._bytes_per_token else None

    def _update_gauges(self) -> None:
        self.metrics.park_bytes.set(self.index.total_bytes())
        self.metrics.parked_files.set(self.index.count())


def _bounded_set(table: dict[str, Any], key: str, value: Any) -> None:
    """Per-session notes whose session may never come back: the oldest go first."""
    table.pop(key, None)
    table[key] = value
    while len(table) > SESSION_NOTES:
        del table[next(iter(table))]


def _same_history(a: Committed, b: Committed) -> bool:
    return a.digests == b.digests and a.shape == b.shape and a.prompt == b.prompt


def _digest_prefix(committed: Sequence[bytes], incoming: Sequence[bytes]) -> bool:
    n = len(committed)
    return 0 < n <= len(incoming) and tuple(incoming[:n]) == tuple(committed)


def _check_file(path: Path, record: ParkRecord, verify_content: bool) -> list[int]:
    """The file's tokens, if it is still the one parked; else SlotFileError (blocking:
    run it in a thread)."""
    size = _size_of(path)
    if size is None:
        raise SlotFileError("missing", f"park file {record.filename} is gone")
    if size < record.size:
        raise SlotFileError("truncated", f"park file {record.filename} has {size} of "
                                         f"{record.size} bytes")
    if size > record.size:
        raise SlotFileError("mismatched", f"park file {record.filename} grew to {size} "
                                          f"bytes from {record.size}")
    tokens = read_slot_tokens(path)
    if len(tokens) != record.n_tokens or tokens_digest(tokens) != record.tokens_digest:
        raise SlotFileError("mismatched", f"park file {record.filename} holds another token "
                                          "list than the one parked")
    if (verify_content and record.content_digest is not None
            and file_digest(path) != record.content_digest):
        raise SlotFileError("corrupted", f"park file {record.filename} changed since it "
                                         "was parked (content digest)")
    return tokens


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _size_of(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _unlink(path: Path) -> None:
    # A file that cannot go now (gone already, permissions) is an orphan for the next sweep.
    with contextlib.suppress(OSError):
        path.unlink()


def _free_bytes(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


# ---------------------------------------------------------------- start-up

async def open_parking(settings: Settings, adapter: Adapter, info: EngineInfo,
                       store: SessionStore, metrics: Metrics,
                       logger: logging.Logger) -> ParkManager | None:
    """Parking on, or off with one log line saying why."""
    def off(reason: str) -> None:
        log_event(logger, logging.INFO, "parking off", reason=reason)

    if not settings.parking:
        off("PREFIXPIN_PARKING=0")
        return None
    if not adapter.capabilities.slot_files:
        off(f"{info.engine} cannot save and restore slots")
        return None
    if not info.slot_save_path:
        off("the engine has no --slot-save-path")
        return None
    limits = await asyncio.to_thread(engine_limits, settings, info)
    if limits.restores_reprocessed and limits.flags_known:
        off(f"the model uses {limits.memory} and llama-server runs without --swa-full: it "
            "re-processes a restored slot from the first token (a restore clears the context "
            "checkpoints every reuse needs); start it with --swa-full to park")
        return None
    files_dir, index_dir, where = _park_dirs(settings, info, limits)
    if files_dir is None or index_dir is None:
        off("--park-dir is not set: it must be the engine's --slot-save-path as this proxy "
            "sees it")
        return None
    problem = await _probe_dir(adapter, files_dir)
    if problem is not None:
        off(problem)
        return None
    config = ParkConfig(files_dir, settings.park_max_bytes, settings.park_min_tokens,
                        settings.park_verify == "full")
    try:
        index = ParkIndex.open(index_dir / INDEX_NAME)  # bound to the event loop's thread
        manager = ParkManager(index, config, adapter, store, metrics, logger,
                              model=info.model, limits=limits)
        manager.sweep()
    except (OSError, sqlite3.Error) as exc:
        off(f"park index {index_dir / INDEX_NAME}: {exc}")
        return None
    log_event(logger, logging.INFO, "parking on", dir=str(files_dir), dir_from=where,
              budget_bytes=config.max_bytes, min_tokens=config.min_tokens,
              verify=settings.park_verify, parked=manager.index.count(),
              parked_bytes=manager.index.total_bytes(), limits_from=limits.source,
              limits=limits.notes())
    return manager


def _park_dirs(settings: Settings, info: EngineInfo,
               limits: EngineLimits) -> tuple[Path | None, Path | None, str]:
    if info.engine == "embedded":
        files = settings.slot_dir()
        return files, files.parent, "embedded engine slot directory"
    if settings.park_dir is not None:
        return settings.park_dir, settings.park_dir, "--park-dir"
    if limits.slot_save_path is not None:
        return limits.slot_save_path, limits.slot_save_path, "the engine's command line"
    return None, None, ""


async def _probe_dir(adapter: Adapter, files_dir: Path) -> str | None:
    """Save slot 0 under a probe name and look for the file: the engine and this proxy
    must see the same directory. A slot busy for long leaves it to the first park."""
    if not await asyncio.to_thread(files_dir.is_dir):
        return f"park directory {files_dir} does not exist"
    name = f"{PARK_PREFIX}probe-{secrets.token_hex(6)}.bin"
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            await adapter.save_slot(0, name)
    except TimeoutError:
        return None
    except ProxyError as exc:
        return f"the engine cannot save slots: {exc.message}"
    path = files_dir / name
    if not path.exists():
        return (f"the engine saved a probe file that is not in {files_dir}: --park-dir must "
                "be the engine's --slot-save-path as this proxy sees it")
    _unlink(path)
    return None
