"""Openings: what a namespace's new sessions share, saved once and restored into the slot a
new session gets.

A coding agent starts every session, and every sub-agent (Claude Code's Task agents,
OpenCode's sub-sessions), with the same system prompt and tools as its siblings: 10-20k
tokens with the real CLIs. Without openings a new session prefills all of it, unless it
happens to land on a slot a sibling left warm, and on recurrent/hybrid memory not even
then (a slot rolls back only to a checkpoint).

The opening of a request is what its template renders before its first user turn's text
(the leading system messages and the tools: ``anchor.tokens_before_user_turn``), or, when
longer, what its prompt shares with the namespace's previous new session's first prompt
(Claude Code's first user turn opens with the same reminders in every session). A new
session's first request, on a slot that does not hold it:

- restores the namespace's longest saved opening that the request's tokens extend, so the
  engine prefills only what differs (on every memory kind a restore followed by an exact
  extension reuses all of it);
- when its own opening is long enough and longer than any saved one (by
  ``EXTEND_MIN_TOKENS``, past a restored one), evaluates it into the slot (after the
  restore: only the tokens past it), saves it, and goes on from there: the request extends
  what the slot holds, so the save is the only work added, once per opening.

Openings are kept per namespace (never restored across namespaces), at most
``PER_NAMESPACE`` each and ``max_bytes`` in all, least recently used out first. They live
in this process's memory and the engine's save directory; a restarted proxy's start-up
sweep deletes the files (no index records them) and the openings are saved again. They are
off where a restored slot is re-processed anyway (sliding-window attention without
``--swa-full``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixpin.adapters.base import Adapter
from prefixpin.core.errors import ProxyError
from prefixpin.proxy.ops.logs import log_event
from prefixpin.proxy.ops.metrics import Metrics
from prefixpin.proxy.parking.anchor import prompt_tokens, tokens_before_user_turn, tokens_shared
from prefixpin.proxy.parking.slotfile import unlink
from prefixpin.proxy.pipeline.system_turns import SYSTEM_ROLES
from prefixpin.proxy.session.tokens import common_prefix

PER_NAMESPACE = 4  # openings kept per namespace (a main agent and its sub-agent kinds)
NAMESPACES = 256  # namespaces with openings, least recently used out first
# What a sibling must share past a restored opening for a longer one to be saved: each
# save writes a file on the request's path, once per shared prefix (later siblings find it).
EXTEND_MIN_TOKENS = 16


@dataclass(slots=True)
class Opening:
    namespace: str
    tokens: tuple[int, ...]
    filename: str
    size: int
    used: float = field(default_factory=time.monotonic)


@dataclass(frozen=True, slots=True)
class Seeded:
    """What a new session's slot got: ``restored`` (an opening) or ``saved`` (its own)."""

    outcome: str
    tokens: int
    note: str


async def request_opening(adapter: Adapter, body: Mapping[str, Any]) -> list[int] | None:
    """The tokens every conversation with ``body``'s leading system messages and tools
    starts with; None for a body without messages."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    lead = []
    for message in messages:
        if not isinstance(message, Mapping) or message.get("role") not in SYSTEM_ROLES:
            break
        lead.append(message)
    return await tokens_before_user_turn(adapter, body, lead)


async def first_turn_tokens(adapter: Adapter, body: Mapping[str, Any]) -> list[int] | None:
    """What a new session's opening is judged on: the request's prompt tokens while it is
    its first turn (the leading system messages and one more), else, for a new session
    arriving with a history (a resumed conversation, a sub-agent handed a long context),
    only the tokens its prompt surely starts with up to the end of that first turn: the
    renderings of the first turn followed by a user turn and by an assistant turn share
    exactly those. Never the whole of a long history: this is on its first token's path."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return await prompt_tokens(adapter, body)
    first_turn = _first_turn_length(messages)
    if len(messages) <= first_turn:
        return await prompt_tokens(adapter, body)
    return await tokens_shared(adapter, body, messages[:first_turn],
                               {"role": "user", "content": "A"},
                               {"role": "assistant", "content": "A"})


def _first_turn_length(messages: Sequence[Any]) -> int:
    """How many of ``messages`` the first turn takes: the leading system messages and the
    message after them."""
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in SYSTEM_ROLES:
            return index + 1
    return len(messages)


