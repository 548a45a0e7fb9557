"""Watch the engine: a restart (new process start time, or a different slot count) empties
every slot, so the proxy forgets what it believed the slots held and says so.

The engine is probed every ``--health-interval`` seconds, and at once when a request loses
its connection to it (``suspect``): a killed engine is seen within a probe, not an
interval. While a stream from the engine that opened within an interval of the last probe
stays open, the watch does not probe: a crash or a restart from then on closes that
stream, and its loss wakes the watch; one just before it is seen, as any restart is, by
the first probe after it (here once the stream ends). A turn that waits seconds on a long
prefill is where a probe would cost most: llama-server answers ``/metrics`` between two
batches, and each probe is wake-ups paid on the way to the turn's first token. So a probe
that falls due while a stream from the engine is still in its prefill is put off to a
later tick (the stream's tokens, or its end), for ``PUT_OFF_INTERVALS`` intervals at most.

An engine that stops answering makes every session *unverified* (the proxy can no longer
vouch for what the slots hold) until bytes decide again on its next request; an
engine that comes back with another start time has restarted, and the slot map is reset.
Every probe has a deadline (``PREFIXPIN_PROBE_TIMEOUT_S``): a hung engine never hangs the watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from prefixpin.adapters.base import Adapter, EngineInfo
from prefixpin.core.cpu import crash_advice
from prefixpin.core.errors import UpstreamError, UpstreamTimeoutError
from prefixpin.proxy.ops.logs import log_event
from prefixpin.proxy.ops.metrics import Metrics
from prefixpin.proxy.pipeline.records import Backend

RestartHook = Callable[[EngineInfo, EngineInfo], Awaitable[None]]
# When the oldest stream from the engine still open began (``time.monotonic``), or None.
OpenSince = Callable[[], float | None]
# When the oldest stream from the engine that has its answer's head and no output yet (a
# prefill) got that head, or None.
PrefillSince = Callable[[], float | None]
LostHook = Callable[[str], None]  # called with the reason, once per loss

# A probe is put off by a prefill for this many intervals at most: a prefill of minutes (a
# long prompt on a CPU) still sees a probe now and then.
PUT_OFF_INTERVALS = 6


def restarted(before: EngineInfo, after: EngineInfo) -> bool:
    known = before.start_time is not None and after.start_time is not None
    if known and before.start_time != after.start_time:
        return True
    return before.n_slots != after.n_slots or before.model != after.model


async def probe(adapter: Adapter, timeout_s: float) -> EngineInfo:
    """The engine's info, or an ``UpstreamError`` within ``timeout_s`` (a probe request is
    small; the long read timeout of generations must not apply to it)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await adapter.probe()
    except TimeoutError:
        raise UpstreamTimeoutError(f"engine probe got no answer within {timeout_s:g} s "
                                   "(PREFIXPIN_PROBE_TIMEOUT_S)") from None


async def probe_until_ready(backend: Backend, metrics: Metrics, timeout_s: float,
                            logger: logging.Logger,
                            on_failure: Callable[[], Awaitable[None] | None]) -> EngineInfo:
    """Probe the backend's engine every 2 s until it answers (``on_failure`` after each
    miss); its info is then the backend's, and the up gauge and the log say so."""
    while True:
        try:
            backend.info = await probe(backend.adapter, timeout_s)
            break
        except UpstreamError as exc:
            metrics.upstream_up.labels(backend.label).set(0)
            log_event(logger, logging.WARNING, "upstream not ready", upstream=backend.label,
                      error=exc.message)
            if (pending := on_failure()) is not None:
                await pending
            await asyncio.sleep(2.0)
    metrics.upstream_up.labels(backend.label).set(1)
    info = backend.info
    log_event(logger, logging.INFO, "upstream ready", upstream=backend.label,
              engine=info.engine, model=info.model, slots=info.n_slots,
              n_ctx_slot=info.n_ctx_slot, build=info.build)
    return info


class EngineWatch:
    """Built with its lane, before the engine first answers: requests that lose the engine
    wake it (``suspect``), and the policies switched on later add their hooks."""

    def __init__(self, backend: Backend, metrics: Metrics, *, interval_s: float,
                 probe_timeout_s: float, logger: logging.Logger,
                 on_restart: list[RestartHook] | None = None,
                 on_lost: list[LostHook] | None = None,
                 streaming_since: OpenSince = lambda: None,
                 prefilling_since: PrefillSince = lambda: None) -> None:
        self.backend = backend
        self.metrics = metrics
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s
        self.log = logger
        self.on_restart = on_restart or []
        self.on_lost = on_lost or []
        self.reachable = True
        self.down_since: str | None = None  # UTC, ISO 8601: when it stopped answering
        self.suspected = False  # a request lost the engine; the probe has not answered yet
        self._wake = asyncio.Event()
        self._streaming_since = streaming_since
        self._prefilling_since = prefilling_since
        self._probed_at = time.monotonic()  # when the last probe began

    def suspect(self) -> None:
        """A request lost its engine connection: probe now rather than at the next tick."""
        self.suspected = True
        self._wake.set()

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s):
                    await self._wake.wait()
            if self._wake.is_set():
                self._wake.clear()
                await self.check()
            elif not self.vouched_by_a_stream() and not self.put_off_by_a_prefill():
                await self.check()

    def vouched_by_a_stream(self) -> bool:
        """A stream from the engine that opened within an interval of the last probe is
        still open."""
        since = self._streaming_since()
        return (since is not None and since <= self._probed_at + self.interval_s
                and self.reachable)

    def put_off_by_a_prefill(self) -> bool:
        """A stream from the engine is in a prefill that began recently enough for a due
        probe to wait for a later tick."""
        since = self._prefilling_since()
        return (since is not None
                and time.monotonic() < since + self.interval_s * PUT_OFF_INTERVALS)

    async def check(self) -> EngineInfo | UpstreamError:
        """Probe now: the engine's info, or the error it failed with (a loss or a restart
        runs the hooks, whoever asked: the watch's own tick or a health check)."""
        try:
            return await self._check()
        finally:
            self.suspected = False

    async def _check(self) -> EngineInfo | UpstreamError:
        backend, metrics = self.backend, self.metrics
        self._probed_at = time.monotonic()
        try:
            info = await probe(backend.adapter, self.probe_timeout_s)
        except UpstreamError as exc:
            metrics.upstream_up.labels(backend.label).set(0)
            log_event(self.log, logging.WARNING, "upstream unreachable", upstream=backend.label,
                      error=exc.message, fault=backend.adapter.fault())
            if self.reachable:
                self.reachable = False
                self.down_since = datetime.now(UTC).isoformat(timespec="seconds")
                log_event(self.log, logging.ERROR, "upstream lost", upstream=backend.label,
                          error=exc.message, hint=crash_advice())
                for lost in self.on_lost:
                    lost(f"engine unreachable ({exc.message})")
            return exc
        metrics.upstream_up.labels(backend.label).set(1)
        self.reachable, self.down_since = True, None
        before, backend.info = backend.info, info
        if before is None or not restarted(before, info):
            return info
        log_event(self.log, logging.WARNING, "engine restarted", upstream=backend.label,
                  start_time=info.start_time, slots=info.n_slots)
        for hook in self.on_restart:
            await hook(before, info)
        return info
