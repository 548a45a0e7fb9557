"""Anchoring: the slot made to hold what the session's next request will start with, before
it is parked, so that a restore of its file is an extension.

On recurrent and hybrid memory (Qwen3.5/3.6, Qwen3-Next, Nemotron-H, ...) the engine cannot
roll a slot back: it resumes from a context checkpoint at or before the first token that
changed, and a restored slot has none. After a turn the slot holds the prompt and the
reply as generated; the next request renders that reply again (Qwen3.5's template drops
its reasoning), so it parts from the slot a few tokens before its end, and a restored file
would be re-processed from token 0. Anchoring evaluates, on the session's own idle slot
and generating nothing, the history with the reply as the next request will render it, up
to where that request starts to differ (its next user turn); the file saved then is a
prefix of every next request. The cost is the re-rendered reply, which the next turn would
pay anyway, moved into the time the user or the tool takes.

Anchoring runs after a turn on an engine short of slots (``CONTENDED_WITHIN_S``), once the
slot idles: before the slot is parked ahead (``ParkManager.park_ahead``), or on its own
where parking is off (``after_turn``); and when a slot not anchored is evicted. It is
not used on sliding-window models: their templates render a reply back as generated, so
a warm slot is an extension already, and without ``--swa-full`` a slot file keeps nothing
to extend (``bench/results/hybrid/RUN.md`` shows why in llama-server's code).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

from prefixpin.adapters.base import Adapter
from prefixpin.core.errors import ProxyError
from prefixpin.proxy.ops.logs import log_event
from prefixpin.proxy.ops.metrics import Metrics
from prefixpin.proxy.parking.renderings import Renderings
from prefixpin.proxy.session.placement import SlotEntry, SlotPool
from prefixpin.proxy.session.sessions import Session
from prefixpin.proxy.session.tokens import common_prefix

# A session's own next request often follows its answer at once (a tool result): work on
# its slot after a turn (anchoring, parking ahead) waits until it stayed idle this long.
IDLE_DELAY_S = 0.2

# An engine is short of slots while requests wait, or for this long after a slot changed
# hands: only then is a slot anchored (or parked) ahead of the eviction that would need it.
CONTENDED_WITHIN_S = 600.0

# Two next user turns that differ from their first character: what the two renderings share
# is what every next request will start with.
_NEXT_TURNS = ("A", "0\n")
# Two replies that differ from their first character: what a prompt shares with both
# renderings of the turn it opens is where any reply to it starts.
_REPLIES = _NEXT_TURNS


class Texts(Protocol):
    """How a computation has the engine render a body with its template and tokenize a
    text as the chat path does: whole (``Whole``), or only what is new
    (``renderings.Conversation``)."""

    async def render(self, body: Mapping[str, Any]) -> str: ...

    async def tokenize(self, text: str) -> list[int]: ...


class Whole:
    """Every rendering and tokenization whole, nothing kept."""

    def __init__(self, adapter: Adapter) -> None:
        self.adapter = adapter

    async def render(self, body: Mapping[str, Any]) -> str:
        return await self.adapter.apply_template(body)

    async def tokenize(self, text: str) -> list[int]:
        return await self.adapter.tokenize(text, add_special=True)


async def when_idle(pool: SlotPool, slot: int, session_id: str,
                    work: Callable[[SlotEntry], Awaitable[None]]) -> None:
    """``work`` on the slot, held, once it stayed idle ``IDLE_DELAY_S`` and still holds the
    session; not while another slot is busy (a prefill or a save would slow its stream)."""
    await asyncio.sleep(IDLE_DELAY_S)
    if pool.others_busy(slot):
        return
    async with pool.holding(slot, session_id) as entry:
        if entry is not None:
            await work(entry)


async def next_request_opening(adapter: Adapter, body: Mapping[str, Any],
                               reply: Mapping[str, Any] | None,
                               texts: Texts | None = None) -> list[int] | None:
    """The tokens every next request of this conversation starts with: ``body``'s messages,
    the ``reply`` as the template renders an earlier assistant turn, up to the next user
    turn's text. None for a body without messages, or no reply to anchor."""
    messages = body.get("messages")
    if not isinstance(messages, list) or reply is None:
        return None
    return await tokens_before_user_turn(adapter, body, [*messages, dict(reply)], texts)


async def prompt_tokens(adapter: Adapter, body: Mapping[str, Any],
                        texts: Texts | None = None) -> list[int] | None:
    """The request's prompt as the engine tokenizes it (its template's rendering of the
    messages, or its raw prompt); None when that prompt is not text."""
    texts = texts or Whole(adapter)
    text = await texts.render(body) if "messages" in body else body.get("prompt")
    if not isinstance(text, str):
        return None
    return await texts.tokenize(text)


