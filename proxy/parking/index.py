"""The park index: one record per parked file, and the protocol every index keeps.

Per parked history: its namespace, explicit key, committed history (messages and their
digests, so a session can be rebuilt after a proxy restart; the content is the tenant's own
and is only ever matched inside its namespace), token count, file, bytes, digests, model,
times of creation and last use, the session that owns it (one file per session), and where
the file is: the lane (engine, ``host:port``) whose save directory holds it, and whether
that directory is the one every engine shares (``--park-shared``). A record is written
only after the engine's file was checked, and deleted before its file, so a crash leaves at
most an orphan file, swept at start-up.

A record's *scope* is the directory its file is in: ``lane/<label>`` for an engine's own
save directory (the default layout), ``shared`` for the directory all engines and replicas
share. A manager budgets, sweeps and restores within its own scope only; lookups by
namespace and key, and ``filenames`` (what the orphan sweep must never delete), see every
scope.

Two indexes keep ``ParkIndexStore``, both synchronous (a commit hook touches the index):

- ``SqliteParkIndex`` (one replica): a sqlite file (WAL) in prefixpin's own directory
  (``--park-index-dir``), never in an engine's save directory;
- ``proxy.cluster.park_index.RedisParkIndex`` (``--redis``): JSON records in Redis, so a
  session parked by one replica is restored by another.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import sqlite3
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from prefixpin.proxy.parking.slotfile import DIGEST_BYTES
from prefixpin.proxy.session.history import Committed, digest, shape_digest
from prefixpin.proxy.session.sessions import Kind

INDEX_NAME = "park-index.sqlite3"
SCHEMA_VERSION = 2  # 2: lane, shared, scope and owner columns
SHARED_SCOPE = "shared"


def scope_of(lane: str, shared: bool) -> str:
    """The directory a file is in, as the index names it."""
    return SHARED_SCOPE if shared else f"lane/{lane}"


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
    lane: str = ""  # the engine (lane label) whose save directory the file was written to
    shared: bool = False  # that directory is the one every engine shares (--park-shared)
    owner: str | None = None  # the session this file is the latest park of

    @property
    def scope(self) -> str:
        return scope_of(self.lane, self.shared)


class ParkIndexStore(Protocol):
    """What ``ParkManager`` asks of an index. ``scope=None``: every scope."""

    errors: tuple[type[BaseException], ...]  # what a failing index raises
    replicated: bool  # other replicas write it too (a file may precede its record)

    def insert(self, record: ParkRecord) -> None:
        """A new record; its owner (if any) owns no other record afterwards."""

    def update_history(self, park_id: str, committed: Committed, prompt_tokens: int) -> None: ...

    def delete(self, park_id: str) -> None: ...

    def touch(self, park_id: str, at: float) -> None: ...

    def get(self, park_id: str) -> ParkRecord | None: ...

    def under(self, namespace: str, key: str | None) -> list[ParkRecord]: ...

    def oldest_first(self, scope: str | None = None) -> list[ParkRecord]: ...

    def total_bytes(self, scope: str | None = None) -> int: ...

    def count(self, scope: str | None = None) -> int: ...

    def filenames(self) -> set[str]:
        """Every record's file name, in every scope."""

    def invalid_ids(self, scope: str | None = None) -> list[str]:
        """Records that do not decode (hand-edited, or written by a future version)."""

    def owned_by(self, session_id: str) -> ParkRecord | None:
        """The session's latest park, if it has one."""

    def set_owner(self, park_id: str, session_id: str) -> None:
        """``session_id`` now owns ``park_id`` (a session rebuilt from it)."""

    def close(self) -> None: ...


# ---------------------------------------------------------------- decoding, shared by both

def checked_committed(messages: Sequence[Any], digests: Sequence[bytes],
                      shape: Sequence[tuple[str, bytes]], prompt: str | None,
                      body: Mapping[str, Any] | None) -> Committed:
    """A stored history, if its digests still match its content (else ValueError)."""
    messages = tuple(messages)
    digests = tuple(digests)
    if digests != tuple(digest(m) for m in messages):
        raise ValueError("message digests do not match the stored messages")
    shape = tuple(shape)
    if body is not None and shape_digest(body) != shape:
        raise ValueError("request fields do not match their stored digests")
    return Committed(messages, digests, shape, prompt, body)


