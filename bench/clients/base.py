"""What every replay client shares: the request it sends for one step of a transcript.

A client turns "the true transcript up to step k" into the request a real agent would
send at that point, deterministically. The assistant messages come from the transcript,
never from the model, so the model only has to prefill and emit a few tokens: the bench
measures the engine's prompt cache, not generation.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, ClassVar

from bench.transcript import JSON, Message, Transcript

MAX_TOKENS = 8  # a handful of tokens proves the prefill finished; decoding is not measured


@dataclass(frozen=True, slots=True)
class Request:
    """One request as the client sends it, with what the client says it did to history."""

    session: str
    step: int  # the transcript step (assistant answer) this request asks for
    body: JSON
    headers: dict[str, str]
    claims_rewrite: bool  # the client's own rule changed history it had sent before
    first_token_timeout_s: float | None = None  # give up and resend the identical body
    max_attempts: int = 1  # the last attempt waits however long it takes
    notes: dict[str, Any] = field(default_factory=dict)


def chat_body(messages: list[Message], tools: list[JSON]) -> JSON:
    """An OpenCode-shaped streaming chat request with greedy decoding."""
    return {
        "model": "bench",
        "messages": messages,
        "tools": tools,
        "tool_choice": "auto",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }


def session_headers(transcript: Transcript) -> dict[str, str]:
    """OpenCode sends both headers with the same value (docs/design.md §8)."""
    session_id = f"ses_{transcript.name}"
    return {"x-session-affinity": session_id, "x-session-id": session_id}


class Client:
    """Extend-only behaviour; subclasses override the hooks for their rewrite class."""

    name: ClassVar[str] = "extend-only"
    rewrites: ClassVar[bool] = False  # whether this class claims to rewrite history

    def messages(self, transcript: Transcript, step: int) -> list[Message]:
        return copy.deepcopy(transcript.history_before(step))

    def tools(self, transcript: Transcript, step: int) -> list[JSON]:
        return copy.deepcopy(list(transcript.tools))

    def claims_rewrite(self, transcript: Transcript, step: int) -> bool:
        """Whether this step's request changes something the previous request carried."""
        return False

    def request(self, transcript: Transcript, step: int) -> Request:
        return Request(
            session=transcript.name,
            step=step,
            body=chat_body(self.messages(transcript, step), self.tools(transcript, step)),
            headers=session_headers(transcript),
            claims_rewrite=step > 0 and self.claims_rewrite(transcript, step),
        )


def last_user_index(messages: list[Message]) -> int:
    return max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)


def estimate_tokens(text: str) -> int:
    """OpenCode's Token.estimate: characters / 4, rounded."""
    return round(len(text) / 4)
