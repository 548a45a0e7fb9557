"""OpenCode-style prune: old tool outputs beyond a protected window are cleared.

Imitates OpenCode's ``SessionCompaction.prune`` (anomalyco/opencode
``packages/opencode/src/session/compaction.ts``; docs/design.md §8): when a user turn
completes, walk the history backwards, skip the last two user turns, count tool-output
tokens (characters / 4); once ``PRUNE_PROTECT`` tokens are counted, every older output
is a candidate; stop at an output pruned earlier; prune the candidates only if they free
more than ``PRUNE_MINIMUM`` tokens. A pruned output is sent as the exact marker
``[Old tool result content cleared]`` from then on (``message-v2.ts`` ``toModelMessages``).

OpenCode's thresholds are 40,000 and 20,000 tokens; a bench session is ~5k tokens, so
both are scaled by 1/80 (500 and 250) to keep the behaviour, including how rarely and
how deep it rewrites.
"""

from __future__ import annotations

from typing import ClassVar

from bench.clients.base import Client, estimate_tokens
from bench.transcript import Message, Transcript

PRUNE_PROTECT = 500
PRUNE_MINIMUM = 250
CLEARED = "[Old tool result content cleared]"


def prune_once(messages: list[Message], compacted: frozenset[str]) -> frozenset[str]:
    """One run of the prune pass over ``messages``; returns the new compacted set."""
    user_turns = total = pruned = 0
    candidates: list[str] = []
    for message in reversed(messages):
        if message["role"] == "user":
            user_turns += 1
        if user_turns < 2 or message["role"] != "tool":
            continue
        if message["tool_call_id"] in compacted:
            break
        estimate = estimate_tokens(message["content"])
        total += estimate
        if total > PRUNE_PROTECT:
            pruned += estimate
            candidates.append(message["tool_call_id"])
    return compacted | frozenset(candidates) if pruned > PRUNE_MINIMUM else compacted


def compacted_before(transcript: Transcript, step: int) -> frozenset[str]:
    """Outputs pruned by the passes that ran at the end of each user turn before ``step``."""
    history = transcript.history_before(step)
    compacted: frozenset[str] = frozenset()
    for end, message in enumerate(history):
        turn_done = message["role"] == "assistant" and not message.get("tool_calls")
        if turn_done:
            compacted = prune_once(history[: end + 1], compacted)
    return compacted


class PruneClient(Client):
    name: ClassVar[str] = "prune"
    rewrites: ClassVar[bool] = True

    def messages(self, transcript: Transcript, step: int) -> list[Message]:
        messages = super().messages(transcript, step)
        compacted = compacted_before(transcript, step)
        for message in messages:
            if message["role"] == "tool" and message["tool_call_id"] in compacted:
                message["content"] = CLEARED
        return messages

    def claims_rewrite(self, transcript: Transcript, step: int) -> bool:
        return compacted_before(transcript, step) != compacted_before(transcript, step - 1)