class Openings:
    """One lane's openings (its engine's save directory)."""

    def __init__(self, adapter: Adapter, files_dir: Path, metrics: Metrics,
                 logger: logging.Logger, *, filenames: Callable[[], str],
                 min_tokens: int, max_bytes: int, lane: str = "") -> None:
        self.adapter = adapter
        self.files_dir = files_dir
        self.metrics = metrics
        self.log = logger
        self.filenames = filenames
        self.min_tokens = min_tokens
        self.max_bytes = max_bytes
        self.lane = lane
        self._by_namespace: OrderedDict[str, list[Opening]] = OrderedDict()
        self._saving: set[tuple[str, int]] = set()  # (namespace, length) being saved
        # Per namespace, the last new session's first prompt: what a sibling shares past
        # the template's opening (the same first reminders, an agent's own preamble).
        self._first_prompts: OrderedDict[str, array[int]] = OrderedDict()

    async def seed(self, namespace: str, session_id: str, body: Mapping[str, Any], slot: int,
                   *, blocked: bool) -> Seeded | None:
        """A new session's first request, on ``slot`` (leased, not holding it): restore the
        longest opening of the namespace that the request extends, else save the request's
        own. ``blocked``: the slot held another namespace (a save erases it first). None
        when neither applies (no messages, too short an opening, a failure: logged)."""
        try:
            opening = await request_opening(self.adapter, body)
            if opening is None or len(opening) < self.min_tokens:
                return None
            prompt = await first_turn_tokens(self.adapter, body)
        except ProxyError as exc:
            self._failed(session_id, slot, f"cannot render the opening: {exc.message}")
            return None
        if prompt is None or len(prompt) <= len(opening) or prompt[:len(opening)] != opening:
            return None  # the template renders the first turn otherwise: nothing to share
        target = max(len(opening), self._shared_with_sibling(namespace, prompt))
        found = self._longest(namespace, prompt)
        restored = None
        if found is not None:
            restored = await self._restore(found, session_id, slot)
            if restored is None or target < len(found.tokens) + EXTEND_MIN_TOKENS:
                return restored
            blocked = False  # the slot holds this namespace's opening now
        saved = await self._save(namespace, tuple(prompt[:target]), session_id, slot, blocked)
        return saved or restored

    def _shared_with_sibling(self, namespace: str, prompt: Sequence[int]) -> int:
        """How many tokens ``prompt`` shares with the namespace's previous new session's
        first prompt (short of its own end), which then becomes ``prompt``."""
        previous = self._first_prompts.get(namespace)
        shared = min(common_prefix(prompt, previous), len(prompt) - 1) if previous else 0
        self._first_prompts[namespace] = array("i", prompt)
        self._first_prompts.move_to_end(namespace)
        while len(self._first_prompts) > NAMESPACES:
            self._first_prompts.popitem(last=False)
        return shared

    def _longest(self, namespace: str, prompt: Sequence[int]) -> Opening | None:
        best = None
        for opening in self._by_namespace.get(namespace, ()):
            n = len(opening.tokens)
            if n < len(prompt) and tuple(prompt[:n]) == opening.tokens and (
                    best is None or n > len(best.tokens)):
                best = opening
        return best

    async def _restore(self, opening: Opening, session_id: str, slot: int) -> Seeded | None:
        started = time.monotonic()
        try:
            result = await self.adapter.restore_slot(slot, opening.filename)
        except ProxyError as exc:
            await self._drop(opening)
            self._failed(session_id, slot, f"restore failed: {exc.message}")
            return None
        if result.n_tokens != len(opening.tokens):
            await self._drop(opening)
            self._failed(session_id, slot, f"the engine restored {result.n_tokens} "
                         f"tokens of the opening's {len(opening.tokens)}")
            return None
        opening.used = time.monotonic()
        self._by_namespace.move_to_end(opening.namespace)
        self.metrics.openings.labels("restored").inc()
        ms = round((time.monotonic() - started) * 1000, 1)
        log_event(self.log, logging.INFO, "opening restored", session=session_id, slot=slot,
                  tokens=result.n_tokens, file=opening.filename, lane=self.lane, ms=ms)
        return Seeded("restored", result.n_tokens,
                      f"opening of {result.n_tokens} tokens restored in {ms:.0f} ms")

    async def _save(self, namespace: str, tokens: tuple[int, ...], session_id: str, slot: int,
                    blocked: bool) -> Seeded | None:
        claim = (namespace, len(tokens))
        if claim in self._saving:
            return None  # a sibling is saving this very opening now
        self._saving.add(claim)
        started = time.monotonic()
        filename = self.filenames()
        try:
            if blocked:  # what the slot held is another namespace's: nothing of it is read
                await self.adapter.erase_slot(slot)
            await self.adapter.prefill(slot, tokens)
            result = await self.adapter.save_slot(slot, filename)
        except ProxyError as exc:
            await asyncio.to_thread(unlink, self.files_dir / filename)
            self._failed(session_id, slot, f"save failed: {exc.message}")
            return None
        finally:
            self._saving.discard(claim)
        if result.n_tokens != len(tokens):
            await asyncio.to_thread(unlink, self.files_dir / filename)
            self._failed(session_id, slot, f"the slot held {result.n_tokens} tokens "
                         f"after the opening's {len(tokens)} were evaluated")
            return None
        opening = Opening(namespace, tokens, filename, result.n_bytes)
        self._by_namespace.setdefault(namespace, []).append(opening)
        self._by_namespace.move_to_end(namespace)
        await self._enforce_bounds(keep=opening)
        self.metrics.openings.labels("saved").inc()
        ms = round((time.monotonic() - started) * 1000, 1)
        log_event(self.log, logging.INFO, "opening saved", session=session_id, slot=slot,
                  tokens=len(tokens), bytes=result.n_bytes, file=filename, lane=self.lane,
                  ms=ms)
        return Seeded("saved", len(tokens), f"opening of {len(tokens)} tokens saved for the "
                      "namespace's next sessions")

    async def _enforce_bounds(self, keep: Opening) -> None:
        """At most PER_NAMESPACE openings a namespace, NAMESPACES namespaces and max_bytes
        in all: the least recently used go first, never ``keep``."""
        gone: list[Opening] = []
        for openings in self._by_namespace.values():
            openings.sort(key=lambda o: o.used)
            while len(openings) > PER_NAMESPACE:
                gone.append(openings.pop(0 if openings[0] is not keep else 1))
        while len(self._by_namespace) > NAMESPACES:
            gone.extend(self._by_namespace.popitem(last=False)[1])
        ranked = sorted((o for os in self._by_namespace.values() for o in os),
                        key=lambda o: o.used)
        total = sum(o.size for o in ranked)
        for opening in ranked:
            if total <= self.max_bytes:
                break
            if opening is not keep:
                self._forget(opening)
                gone.append(opening)
                total -= opening.size
        for opening in gone:
            await asyncio.to_thread(unlink, self.files_dir / opening.filename)
        self._update_gauge()

    async def _drop(self, opening: Opening) -> None:
        self._forget(opening)
        await asyncio.to_thread(unlink, self.files_dir / opening.filename)
        self._update_gauge()

    def _forget(self, opening: Opening) -> None:
        openings = self._by_namespace.get(opening.namespace, [])
        if opening in openings:
            openings.remove(opening)
        if not openings:
            self._by_namespace.pop(opening.namespace, None)

    def _failed(self, session_id: str, slot: int, reason: str) -> None:
        self.metrics.openings.labels("failed").inc()
        log_event(self.log, logging.WARNING, "opening skipped", session=session_id, slot=slot,
                  lane=self.lane, reason=reason)

    def _update_gauge(self) -> None:
        self.metrics.opening_bytes.labels(self.lane).set(
            sum(o.size for os in self._by_namespace.values() for o in os))

    def view(self) -> list[dict[str, Any]]:
        """For /sessions: per namespace, the openings' lengths (never their tokens)."""
        return [{"namespace": namespace, "tokens": [len(o.tokens) for o in openings]}
                for namespace, openings in self._by_namespace.items()]

    async def aclose(self) -> None:
        """The files go with the process (nothing records them for the next one)."""
        for openings in list(self._by_namespace.values()):
            for opening in list(openings):
                await self._drop(opening)