def _kind(value: object) -> Kind:
    if value == "main":
        return "main"
    if value == "side":
        return "side"
    raise ValueError(f"unknown kind {value!r}")


def record_to_json(record: ParkRecord) -> dict[str, Any]:
    """A record as JSON (never pickle), without its last use and owner (kept beside it)."""
    committed = record.committed
    return {
        "v": 1, "id": record.park_id, "ns": record.namespace, "key": record.key,
        "kind": record.kind, "messages": list(committed.messages),
        "digests": [d.hex() for d in committed.digests],
        "shape": [[name, value.hex()] for name, value in committed.shape],
        "prompt": committed.prompt,
        "body": dict(committed.body) if committed.body is not None else None,
        "pt": record.prompt_tokens, "n": record.n_tokens, "file": record.filename,
        "bytes": record.size, "td": record.tokens_digest.hex(),
        "cd": record.content_digest.hex() if record.content_digest is not None else None,
        "model": record.model, "created": record.created, "lane": record.lane,
        "shared": record.shared,
    }


def record_from_json(data: Mapping[str, Any], *, last_use: float | None,
                     owner: str | None) -> ParkRecord:
    """The record ``record_to_json`` wrote (ValueError, TypeError or KeyError if not)."""
    if data.get("v") != 1:
        raise ValueError(f"unknown park record version {data.get('v')!r}")
    committed = checked_committed(
        data["messages"], [bytes.fromhex(d) for d in data["digests"]],
        [(str(name), bytes.fromhex(value)) for name, value in data["shape"]],
        data["prompt"], data["body"])
    key = data["key"]
    content = data["cd"]
    created = float(data["created"])
    return ParkRecord(
        str(data["id"]), str(data["ns"]), str(key) if key is not None else None,
        _kind(data["kind"]), committed, int(data["pt"]), int(data["n"]), str(data["file"]),
        int(data["bytes"]), bytes.fromhex(data["td"]),
        bytes.fromhex(content) if content is not None else None, str(data["model"]), created,
        float(last_use) if last_use is not None else created, str(data["lane"]),
        bool(data["shared"]), owner)


