"""The Redis connection every shared store uses, key names, and replica liveness.

Each replica has a name (``--replica-id``, default random) and writes a heartbeat into one
sorted set every second, timed by Redis's own clock (``TIME``: replicas on different hosts
need no synchronised clocks). A replica whose heartbeat is older than ``REPLICA_TTL_S`` is
dead: its slot locks may be taken over and a generation it was running is not waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import Any

import redis
import redis.asyncio as aioredis

from prefixpin.proxy.ops.logs import log_event

HEARTBEAT_S = 1.0
REPLICA_TTL_S = 3.0  # no heartbeat for this long: the replica is gone

# KEYS[1] the replicas set; ARGV: replica, ttl seconds. Returns the live replicas.
_HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - 3600)
return redis.call('ZRANGEBYSCORE', KEYS[1], now - tonumber(ARGV[2]), '+inf')
"""

# KEYS[1] the replicas set; ARGV: replica, ttl seconds. 1 when its heartbeat is recent.
_ALIVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local at = redis.call('ZSCORE', KEYS[1], ARGV[1])
if at and tonumber(at) >= now - tonumber(ARGV[2]) then return 1 end
return 0
"""

# Compare-and-delete / compare-and-expire: only the owner of a value may drop or extend it.
_DELETE_IF = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_EXPIRE_IF = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


class Cluster:
    """One replica's view of the shared state: async client for the request path, a sync one
    for the few writes made from synchronous commit hooks (see ``sessions``)."""

    def __init__(self, url: str, prefix: str, replica_id: str | None,
                 logger: logging.Logger) -> None:
        self.url = url
        self.prefix = prefix
        self.replica = replica_id or f"r-{secrets.token_hex(4)}"
        self.log = logger
        self.r: aioredis.Redis = aioredis.Redis.from_url(url, health_check_interval=30)
        self.sync: redis.Redis = redis.Redis.from_url(url)
        self._live: set[str] = {self.replica}
        self._heartbeat = self.r.register_script(_HEARTBEAT)
        self._alive = self.r.register_script(_ALIVE)
        self.delete_if = self.r.register_script(_DELETE_IF)
        self.expire_if = self.r.register_script(_EXPIRE_IF)
        self._task: asyncio.Task[None] | None = None
        # What a lost or refusing Redis raises (the boundary turns them into a 503).
        self.errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)

    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    async def start(self) -> None:
        """Check the connection and announce this replica (raises when Redis is down)."""
        await self.beat()
        self._task = asyncio.create_task(self._beat_forever(), name="prefixpin-heartbeat")
        log_event(self.log, logging.INFO, "redis on", url=_redacted(self.url),
                  replica=self.replica, prefix=self.prefix, live_replicas=sorted(self._live))

    async def beat(self) -> None:
        live = await self._heartbeat(keys=[self.key("replicas")],
                                     args=[self.replica, REPLICA_TTL_S])
        self._live = {_text(r) for r in live} | {self.replica}

    def alive(self, replica: str) -> bool:
        """Whether ``replica`` sent a heartbeat lately, as of this replica's last beat (a
        replica started since is not known yet: see ``is_alive``)."""
        return replica in self._live

    async def is_alive(self, replica: str) -> bool:
        """Asked of Redis now: whether ``replica`` sent a heartbeat lately. Used before
        acting on a replica's death (taking over its locks, dropping its claims)."""
        if replica in self._live:
            return True
        return bool(await self._alive(keys=[self.key("replicas")],
                                      args=[replica, REPLICA_TTL_S]))

    def token(self) -> str:
        """A value naming this replica, unique per use: locks and claims hold one."""
        return f"{self.replica}/{secrets.token_hex(6)}"

    @staticmethod
    def owner_of(token: bytes | str) -> str:
        return _text(token).split("/", 1)[0]

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        with contextlib.suppress(redis.RedisError, OSError):
            await self.r.zrem(self.key("replicas"), self.replica)
        await self.r.aclose()
        self.sync.close()

    async def _beat_forever(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self.beat()
                if failing:
                    log_event(self.log, logging.INFO, "redis reachable again")
                failing = False
            except (redis.RedisError, OSError) as exc:
                if not failing:
                    log_event(self.log, logging.WARNING, "redis unreachable", error=str(exc))
                failing = True


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _redacted(url: str) -> str:
    """The URL without a password, for the log."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return scheme + sep + rest
