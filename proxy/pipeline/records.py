"""The records every stage reads: the engine a lane speaks to (``Backend``), a request as
the planners see it (``Incoming``), what to send and where (``Plan``), how it went
(``Outcome``), the planner's seam (``Planner``) and what placement weighs (``Load``).
A leaf: it imports nothing that runs a request."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from prefixpin.proxy.session.identity import explicit_identity

if TYPE_CHECKING:  # the records name what the stages hold; importing them runs none
    from prefixpin.adapters.base import Adapter, EngineInfo
    from prefixpin.core.figures import Figures
    from prefixpin.proxy.codecs import Codec
    from prefixpin.proxy.pipeline.validation import ClientRequest
    from prefixpin.proxy.session.history import DigestMemo, Shape
    from prefixpin.proxy.session.identity import ExplicitIdentity
    from prefixpin.proxy.session.implicit import PendingChain
    from prefixpin.proxy.session.placement import Lease, Want
    from prefixpin.proxy.session.repair import Applied

# For an engine that reports no cached count (Ollama before 0.33.3): a function from the
# request's figures to the planner's estimate. An estimate goes to the metrics labelled
# source="estimated" and to the log, never to a client.
CachedEstimate: TypeAlias = "Callable[[Figures], int]"


@dataclass(slots=True)
class Backend:
    label: str
    adapter: Adapter
    info: EngineInfo | None = None
    # Configured tenants: a client's own credentials never reach the engine, and its
    # requests carry the engine's key (None: none); unset, the client's go as they came.
    engine_credentials: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True)
class Incoming:
    """A request as every planner sees it: parsed once (by the router), with its headers,
    its tenant namespace and, when the router weighed several lanes, why it chose this one."""

    client: ClientRequest
    codec: Codec  # its wire format's (the route's): parses, answers, and keys the join
    headers: Mapping[str, str]
    namespace: str
    # The session the request names (``proxy.session.identity``), read once for the whole path
    # (the in-flight key, the planner).
    identity: ExplicitIdentity | None
    # The digests of the body's messages (``proxy.session.history.digest``), computed once: the
    # in-flight key, the planner's bytes-decide and the commit all read them.
    digests: list[bytes] = field(compare=False)
    placement: str | None = None  # the router's reason, when it chose among lanes
    moved: bool = False  # the session's home lane was down or overloaded: it moved

    @classmethod
    def of(cls, client: ClientRequest, codec: Codec, headers: Mapping[str, str],
           namespace: str, placement: str | None = None, moved: bool = False, *,
           memo: DigestMemo) -> Incoming:
        """The request with what every planner reads of it computed once (its messages'
        digests through ``memo``: those of the history it resends are known)."""
        return cls(client, codec, headers, namespace, explicit_identity(client.body, headers),
                   _message_digests(client.body, memo), placement, moved)


@dataclass(slots=True)
class Plan:
    """What to send and where: the (possibly rewritten) body, and the slot it needs; and,
    typed, everything the pipeline reads back at commit."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    session: str | None = None
    want: Want | None = None  # a slot lease to take first; None lets the engine choose
    slot: int | None = None  # the slot the request ran in, once known
    # The log line's free-form fields (why, where from): nothing reads them back.
    notes: dict[str, Any] = field(default_factory=dict)
    # the request's fingerprint chain, committed with the turn (computed then, if the
    # planner needed none)
    chain: PendingChain | None = None
    digests: Sequence[bytes] | None = None  # digests of the forwarded messages
    shape: Shape | None = None  # shape_digest of the forwarded body, when known
    repairs: tuple[Applied, ...] = ()  # the repair policies that rewrote the body
    cached_estimate: CachedEstimate | None = None  # engines that report no cached count
    engine_resumed: bool = False  # the engine is believed to hold the session's prompt
    lane: str | None = None  # the backend (lane label) the request goes to
    # What the planner decided (resumed, rewound, new, declined, ...; None: no planner
    # decides), and whether the slot is read from cache at all: why a prefix broke.
    decision: str | None = None
    cache_blocked: bool = False
    final: bool = False  # the client ends the session with this request
    tier: str | None = None  # which identity tier named the session (header, chain, ...)
    park: str | None = None  # the parked session's restore into the slot: its outcome
    opening: str | None = None  # the namespace's opening seeded into the slot: its outcome

    def log_fields(self) -> dict[str, Any]:
        """The decision's fields for the request's log line, typed first, then the notes."""
        fields: dict[str, Any] = {"tier": self.tier, "decision": self.decision,
                                  **self.notes}
        for name, value in (("park", self.park), ("opening", self.opening)):
            if value is not None:
                fields[name] = value
        if self.final:
            fields["final"] = True
        return fields


@dataclass(frozen=True, slots=True)
class Outcome:
    ok: bool
    figures: Figures
    ttft_ms: float | None
    reply: Mapping[str, Any] | None = None  # the assistant message returned (chat)


class Planner(Protocol):
    async def plan(self, incoming: Incoming, backend: Backend) -> Plan: ...

    async def on_lease(self, plan: Plan, lease: Lease) -> None:
        """Called when the plan's slot lease is granted, before the request is sent (a
        parked session is restored into the slot here)."""

    def commit(self, plan: Plan, outcome: Outcome) -> None: ...


@dataclass(frozen=True, slots=True)
class Load:
    """What placement weighs: slots, those leased now, requests waiting for one."""

    slots: int
    busy: int
    queued: int


def _message_digests(body: Mapping[str, Any], memo: DigestMemo) -> list[bytes]:
    """The digest of each of the body's ``messages`` (none when it has none, or holds
    something that is not a list of them: left for the planner to judge, as ever)."""
    try:
        return memo.digests(body.get("messages") or [])
    except TypeError:  # not iterable (a completions body's stray "messages": 5)
        return []
