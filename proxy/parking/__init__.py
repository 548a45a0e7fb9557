"""Parking: a session that loses its slot is saved to disk, and restored when it returns.

    SlotPool hands slot 0 (holding session A) to session C
      └─► on_evict ─► ParkManager.park: POST /slots/0?action=save {"filename": "pp-….bin"}
                      ─► check the file (size, token list, digest) ─► park index record
    A returns, and bytes decide that the request extends what A's file holds
      └─► on_lease ─► ParkManager.restore: check the file again
                      ─► POST /slots/N?action=restore ─► the request goes out on slot N

    slotfile   the engine's slot file: its format, read back and checked
    index      the park index: ParkRecord, the ParkIndexStore protocol, the sqlite index
               (one replica; ``proxy.cluster.park_index.RedisParkIndex`` with ``--redis``)
    limits     what the engine allows: when a restored slot is reused at all
    anchor     a hybrid slot made to hold its next request's opening before it is parked
    snapshot   beside it, the prompt's end, for a next request that changes the last reply
    renderings the tokens of their renderings, the engine tokenizing only what is new
    manager    ParkManager: park, restore, lookup, budget, sweep
    (here)     start-up: ``open_parking``, one manager per lane (engine)

What survives what:
- a llama-server restart: every parked file (same model), not the sessions that were in
  their slots at the moment of the restart (they re-prefill once);
- a proxy restart: every parked file, and the sessions resident in idle slots at a clean
  shutdown (they are parked on the way out); a request with no live session finds its
  history in the index (same namespace; same explicit key, or none and the committed
  messages repeated exactly as its prefix) and resumes by restoring;
- with ``--redis``, the index is in Redis: a session parked by one replica is restored by
  another, and every replica's restart finds every replica's parks.

Where files live. Parking needs ``--park-dir`` to be the engine's ``--slot-save-path`` as
this proxy sees it (or, unset, the path on the engine's command line when this host can read
it; the embedded engine uses ``Settings.slot_dir()``); start-up saves a probe file to check.
Two layouts:

- per-engine save directories (the default): each engine saves into its own directory, and
  a record is restored only by the lane whose engine wrote it (another lane skips it and
  says why);
- one directory shared by every engine and replica (``--park-shared``: every engine's
  ``--slot-save-path`` is ``--park-dir``): a file one engine wrote may be restored into
  another running the same model.

The sqlite index lives in prefixpin's own directory (``--park-index-dir``; by default one
per park directory under ``~/.cache/prefixpin/park-index/``), never in an engine's save
directory; the embedded engine's sits beside its slot directory, as before.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

import blake3

from prefixpin.adapters.base import Adapter, EngineInfo
from prefixpin.core.errors import ProxyError
from prefixpin.proxy.engine.engine_facts import ServerFlags
from prefixpin.proxy.ops.logs import log_event
from prefixpin.proxy.ops.metrics import Metrics
from prefixpin.proxy.parking.anchor import Anchorer
from prefixpin.proxy.parking.index import (
    INDEX_NAME,
    SCHEMA_VERSION,
    SHARED_SCOPE,
    ParkIndex,
    ParkIndexStore,
    ParkRecord,
    SqliteParkIndex,
    scope_of,
)
from prefixpin.proxy.parking.limits import EngineLimits, engine_limits, limits_from
from prefixpin.proxy.parking.manager import (
    ParkConfig,
    ParkManager,
    RestoreResult,
    random_filename,
)
from prefixpin.proxy.parking.slotfile import (
    DIGEST_BYTES,
    PARK_PREFIX,
    SLOT_FILE_MAGIC,
    SLOT_FILE_VERSION,
    SlotFileError,
    file_digest,
    parse_header,
    read_slot_tokens,
    tokens_digest,
    unlink,
    unpack_tokens,
)
from prefixpin.proxy.session.sessions import SessionStore
from prefixpin.proxy.settings import Settings

if TYPE_CHECKING:  # the redis package is only needed with --redis
    from prefixpin.proxy.cluster.core import Cluster
    from prefixpin.proxy.cluster.sessions import SharedSessions

__all__ = [
    "DEFAULT_INDEX_ROOT", "DIGEST_BYTES", "INDEX_NAME", "PARK_PREFIX", "SCHEMA_VERSION",
    "SHARED_SCOPE", "SLOT_FILE_MAGIC", "SLOT_FILE_VERSION", "EngineLimits", "ParkConfig",
    "ParkIndex", "ParkIndexStore", "ParkManager", "ParkRecord", "RestoreResult",
    "SlotFileError", "SqliteParkIndex", "engine_limits", "file_digest", "index_dir",
    "open_parking", "parse_header", "random_filename", "read_slot_tokens", "scope_of",
    "tokens_digest", "unpack_tokens",
]

PROBE_TIMEOUT_S = 10.0
DEFAULT_INDEX_ROOT = Path.home() / ".cache" / "prefixpin" / "park-index"


async def open_parking(settings: Settings, adapter: Adapter, info: EngineInfo,
                       store: SessionStore, metrics: Metrics, logger: logging.Logger, *,
                       lane: str, flags: ServerFlags | None = None,
                       limits: EngineLimits | None = None,
                       cluster: Cluster | None = None,
                       shared_sessions: SharedSessions | None = None,
                       anchorer: Anchorer | None = None) -> ParkManager | None:
    """Parking for one lane (``lane``: its label, e.g. ``127.0.0.1:8081``; ``flags``: its
    engine's, as the lane read them: None when not readable here) on, or off with one log
    line saying why. With ``cluster`` the index is Redis (shared by replicas; the
    embedded engine, private to this process, keeps a sqlite index), and with
    ``shared_sessions`` an evicted session another replica committed is read from Redis."""
    def off(reason: str) -> None:
        log_event(logger, logging.INFO, "parking off", upstream=lane, reason=reason)

    if not settings.parking:
        off("PREFIXPIN_PARKING=0")
        return None
    if not adapter.capabilities.slot_files:
        off(f"{info.engine} cannot save and restore slots")
        return None
    if not info.slot_save_path:
        off("the engine has no --slot-save-path")
        return None
    if limits is None:  # the lane reads them once for parking and anchoring alike
        limits = await asyncio.to_thread(limits_from, info, flags)
    if limits.restores_reprocessed and limits.flags_known:
        off(f"the model uses {limits.memory} and llama-server runs without --swa-full: it "
            "re-processes a restored slot from the first token (a restore clears the context "
            "checkpoints every reuse needs); start it with --swa-full to park")
        return None
    shared = settings.park_shared and info.engine != "embedded"
    if shared and settings.park_dir is None:
        off("--park-shared needs --park-dir: the directory every engine saves slots to")
        return None
    files_dir, where = _files_dir(settings, info, limits)
    if files_dir is None:
        off("--park-dir is not set: it must be the engine's --slot-save-path as this proxy "
            "sees it")
        return None
    problem = await _probe_dir(adapter, files_dir)
    if problem is not None:
        off(problem)
        return None
    config = ParkConfig(files_dir, settings.park_max_bytes, settings.park_min_tokens,
                        settings.park_verify == "full", park_ahead=settings.park_ahead)
    replicated = cluster is not None and info.engine != "embedded"
    index: ParkIndexStore
    if replicated:
        assert cluster is not None
        from prefixpin.proxy.cluster.park_index import RedisParkIndex

        index, index_at = RedisParkIndex(cluster), f"redis {cluster.key('park')}"
    else:
        directory = index_dir(settings, info, files_dir)
        index_at = str(directory / INDEX_NAME)
        try:
            index = SqliteParkIndex.in_directory(directory)  # bound to the loop's thread
        except (OSError, sqlite3.Error) as exc:
            off(f"park index {index_at}: {exc}")
            return None
    try:
        manager = ParkManager(index, config, adapter, store, metrics, logger,
                              model=info.model, lane=lane, shared=shared, limits=limits,
                              resolve=shared_sessions.fetch if shared_sessions else None,
                              anchorer=anchorer)
        manager.sweep()
        parked, parked_bytes = index.count(manager.scope), index.total_bytes(manager.scope)
    except index.errors as exc:
        off(f"park index {index_at}: {exc}")
        return None
    log_event(logger, logging.INFO, "parking on", upstream=lane, dir=str(files_dir),
              dir_from=where, layout="shared" if shared else "per-engine", index=index_at,
              budget_bytes=config.max_bytes, min_tokens=config.min_tokens,
              verify=settings.park_verify, parked=parked, parked_bytes=parked_bytes,
              limits_from=limits.source, limits=limits.notes())
    return manager


def index_dir(settings: Settings, info: EngineInfo, files_dir: Path) -> Path:
    """prefixpin's own directory for the sqlite index: ``--park-index-dir``; else beside the
    embedded engine's slot directory; else one per park directory under
    ``~/.cache/prefixpin/park-index`` (never the engine's save directory)."""
    if settings.park_index_dir is not None:
        return settings.park_index_dir
    if info.engine == "embedded":
        return files_dir.parent
    name = blake3.blake3(str(files_dir.resolve()).encode()).hexdigest()[:16]
    return DEFAULT_INDEX_ROOT / name


def _files_dir(settings: Settings, info: EngineInfo,
               limits: EngineLimits) -> tuple[Path | None, str]:
    if info.engine == "embedded":
        return settings.slot_dir(), "embedded engine slot directory"
    if settings.park_dir is not None:
        return settings.park_dir, "--park-dir"
    if limits.slot_save_path is not None:
        return limits.slot_save_path, "the engine's command line"
    return None, ""


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
    unlink(path)
    return None
