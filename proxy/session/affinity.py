"""Session affinity: identity nominates, bytes decide, and each session keeps its slot.

For each request (steps 2, 4, 5 and 6 of the request path):

1. tenant namespace and explicit session key (``proxy.session.identity``);
2. candidates: the histories under the key; without a key, the keyless sessions of the
   namespace whose fingerprint chain shares at least 3 leading segments with the request's
   (or, with no tokenizer, whose first 3 messages are byte-identical);
3. bytes decide (``proxy.session.history``): a candidate whose committed history the request
   extends (or repeats) is *resumed*; a key's history that the request rewrites after a
   shared prefix is *rewound* (an edited last message: the engine still reuses the prefix);
   otherwise the request starts a *new* history and the reason for every decline is kept;
4. placement (``proxy.session.placement``): a resumed or rewound session goes to the slot holding
   it; a new one to an empty slot, else the cheapest victim. A slot that changes hands
   between namespaces is never reused from cache (``cache_prompt: false``), so no tenant
   can learn anything from another's cached prefix;
5. parking (``proxy.parking``): the victim's history is saved before its slot is reused; a
   session that comes back to a slot not holding it is restored first when the request
   extends the parked history; a request no live session takes finds its parked history in
   the park index (after a proxy restart) and resumes from it;
6. a session's end (``x-dynamo-session-final``): once that request commits, every history
   under its key gives up its slot and its parked file and leaves the store (``_release``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from prefixpin.adapters.base import EngineInfo
from prefixpin.core.errors import ProxyError
from prefixpin.fingerprint import Chain, nominates, shared_leading
from prefixpin.proxy.ops.logs import log_event
from prefixpin.proxy.ops.metrics import Metrics
from prefixpin.proxy.parking import ParkManager
from prefixpin.proxy.parking.anchor import Anchorer
from prefixpin.proxy.parking.openings import Openings
from prefixpin.proxy.parking.renderings import counted
from prefixpin.proxy.parking.windows import LastRenderings, Render, Rendered, render_body
from prefixpin.proxy.pipeline.records import Backend, Incoming, Outcome, Plan
from prefixpin.proxy.pipeline.validation import ClientRequest
from prefixpin.proxy.session.history import Committed, Shape, Verdict, decide, digest, shape_digest
from prefixpin.proxy.session.identity import ExplicitIdentity
from prefixpin.proxy.session.implicit import Fingerprinter, PendingChain
from prefixpin.proxy.session.placement import Lease, SlotPool, Want
from prefixpin.proxy.session.repair import Applied, Repairer
from prefixpin.proxy.session.sessions import (
    NOMINATION_BAR,
    Kind,
    Session,
    SessionStore,
    TurnFigures,
)

Tier = Literal["explicit", "implicit", "none"]
DecisionOutcome = Literal["resumed", "rewound", "new"]
RENDERED_SESSIONS = 256  # sessions whose last rendered prompt is kept, least recent out



@dataclass(frozen=True, slots=True)
class Decision:
    tier: Tier
    outcome: DecisionOutcome
    session: Session
    verdict: Verdict | None  # for a new history: the best decline, if any candidate
    chain: PendingChain | None
    body: Mapping[str, Any] | None = None  # the body to forward, when repair changed it
    repairs: tuple[Applied, ...] = ()


@dataclass(frozen=True, slots=True)
class Match:
    """A candidate's verdict, and the body it holds for (repaired or as it came)."""

    verdict: Verdict
    body: Mapping[str, Any]
    repairs: tuple[Applied, ...] = ()
    cut_moved: bool = False


