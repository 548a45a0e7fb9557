"""The session table in Redis: what bytes-decide needs, shared by every replica.

Each replica plans on its own in-memory ``SessionStore``; this module keeps it in step:

- before a request is planned, the sessions it could continue (those under its explicit
  key, or the namespace's most recent keyless ones) are read from Redis into the local
  store when Redis holds a newer version (``hydrate``);
- when a request commits, its session is written back (``publish``) in one round trip,
  *synchronously*, from the commit hook: the commit runs before the generation is marked
  finished, so the client's response ends only after Redis holds the new committed
  history, and its next turn, on whichever replica, is decided against it.

A record is JSON (never pickle: whoever can write to Redis must not be able to run code in
the proxy): the committed messages and their digests, the shaping fields, the fingerprint
chain, token count, the backend and slot believed to hold it, the last decision and the
repair memory. Versions only grow: a stale replica never overwrites a newer commit.
"""

from __future__ import annotations

import logging
import secrets
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, cast

import blake3
import orjson
import redis

from prefixpin.fingerprint import Chain
from prefixpin.fingerprint.chain import Edges
from prefixpin.proxy.cluster.core import Cluster
from prefixpin.proxy.ops.logs import log_event
from prefixpin.proxy.session.history import Committed
from prefixpin.proxy.session.repair import RepairMemory
from prefixpin.proxy.session.sessions import TURN_HISTORY, Session, SessionStore, TurnFigures

KEYLESS_CANDIDATES = 32  # most recent keyless sessions of a namespace read per request
TTL_S = 24 * 3600

# KEYS: record, version, index, the namespace's index of all its sessions. ARGV: version,
# record, ttl, index score, session id, the namespace's cap, the record and version key
# prefixes. Past the cap the namespace's least recently used records are deleted (their ids
# may linger in a key's index: hydrate skips a missing record). The key names built here
# keep this script to one Redis node, which is what prefixpin uses.
_PUBLISH = """
local current = tonumber(redis.call('GET', KEYS[2]) or '0')
if current >= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[5])
redis.call('EXPIRE', KEYS[3], ARGV[3])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[5])
redis.call('EXPIRE', KEYS[4], ARGV[3])
local over = redis.call('ZCARD', KEYS[4]) - tonumber(ARGV[6])
if over > 0 then
  for _, id in ipairs(redis.call('ZRANGE', KEYS[4], 0, over - 1)) do
    redis.call('DEL', ARGV[7] .. id, ARGV[8] .. id)
    redis.call('ZREM', KEYS[4], id)
  end
end
return 1
"""


def new_session_id() -> str:
    return f"s{secrets.token_hex(6)}"


class SharedSessions:
    def __init__(self, cluster: Cluster, store: SessionStore, logger: logging.Logger, *,
                 max_per_namespace: int = 4096) -> None:
        self.cluster = cluster
        self.store = store
        self.log = logger
        self.max_per_namespace = max_per_namespace  # shared records a namespace keeps
        self._publish = cluster.sync.register_script(_PUBLISH)

    def _record_key(self, session_id: str) -> str:
        return self.cluster.key("s", session_id)

    def _index_key(self, namespace: str, key: str | None) -> str:
        if key is None:
            return self.cluster.key("keyless", namespace)
        return self.cluster.key("key", namespace, blake3.blake3(key.encode()).hexdigest()[:32])

    async def hydrate(self, namespace: str, key: str | None) -> int:
        """Bring the local store up to date for one key (or the namespace's keyless
        sessions); returns how many sessions were read anew."""
        r = self.cluster.r
        limit = KEYLESS_CANDIDATES if key is None else 8
        found: Any = await r.zrevrange(self._index_key(namespace, key), 0, limit - 1)
        ids = [i.decode() for i in found]
        if not ids:
            return 0
        versions = await r.mget([self.cluster.key("sv", i) for i in ids])
        stale = [i for i, v in zip(ids, versions, strict=True)
                 if v is not None and int(v) > _version_of(self.store.get(i))]
        if not stale:
            return 0
        records = await r.mget([self._record_key(i) for i in stale])
        for raw in records:
            if raw is None:
                continue
            session = decode_session(orjson.loads(raw))
            self.store.put(session)
        return len(stale)

    async def fetch(self, session_id: str) -> Session | None:
        """One session by id (``s:<id>``), into the local store when Redis holds a newer
        version: parking saves a slot whose occupant another replica committed. Never
        raises: Redis unreachable, or a record that does not decode, leaves the local copy
        (None if there is none)."""
        local = self.store.get(session_id)
        errors: tuple[type[BaseException], ...] = (*self.cluster.errors, ValueError, TypeError,
                                                    KeyError)
        try:
            raw = await self.cluster.r.get(self._record_key(session_id))
            if raw is None:
                return local
            session = decode_session(orjson.loads(raw))
        except errors as exc:
            log_event(self.log, logging.WARNING, "shared session not read", session=session_id,
                      error=str(exc))
            return local
        if local is not None and _version_of(local) >= _version_of(session):
            return local
        return self.store.put(session)

    def withdraw(self, namespace: str, key: str | None, session_ids: list[str]) -> None:
        """Sessions their client ended (``x-dynamo-session-final``): gone from the shared
        table too, so no replica brings them back (synchronous, as ``publish``)."""
        pipe = self.cluster.sync.pipeline(transaction=True)
        for session_id in session_ids:
            pipe.delete(self._record_key(session_id), self.cluster.key("sv", session_id))
            pipe.zrem(self._index_key(namespace, key), session_id)
            pipe.zrem(self.cluster.key("all", namespace), session_id)
        try:
            pipe.execute()
        except (redis.RedisError, OSError) as exc:
            log_event(self.log, logging.WARNING, "ended sessions not withdrawn",
                      sessions=session_ids, error=str(exc))

    def publish(self, session: Session) -> bool:
        """Write a committed session (synchronous: see the module docstring)."""
        version = _version_of(session) + 1
        session.shared_version = version
        record = orjson.dumps(encode_session(session, version))
        try:
            written = self._publish(
                keys=[self._record_key(session.id), self.cluster.key("sv", session.id),
                      self._index_key(session.namespace, session.key),
                      self.cluster.key("all", session.namespace)],
                args=[version, record, TTL_S, session.last_used, session.id,
                      self.max_per_namespace, self.cluster.key("s", ""),
                      self.cluster.key("sv", "")])
        except (redis.RedisError, OSError) as exc:
            log_event(self.log, logging.WARNING, "session not shared", session=session.id,
                      error=str(exc))
            return False
        return bool(written)


