"""The planner of a lane whose state replicas share (``--redis``): it reads the session
table before planning and writes it back at commit, around the lane's own planner."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from prefixpin.core.errors import ProxyError
from prefixpin.proxy.pipeline.records import Backend, Incoming, Outcome, Plan, Planner
from prefixpin.proxy.session.identity import explicit_identity
from prefixpin.proxy.session.placement import Lease

if TYPE_CHECKING:
    from prefixpin.proxy.cluster.sessions import SharedSessions


class SharedStateError(ProxyError):
    """Redis (the state replicas share) did not answer: the request is refused rather than
    decided on state this replica cannot check."""

    status_code = 503
    error_type = "server_busy"
    code = "shared_state_unavailable"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "2"}


class SharedStatePlanner:
    def __init__(self, inner: Planner, shared: SharedSessions,
                 refresh: Callable[[], Awaitable[None]] | None = None) -> None:
        self.inner = inner
        self.shared = shared
        self.store = shared.store
        self.refresh = refresh  # the slot table, as other replicas left it
        self.errors = shared.cluster.errors

    async def plan(self, incoming: Incoming, backend: Backend) -> Plan:
        try:
            explicit = explicit_identity(incoming.client.body, incoming.headers)
            await self.shared.hydrate(incoming.namespace, explicit.key if explicit else None)
            if self.refresh is not None:
                await self.refresh()
        except self.errors as exc:
            raise SharedStateError(f"shared state (Redis) unreachable: {exc}") from None
        return await self.inner.plan(incoming, backend)

    async def on_lease(self, plan: Plan, lease: Lease) -> None:
        await self.inner.on_lease(plan, lease)

    def commit(self, plan: Plan, outcome: Outcome) -> None:
        session = self.store.get(plan.session) if plan.session else None
        # What the planner releases on a final commit: every history under the key.
        ended = ([s.id for s in self.store.histories_of(session)]
                 if session is not None and outcome.ok and plan.final else None)
        self.inner.commit(plan, outcome)
        if session is not None and ended is not None:  # the planner released them
            self.shared.withdraw(session.namespace, session.key, ended)
        elif session is not None and outcome.ok:
            self.shared.publish(session)
