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
    def __init__(self) -> None:
        self._running: dict[bytes, Generation] = {}

    def find(self, key: bytes) -> Generation | None:
        generation = self._running.get(key)
        if generation is None or generation.finished:
            return None
        return generation

    def add(self, key: bytes, generation: Generation) -> None:
        self._running[key] = generation

    def remove(self, key: bytes, generation: Generation) -> None:
        if self._running.get(key) is generation:
            del self._running[key]

    def __len__(self) -> int:
        return len(self._running)
