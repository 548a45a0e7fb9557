"""Moving compaction: the oldest messages are dropped, the cut recomputed every step.

Imitates clients that fit the history into a token budget from the end on every call,
such as LangChain's ``trim_messages(strategy="last", include_system=True)`` inside an agent
loop, and the field report in docs/design.md §1 ("Clients rewrite, they don't extend": an
agent recomputes its compaction cut point every step); issue 4's client 5. The system
prompt stays; the oldest messages that do not fit are dropped; the cut never lands on a
tool result (it would be orphaned from its call). Once the history outgrows the budget the
cut moves forward almost every step, so the first difference from the previous request
sits right after the system prompt.
"""

from __future__ import annotations

from typing import ClassVar

from bench.clients.base import Client
from bench.transcript import Message, Transcript

BUDGET_TOKENS = 1500
CHARS_PER_TOKEN = 3.4  # the client's own estimate; measured for SmolLM2 on these texts


def message_tokens(message: Message) -> int:
    text = (message.get("content") or "") + (message.get("reasoning_content") or "")
    text += "".join(call["function"]["arguments"] for call in message.get("tool_calls", []))
    return int(len(text) / CHARS_PER_TOKEN) + 4  # + the role and separator tokens


def cut_point(messages: list[Message]) -> int:
    """Index of the first non-system message kept (1 keeps everything)."""
    total = 0
    cut = len(messages)
    for index in range(len(messages) - 1, 0, -1):
        total += message_tokens(messages[index])
        if total > BUDGET_TOKENS:
            break
        cut = index
    while cut < len(messages) and messages[cut]["role"] == "tool":
        cut += 1
    return cut


class CompactionClient(Client):
    name: ClassVar[str] = "compaction"
    rewrites: ClassVar[bool] = True

    def messages(self, transcript: Transcript, step: int) -> list[Message]:
        messages = super().messages(transcript, step)
        return [messages[0], *messages[cut_point(messages):]]

    def claims_rewrite(self, transcript: Transcript, step: int) -> bool:
        now = cut_point(transcript.history_before(step))
        return now > cut_point(transcript.history_before(step - 1))