async def prompt_opening(adapter: Adapter, body: Mapping[str, Any],
                         texts: Texts | None = None
                         ) -> tuple[list[int], list[int]] | None:
    """The request's prompt tokens, and the part of them every next request of the
    conversation starts with, whatever reply it sends back in the turn this prompt opens
    (interrupted, regenerated, edited, rewritten): the prompt up to where its reply starts,
    as the template renders an earlier assistant turn. None for a body without messages."""
    messages = body.get("messages")
    texts = texts or Whole(adapter)
    prompt = await prompt_tokens(adapter, body, texts)
    if not isinstance(messages, list) or prompt is None:
        return None
    shared = len(prompt)
    for reply in _REPLIES:
        following = [*messages, {"role": "assistant", "content": reply},
                     {"role": "user", "content": _NEXT_TURNS[0]}]
        text = await texts.render({**body, "messages": following})
        shared = min(shared, common_prefix(prompt, await texts.tokenize(text)))
    return prompt, prompt[:shared]


async def tokens_before_user_turn(adapter: Adapter, body: Mapping[str, Any],
                                  messages: Sequence[Mapping[str, Any]],
                                  texts: Texts | None = None) -> list[int]:
    """The tokens ``body`` rendered with ``messages`` and then any user turn starts with:
    the two renderings of ``_NEXT_TURNS`` share exactly that."""
    first, second = ({"role": "user", "content": text} for text in _NEXT_TURNS)
    return await tokens_shared(adapter, body, messages, first, second, texts)


async def tokens_shared(adapter: Adapter, body: Mapping[str, Any],
                        messages: Sequence[Mapping[str, Any]], one: Mapping[str, Any],
                        other: Mapping[str, Any], texts: Texts | None = None
                        ) -> list[int]:
    """The tokens ``body`` rendered with ``messages`` then ``one``, and with ``messages``
    then ``other``, start with: what any next message after ``messages`` leaves as it is,
    where the two differ from their first token."""
    texts = texts or Whole(adapter)
    renderings = []
    for last in (one, other):
        prompt = await texts.render({**body, "messages": [*messages, last]})
        renderings.append(await texts.tokenize(prompt))
    first, second = renderings
    return first[:common_prefix(first, second)]


class Anchorer:
    """Anchors a lane's idle slots (``anchor``), after each turn when parking is off
    (``after_turn``), or when the park manager parks a slot ahead."""

    def __init__(self, adapter: Adapter, metrics: Metrics, logger: logging.Logger,
                 session_of: Callable[[str], Awaitable[Session | None]]) -> None:
        self.adapter = adapter
        self.metrics = metrics
        self.log = logger
        self.session_of = session_of
        # Each session's last rendering: the next computation's engine tokenizes what is new.
        self.renderings = Renderings(adapter, metrics, logger)
        self._tasks: set[asyncio.Task[None]] = set()
        # Slot -> (session, tokens) its last committed turn left there, not anchored since.
        self._unanchored: dict[int, tuple[str, int]] = {}

    def turn_committed(self, slot: int, session_id: str, tokens: int) -> None:
        """A turn of ``session_id`` left ``tokens`` in ``slot`` (the commit's figure)."""
        self._unanchored[slot] = (session_id, tokens)

    def unanchored_turn(self, slot: int, session_id: str, tokens: int) -> bool:
        """Whether ``slot`` holds just what the session's last committed turn left there:
        anchoring it now renders that very history. Not after an anchor, and not when a
        turn whose commit is still to come has changed the slot since (its tokens differ)."""
        return self._unanchored.get(slot) == (session_id, tokens)

    async def anchor(self, slot: int, session_id: str) -> int | None:
        """Make the idle ``slot`` (held by the caller) hold its session's next request's
        opening; how many tokens it then holds, None when it was not anchored."""
        session = await self.session_of(session_id)
        if session is None or session.committed is None or session.committed.body is None:
            return None
        started = time.monotonic()
        texts = self.renderings.of(session_id)
        try:
            opening = await next_request_opening(self.adapter, session.committed.body,
                                                 session.repair.last_reply, texts)
            texts.keep()
            if not opening:
                return None
            held = await self.adapter.prefill(slot, opening)
        except ProxyError as exc:
            self.metrics.anchors.labels("failed").inc()
            log_event(self.log, logging.WARNING, "anchor failed", session=session_id,
                      slot=slot, error=exc.message)
            return None
        self._unanchored.pop(slot, None)
        self.metrics.anchors.labels("anchored").inc()
        log_event(self.log, logging.INFO, "anchored", session=session_id, slot=slot,
                  tokens=held, ms=round((time.monotonic() - started) * 1000, 1))
        return held

    def after_turn(self, pool: SlotPool, slot: int, session_id: str) -> None:
        """Anchor the slot in the background once it stays idle (parking off), when the
        engine is short of slots: a session that keeps its slot needs no anchor (the
        engine's own checkpoints cover its next request), and anchoring has the engine
        render the whole conversation (``renderings``: it tokenizes only what is new)."""
        if not pool.contended(CONTENDED_WITHIN_S):
            return
        task = asyncio.get_running_loop().create_task(
            self._when_idle(pool, slot, session_id), name=f"prefixpin-anchor-{slot}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _when_idle(self, pool: SlotPool, slot: int, session_id: str) -> None:
        async def anchor(entry: SlotEntry) -> None:
            if (held := await self.anchor(slot, session_id)) is not None:
                entry.tokens = held

        await when_idle(pool, slot, session_id, anchor)

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
