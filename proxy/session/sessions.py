"""Sessions: one committed history each, owned by a namespace, bounded in number and age.

A session is one *history*. An explicit session key may carry several (OpenCode sends its
title request under the main thread's id, with another system prompt): the key nominates
them all and bytes pick the one a request continues. Sessions without a key are found by
their fingerprint chain. Nothing here is shared across namespaces.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from prefixpin.fingerprint import Chain
from prefixpin.proxy.session.history import Committed
from prefixpin.proxy.session.repair import RepairMemory

Kind = Literal["main", "side"]
TURN_HISTORY = 64  # per-session turn figures kept for the /sessions view and status page
# Leading fingerprint segments a keyless session must share with a request to be nominated
# (``proxy.session.affinity``; a bare system prompt is shared by all): the store indexes each
# keyless session by the chain digest that commits to exactly that many.
NOMINATION_BAR = 3

# What a keyless session is indexed by, so a request reads only those it may continue
# (``SessionStore.nominees``), not every session of its namespace: (namespace, what, a
# message count, a digest).
_IndexKey = tuple[str, str, int, bytes]


@dataclass(slots=True)
class TurnFigures:
    at: float
    decision: str
    prompt_tokens: int | None
    cached_tokens: int | None
    ttft_ms: float | None
    prefill_ms: float | None = None  # the engine's own prompt time, where it reports one


@dataclass(slots=True)
class EngineCache:
    """What the proxy believes an engine that chooses its own slots (Ollama) holds for one
    session."""

    model: str | None = None
    cold: str | None = None  # why its cache is assumed gone; None while it is believed warm


@dataclass(slots=True)
class Session:
    id: str
    namespace: str
    key: str | None  # the explicit key, or None for a session found by fingerprint
    kind: Kind
    parent: str | None = None
    committed: Committed | None = None
    chain: Chain | None = None
    prompt_tokens: int = 0  # tokens of the committed prompt, as the engine counted them
    slot: int | None = None  # the engine slot believed to hold this history
    backend: str | None = None
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    last_decision: str = "new"
    last_reason: str = ""
    turns: deque[TurnFigures] = field(default_factory=lambda: deque(maxlen=TURN_HISTORY))
    # What repair keeps besides the committed history (the reply returned, the trim cut).
    repair: RepairMemory = field(default_factory=RepairMemory)
    engine_cache: EngineCache = field(default_factory=EngineCache)
    shared_version: int = 0  # with --redis: the version of the shared record last seen
    api: str = "openai"  # the wire format of its last request (the /sessions view, by API)

    def view(self) -> dict[str, Any]:
        return {
            "id": self.id, "key": self.key, "kind": self.kind, "parent": self.parent,
            "api": self.api, "slot": self.slot, "backend": self.backend,
            "committed_messages": len(self.committed.messages) if self.committed else 0,
            "committed_tokens": self.prompt_tokens,
            "last_decision": self.last_decision, "last_reason": self.last_reason,
            "last_used": round(self.last_used, 3),
            "turns": [{"at": round(t.at, 3), "decision": t.decision,
                       "prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens,
                       "ttft_ms": t.ttft_ms} for t in self.turns],
        }


class SessionStore:
    """Bounded, per namespace first: a tenant cycling session keys evicts its own.

    - at most ``max_per_namespace`` sessions in one namespace: its least recently used
      goes first;
    - at most ``max_committed_bytes`` of committed history in one namespace: its least
      recently used others go first (a single history over the budget keeps its session
      but not its history);
    - at most ``max_sessions`` in all: the least recently used session of the namespace
      holding the most (the one furthest over its share) goes, never another's first;
    - sessions idle for ``ttl_s`` are dropped.
    """

    def __init__(self, max_sessions: int = 4096, ttl_s: float = 24 * 3600, *,
                 max_per_namespace: int | None = None,
                 max_committed_bytes: int | None = None,
                 new_id: Callable[[], str] | None = None) -> None:
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._by_ns: dict[str, OrderedDict[str, Session]] = {}
        self._bytes: dict[str, int] = {}  # committed bytes per namespace
        self._sizes: dict[str, int] = {}  # per session, the committed bytes counted
        # Recency without a scan: each put or touch moves a session to the end of both
        # ordered dicts above and gives it the next tick, so ticks order a namespace's
        # sessions exactly as those dicts do.
        self._ticks = itertools.count()
        self._order: dict[str, int] = {}
        self._keyed: dict[tuple[str, str], dict[str, Session]] = {}  # (namespace, key)
        self._nominees: dict[_IndexKey, dict[str, Session]] = {}
        # per namespace, the committed lengths some "history" bucket has (with the number
        # of buckets): a request looks up only those, not every one of its message counts
        self._lengths: dict[str, Counter[int]] = {}
        self._indexed: dict[str, tuple[_IndexKey, ...]] = {}  # per session, its index keys
        self._max = max_sessions
        self._max_ns = max_per_namespace or max_sessions
        self._max_bytes = max_committed_bytes
        self._ttl_s = ttl_s
        counter = itertools.count(1)
        # Several replicas sharing a session table need ids unique across them (random).
        self._new_id = new_id or (lambda: f"s{next(counter)}")

    @classmethod
    def from_settings(cls, settings: Any, *,
                      new_id: Callable[[], str] | None = None) -> SessionStore:
        """The bounds from ``proxy.settings.Settings``."""
        return cls(settings.max_sessions, max_per_namespace=settings.max_sessions_per_namespace,
                   max_committed_bytes=settings.max_committed_bytes_per_namespace,
                   new_id=new_id)

    def create(self, namespace: str, key: str | None, kind: Kind,
               parent: str | None = None) -> Session:
        return self.put(Session(self._new_id(), namespace, key, kind, parent))

    def put(self, session: Session) -> Session:
        """Add or replace a session (one read from the shared table)."""
        self._expire()
        previous = self._sessions.get(session.id)
        if previous is not None and previous is not session:
            self._drop(previous)
        self._sessions[session.id] = session
        self._sessions.move_to_end(session.id)
        own = self._by_ns.setdefault(session.namespace, OrderedDict())
        own[session.id] = session
        own.move_to_end(session.id)
        self._order[session.id] = next(self._ticks)
        if session.key is not None:
            self._keyed.setdefault((session.namespace, session.key), {})[session.id] = session
        self._account(session)
        while len(own) > self._max_ns:
            self._drop(next(iter(own.values())))
        while len(self._sessions) > self._max:
            self._drop(self._victim())
        return session

    def committed_bytes(self, namespace: str) -> int:
        return self._bytes.get(namespace, 0)

    def count(self, namespace: str) -> int:
        return len(self._by_ns.get(namespace, ()))

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def touch(self, session: Session) -> None:
        """A session was used (and may hold a new committed history: it is counted)."""
        session.last_used = time.time()
        if self._sessions.get(session.id) is session:
            self._sessions.move_to_end(session.id)
            self._by_ns[session.namespace].move_to_end(session.id)
            self._order[session.id] = next(self._ticks)
            self._account(session)

    def remove(self, session: Session) -> None:
        """Forget ``session`` (the client ended it): no request finds it again."""
        self._drop(session)

    def reindex(self, session: Session) -> None:
        """``session``'s committed history or chain changed outside ``touch`` (which
        reindexes it too): what nominates it follows."""
        if self._sessions.get(session.id) is session:
            self._index(session)

    def with_key(self, namespace: str, key: str) -> list[Session]:
        """Every history under one explicit key, most recently used first."""
        return self._newest_first_of(self._keyed.get((namespace, key)))

    def histories_of(self, session: Session) -> list[Session]:
        """Every history under ``session``'s key (just ``session`` when it has none)."""
        return (self.with_key(session.namespace, session.key) if session.key is not None
                else [session])

    def keyless(self, namespace: str) -> list[Session]:
        return [s for s in self._own_newest_first(namespace) if s.key is None]

    def nominees(self, namespace: str, *, digests: Sequence[bytes], chain: bytes | None,
                 prompt: bool) -> list[Session]:
        """The keyless sessions of ``namespace`` holding a committed history that a request
        may continue, most recently used first (a superset: the caller decides): those
        whose ``n`` committed messages end with the digest the request's message ``n``
        has (``digests``: the request's; a history the request repeats as its prefix does),
        those whose fingerprint chain has the digest ``chain`` at segment
        ``NOMINATION_BAR`` (sharing that many leading segments means sharing that digest),
        and with ``prompt`` every one holding a raw prompt. Every session a scan of all the
        keyless ones (``keyless``) would keep is among them, in the same order."""
        index = self._nominees
        buckets = [bucket for n in self._history_lengths(namespace, len(digests))
                   if (bucket := index.get((namespace, "history", n, digests[n - 1])))]
        if chain is not None and (bucket := index.get((namespace, "chain", 0, chain))):
            buckets.append(bucket)
        if prompt and (bucket := index.get((namespace, "prompt", 0, b""))):
            buckets.append(bucket)
        if len(buckets) == 1:  # the common case: the one history the request continues
            return self._newest_first_of(buckets[0])
        found: dict[str, Session] = {}
        for bucket in buckets:
            found.update(bucket)
        return self._newest_first_of(found)

    def _history_lengths(self, namespace: str, most: int) -> list[int]:
        """The committed lengths up to ``most`` that a "history" bucket of ``namespace``
        has, in increasing order."""
        lengths = self._lengths.get(namespace)
        if not lengths:
            return []
        if len(lengths) >= most:
            return [n for n in range(1, most + 1) if n in lengths]
        return sorted(n for n in lengths if n <= most)

    def namespaces(self) -> dict[str, list[Session]]:
        grouped: dict[str, list[Session]] = {}
        for session in self._newest_first():
            grouped.setdefault(session.namespace, []).append(session)
        return grouped

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def __len__(self) -> int:
        return len(self._sessions)

    def _newest_first(self) -> list[Session]:
        return list(reversed(self._sessions.values()))

    def _own_newest_first(self, namespace: str) -> list[Session]:
        """One namespace's sessions, most recently used first: the same order as in the
        whole store (both move a session to the end together), without reading every
        other namespace's."""
        own = self._by_ns.get(namespace)
        return list(reversed(own.values())) if own else []

    def _newest_first_of(self, sessions: dict[str, Session] | None) -> list[Session]:
        if not sessions:
            return []
        if len(sessions) == 1:
            return list(sessions.values())
        order = self._order
        return sorted(sessions.values(), key=lambda s: order[s.id], reverse=True)

    def _index(self, session: Session) -> None:
        """File a keyless session under what may nominate it (``nominees``)."""
        before = self._indexed.pop(session.id, ())
        after = _index_keys(session)
        if before == after:
            if after:
                self._indexed[session.id] = after
            return
        self._unindex(session, before)
        for index_key in after:
            bucket = self._nominees.setdefault(index_key, {})
            if not bucket:
                self._count_bucket(index_key, 1)
            bucket[session.id] = session
        if after:
            self._indexed[session.id] = after

    def _unindex(self, session: Session, keys: tuple[_IndexKey, ...]) -> None:
        for index_key in keys:
            bucket = self._nominees.get(index_key)
            if bucket is not None and bucket.get(session.id) is session:
                del bucket[session.id]
                if not bucket:
                    del self._nominees[index_key]
                    self._count_bucket(index_key, -1)

    def _count_bucket(self, index_key: _IndexKey, change: int) -> None:
        namespace, kind, length, _ = index_key
        if kind != "history":
            return
        lengths = self._lengths.setdefault(namespace, Counter())
        lengths[length] += change
        if lengths[length] <= 0:
            del lengths[length]
            if not lengths:
                del self._lengths[namespace]

    def _expire(self) -> None:
        cutoff = time.time() - self._ttl_s
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            if oldest.last_used >= cutoff:
                break
            self._drop(oldest)

    def _victim(self) -> Session:
        """The store is full: the oldest session of the namespace holding the most."""
        most = max(len(own) for own in self._by_ns.values())
        oldest = [next(iter(own.values())) for own in self._by_ns.values() if len(own) == most]
        return min(oldest, key=lambda s: s.last_used)

    def _account(self, session: Session) -> None:
        """Count the session's committed bytes (its history and the reply it was last
        given, which repair keeps); over the namespace's budget, its least recently used
        others go, then, alone over it, its own history and reply."""
        self._index(session)
        size = (session.committed.size if session.committed is not None else 0
                ) + session.repair.reply_size
        namespace = session.namespace
        self._bytes[namespace] = self._bytes.get(namespace, 0) + size - self._sizes.get(
            session.id, 0)
        self._sizes[session.id] = size
        if self._max_bytes is None:
            return
        own = self._by_ns[namespace]
        while self._bytes[namespace] > self._max_bytes:
            oldest = next(s for s in own.values())
            if oldest is session:
                others = [s for s in own.values() if s is not session]
                if not others:
                    session.committed = None  # alone over the budget: not kept
                    session.repair.remember_reply(None)
                    self._index(session)
                    self._bytes[namespace] -= self._sizes.pop(session.id, 0)
                    self._sizes[session.id] = 0
                    return
                oldest = others[0]
            self._drop(oldest)

    def _drop(self, session: Session) -> None:
        if self._sessions.get(session.id) is session:
            del self._sessions[session.id]
            self._order.pop(session.id, None)
            self._unindex(session, self._indexed.pop(session.id, ()))
            if session.key is not None:
                keyed = self._keyed.get((session.namespace, session.key))
                if keyed is not None and keyed.get(session.id) is session:
                    del keyed[session.id]
                    if not keyed:
                        del self._keyed[session.namespace, session.key]
        own = self._by_ns.get(session.namespace)
        if own is not None and own.get(session.id) is session:
            del own[session.id]
            if not own:
                del self._by_ns[session.namespace]
        size = self._sizes.pop(session.id, 0)
        if session.namespace in self._bytes:
            self._bytes[session.namespace] -= size
            if session.namespace not in self._by_ns:
                del self._bytes[session.namespace]


def _index_keys(session: Session) -> tuple[_IndexKey, ...]:
    """What may nominate a keyless session with a committed history (``nominees``)."""
    committed = session.committed
    if session.key is not None or committed is None:
        return ()
    namespace = session.namespace
    keys: list[_IndexKey] = []
    if committed.prompt is not None:
        keys.append((namespace, "prompt", 0, b""))
    elif committed.digests:
        keys.append((namespace, "history", len(committed.digests), committed.digests[-1]))
    chain = session.chain
    if chain is not None and chain.marked and len(chain.digests) >= NOMINATION_BAR:
        keys.append((namespace, "chain", 0, chain.digests[NOMINATION_BAR - 1]))
    return tuple(keys)