# ---------------------------------------------------------------- sqlite: one replica

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
    last_use REAL NOT NULL,
    lane TEXT NOT NULL,
    shared INTEGER NOT NULL,
    scope TEXT NOT NULL,
    owner TEXT
);
CREATE INDEX IF NOT EXISTS parked_by_key ON parked (namespace, session_key);
CREATE INDEX IF NOT EXISTS parked_by_use ON parked (scope, last_use);
CREATE INDEX IF NOT EXISTS parked_by_owner ON parked (owner);
"""
_COLUMNS = ("park_id", "namespace", "session_key", "kind", "messages", "digests", "shape",
            "prompt", "body", "prompt_tokens", "n_tokens", "filename", "bytes", "tokens_digest",
            "content_digest", "model", "created", "last_use", "lane", "shared", "scope", "owner")


# Session ids of a process without --redis restart with it ("s1", "s2", ...): an owner is
# stored with this process's token, and a record another process owned reads as ownerless
# (a restarted proxy finds it by lookup, as a parked history no live session owns).
_PROCESS = secrets.token_hex(6)


class SqliteParkIndex:
    """The park index of one replica: one sqlite connection, used from the event loop
    thread only."""

    errors: tuple[type[BaseException], ...] = (sqlite3.Error, OSError)
    replicated = False

    def __init__(self, connection: sqlite3.Connection, path: Path | None = None) -> None:
        self._db = connection
        self.path = path

    @classmethod
    def in_directory(cls, directory: Path) -> SqliteParkIndex:
        """The index file in ``directory`` (prefixpin's own, not an engine's save dir)."""
        return cls.open(directory / INDEX_NAME)

    @classmethod
    def open(cls, path: Path) -> SqliteParkIndex:
        path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            db.execute("DROP TABLE IF EXISTS parked")  # its files become orphans: swept
        db.executescript(_SCHEMA)
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        return cls(db, path)

    def close(self) -> None:
        self._db.close()

    @contextlib.contextmanager
    def _atomic(self) -> Iterator[None]:
        self._db.execute("BEGIN")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def insert(self, record: ParkRecord) -> None:
        row = (record.park_id, record.namespace, record.key, record.kind,
               *_history_columns(record.committed), record.prompt_tokens, record.n_tokens,
               record.filename, record.size, record.tokens_digest, record.content_digest,
               record.model, record.created, record.last_use, record.lane, int(record.shared),
               record.scope, _owner_column(record.owner))
        marks = ", ".join("?" for _ in _COLUMNS)
        with self._atomic():
            if record.owner is not None:
                self._db.execute("UPDATE parked SET owner = NULL WHERE owner = ?",
                                 (_owner_column(record.owner),))
            self._db.execute(f"INSERT INTO parked ({', '.join(_COLUMNS)}) VALUES ({marks})",
                             row)

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

    def oldest_first(self, scope: str | None = None) -> list[ParkRecord]:
        if scope is None:
            return self._select("ORDER BY last_use", ())
        return self._select("WHERE scope = ? ORDER BY last_use", (scope,))

    def total_bytes(self, scope: str | None = None) -> int:
        where, args = _in_scope(scope)
        return int(self._db.execute(f"SELECT COALESCE(SUM(bytes), 0) FROM parked {where}",
                                    args).fetchone()[0])

    def count(self, scope: str | None = None) -> int:
        where, args = _in_scope(scope)
        return int(self._db.execute(f"SELECT COUNT(*) FROM parked {where}", args).fetchone()[0])

    def filenames(self) -> set[str]:
        return {row[0] for row in self._db.execute("SELECT filename FROM parked")}

    def invalid_ids(self, scope: str | None = None) -> list[str]:
        where, args = _in_scope(scope)
        bad = []
        for row in self._db.execute(f"SELECT {', '.join(_COLUMNS)} FROM parked {where}", args):
            try:
                _record(row)
            except (ValueError, TypeError, KeyError):
                bad.append(str(row[0]))
        return bad

    def owned_by(self, session_id: str) -> ParkRecord | None:
        rows = self._select("WHERE owner = ? ORDER BY created DESC",
                            (_owner_column(session_id),))
        return rows[0] if rows else None

    def set_owner(self, park_id: str, session_id: str) -> None:
        owner = _owner_column(session_id)
        with self._atomic():
            self._db.execute("UPDATE parked SET owner = NULL WHERE owner = ? AND park_id != ?",
                             (owner, park_id))
            self._db.execute("UPDATE parked SET owner = ? WHERE park_id = ?", (owner, park_id))

    def _select(self, where: str, args: tuple[Any, ...]) -> list[ParkRecord]:
        records = []
        for row in self._db.execute(f"SELECT {', '.join(_COLUMNS)} FROM parked {where}", args):
            with contextlib.suppress(ValueError, TypeError, KeyError):
                records.append(_record(row))
        return records


ParkIndex = SqliteParkIndex  # its name before there were two indexes


def _owner_column(session_id: str | None) -> str | None:
    return f"{_PROCESS}/{session_id}" if session_id is not None else None


def _owner_of_column(value: object) -> str | None:
    """The owner, if this process wrote it (else None: an id of another process's run)."""
    if not isinstance(value, str):
        return None
    process, _, session_id = value.partition("/")
    return session_id if process == _PROCESS and session_id else None


def _in_scope(scope: str | None) -> tuple[str, tuple[Any, ...]]:
    return ("", ()) if scope is None else ("WHERE scope = ?", (scope,))


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
     last_use, lane, shared, _scope, owner) = row
    blob = bytes(digests)
    split = [blob[i: i + DIGEST_BYTES] for i in range(0, len(blob), DIGEST_BYTES)]
    shape = [(str(name), bytes.fromhex(value)) for name, value in json.loads(shape_json)]
    body = json.loads(body_json) if body_json is not None else None
    committed = checked_committed(json.loads(messages_json), split, shape, prompt, body)
    return ParkRecord(str(park_id), str(namespace), key, _kind(kind), committed,
                      int(prompt_tokens), int(n_tokens), str(filename), int(size),
                      bytes(tokens_dig),
                      bytes(content_dig) if content_dig is not None else None, str(model),
                      float(created), float(last_use), str(lane), bool(shared),
                      _owner_of_column(owner))
