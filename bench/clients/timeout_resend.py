"""Timeout and resend: a client gives up on a slow first token and resends the same body.

Imitates agents with a first-token or chunk timeout shorter than a long prefill: the
OpenAI SDK's 10-minute default (RooCodeInc/Roo-Code#3621), Cline's hard-coded 5 minutes
(cline/cline#9328), Aider through LiteLLM retrying after 0.2/0.5/1 s (BerriAI/litellm#8174),
OpenCode's ``chunkTimeout`` (docs/design.md §8), a 90 s first-token watchdog
(coddy-project/coddy-agent#121). Scaled to the bench: the session is resumed cold in the
middle (like ``opencode run -c`` after a restart), so the first request is a ~4k-token
prefill (~20 s on two cores) against a 5 s first-token timeout. The client closes the
connection at the timeout and resends the identical request, at most ``MAX_ATTEMPTS``
times; the last attempt waits for the answer so the turn can be measured. Later turns
are plain extensions and only time out if their prefill is slow.

The clock that triggers the timeout is the same one that stops TTFT: SSE comments and
progress-only chunks do not count as a first token (oh-my-pi#6524: "timed out while
waiting for the first event").
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from bench.clients.base import Client, Request
from bench.clients.compaction import message_tokens
from bench.transcript import Transcript

FIRST_TOKEN_TIMEOUT_S = 5.0
MAX_ATTEMPTS = 4
RESUME_AT_TOKENS = 3600


def resume_step(transcript: Transcript) -> int:
    """The first step whose prompt is estimated at ``RESUME_AT_TOKENS`` or more."""
    fixed = sum(len(str(tool)) for tool in transcript.tools) // 3
    for step in range(len(transcript.steps)):
        history = transcript.history_before(step)
        if fixed + sum(message_tokens(m) for m in history) >= RESUME_AT_TOKENS:
            return step
    return len(transcript.steps) - 1


class TimeoutResendClient(Client):
    name: ClassVar[str] = "timeout-resend"
    rewrites: ClassVar[bool] = False

    def request(self, transcript: Transcript, step: int) -> Request:
        return replace(super().request(transcript, step),
                       first_token_timeout_s=FIRST_TOKEN_TIMEOUT_S, max_attempts=MAX_ATTEMPTS)
