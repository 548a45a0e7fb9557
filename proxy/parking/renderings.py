"""Renderings: the tokens of a conversation's renderings, the engine tokenizing only the
text a rendering adds to an earlier one.

After a turn on an engine short of slots, anchoring and the prompt-end snapshot (``anchor``)
need the tokens of several renderings of the whole conversation. The engine renders them
(``/apply-template``: only the template knows what it does with earlier turns, and Qwen3.5's
rewrites them), from the last user message on where that fits (``windows``). Each
rendering starts with most of an earlier one: a sibling rendering
of the same turn, or the one the session's previous turn left. llama.cpp tokenizes a text,
special tokens parsed, in fragments cut at each special token, every fragment on its own
(``llama-vocab.cpp``: ``tokenizer_st_partition``, then one tokenizer session a fragment).
So where two texts have the same characters up to and through a special token, their
tokens up to it are the same, and the rest are the tokens of the text from it on. A
rendering is therefore tokenized from the last turn marker (``MARKERS``) it shares with an
earlier one, whose tokens stand for all before it: what the engine reads and answers is
what the turn added. The text itself is compared here, never assumed: a rendering that
shares no marker with any earlier one (a template that rewrote the first turn, a session
not seen since this process started, an engine whose vocabulary has no marker as a special
token) is tokenized whole, and said (``prefixpin_tokenizations_total``, the log).
"""

from __future__ import annotations

import logging
import re
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefixpin.adapters.base import Adapter
from prefixpin.proxy.ops.logs import log_event
from prefixpin.proxy.ops.metrics import Metrics
from prefixpin.proxy.parking.windows import LastRenderings, Outcome, Rendered, render_body
from prefixpin.proxy.session.tokens import common_text_prefix

# The special tokens that open a turn in the chat templates of the model families
# prefixpin anchors for (ChatML: Qwen, SmolLM2; Gemma; Llama 3; gpt-oss's harmony). Each is
# used only where the engine's vocabulary has it as one special token.
MARKERS = ("<|im_start|>", "<start_of_turn>", "<|start_header_id|>", "<|start|>")
SESSIONS = 256  # sessions whose last rendering is kept, least recently used out first


@dataclass(frozen=True, slots=True)
class Marker:
    text: str
    token: int


@dataclass(frozen=True, slots=True)
class Rendering:
    """A rendered text, its tokens as the engine's chat path makes them (special tokens
    added and parsed), and where the marker stands in both: ``cuts[k]`` is the character
    offset of an occurrence the tokenizer took as the marker's token, ``at[k]`` that
    token's index (none where the two disagree: that text is never cut)."""

    text: str
    tokens: array[int]
    marker: Marker | None = None
    cuts: tuple[int, ...] = ()
    at: tuple[int, ...] = ()


class Renderings:
    """One engine's tokenizations for anchoring: the markers its vocabulary has, and each
    session's last rendering (``SESSIONS`` at most)."""

    def __init__(self, adapter: Adapter, metrics: Metrics, logger: logging.Logger,
                 bound: int = SESSIONS) -> None:
        self.adapter = adapter
        self.metrics = metrics
        self.log = logger
        self._markers: dict[str, Marker | None] = {}  # probed once per engine process
        self._last: LastRenderings[Rendering] = LastRenderings(bound)  # tokens
        self.rendered: LastRenderings[Rendered] = LastRenderings(bound)  # template texts
        self._unmarked_said = False  # an engine without markers is said once, not each time

    def of(self, session_id: str | None) -> Conversation:
        """One computation on ``session_id``'s conversation (None: one that keeps nothing
        past the computation)."""
        return Conversation(self, session_id)

    def last(self, session_id: str) -> Rendering | None:
        return self._last.get(session_id)

    def keep(self, session_id: str, rendering: Rendering) -> None:
        self._last.keep(session_id, rendering)

    def forget(self, session_id: str) -> None:
        self._last.forget(session_id)
        self.rendered.forget(session_id)

    def engine_restarted(self) -> None:
        """Another engine process (perhaps another model, another vocabulary): nothing
        tokenized before is reused."""
        self._markers.clear()
        self._last.clear()
        self.rendered.clear()
        self._unmarked_said = False

    async def tokenize(self, text: str, earlier: Sequence[Rendering],
                       session_id: str | None) -> Rendering:
        """``text``'s tokens (``/tokenize`` with ``add_special``), the engine sent only
        what follows the last marker it shares with one of ``earlier``."""
        marker = await self._marker(text)
        found = _longest_cut(text, earlier, marker) if marker is not None else None
        if found is None:
            why = ("no earlier rendering" if not earlier else
                   "no turn marker known to this engine's vocabulary" if marker is None else
                   "it shares no turn marker with an earlier rendering")
            return await self._whole(text, marker, why, session_id, first=not earlier)
        base, k = found
        assert marker is not None
        start, index = base.cuts[k], base.at[k]
        tail = await self.adapter.tokenize(text[start:], add_special=False)
        if not tail or tail[0] != marker.token or base.tokens[index] != marker.token:
            return await self._whole(text, marker, "the engine tokenized the marker otherwise",
                                     session_id, first=False)
        self.metrics.tokenizations.labels("spliced").inc()
        tokens = base.tokens[:index]
        tokens.extend(tail)
        cuts, at = _cuts(text[start:], tail, marker)
        if not cuts:
            cuts, at = (0,), (0,)  # the tail's own markers disagree: cut at its start only
        return Rendering(text, tokens, marker, base.cuts[:k] + tuple(start + c for c in cuts),
                         base.at[:k] + tuple(index + a for a in at))

    async def _whole(self, text: str, marker: Marker | None, why: str,
                     session_id: str | None, *, first: bool) -> Rendering:
        tokens = array("i", await self.adapter.tokenize(text, add_special=True))
        self.metrics.tokenizations.labels("first" if first else "whole").inc()
        if not first and not (marker is None and self._unmarked_said):
            self._unmarked_said = self._unmarked_said or marker is None
            log_event(self.log, logging.INFO, "rendering tokenized whole",
                      session=session_id, chars=len(text), reason=why)
        if marker is None:
            return Rendering(text, tokens)
        cuts, at = _cuts(text, tokens, marker)
        return Rendering(text, tokens, marker, cuts, at)

    async def _marker(self, text: str) -> Marker | None:
        """The first of ``MARKERS`` in ``text`` that the engine's vocabulary has as one
        special token, probed once: tokenized alone it is one token, and without special
        tokens parsed it is not (a plain token would merge with its neighbours), and
        ``add_special`` adds nothing after it (an end token appended to every text would
        not be at a cut)."""
        for candidate in MARKERS:
            if candidate not in text:
                continue
            if candidate not in self._markers:
                self._markers[candidate] = await self._probe(candidate)
            marker = self._markers[candidate]
            if marker is not None:
                return marker
        return None

    async def _probe(self, candidate: str) -> Marker | None:
        parsed = await self.adapter.tokenize(candidate, add_special=False)
        if len(parsed) != 1:
            return None
        plain = await self.adapter.tokenize(candidate, add_special=False, parse_special=False)
        added = await self.adapter.tokenize(candidate, add_special=True)
        if plain == parsed or added[-1:] != parsed:
            return None
        return Marker(candidate, parsed[0])


