"""Implicit session identity: chat messages to a chain of segment hashes.

Sans-IO except :mod:`fingerprint.tokenizer`, which loads the model's tokenizer from a
file. See :mod:`fingerprint.chain` for what a chain is and why it hashes only the edges
of each segment.
"""

from prefixpin.fingerprint.chain import (
    DEFAULT_BAR,
    DEFAULT_EDGE,
    Chain,
    Edges,
    chain,
    extend,
    nominates,
    segment_bounds,
    shared_leading,
    start_chain,
)
from prefixpin.fingerprint.messages import (
    CHECKPOINT_EVERY,
    EDGE_CHARS,
    TOOL_RESULT_CHARS,
    CacheStats,
    ChainMemo,
    Encoder,
    Markers,
    MessageTokenCache,
    chain_for_messages,
    edge_texts,
    extend_prefix_keys,
    fingerprint_view,
    prefix_keys,
)

__all__ = [
    "CHECKPOINT_EVERY",
    "DEFAULT_BAR",
    "DEFAULT_EDGE",
    "EDGE_CHARS",
    "TOOL_RESULT_CHARS",
    "CacheStats",
    "Chain",
    "ChainMemo",
    "Edges",
    "Encoder",
    "Markers",
    "MessageTokenCache",
    "chain",
    "chain_for_messages",
    "edge_texts",
    "extend",
    "extend_prefix_keys",
    "fingerprint_view",
    "nominates",
    "prefix_keys",
    "segment_bounds",
    "shared_leading",
    "start_chain",
]
