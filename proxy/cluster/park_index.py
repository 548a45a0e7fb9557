"""The park index in Redis (``--redis``): every replica sees every parked file, so a session
parked by one replica is restored by another.

Keys (under ``Cluster.key``):

    park:r:<id>              the record, JSON (never pickle): ``record_to_json``
    park:all                 hash id -> {"f": file, "b": bytes, "d": scope}: what exists,
                             where (per-scope budgets, counts and the orphan sweep)
    park:used                sorted set id -> last use (the LRU budget)
    park:owner               hash id -> the session whose latest park it is
    park:of:<session>        that session's latest park id
    park:key:<ns>:<hash>     set of ids parked under an explicit key (blake3 of the key)
    park:keyless:<ns>        set of ids parked without one

A record is immutable but for its history (a late commit) and its owner; last use lives
in the sorted set, so a touch is one ``ZADD XX``. Writes that touch several keys run as one
script. Synchronous, on ``Cluster.sync``: the commit hook touches the index.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import blake3
import orjson

from prefixpin.proxy.cluster.core import Cluster
from prefixpin.proxy.parking.index import ParkRecord, record_from_json, record_to_json
from prefixpin.proxy.session.history import Committed

# KEYS: record, all, used, lookup set, owners, the owner's "of" key (or the none key).
# ARGV: id, record JSON, all entry, last use, owner ("": none).
_INSERT = """
redis.call('SET', KEYS[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
redis.call('SADD', KEYS[4], ARGV[1])
if ARGV[5] ~= '' then
  local before = redis.call('GET', KEYS[6])
  if before and before ~= ARGV[1] and redis.call('HGET', KEYS[5], before) == ARGV[5] then
    redis.call('HDEL', KEYS[5], before)
  end
  redis.call('SET', KEYS[6], ARGV[1])
  redis.call('HSET', KEYS[5], ARGV[1], ARGV[5])
end
return 1
"""

# KEYS: record, all, used, lookup set, owners. ARGV: id, prefix of the "of" keys.
_DELETE = """
redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('SREM', KEYS[4], ARGV[1])
local owner = redis.call('HGET', KEYS[5], ARGV[1])
if owner then
  redis.call('HDEL', KEYS[5], ARGV[1])
  local of = ARGV[2] .. owner
  if redis.call('GET', of) == ARGV[1] then redis.call('DEL', of) end
end
return 1
"""

# KEYS: record, owners, the new owner's "of" key. ARGV: id, session, prefix of the "of" keys.
_SET_OWNER = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local old = redis.call('HGET', KEYS[2], ARGV[1])
if old and old ~= ARGV[2] then
  local of = ARGV[3] .. old
  if redis.call('GET', of) == ARGV[1] then redis.call('DEL', of) end
end
local before = redis.call('GET', KEYS[3])
if before and before ~= ARGV[1] and redis.call('HGET', KEYS[2], before) == ARGV[2] then
  redis.call('HDEL', KEYS[2], before)
end
redis.call('SET', KEYS[3], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"""


class RedisParkIndex:
    """``ParkIndexStore`` on a ``Cluster``: one index for every replica and lane."""

    replicated = True

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.r = cluster.sync
        self.errors: tuple[type[BaseException], ...] = cluster.errors
        self._all = cluster.key("park", "all")
        self._used = cluster.key("park", "used")
        self._owners = cluster.key("park", "owner")
        self._of_prefix = cluster.key("park", "of", "")
        self._none = cluster.key("park", "none")  # never written: a script's unused key
        self._insert = self.r.register_script(_INSERT)
        self._delete = self.r.register_script(_DELETE)
        self._set_owner = self.r.register_script(_SET_OWNER)

    # -- keys -------------------------------------------------------------------------

    def _record_key(self, park_id: str) -> str:
        return self.cluster.key("park", "r", park_id)

    def _of(self, session_id: str) -> str:
        return self._of_prefix + session_id

    def _lookup_key(self, namespace: str, key: str | None) -> str:
        if key is None:
            return self.cluster.key("park", "keyless", namespace)
        return self.cluster.key("park", "key", namespace,
                                blake3.blake3(key.encode()).hexdigest()[:32])

    # -- writes -----------------------------------------------------------------------

    def insert(self, record: ParkRecord) -> None:
        entry = orjson.dumps({"f": record.filename, "b": record.size, "d": record.scope})
        owner = record.owner or ""
        self._insert(keys=[self._record_key(record.park_id), self._all, self._used,
                           self._lookup_key(record.namespace, record.key), self._owners,
                           self._of(owner) if owner else self._none],
                     args=[record.park_id, orjson.dumps(record_to_json(record)), entry,
                           record.last_use, owner])

    def update_history(self, park_id: str, committed: Committed, prompt_tokens: int) -> None:
        key = self._record_key(park_id)
        raw = self.r.get(key)
        if raw is None:
            return
        data = orjson.loads(raw)
        data.update(_history_fields(committed), pt=prompt_tokens)
        self.r.set(key, orjson.dumps(data), xx=True)

    def delete(self, park_id: str) -> None:
        raw = self.r.get(self._record_key(park_id))
        lookup = self._none
        if raw is not None:
            try:  # the lookup set, even of a record that no longer decodes
                data = orjson.loads(raw)
                lookup = self._lookup_key(str(data["ns"]), data["key"])
            except (ValueError, TypeError, KeyError):
                pass
        self._delete(keys=[self._record_key(park_id), self._all, self._used, lookup,
                           self._owners], args=[park_id, self._of_prefix])

    def touch(self, park_id: str, at: float) -> None:
        self.r.zadd(self._used, {park_id: at}, xx=True)

    def set_owner(self, park_id: str, session_id: str) -> None:
        self._set_owner(keys=[self._record_key(park_id), self._owners, self._of(session_id)],
                        args=[park_id, session_id, self._of_prefix])

    def close(self) -> None:
        """Nothing to close: the connections are the cluster's."""

    # -- reads ------------------------------------------------------------------------

    def get(self, park_id: str) -> ParkRecord | None:
        found = self._records([park_id])
        return found[0] if found else None

    def under(self, namespace: str, key: str | None) -> list[ParkRecord]:
        lookup = self._lookup_key(namespace, key)
        ids = sorted(_text(i) for i in self._smembers(lookup))
        rows = self._rows(ids)
        gone = [park_id for park_id, (raw, _, _) in zip(ids, rows, strict=True) if raw is None]
        if gone:
            self.r.srem(lookup, *gone)
        return [r for r in map(_decoded, rows) if r is not None]

    def oldest_first(self, scope: str | None = None) -> list[ParkRecord]:
        records = self._records(list(self._entries(scope)))
        return sorted(records, key=lambda r: (r.last_use, r.park_id))

    def total_bytes(self, scope: str | None = None) -> int:
        return sum(int(entry.get("b") or 0) for entry in self._entries(scope).values())

    def count(self, scope: str | None = None) -> int:
        return len(self._entries(scope))

    def filenames(self) -> set[str]:
        return {str(entry.get("f")) for entry in self._entries(None).values()}

    def invalid_ids(self, scope: str | None = None) -> list[str]:
        ids = list(self._entries(scope))
        return [park_id for park_id, row in zip(ids, self._rows(ids), strict=True)
                if _decoded(row) is None]

    def owned_by(self, session_id: str) -> ParkRecord | None:
        park_id = self.r.get(self._of(session_id))
        if park_id is None:
            return None
        record = self.get(_text(park_id))
        return record if record is not None and record.owner == session_id else None

    # -- helpers ----------------------------------------------------------------------

    def _smembers(self, key: str) -> set[Any]:
        found: Any = self.r.smembers(key)
        return set(found)

    def _entries(self, scope: str | None) -> dict[str, dict[str, Any]]:
        raw: Any = self.r.hgetall(self._all)
        entries = {}
        for park_id, value in raw.items():
            try:
                entry = orjson.loads(value)
            except ValueError:
                entry = {}
            if not isinstance(entry, dict):
                entry = {}
            if scope is None or entry.get("d") == scope:
                entries[_text(park_id)] = entry
        return entries

    def _rows(self, ids: Sequence[str]) -> list[tuple[Any, Any, Any]]:
        """Per id: the record's JSON, its last use and its owner (one round trip)."""
        if not ids:
            return []
        with self.r.pipeline(transaction=False) as pipe:
            for park_id in ids:
                pipe.get(self._record_key(park_id))
                pipe.zscore(self._used, park_id)
                pipe.hget(self._owners, park_id)
            flat = pipe.execute()
        return [(flat[i], flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)]

    def _records(self, ids: Sequence[str]) -> list[ParkRecord]:
        return [r for r in map(_decoded, self._rows(ids)) if r is not None]


def _decoded(row: tuple[Any, Any, Any]) -> ParkRecord | None:
    raw, last_use, owner = row
    if raw is None:
        return None
    try:
        data = orjson.loads(raw)
        if not isinstance(data, dict):
            return None
        return record_from_json(data, last_use=float(last_use) if last_use is not None else None,
                                owner=_text(owner) if owner is not None else None)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def _history_fields(committed: Committed) -> dict[str, Any]:
    encoded = record_to_json(ParkRecord("", "", None, "main", committed, 0, 0, "", 0, b"",
                                        None, "", 0.0, 0.0))
    return {k: encoded[k] for k in ("messages", "digests", "shape", "prompt", "body")}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
