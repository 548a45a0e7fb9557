"""Watch the engine: a restart (new process start time, or a different slot count) empties
every slot, so the proxy forgets what it believed the slots held and says so."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from adapters.base import EngineInfo
from proxy.errors import UpstreamError
from proxy.logs import log_event
from proxy.service import ProxyService

RestartHook = Callable[[EngineInfo, EngineInfo], Awaitable[None]]


def restarted(before: EngineInfo, after: EngineInfo) -> bool:
    known = before.start_time is not None and after.start_time is not None
    if known and before.start_time != after.start_time:
        return True
    return before.n_slots != after.n_slots or before.model != after.model


async def watch_engine(service: ProxyService, interval_s: float, logger: logging.Logger,
                       hooks: list[RestartHook]) -> None:
    backend = service.backend
    while True:
        await asyncio.sleep(interval_s)
        try:
            info = await backend.adapter.probe()
        except UpstreamError as exc:
            service.metrics.upstream_up.labels(backend.label).set(0)
            log_event(logger, logging.WARNING, "upstream unreachable", upstream=backend.label,
                      error=exc.message)
            continue
        service.metrics.upstream_up.labels(backend.label).set(1)
        before, backend.info = backend.info, info
        if before is None or not restarted(before, info):
            continue
        log_event(logger, logging.WARNING, "engine restarted", upstream=backend.label,
                  start_time=info.start_time, slots=info.n_slots)
        service.ledger.forget(backend.label)
        for hook in hooks:
            await hook(before, info)