class AffinityPlanner:
    def __init__(self, store: SessionStore, pool: SlotPool, metrics: Metrics,
                 fingerprinter: Fingerprinter | None, logger: logging.Logger,
                 repairer: Repairer | None = None, budget_tokens: int | None = None,
                 parking: ParkManager | None = None,
                 anchorer: Anchorer | None = None, openings: Openings | None = None) -> None:
        self.store = store
        self.pool = pool
        self.metrics = metrics
        self.fingerprinter = fingerprinter
        self.log = logger
        self.repairer = repairer
        self.budget_tokens = budget_tokens
        self.parking = parking
        self.anchorer = anchorer  # anchors idle slots after a turn when parking is off
        self.openings = openings  # a new session's slot starts from its namespace's opening
        # Each session's last rendered prompt, for the next comparison (``_rendered_extends``)
        self._renderings: LastRenderings[Rendered] = LastRenderings(RENDERED_SESSIONS)

    async def plan(self, incoming: Incoming, backend: Backend) -> Plan:
        client, namespace = incoming.client, incoming.namespace
        identity = incoming.identity
        digests = incoming.digests
        if not digests and client.body.get("messages"):  # not a list of messages: as ever,
            digests = [digest(m) for m in client.body["messages"]]  # refused here (500)
        planned = planned_body(client.path, client.body)
        shape = shape_digest(planned)  # once, for every candidate and the commit
        decision = await self._decide(client, namespace, identity, backend, digests, planned,
                                      shape)
        session = decision.session
        session.api = client.api
        self._observe(decision, backend.label)
        # An infill request is planned by its identity (``planned_body``) and forwarded as
        # it came: no repair rewrites a raw prompt.
        body = dict(decision.body if decision.body is not None and client.path != INFILL_PATH
                    else client.body)
        as_planned = decision.body is None or decision.body is planned
        preferred = self.pool.holder_of(session.id)
        notes: dict[str, Any] = {"reason": session.last_reason, "kind": session.kind,
                                 "namespace": namespace}
        if session.key is not None:
            notes["key"] = session.key
        plan = Plan(path=client.path, body=body, session=session.id, notes=notes,
                    want=Want(session.id, session.kind, preferred, session.prompt_tokens),
                    chain=decision.chain, repairs=decision.repairs, lane=backend.label,
                    decision=session.last_decision, tier=decision.tier,
                    final=identity is not None and identity.final,
                    # the body as planned (not rewritten by repair): the request's own
                    # digests and shape
                    digests=(digests if as_planned
                             else _digests_of(body, client.body, digests, session)),
                    shape=shape if as_planned else None)
        if incoming.placement is not None:
            notes["placement"] = incoming.placement
            if incoming.moved:
                session.last_reason = f"{session.last_reason}; {incoming.placement}"
                notes["reason"] = session.last_reason
        if decision.repairs:
            notes["repairs"] = [r.line() for r in decision.repairs]
        return plan

    async def on_lease(self, plan: Plan, lease: Lease) -> None:
        """A slot that last held another tenant's history, or one the proxy knows nothing
        about (it restarted), is never read from cache: no tenant learns anything from
        another's cached prefix, not even its length."""
        session = self.store.get(plan.session) if plan.session else None
        if session is None:
            return
        blocked = None
        if lease.eviction is not None:
            self.metrics.slot_evictions.labels(plan.lane or "",
                                               lease.eviction.reason).inc()
            previous = self.store.get(lease.eviction.session_id)
            if previous is None or previous.namespace != session.namespace:
                blocked = "blocked: slot held another namespace"
            if previous is not None:
                previous.slot = None
        elif not self.pool.known(lease.slot):
            blocked = "blocked: slot contents unknown"
        self.pool.mark_known(lease.slot)
        if self.parking is not None and not lease.resident:
            restored = await self.parking.restore(session, planned_body(plan.path, plan.body),
                                                  lease.slot)
            if restored is not None:
                plan.park = restored.note
                if restored.ok:
                    blocked = None  # the slot now holds this session's own history only
            if (self.openings is not None and session.committed is None
                    and plan.path != INFILL_PATH and (restored is None or not restored.ok)):
                seeded = await self.openings.seed(session.namespace, session.id, plan.body,
                                                  lease.slot, blocked=blocked is not None)
                if seeded is not None:
                    plan.opening = seeded.note
                    blocked = None  # the slot holds this namespace's opening only
        if blocked is not None:
            plan.body["cache_prompt"] = False
            plan.notes["cache"] = blocked
            plan.cache_blocked = True

    async def engine_restarted(self, before: EngineInfo, after: EngineInfo) -> None:
        """Every slot is empty now: no session is in a slot until bytes decide again."""
        if after.n_slots != len(self.pool.entries):
            self.pool.resize(after.n_slots)
        self.pool.reset()
        for session in self.store:
            session.slot = None
            session.last_decision = "unverified"
            session.last_reason = "engine restarted"
        if self.parking is not None:  # parked files outlive the engine: restored from disk
            await self.parking.engine_restarted(before, after)

    def commit(self, plan: Plan, outcome: Outcome) -> None:
        session = self.store.get(plan.session) if plan.session else None
        if session is None:
            return
        figures = outcome.figures
        session.turns.append(TurnFigures(time.time(), session.last_decision,
                                         figures.prompt_tokens, figures.cached_tokens,
                                         outcome.ttft_ms, figures.prompt_ms))
        self.metrics.sessions.set(len(self.store))
        if not outcome.ok:
            return
        body = plan.body
        session.committed = (Committed.of_chat(body, plan.digests, plan.shape,
                                               previous=session.committed)
                             if "messages" in body
                             else Committed.of_completion(planned_body(plan.path, body),
                                                          plan.shape))
        if plan.chain is not None:  # computed now, if planning needed none (PendingChain)
            session.chain = plan.chain.now()
        if outcome.reply is not None:
            session.repair.remember_reply(outcome.reply)
        session.prompt_tokens = figures.prompt_tokens or 0
        session.slot = plan.slot
        session.backend = plan.lane
        self.store.touch(session)
        if self.parking is not None:
            self.parking.touch(session.id)
        if plan.final:  # the commit releases the session
            self._release(session)
        elif plan.slot is not None:
            held = (figures.prompt_tokens or 0) + max(0, (figures.completion_tokens or 0) - 1)
            self.pool.record_tokens(plan.slot, session.id, held)
            if self.anchorer is not None:
                self.anchorer.turn_committed(plan.slot, session.id, held)
            if self.parking is not None:
                self.parking.park_ahead(self.pool, plan.slot, session.id)
            elif self.anchorer is not None:
                self.anchorer.after_turn(self.pool, plan.slot, session.id)
        self.metrics.slots_occupied.labels(plan.lane or "").set(
            self.pool.occupied)

    def _release(self, session: Session) -> None:
        """The client ended the session (``x-dynamo-session-final``) and its turn committed:
        every history under its key lets go of its slot (the slot is an empty one to
        placement, its contents unknown: nobody reads them from cache) and of its parked
        file, and leaves the store."""
        ended = self.store.histories_of(session)
        for history in ended:
            self.pool.release(history.id)
            if self.parking is not None:
                self.parking.forget(history.id)
            history.slot = None
            self.store.remove(history)
        self.metrics.sessions.set(len(self.store))
        log_event(self.log, logging.INFO, "session ended", session=session.id,
                  key=session.key, histories=len(ended), reason="final")

    async def _decide(self, client: ClientRequest, namespace: str,
                      identity: ExplicitIdentity | None, backend: Backend,
                      digests: Sequence[bytes], body: Mapping[str, Any],
                      shape: Shape) -> Decision:
        """``body``: the body as planned (``planned_body``), ``shape`` its shape digest."""
        # A named session is found by its key alone (it never matches an unnamed one, nor
        # the reverse): only a request without a key needs its fingerprint.
        if identity is not None:
            found = await self._first_taker(self.store.with_key(namespace, identity.key),
                                            "explicit", body, digests, backend, shape, None)
            return found if isinstance(found, Decision) else self._declined(
                namespace, identity, client, "explicit", body, digests, shape, None, found)
        pending = await self._pending_chain(client, namespace, digests)
        prompt = body.get("prompt")
        # The histories the request repeats byte for byte come first and need no chain: a
        # follow-up one of them takes has its chain computed at the commit, after the answer.
        exact = ranked(self.store.nominees(namespace, digests=digests, chain=None,
                                           prompt=isinstance(prompt, str)),
                       None, digests, prompt)
        found = await self._first_taker(exact, "implicit", body, digests, backend, shape,
                                        pending)
        if isinstance(found, Decision):
            return found
        chain = await pending.result() if pending is not None else None
        fuzzy = [s for s in self._nominated(namespace, chain, digests, prompt)
                 if s not in exact] if chain is not None else []
        found = await self._first_taker(fuzzy, "implicit", body, digests, backend, shape,
                                        pending, found)
        if isinstance(found, Decision):
            return found
        return self._declined(namespace, identity, client,
                              "implicit" if exact or fuzzy else "none", body, digests, shape,
                              pending, found)

    async def _first_taker(self, candidates: Sequence[Session], tier: Tier,
                           body: Mapping[str, Any], digests: Sequence[bytes], backend: Backend,
                           shape: Shape, chain: PendingChain | None,
                           best_decline: tuple[Session, Match] | None = None
                           ) -> Decision | tuple[Session, Match] | None:
        """The first candidate, in order, that takes the request (resumed, or rewound where
        the budget cut point moved); else the best decline, among ``best_decline``'s."""
        for candidate in candidates:
            if candidate.committed is None:
                continue
            match = await self._match(candidate, body, digests, backend, shape)
            if match.verdict.resumable:
                return self._resume(candidate, tier, match, chain)
            if match.cut_moved:
                return self._rewind(candidate, match, tier, chain,
                                    "the budget cut point moved")
            if best_decline is None or (match.verdict.index or 0) > (
                    best_decline[1].verdict.index or 0):
                best_decline = (candidate, match)
        return best_decline

    def _declined(self, namespace: str, identity: ExplicitIdentity | None,
                  client: ClientRequest, tier: Tier, body: Mapping[str, Any],
                  digests: Sequence[bytes], shape: Shape, chain: PendingChain | None,
                  best_decline: tuple[Session, Match] | None) -> Decision:
        """No candidate took the request: a key's history it shares a prefix with is
        rewound, a parked history revived, else a new session starts."""
        if best_decline is not None and tier == "explicit" and (
                best_decline[1].verdict.index or 0) >= 1:
            return self._rewind(*best_decline, tier, chain, "the engine reuses the shared prefix")
        if (revived := self._revive(namespace, identity, body, digests, chain,
                                    shape)) is not None:
            return revived
        session = self._new(namespace, identity, client, tier)
        if best_decline is None:
            session.last_decision, session.last_reason = "new", "no candidate"
            return Decision(tier, "new", session, None, chain)
        declined, match = best_decline
        session.last_decision = "declined"
        session.last_reason = f"declined {declined.id}: {match.verdict.reason()}"
        return Decision(tier, "new", session, match.verdict, chain)

    def _revive(self, namespace: str, identity: ExplicitIdentity | None,
                body: Mapping[str, Any], digests: Sequence[bytes],
                chain: PendingChain | None, shape: Shape | None = None) -> Decision | None:
        """No live session takes the request: a parked history may (the proxy restarted, or
        the store forgot the session). Same namespace, same key or none, and the request
        repeats its committed messages exactly: bytes decide here too."""
        if self.parking is None:
            return None
        record = self.parking.lookup(namespace, identity.key if identity else None, body,
                                     digests)
        if record is None:
            return None
        session = self.store.create(namespace, record.key, record.kind,
                                    identity.parent if identity else None)
        session.committed = record.committed
        self.store.reindex(session)
        session.prompt_tokens = record.prompt_tokens
        self.parking.revived(session, record)
        verdict = decide(record.committed, body, digests, shape)
        session.last_decision = "resumed"
        session.last_reason = f"{verdict.reason()} (parked history, from the park index)"
        return Decision("explicit" if identity else "implicit", "resumed", session, verdict,
                        chain)

    async def _match(self, session: Session, body: Mapping[str, Any],
                     digests: Sequence[bytes], backend: Backend,
                     shape: Shape | None = None) -> Match:
        """Bytes decide, after repair: the incoming body as it came, else repaired back to
        the session's committed history, else (templates that drop what the client
        rewrote) the rendered prompts compared."""
        committed = session.committed
        assert committed is not None
        plain = decide(committed, body, digests, shape)
        if plain.resumable or self.repairer is None or committed.prompt is not None:
            return Match(plain, body)
        memory = session.repair
        repaired = self.repairer.repair(committed.messages, committed.body or {}, body, memory,
                                        self.budget_tokens)
        verdict = decide(committed, repaired.body) if repaired.changed else plain
        if verdict.resumable or repaired.cut_moved:
            return Match(verdict, repaired.body, tuple(repaired.applied), repaired.cut_moved)
        if await self._rendered_extends(session.id, committed, body, backend):
            return Match(Verdict(True, committed_messages=len(committed.messages)), body)
        return Match(plain, body)

    async def _rendered_extends(self, session_id: str, committed: Committed,
                                body: Mapping[str, Any], backend: Backend) -> bool:
        """Bytes means the rendered prompt: a client rewrite the template does not render
        (reasoning a template drops) leaves the engine's prompt an extension. The engine
        renders each prompt from its last user message on where that fits (``windows``):
        the request's rendering is kept for the next turn's comparison."""
        adapter = backend.adapter
        if not adapter.capabilities.render or committed.body is None:
            return False
        try:
            before = await self._rendered(session_id, adapter.apply_template, committed.body)
            after = await self._rendered(session_id, adapter.apply_template, body)
        except ProxyError:
            return False
        return bool(before) and after.startswith(before) and after != before

    async def _rendered(self, session_id: str, render: Render, body: Mapping[str, Any]) -> str:
        outcome = await render_body(render, body, self._renderings.get(session_id))
        counted(outcome, self.metrics, self.log, session_id)
        self._renderings.keep(session_id, outcome.rendered)
        return outcome.rendered.text

    async def _pending_chain(self, client: ClientRequest, namespace: str,
                             digests: Sequence[bytes]) -> PendingChain | None:
        """The request's chain, computed now only where it would take the event loop long
        (many new messages: in a worker thread, as ``chain_of_messages``), else when asked."""
        if self.fingerprinter is None:
            return None
        if client.endpoint == "chat":
            pending = self.fingerprinter.pending(
                client.body.get("messages") or [], digests, self._normalize_for_identity,
                namespace)
            if not pending.small:
                await pending.result()
            return pending
        if client.path == INFILL_PATH:
            return None  # its identity has no message markers: a chain would nominate none
        prompt = client.body.get("prompt")
        if not isinstance(prompt, str):
            return None
        return PendingChain(await self.fingerprinter.chain_of_prompt(prompt))

    def _normalize_for_identity(self, messages: Sequence[Mapping[str, Any]]
                                ) -> Sequence[Mapping[str, Any]]:
        return self.repairer.normalize_for_identity(messages) if self.repairer else messages

    def _nominated(self, namespace: str, chain: Chain | None, digests: Sequence[bytes],
                   prompt: object) -> list[Session]:
        """Keyless candidates: first those whose committed history the request repeats
        byte for byte as its prefix (longest first; exact bytes need no bar), then those
        its fingerprint chain nominates (at least NOMINATION_BAR shared segments)."""
        # Only those the store files under what the request may continue (a prefix of its
        # messages, its chain at the bar, a raw prompt): not every session of the namespace.
        bar_digest = (chain.digests[NOMINATION_BAR - 1] if chain is not None and chain.marked
                      and len(chain.digests) >= NOMINATION_BAR else None)
        return ranked(self.store.nominees(namespace, digests=digests, chain=bar_digest,
                                          prompt=isinstance(prompt, str)),
                      chain, digests, prompt)

    def _resume(self, session: Session, tier: Tier, match: Match,
                chain: PendingChain | None) -> Decision:
        session.last_decision = "resumed"
        session.last_reason = match.verdict.reason()
        if match.repairs:
            session.last_reason += f" after {len(match.repairs)} repair(s)"
        self.store.touch(session)
        return Decision(tier, "resumed", session, match.verdict, chain, match.body,
                        match.repairs)

    def _rewind(self, session: Session, match: Match, tier: Tier, chain: PendingChain | None,
                why: str) -> Decision:
        session.last_decision = "rewound"
        session.last_reason = f"{match.verdict.reason()}; {why}"
        self.store.touch(session)
        return Decision(tier, "rewound", session, match.verdict, chain, match.body,
                        match.repairs)

    def _new(self, namespace: str, identity: ExplicitIdentity | None, client: ClientRequest,
             tier: Tier) -> Session:
        kind = self._kind_of_new(namespace, identity, client)
        key = identity.key if identity else None
        parent = identity.parent if identity else None
        return self.store.create(namespace, key, kind, parent)

    def _kind_of_new(self, namespace: str, identity: ExplicitIdentity | None,
                     client: ClientRequest) -> Kind:
        """A side history never evicts a main one while a cheaper slot exists: sub-agents,
        a second history under a key that has one (title requests), raw prompts."""
        if client.endpoint != "chat" or (identity is not None and identity.parent):
            return "side"
        if identity is not None and any(s.kind == "main" and s.committed is not None
                                        for s in self.store.with_key(namespace, identity.key)):
            return "side"
        return "main"

    def _observe(self, decision: Decision, upstream: str) -> None:
        outcome = decision.outcome
        label = "declined" if outcome == "new" and decision.verdict is not None else outcome
        self.metrics.affinity_decisions.labels(decision.tier, label).inc()
        if decision.verdict is not None and not decision.verdict.resumable:
            self.metrics.affinity_declines.labels(decision.verdict.cause).inc()
        for repair in decision.repairs:
            self.metrics.repairs.labels(repair.policy).inc()
            log_event(self.log, logging.INFO, "repair", session=decision.session.id,
                      policy=repair.policy, index=repair.index, detail=repair.detail)
        # The request's own line says all of this (``plan.notes``) when it ends: this one,
        # at the decision, only for a closer look (one line a request, not two).
        if self.log.isEnabledFor(logging.DEBUG):
            log_event(self.log, logging.DEBUG, "affinity", tier=decision.tier, decision=label,
                      session=decision.session.id, key=decision.session.key,
                      kind=decision.session.kind, reason=decision.session.last_reason,
                      upstream=upstream)


