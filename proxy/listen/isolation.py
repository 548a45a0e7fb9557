"""Tenant isolation across an engine's shared prompt cache.

llama-server's host prompt cache (``--cache-ram``, on by default) is shared by all slots: a
slot about to be overwritten is saved into one RAM cache that every slot loads from, so a
tenant sending a guess of another's system prompt reads ``cached_tokens`` and learns
whether the guess was right. Every Ollama shares cached prefixes across requests the same
way. ``cache_prompt: false`` on a slot that changes hands (``AffinityPlanner.on_lease``)
does not help there: the second tenant lands on a slot of its own.

With no tenants configured (``proxy.listen.tenants``) there is one namespace and nothing to
isolate. With several tenants configured, an engine whose cache crosses slots
(``Lane.shared_cache``) serves only the tenants the operator dedicated it to
(``--upstreams-file ... namespace=``; tenants listed together on one backend are trusted
with each other's prefixes), or every tenant with ``--allow-shared-cache``; otherwise none,
and the router refuses the request before planning. No tenant claims such an engine by
arriving first: one that did could keep every other tenant off it for as long as it
sends requests, and handing it over would leave the first tenant's prefixes in the
engine's cache for the next to read.

The refusal is a 403: the request is not allowed for this caller, and retrying changes
nothing until the operator changes the deployment. (A 409 would invite retries: OpenAI's
SDKs retry 409s.)
"""

from __future__ import annotations

from prefixpin.core.errors import ClientError

FIX = ("run llama-server with --cache-ram 0 (prefixpin's per-tenant parking then stands in "
       "for its host cache), or dedicate the backend to this tenant (namespace= in the "
       "--upstreams-file), or start prefixpin with --allow-shared-cache (tenants may then "
       "learn each other's cached prefixes)")


class SharedPromptCacheError(ClientError):
    """A tenant, among several, on an engine whose prompt cache crosses slots."""

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
    """``refused``: (label, why its cache is shared) of each lane the tenant may not use."""
    where = "; ".join(f"{label}: {why}" for label, why in refused)
    return SharedPromptCacheError(
        f"tenant {namespace} refused: the engine's prompt cache is shared by all its slots "
        f"and several tenants are configured, so each could learn the others' cached "
        f"prefixes there ({where}). Fix: {FIX}")
