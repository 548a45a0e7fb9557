"""Tenant isolation across an engine's shared prompt cache (issue 16).

llama-server's host prompt cache (``--cache-ram``, on by default) is shared by all slots: a
slot about to be overwritten is saved into one RAM cache that every slot loads from, so a
tenant sending a guess of another's system prompt reads ``cached_tokens`` and learns
whether the guess was right. Every Ollama shares cached prefixes across requests the same
way. ``cache_prompt: false`` on a slot that changes hands (``AffinityPlanner.on_lease``)
does not help there: the second tenant lands on a slot of its own.

So an engine whose cache crosses slots (``Lane.shared_cache``) serves one namespace: the
first one seen there owns it (in memory; with ``--redis`` a ``SET NX`` key every replica
reads), and the router refuses any other before planning, unless the lane is dedicated to
that namespace (``--upstreams-file ... namespace=``; namespaces listed together on one
backend are trusted with each other's prefixes) or ``--allow-shared-cache`` is given.

The refusal is a 403: the request is not allowed for this caller, and retrying changes
nothing until the operator changes the deployment. (A 409 would invite retries: OpenAI's
SDKs retry 409s.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from core.errors import ClientError

if TYPE_CHECKING:
    from proxy.cluster.core import Cluster

FIX = ("run llama-server with --cache-ram 0 (prefixpin's per-namespace parking then stands in "
       "for its host cache), or give this namespace its own backend (namespace= in the "
       "--upstreams-file), or start prefixpin with --allow-shared-cache (tenants may then "
       "learn each other's cached prefixes)")


class SharedPromptCacheError(ClientError):
    """A second namespace on an engine whose prompt cache crosses slots."""

    status_code = 403
    error_type = "permission_error"
    code = "shared_prompt_cache"


class NamespaceNotServedError(ClientError):
    """Every backend that serves the request's API is dedicated to other namespaces."""

    status_code = 403
    error_type = "permission_error"
    code = "namespace_not_served"


class ApiNotServedError(ClientError):
    """A route of a wire format no engine behind this port serves through the pipeline. It
    is not forwarded: an engine that answers it anyway (llama-server routes ``/api/chat`` to
    its chat handler) would serve it unpinned, past the shared-cache gate."""

    status_code = 404
    error_type = "invalid_request_error"
    code = "api_not_served"


def refusal(namespace: str, refused: list[tuple[str, str]]) -> SharedPromptCacheError:
    """``refused``: (label, why its cache is shared) of each lane another namespace owns."""
    where = "; ".join(f"{label}: {why}" for label, why in refused)
    return SharedPromptCacheError(
        f"namespace {namespace} refused: the engine's prompt cache is shared by all its "
        f"slots and already serves another namespace, so this one could learn that one's "
        f"cached prefixes ({where}). Fix: {FIX}")


class CacheOwners(Protocol):
    """Which namespace owns each shared-cache lane (the first one seen there)."""

    def known(self, label: str) -> str | None:
        """The owner as this process last saw it (no I/O; for views)."""
        ...

    async def owner(self, label: str) -> str | None: ...

    async def claim(self, label: str, namespace: str) -> str:
        """Own ``label`` for ``namespace`` unless another already does: the owner after."""
        ...


class MemoryOwners:
    def __init__(self) -> None:
        self._owners: dict[str, str] = {}

    def known(self, label: str) -> str | None:
        return self._owners.get(label)

    async def owner(self, label: str) -> str | None:
        return self._owners.get(label)

    async def claim(self, label: str, namespace: str) -> str:
        return self._owners.setdefault(label, namespace)


class RedisOwners:
    """``{prefix}:cache-owner:{label}``, set once (``SET NX``, no expiry): replicas agree
    on the owner. An owner never changes, so each replica keeps the ones it has read."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._seen: dict[str, str] = {}

    def known(self, label: str) -> str | None:
        return self._seen.get(label)

    async def owner(self, label: str) -> str | None:
        if (seen := self._seen.get(label)) is not None:
            return seen
        value = await self.cluster.r.get(self.cluster.key("cache-owner", label))
        if value is None:
            return None
        owner = value.decode() if isinstance(value, bytes) else str(value)
        self._seen[label] = owner
        return owner

    async def claim(self, label: str, namespace: str) -> str:
        if (seen := self._seen.get(label)) is not None:
            return seen
        key = self.cluster.key("cache-owner", label)
        if not await self.cluster.r.set(key, namespace, nx=True):
            current = await self.owner(label)
            if current is not None:
                return current
            await self.cluster.r.set(key, namespace, nx=True)  # deleted by hand meanwhile
            return await self.owner(label) or namespace
        self._seen[label] = namespace
        return namespace