# llama-server's fill-in-the-middle path (editor plugins: llama.vim, llama.vscode). Its
# body has no conversation and no stable prompt: the engine's prompt is the ``input_extra``
# chunks (the editor's ring buffer of context from open files), then the FIM prefix (the
# lines before the cursor), the suffix and the ``prompt`` (the cursor's line so far), and
# the editor sends one on nearly every keystroke, each moving the prefix, suffix and
# ``prompt``. What the engine can reuse from one request to the next is the chunks first,
# then whatever of the prefix still matches. So an infill request is planned as a raw
# prompt made of its chunks alone (``infill_identity``): the same chunks are the same
# history (resumed, same slot) however the cursor moved, chunks added at the end extend it
# (resumed), and chunks dropped or changed diverge (a new side history). Without chunks,
# a namespace's infill requests are one history on one slot. The body forwarded is always
# the client's own.
INFILL_PATH = "/infill"
# A completion prompt would have to start with these control characters to match one.
_INFILL_MARK = "\x1dllama-infill\x1d"


def planned_body(path: str, body: Mapping[str, Any]) -> Mapping[str, Any]:
    """What the planner decides on: the body itself, or an infill body with its identity
    as its ``prompt`` (never forwarded)."""
    return {**body, "prompt": infill_identity(body)} if path == INFILL_PATH else body


