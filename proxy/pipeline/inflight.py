"""Join in flight: a *retry* of a request already running attaches to its generation.

The loop this breaks: nothing reaches a client during a long prefill, it times out and
resends the identical request, which would queue behind the original and prefill again.

Identical means same namespace, same wire format and path, same session identity and same
body once the fields that only shape one client's view are set aside (``stream``,
``stream_options``, ``return_progress``): a streaming and a non-streaming client can share
one generation.

Identical is not enough: two clients that sample the same prompt at once (pass@k) want two
samples. A request joins a running generation only when it is a retry of it:

- the first client has left (its connection closed): the generation is kept running for
  ``--retry-grace`` seconds for exactly this;
- the request says it is a retry: ``x-stainless-retry-count`` > 0 (the OpenAI and
  Anthropic SDKs send it);
- it carries the running request's ``Idempotency-Key``.

A request with an idempotency key joins only the one with that key, and a request without
one never joins one that has one. A generation whose answer is
complete is never joined (a back-to-back resend is a new request, not a replay).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import blake3

from prefixpin.proxy.pipeline.generation import Generation
from prefixpin.proxy.session.history import canonical_bytes

VIEW_FIELDS = frozenset({"stream", "stream_options", "return_progress"})
RETRY_HEADER = "x-stainless-retry-count"
IDEMPOTENCY_HEADER = "idempotency-key"
MAX_IDEMPOTENCY_CHARS = 256


def inflight_key(namespace: str, codec: str, path: str, session: str | None,
                 body: Mapping[str, Any], digests: Sequence[bytes] | None = None) -> bytes:
    """``session``: the request's explicit session identity (None without one).
    ``digests``: those of the body's ``messages`` (``proxy.session.history.digest``), when the
    caller has them: the messages then enter the key by their digests, not serialised
    a second time (a 64-message history is ~80 us of canonical JSON)."""
    shared = {k: v for k, v in body.items() if k not in VIEW_FIELDS}
    messages = shared.get("messages")
    by_digest = (digests is not None and isinstance(messages, list)
                 and len(digests) == len(messages))
    if by_digest:
        del shared["messages"]
    hasher = blake3.blake3(canonical_bytes([namespace, codec, path, session]))
    hasher.update(b"\0")
    hasher.update(canonical_bytes(shared))
    if by_digest:  # marked, so no body without messages can read as one with them
        assert digests is not None
        hasher.update(b"\0messages\0%d\0" % len(digests))
        hasher.update(b"".join(digests))
    return hasher.digest()


@dataclass(frozen=True, slots=True)
class JoinIntent:
    """What a request says about itself: a retry, and its idempotency key."""

    retry: bool = False
    idempotency_key: str | None = None

    @classmethod
    def of(cls, headers: Mapping[str, str]) -> JoinIntent:
        """From the request headers (lower-case names, as Starlette gives them)."""
        count = (headers.get(RETRY_HEADER) or "").strip()
        retry = count.isdigit() and int(count) > 0
        idem = (headers.get(IDEMPOTENCY_HEADER) or "").strip()
        return cls(retry, idem if 0 < len(idem) <= MAX_IDEMPOTENCY_CHARS else None)

    def wire(self) -> dict[str, Any]:
        return {"retry": self.retry, "idem": self.idempotency_key}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> JoinIntent:
        idem = data.get("idem")
        return cls(bool(data.get("retry")), idem if isinstance(idem, str) else None)


@dataclass(eq=False, slots=True)
class Entry:
    """One generation running (or a reservation for one being planned) under a key."""

    target: Generation | asyncio.Future[Generation]
    idempotency_key: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def joinable(generation: Generation) -> bool:
    """Its answer is not complete yet (a complete one is never replayed), and its log
    holds every frame from the first (a long reply's lets go: ``proxy.pipeline.generation``)."""
    return not generation.answered and generation.whole


def is_retry_of(entry: Entry, intent: JoinIntent, generation: Generation | None) -> bool:
    """Does a request with ``intent`` retry the one running as ``entry``? ``generation``:
    the entry's generation, None while it is still being planned."""
    mine, theirs = intent.idempotency_key, entry.idempotency_key
    if mine is not None or theirs is not None:
        return mine == theirs  # a retry carries its original's key, whatever else it says
    if intent.retry:
        return True
    return generation is not None and generation.abandoned


class InFlight:
    """Running generations by key, and reservations for those still being planned.

    A key is reserved *before* the request is planned (planning awaits: fingerprints run in
    a thread, parked sessions are restored), so a retry that arrives meanwhile waits for
    the first one's generation instead of starting its own. Several independent requests
    may run under one key (pass@k sampling): each has its own entry.
    """

    def __init__(self) -> None:
        self._running: dict[bytes, list[Entry]] = {}

    async def find(self, key: bytes, intent: JoinIntent | None = None) -> Generation | None:
        """The running generation this request retries, if any."""
        intent = intent or JoinIntent()
        for entry in list(self._running.get(key, ())):
            generation = await self.joinable_of(entry, intent)
            if generation is not None:
                return generation
        return None

    async def joinable_of(self, entry: Entry, intent: JoinIntent) -> Generation | None:
        """``entry``'s generation when a request with ``intent`` may join it (waiting for a
        reservation to be planned when the request may join a planned one)."""
        target = entry.target
        if isinstance(target, asyncio.Future):
            if not is_retry_of(entry, intent, None):
                return None
            reservation = target
            try:
                target = await asyncio.shield(reservation)
            except asyncio.CancelledError:
                if reservation.cancelled():
                    return None  # the first request failed to plan: plan this one anew
                raise  # this request itself was cancelled
        if not joinable(target) or not is_retry_of(entry, intent, target):
            return None
        return target

    async def claim(self, key: bytes, intent: JoinIntent | None = None
                    ) -> Generation | asyncio.Future[Generation]:
        """The generation to join, or a reservation: this request runs it."""
        running = await self.find(key, intent)
        return running if running is not None else self.reserve(key, intent)

    def reserve(self, key: bytes, intent: JoinIntent | None = None
                ) -> asyncio.Future[Generation]:
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self.entry(key, future, intent)
        return future

    def entry(self, key: bytes, target: Generation | asyncio.Future[Generation],
              intent: JoinIntent | None = None) -> Entry:
        entry = Entry(target, intent.idempotency_key if intent is not None else None)
        self._running.setdefault(key, []).append(entry)
        return entry

    def add(self, key: bytes, generation: Generation,
            reservation: asyncio.Future[Generation] | None = None) -> None:
        entry = self._find_entry(key, reservation) if reservation is not None else None
        if entry is None:
            self.entry(key, generation)
        else:
            entry.target = generation
        if reservation is not None and not reservation.done():
            reservation.set_result(generation)

    def release(self, key: bytes, reservation: asyncio.Future[Generation]) -> None:
        """Planning failed: waiters plan for themselves."""
        self._drop(key, reservation)
        if not reservation.done():
            reservation.cancel()

    def remove(self, key: bytes, generation: Generation) -> None:
        self._drop(key, generation)

    def _find_entry(self, key: bytes, target: object) -> Entry | None:
        return next((e for e in self._running.get(key, ()) if e.target is target), None)

    def _drop(self, key: bytes, target: object) -> None:
        entries = self._running.get(key)
        if entries is None:
            return
        entries[:] = [e for e in entries if e.target is not target]
        if not entries:
            del self._running[key]

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._running.values())
