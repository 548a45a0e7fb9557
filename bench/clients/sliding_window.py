"""Sliding-window trim: tool results older than the last 6 messages cut to 400 characters.

Imitates the field report in docs/design.md ("Clients rewrite, they don't extend": an agent
trims old tool results with a sliding window, tool results older than the last N
messages cut to 400 chars) and issue 4's client 3. The window is measured from the end of
the history, so every step pushes one more full tool result out of it: the first
difference from the previous request moves forward every turn and sits about six
messages before the end.
"""

from __future__ import annotations

from typing import ClassVar

from bench.clients.base import Client
from bench.transcript import Message, Transcript

KEEP_LAST = 6
TRIM_TO = 400


def trimmed_ids(messages: list[Message]) -> set[str]:
    """tool_call_ids of the results the window cuts in this history."""
    cut = len(messages) - KEEP_LAST
    return {m["tool_call_id"] for i, m in enumerate(messages)
            if i < cut and m["role"] == "tool" and len(m["content"]) > TRIM_TO}


class SlidingWindowClient(Client):
    name: ClassVar[str] = "sliding-window"
    rewrites: ClassVar[bool] = True

    def messages(self, transcript: Transcript, step: int) -> list[Message]:
        messages = super().messages(transcript, step)
        cut = trimmed_ids(messages)
        for message in messages:
            if message["role"] == "tool" and message["tool_call_id"] in cut:
                message["content"] = message["content"][:TRIM_TO]
        return messages

    def claims_rewrite(self, transcript: Transcript, step: int) -> bool:
        # A result the previous request sent whole is cut now.
        previous = transcript.history_before(step - 1)
        sent_ids = {m["tool_call_id"] for m in previous if m["role"] == "tool"}
        newly_cut = trimmed_ids(transcript.history_before(step)) - trimmed_ids(previous)
        return bool(newly_cut & sent_ids)