def _version_of(session: Session | None) -> int:
    if session is None:
        return 0
    return session.shared_version


def encode_session(session: Session, version: int) -> dict[str, Any]:
    memory = session.repair
    return {
        "v": version, "id": session.id, "ns": session.namespace, "key": session.key,
        "kind": session.kind, "parent": session.parent, "pt": session.prompt_tokens,
        "slot": session.slot, "backend": session.backend, "created": session.created,
        "used": session.last_used, "dec": session.last_decision, "why": session.last_reason,
        "committed": _encode_committed(session.committed),
        "chain": _encode_chain(session.chain),
        "turns": [[t.at, t.decision, t.prompt_tokens, t.cached_tokens, t.ttft_ms,
                   t.prefill_ms] for t in session.turns],
        "repair": {"last_reply": memory.last_reply, "cut": memory.cut},
    }


def decode_session(data: Mapping[str, Any]) -> Session:
    session = Session(str(data["id"]), str(data["ns"]), data.get("key"),
                      "side" if data.get("kind") == "side" else "main", data.get("parent"))
    session.prompt_tokens = int(data.get("pt") or 0)
    session.slot = data.get("slot")
    session.backend = data.get("backend")
    session.created = float(data.get("created") or 0.0)
    session.last_used = float(data.get("used") or 0.0)
    session.last_decision = str(data.get("dec") or "new")
    session.last_reason = str(data.get("why") or "")
    session.committed = _decode_committed(data.get("committed"))
    session.chain = _decode_chain(data.get("chain"))
    session.turns = deque((TurnFigures(*turn) for turn in data.get("turns") or ()),
                          maxlen=TURN_HISTORY)
    repair = data.get("repair")
    if isinstance(repair, Mapping):
        session.repair = RepairMemory(repair.get("last_reply"), int(repair.get("cut") or 0))
    session.shared_version = int(data["v"])
    return session


def _encode_committed(committed: Committed | None) -> dict[str, Any] | None:
    if committed is None:
        return None
    return {"messages": list(committed.messages),
            "digests": [d.hex() for d in committed.digests],
            "shape": [[name, d.hex()] for name, d in committed.shape],
            "prompt": committed.prompt,
            "body": dict(committed.body) if committed.body is not None else None}


def _decode_committed(data: object) -> Committed | None:
    if not isinstance(data, Mapping):
        return None
    messages = tuple(cast(Sequence[Mapping[str, Any]], data.get("messages") or ()))
    digests = tuple(bytes.fromhex(d) for d in data.get("digests") or ())
    shape = tuple((str(name), bytes.fromhex(d)) for name, d in data.get("shape") or ())
    return Committed(messages, digests, shape, data.get("prompt"), data.get("body"))


def _encode_chain(chain: Chain | None) -> dict[str, Any] | None:
    if chain is None:
        return None
    last = chain.last
    return {"openers": sorted(chain.openers), "edge": chain.edge,
            "digests": chain.hexdigests(), "marked": chain.marked,
            "last": [list(last.head), list(last.tail)] if last is not None else None}


def _decode_chain(data: object) -> Chain | None:
    if not isinstance(data, Mapping):
        return None
    last = data.get("last")
    edges = Edges(tuple(last[0]), tuple(last[1])) if last is not None else None
    return Chain(frozenset(data.get("openers") or ()), int(data["edge"]),
                 tuple(bytes.fromhex(d) for d in data.get("digests") or ()), edges,
                 bool(data.get("marked")))
