"""Implicit identity: the model's own tokenizer and the fingerprint chain of a request.

The tokenizer is loaded once (in a worker thread: Gemma's vocabulary takes seconds) from
``--tokenizer``, else from the model file the engine reports in ``/props`` when it is
readable here. Without one, implicit identity is off and only explicit session keys
nominate; that is said once at start-up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from prefixpin.fingerprint import (
    EDGE_CHARS,
    Chain,
    ChainMemo,
    Markers,
    MessageTokenCache,
    chain,
    start_chain,
)
from prefixpin.fingerprint.tokenizer import (
    ModelTokenizer,
    TokenizerLoadError,
    load_tokenizer,
    markers_for,
)
from prefixpin.proxy.ops.logs import log_event
from prefixpin.proxy.session.resent import PrefixKeys

Message = Mapping[str, Any]
Normalize = Callable[[Sequence[Message]], Sequence[Message]]

# New messages with up to this many characters to tokenize (~250 tokens, ~0.3 ms) are
# fingerprinted on the event loop: handing them to a worker thread costs about as much.
INLINE_CHARS = 1_000


class PendingChain:
    """A request's chain, computed once, when first asked for. A follow-up that a session's
    committed history decides byte for byte needs no chain to be planned (the chain only
    nominates the other candidates): the commit asks for it, after the answer, to keep
    with the session for the requests that will need it."""

    def __init__(self, chain: Chain, rest: Callable[[], Chain] | None = None, *,
                 small: bool = True) -> None:
        self._chain = chain  # until ``rest`` has run: the chain of the messages known
        self._rest = rest
        self.small = small  # what is left runs on the event loop (INLINE_CHARS)

    def now(self) -> Chain:
        if self._rest is not None:
            self._chain, self._rest = self._rest(), None
        return self._chain

    async def result(self) -> Chain:
        if self._rest is None or self.small:
            return self.now()
        # Off the event loop: a new session arriving with hundreds of messages takes
        # milliseconds, each message tokenized by its edges.
        return await asyncio.to_thread(self.now)


class Fingerprinter:
    def __init__(self, tokenizer: ModelTokenizer, markers: Markers) -> None:
        self.tokenizer = tokenizer
        self.markers = markers
        self.cache = MessageTokenCache()
        self.memo = ChainMemo()
        # a follow-up's digests are the earlier request's objects up to what it added
        self._keys = PrefixKeys()

    async def chain_of_messages(self, messages: Sequence[Message], digests: Sequence[bytes],
                                normalize: Normalize, namespace: str) -> Chain:
        """The chain of ``messages`` (``digests``: theirs, as the client sent them), each
        message passed through ``normalize`` first, the same function on every call: the
        memo of known prefixes is keyed on the client's bytes. What one namespace's
        requests put in the caches, only its own find (no tenant learns from the timing
        whether another sent the same text)."""
        return await self.pending(messages, digests, normalize, namespace).result()

    def pending(self, messages: Sequence[Message], digests: Sequence[bytes],
                normalize: Normalize, namespace: str) -> PendingChain:
        """``chain_of_messages``, to be computed when first asked for: the memo is read
        and the new messages normalised now, the new messages tokenized then."""
        scope = namespace.encode()
        keys = self._keys(digests, scope)
        covered, known = self.memo.longest(keys)
        base = known if known is not None else start_chain(self.markers.openers)
        if covered == len(messages):
            return PendingChain(base)
        rest = normalize(messages[covered:])
        return PendingChain(base, partial(self.memo.extend, keys, covered, base, rest,
                                          self.tokenizer, self.cache, self.markers, scope),
                            small=_approximate_chars(rest) <= INLINE_CHARS)

    async def chain_of_prompt(self, prompt: str) -> Chain:
        tokens = await asyncio.to_thread(self.tokenizer.encode, prompt)
        return chain(tokens, self.markers.openers)


def _approximate_chars(messages: Sequence[Message]) -> int:
    """What tokenizing ``messages`` would cost, in characters: each message's, up to the
    two edges a long view is tokenized by (``EDGE_CHARS``; content parts and tool calls
    counted by their printed form: an overestimate, which only moves work off the loop)."""
    total = 0
    for message in messages:
        content = message.get("content")
        chars = len(content) if isinstance(content, str) else len(str(content or ""))
        if message.get("tool_calls"):
            chars += len(str(message["tool_calls"]))
        total += min(chars, 2 * EDGE_CHARS + 64)
    return total


async def load_fingerprinter(explicit: Path | None, props: Mapping[str, Any] | None,
                             logger: logging.Logger) -> Fingerprinter | None:
    source = explicit or _model_path(props)
    if source is None:
        log_event(logger, logging.WARNING, "implicit identity off",
                  reason="no --tokenizer and the engine's model file is not readable here")
        return None
    try:
        tokenizer = await asyncio.to_thread(load_tokenizer, source)
    except TokenizerLoadError as exc:
        log_event(logger, logging.WARNING, "implicit identity off", reason=str(exc))
        return None
    markers = markers_for(tokenizer)
    if markers is None:
        log_event(logger, logging.WARNING, "implicit identity off",
                  reason=f"no known message markers in {source}")
        return None
    log_event(logger, logging.INFO, "implicit identity on", tokenizer=str(source),
              exact=tokenizer.exact)
    return Fingerprinter(tokenizer, markers)


def _model_path(props: Mapping[str, Any] | None) -> Path | None:
    if not props:
        return None
    path = props.get("model_path")
    if isinstance(path, str) and path and Path(path).is_file():
        return Path(path)
    return None