def infill_identity(body: Mapping[str, Any]) -> str:
    """An infill request's ``input_extra`` chunks, in order, as one text: a chunk added at
    the end extends it."""
    parts = [_INFILL_MARK]
    extra = body.get("input_extra")
    for chunk in extra if isinstance(extra, list) else ():
        if isinstance(chunk, Mapping):
            parts.append(f"{chunk.get('filename') or ''}\x1f{chunk.get('text') or ''}\x1e")
    return "".join(parts)


def ranked(sessions: Iterable[Session], chain: Chain | None, digests: Sequence[bytes],
           prompt: object) -> list[Session]:
    """The keyless candidates among ``sessions``, in the planner's order: those whose
    committed history the request repeats as its prefix (longest first), then those its
    fingerprint chain nominates (most shared segments first)."""
    keyless = [s for s in sessions if s.committed is not None]
    exact = [s for s in keyless if _is_prefix_of(s, digests, prompt)]
    exact.sort(key=lambda s: -len(s.committed.digests) if s.committed else 0)
    if chain is None:
        return exact
    fuzzy = [s for s in keyless if s not in exact and s.chain is not None
             and nominates(chain, s.chain, NOMINATION_BAR)]
    fuzzy.sort(key=lambda s: -shared_leading(chain, s.chain) if s.chain else 0)
    return exact + fuzzy


def _is_prefix_of(session: Session, digests: Sequence[bytes], prompt: object) -> bool:
    committed = session.committed
    if committed is None:
        return False
    if committed.prompt is not None:
        return isinstance(prompt, str) and prompt.startswith(committed.prompt)
    n = len(committed.digests)
    return 0 < n <= len(digests) and tuple(digests[:n]) == committed.digests


def _digests_of(body: Mapping[str, Any], client_body: Mapping[str, Any],
                client_digests: Sequence[bytes], session: Session) -> list[bytes]:
    """Digests of a repaired body's messages for its commit: a repaired history is mostly
    the client's own message objects and the session's committed ones, whose digests are
    known already (a 64-message history costs ~0.25 ms to digest again)."""
    known = {id(m): d for m, d in zip(client_body.get("messages") or [], client_digests,
                                      strict=False)}
    if session.committed is not None:
        known.update(zip(map(id, session.committed.messages), session.committed.digests,
                         strict=False))
    return [known.get(id(m)) or digest(m) for m in body.get("messages") or []]
