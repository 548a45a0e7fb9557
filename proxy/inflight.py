"""Join in flight: a request identical to one already running attaches to its generation.

The loop this breaks: nothing reaches a client during a long prefill, it times out and
resends the identical request, which would queue behind the original and prefill again.
Identical means same namespace, same endpoint and same body once the fields that only
shape one client's view are set aside (``stream``, ``stream_options``,
``return_progress``): a streaming and a non-streaming client can share one generation.
A generation whose clients all left keeps running for ``--retry-grace`` seconds, so a
resend that arrives meanwhile joins it too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import blake3

from proxy.generation import Generation
from proxy.history import canonical_bytes

VIEW_FIELDS = frozenset({"stream", "stream_options", "return_progress"})


def inflight_key(namespace: str, endpoint: str, body: Mapping[str, Any]) -> bytes:
    shared = {k: v for k, v in body.items() if k not in VIEW_FIELDS}
    hasher = blake3.blake3(f"{namespace}\0{endpoint}\0".encode())
    hasher.update(canonical_bytes(shared))
    return hasher.digest()


class InFlight:
    """Running generations by key, and reservations for those still being planned.

    A key is reserved *before* the request is planned (planning awaits: fingerprints run in
    a thread, parked sessions are restored), so identical requests that arrive together
    wait for the first one's generation instead of each starting their own.
    """

    def __init__(self) -> None:
        self._running: dict[bytes, Generation | asyncio.Future[Generation]] = {}

    async def find(self, key: bytes) -> Generation | None:
        entry = self._running.get(key)
        if isinstance(entry, asyncio.Future):
            reservation = entry
            try:
                entry = await asyncio.shield(reservation)
            except asyncio.CancelledError:
                if reservation.cancelled():
                    return None  # the first request failed to plan: plan this one anew
                raise  # this request itself was cancelled
        if entry is None or entry.finished:
            return None
        return entry

    async def claim(self, key: bytes) -> Generation | asyncio.Future[Generation]:
        """The generation to join, or a reservation: this request runs it."""
        running = await self.find(key)
        return running if running is not None else self.reserve(key)

    def reserve(self, key: bytes) -> asyncio.Future[Generation]:
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._running[key] = future
        return future

    def add(self, key: bytes, generation: Generation,
            reservation: asyncio.Future[Generation] | None = None) -> None:
        self._running[key] = generation
        if reservation is not None and not reservation.done():
            reservation.set_result(generation)

    def release(self, key: bytes, reservation: asyncio.Future[Generation]) -> None:
        """Planning failed: waiters plan for themselves."""
        if self._running.get(key) is reservation:
            del self._running[key]
        if not reservation.done():
            reservation.cancel()

    def remove(self, key: bytes, generation: Generation) -> None:
        if self._running.get(key) is generation:
            del self._running[key]

    def __len__(self) -> int:
        return len(self._running)
