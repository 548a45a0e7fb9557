"""From chat messages to a segment chain, tokenizing each distinct message once.

Each message is reduced to a canonical *fingerprint view* that drops what clients
rewrite between turns (reasoning, think blocks, tool-call JSON formatting, the tail of
old tool results), wrapped in the model's own message markers, tokenized, and the
per-message token runs are chained (:mod:`fingerprint.chain`). The view is a
fingerprint, not a prompt: the engine never sees it, and bytes still decide.

The tokenizer is reached only through :class:`Encoder`, so this module stays free of
I/O and tests can hand it the real tokenizer.
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from blake3 import blake3

from prefixpin.fingerprint.chain import DEFAULT_EDGE, Chain, extend, start_chain

__all__ = [
    "CHECKPOINT_EVERY",
    "EDGE_CHARS",
    "TOOL_RESULT_CHARS",
    "CacheStats",
    "ChainMemo",
    "Encoder",
    "Markers",
    "MessageTokenCache",
    "chain_for_messages",
    "edge_texts",
    "fingerprint_view",
    "prefix_keys",
]

# Agents trim old tool results (a sliding window cuts them to 400 chars): a view that
# keeps only the first 256 survives any trim that keeps at least that much.
TOOL_RESULT_CHARS = 256

# A segment is hashed by its edge tokens only (``DEFAULT_EDGE`` at each end): a longer view
# is tokenized as its first and its last this many characters, apart, never its interior.
# A new session arriving with a long history then costs a few dozen characters a message.
EDGE_CHARS = 64

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"


class Encoder(Protocol):
    """The one tokenizer call the fingerprint needs: text in, token ids out."""

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class Markers:
    """How a message view is wrapped before tokenizing, and which ids open a message.

    ``open`` and ``close`` are the model's own turn markers (``<|im_start|>`` and
    ``<|im_end|>\\n`` for ChatML); ``openers`` are the control-token ids that ``open``
    tokenizes to, where segments start.
    """

    open: str
    close: str
    openers: frozenset[int]

    def wrap(self, view: str) -> str:
        return f"{self.open}{view}{self.close}"


def fingerprint_view(message: Mapping[str, object]) -> str:
    """The canonical text of ``message`` that its fingerprint segment is built from.

    Role, then visible content, then one ``name(args)`` line per tool call with the
    arguments as canonical JSON. Reasoning (``reasoning_content``, ``<think>`` blocks)
    is excluded; a ``tool`` message keeps only its first :data:`TOOL_RESULT_CHARS`
    characters.
    """
    role = str(message.get("role") or "")
    text = _visible_text(message.get("content"))
    if role == "tool":
        body = text.lstrip()[:TOOL_RESULT_CHARS].rstrip()
    else:
        body = _without_reasoning(text).strip()
    calls = _tool_call_lines(message.get("tool_calls"))
    return "\n".join([role, body, *calls])


@dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class MessageTokenCache:
    """A bounded LRU of token runs keyed by blake3 of the wrapped view text.

    A long conversation then costs only its new messages. Bounded both in entries and in
    cached tokens (ids are stored as packed uint32). A cache belongs to one tokenizer:
    the key is the text alone. Safe to share between threads.
    """

    def __init__(self, max_entries: int = 4096, max_tokens: int = 4_000_000) -> None:
        if max_entries < 1 or max_tokens < 1:
            raise ValueError("max_entries and max_tokens must be at least 1")
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self.stats = CacheStats()
        self._runs: OrderedDict[bytes, array[int]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._runs)

    @property
    def cached_tokens(self) -> int:
        return self._tokens

    def tokens(self, text: str, encoder: Encoder, scope: bytes = b"") -> array[int]:
        """The token ids of ``text``, from the cache or from ``encoder``.

        Entries are found only in the ``scope`` they were stored in (the proxy's tenant):
        how fast a text is fingerprinted tells nobody what another tenant sent.
        """
        # JSON can carry lone surrogates, which no tokenizer accepts: they become "?".
        data = text.encode("utf-8", "replace")
        key = blake3(_scoped(scope) + data).digest()
        with self._lock:
            run = self._runs.get(key)
            if run is not None:
                self._runs.move_to_end(key)
                self.stats.hits += 1
                return run
            self.stats.misses += 1
        # Tokenize outside the lock, so one long message does not stall other threads.
        run = array("I", encoder.encode(data.decode("utf-8")))
        self._store(key, run)
        return run

    def _store(self, key: bytes, run: array[int]) -> None:
        if len(run) > self.max_tokens:
            return  # larger than the whole budget: caching it would evict everything
        with self._lock:
            if key in self._runs:
                return  # another thread tokenized the same text meanwhile
            self._runs[key] = run
            self._tokens += len(run)
            while len(self._runs) > self.max_entries or self._tokens > self.max_tokens:
                _, evicted = self._runs.popitem(last=False)
                self._tokens -= len(evicted)
                self.stats.evictions += 1


def chain_for_messages(
    messages: Iterable[Mapping[str, object]],
    encoder: Encoder,
    cache: MessageTokenCache,
    markers: Markers,
    *,
    edge: int = DEFAULT_EDGE,
    base: Chain | None = None,
    scope: bytes = b"",
) -> Chain:
    """The fingerprint chain of a chat request's messages (after ``base``'s, if given).

    Equal to hashing the concatenated wrapped views in one piece (each message's first
    run starts with an opener) where no view is longer than ``2 * EDGE_CHARS``, and to
    within the tokens next to a cut otherwise (``edge_texts``); only texts the cache has
    not seen (in ``scope``) are tokenized.
    """
    runs = [cache.tokens(text, encoder, scope) for message in messages
            for text in edge_texts(fingerprint_view(message), markers)]
    return extend(base if base is not None else start_chain(markers.openers, edge), *runs)


def edge_texts(view: str, markers: Markers) -> tuple[str, ...]:
    """What of a message's view is tokenized: the view wrapped in the model's markers, or,
    past ``2 * EDGE_CHARS``, its wrapped opening and its wrapped end apart (the end's run
    continues the opening's segment). The tokens next to a cut may differ from those of
    the whole text, but the same view always gives the same ones, and the segment's
    digest reads only its first and last tokens."""
    if len(view) <= 2 * EDGE_CHARS:
        return (markers.wrap(view),)
    return (markers.open + view[:EDGE_CHARS], view[-EDGE_CHARS:] + markers.close)


# Chains are memoised at every CHECKPOINT_EVERY-th message as well as at the end of each
# request: a client that rewrites message 40 of 64 still finds the chain of its first 32.
# And after the first message: the system prompt every new conversation of a client starts
# with is then chained once, not once per conversation.
CHECKPOINT_EVERY = 16

_PREFIX_DOMAIN = b"prefixpin.fingerprint.prefix.v1"


def prefix_keys(digests: Sequence[bytes], scope: bytes = b"") -> list[bytes]:
    """One key per message prefix: ``keys[i]`` commits to ``scope`` and ``digests[0..i]``.

    ``digests`` are per-message digests of the bytes the client sent (any collision-
    resistant digest): equal keys mean equal message prefixes in the same scope.
    """
    return extend_prefix_keys(blake3(_PREFIX_DOMAIN + _scoped(scope)).digest(), digests)


def extend_prefix_keys(last: bytes, digests: Sequence[bytes]) -> list[bytes]:
    """The keys of the prefixes that ``digests`` add to the prefix whose key is ``last``:
    ``prefix_keys(a + b, scope)`` is ``prefix_keys(a, scope)`` followed by
    ``extend_prefix_keys(prefix_keys(a, scope)[-1], b)``."""
    keys: list[bytes] = []
    previous = last
    for message_digest in digests:
        previous = blake3(previous + message_digest).digest()
        keys.append(previous)
    return keys


class ChainMemo:
    """Chains of message prefixes already computed, keyed by :func:`prefix_keys`.

    An agent resends its whole history every turn: the chain of the longest prefix seen
    before is extended by the new messages only, so a 64-message conversation costs what
    its last turn added, not 64 fingerprint views. A memo belongs to one tokenizer, one
    set of markers and one normalisation of the messages (the key is the client's bytes
    and its scope). A bounded LRU; safe to share between threads.
    """

    def __init__(self, max_entries: int = 2048) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self._chains: OrderedDict[bytes, Chain] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._chains)

    def longest(self, keys: Sequence[bytes]) -> tuple[int, Chain | None]:
        """How many leading messages the longest memoised prefix covers, and its chain."""
        with self._lock:
            for covered in range(len(keys), 0, -1):
                chain = self._chains.get(keys[covered - 1])
                if chain is not None:
                    self._chains.move_to_end(keys[covered - 1])
                    return covered, chain
        return 0, None

    def put(self, key: bytes, chain: Chain) -> None:
        with self._lock:
            self._chains[key] = chain
            self._chains.move_to_end(key)
            while len(self._chains) > self.max_entries:
                self._chains.popitem(last=False)

    def extend(self, keys: Sequence[bytes], covered: int, chain: Chain,
               messages: Sequence[Mapping[str, object]], encoder: Encoder,
               cache: MessageTokenCache, markers: Markers, scope: bytes = b"") -> Chain:
        """``chain`` (of the first ``covered`` messages) extended by ``messages``, the rest
        of the request, memoising checkpoints and the whole request's chain on the way;
        ``scope``: that of the keys, for the token cache."""
        # One chain_for_messages call a run of messages up to the next checkpoint (the
        # chain is the same however its runs are grouped): each call copies the digests.
        stop = covered + len(messages)
        start = covered
        while start < stop:
            end = min(stop, 1 if start == 0 else (start // CHECKPOINT_EVERY + 1) * CHECKPOINT_EVERY)
            chain = chain_for_messages(messages[start - covered:end - covered], encoder, cache,
                                       markers, base=chain, scope=scope)
            self.put(keys[end - 1], chain)
            start = end
        return chain


def _scoped(scope: bytes) -> bytes:
    # Length-prefixed, so no scope and text can run into another scope's text.
    return len(scope).to_bytes(4, "little") + scope


def _visible_text(content: object) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_part_text(part) for part in content)
    return _canonical_json(content)


def _part_text(part: object) -> str:
    if not isinstance(part, Mapping):
        return _visible_text(part)
    if part.get("type") in ("text", "input_text", "output_text"):
        return str(part.get("text") or "")
    # An image or audio part: its kind is structure, its payload is left to bytes.
    return f"[{part.get('type')}]"


def _without_reasoning(text: str) -> str:
    if "think>" not in text:
        return text  # the common case, found at memory speed
    text = _THINK_BLOCK.sub("", text)
    # A template that opens the think block itself leaves only the closing tag in the
    # reply; what precedes it is reasoning.
    _, closed, after = text.rpartition(_THINK_CLOSE)
    text = after if closed else text
    # An unterminated block (a reply cut off while thinking) is reasoning to the end.
    return text.partition(_THINK_OPEN)[0]


def _tool_call_lines(tool_calls: object) -> list[str]:
    if not isinstance(tool_calls, list):
        return []
    return [_tool_call_line(call) for call in tool_calls]


def _tool_call_line(call: object) -> str:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        return f"?({_canonical_json(call)})"
    return f"{function.get('name') or ''}({_canonical_arguments(function.get('arguments'))})"


def _canonical_arguments(arguments: object) -> str:
    # Clients re-serialize tool-call JSON (key order, spacing); the view parses it back.
    if isinstance(arguments, str):
        try:
            return _canonical_json(json.loads(arguments))
        except ValueError:
            return arguments.strip()
    return _canonical_json(arguments)


def _canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str)