class Conversation:
    """The renderings and tokenizations of one computation on one conversation
    (``anchor``'s helpers call it with each body and each text): each rendering spliced
    from a window onto the computation's or the session's latest (``windows``), each
    tokenization onto the longest shared of the computation's earlier renderings and the
    session's last one; ``keep`` leaves the latest of both for the session's next
    computation."""

    def __init__(self, renderings: Renderings, session_id: str | None) -> None:
        self.renderings = renderings
        self.session_id = session_id
        last = renderings.last(session_id) if session_id is not None else None
        self.done: list[Rendering] = [last] if last is not None else []
        self.rendered = (renderings.rendered.get(session_id) if session_id is not None
                         else None)

    async def render(self, body: Mapping[str, Any]) -> str:
        outcome = await render_body(self.renderings.adapter.apply_template, body,
                                    self.rendered)
        counted(outcome, self.renderings.metrics, self.renderings.log, self.session_id)
        self.rendered = outcome.rendered
        return outcome.rendered.text

    async def tokenize(self, text: str) -> list[int]:
        rendering = await self.renderings.tokenize(text, self.done, self.session_id)
        self.done.append(rendering)
        return rendering.tokens.tolist()

    def keep(self) -> None:
        if self.session_id is None:
            return
        if self.done:
            self.renderings.keep(self.session_id, self.done[-1])
        if self.rendered is not None:
            self.renderings.rendered.keep(self.session_id, self.rendered)


def counted(outcome: Outcome, metrics: Metrics, logger: logging.Logger,
            session_id: str | None) -> None:
    """A template rendering in ``prefixpin_template_renderings_total``; one rendered whole
    where a window did not fit is logged with why."""
    metrics.template_renderings.labels(outcome.how).inc()
    if outcome.why:
        log_event(logger, logging.INFO, "rendering rendered whole", session=session_id,
                  chars=len(outcome.rendered.text), reason=outcome.why)


def _longest_cut(text: str, earlier: Sequence[Rendering],
                 marker: Marker) -> tuple[Rendering, int] | None:
    """The earlier rendering and cut with the most characters before it that ``text``
    shares through the marker there. The characters before the cut are the same, and so
    are their fragments and tokens; the marker, shared whole, is a fragment of ``text``
    too unless a longer special token holding its text runs past the shared characters
    (none does in the vocabularies of ``MARKERS``' families), and the tail's first token
    is checked to be the marker's."""
    best: tuple[Rendering, int] | None = None
    for rendering in earlier:
        if rendering.marker != marker or not rendering.cuts:
            continue
        shared = common_text_prefix(text, rendering.text)
        k = _last_cut_within(rendering.cuts, shared - len(marker.text))
        # (a cut at the text's start would have the engine tokenize it all: no splice)
        if k is not None and rendering.cuts[k] > 0 and (
                best is None or rendering.cuts[k] > best[0].cuts[best[1]]):
            best = (rendering, k)
    return best


def _last_cut_within(cuts: Sequence[int], limit: int) -> int | None:
    """The index of the last of the ascending ``cuts`` at or before ``limit``."""
    low, high = 0, len(cuts)
    while low < high:
        middle = (low + high) // 2
        if cuts[middle] <= limit:
            low = middle + 1
        else:
            high = middle
    return low - 1 if low else None


def _cuts(text: str, tokens: Sequence[int],
          marker: Marker) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where ``marker`` stands in ``text`` and in its ``tokens``: the marker's occurrences
    pair up in order only when there are as many of each (the tokenizer takes every
    occurrence as the token unless a longer special token holds it, and the token comes
    only from its text); otherwise no cut."""
    offsets = tuple(m.start() for m in re.finditer(re.escape(marker.text), text))
    indices = tuple(i for i, token in enumerate(tokens) if token == marker.token)
    return (offsets, indices) if len(offsets) == len(indices) else ((), ())
