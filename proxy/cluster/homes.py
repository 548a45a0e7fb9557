"""Which backend each session identity lives on, in Redis (the shared ``Homes``).

    home:<identity>       the backend label (expires after a day unused)
    homes:<backend>       sorted set: identity -> last use (Redis time); members used within
                          --live-session-s count towards the backend's occupancy

A new identity is assigned by one script, atomically across replicas: the first backend in
its rendezvous order whose live sessions are below its capacity, else the first one. Two
replicas placing two new sessions at once therefore never both take a backend's last room.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefixpin.proxy.cluster.core import Cluster

HOME_TTL_S = 24 * 3600

# KEYS[1] home key. ARGV: identity, live window s, ttl s, then label, capacity pairs.
_ASSIGN = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local chosen = nil
local prefix = ARGV[4]
for i = 5, #ARGV, 2 do
  local homes = prefix .. ARGV[i]
  redis.call('ZREMRANGEBYSCORE', homes, '-inf', now - tonumber(ARGV[2]))
  if not chosen and redis.call('ZCARD', homes) < tonumber(ARGV[i + 1]) then
    chosen = ARGV[i]
  end
end
if not chosen then chosen = ARGV[5] end
local old = redis.call('GET', KEYS[1])
if old and old ~= chosen then redis.call('ZREM', prefix .. old, ARGV[1]) end
redis.call('SET', KEYS[1], chosen, 'EX', ARGV[3])
redis.call('ZADD', prefix .. chosen, now, ARGV[1])
return chosen
"""

# KEYS[1] home key. ARGV: identity, label, ttl, homes prefix.
_TOUCH = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
redis.call('ZADD', ARGV[4] .. ARGV[2], now, ARGV[1])
return 1
"""

# ARGV: live window s, homes prefix, then labels. Live sessions per label.
_COUNTS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local out = {}
for i = 3, #ARGV do
  out[#out + 1] = redis.call('ZCOUNT', ARGV[2] .. ARGV[i], now - tonumber(ARGV[1]), '+inf')
end
return out
"""


class RedisHomes:
    def __init__(self, cluster: Cluster, live_s: float) -> None:
        self.cluster = cluster
        self.live_s = live_s
        self._prefix = cluster.key("homes", "")
        self._assign = cluster.r.register_script(_ASSIGN)
        self._touch = cluster.r.register_script(_TOUCH)
        self._counts = cluster.r.register_script(_COUNTS)

    def _home(self, identity: str) -> str:
        return self.cluster.key("home", identity)

    async def get(self, identity: str) -> str | None:
        raw: Any = await self.cluster.r.get(self._home(identity))
        return raw.decode() if raw is not None else None

    async def assign(self, identity: str, ranked: Sequence[tuple[str, float]]) -> str:
        args: list[str | float] = [identity, self.live_s, HOME_TTL_S, self._prefix]
        for label, capacity in ranked:
            args += [label, capacity]
        chosen = await self._assign(keys=[self._home(identity)], args=args)
        return str(chosen.decode() if isinstance(chosen, bytes) else chosen)

    async def touch(self, identity: str, label: str) -> None:
        await self._touch(keys=[self._home(identity)],
                          args=[identity, label, HOME_TTL_S, self._prefix])

    async def counts(self, labels: Sequence[str]) -> dict[str, int]:
        if not labels:
            return {}
        values = await self._counts(keys=[], args=[self.live_s, self._prefix, *labels])
        return {label: int(v) for label, v in zip(labels, values, strict=True)}
