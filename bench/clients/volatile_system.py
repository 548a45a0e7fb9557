"""Volatile system prompt: a per-request nonce at the top of the system prompt.

Imitates Claude Code's attribution line ``x-anthropic-billing-header: cc_version=...;
cc_entrypoint=cli; cch=<nonce>;`` in ``system[0]``, which changes on every request and
gives 0% prefix-cache reuse on llama.cpp (anthropics/claude-code#68900 and #50085,
docs/design.md §1 and §8: a timestamp or a per-request nonce in the system prompt). The
line comes first, so the first difference is a few tokens into the prompt and every
turn re-prefills everything.
"""

from __future__ import annotations

import hashlib
from typing import ClassVar

from bench.clients.base import Client
from bench.transcript import Message, Transcript


def billing_line(session: str, step: int) -> str:
    nonce = hashlib.blake2b(f"{session}:{step}".encode(), digest_size=3).hexdigest()[:5]
    return f"x-anthropic-billing-header: cc_version=2.1.37.4f1; cc_entrypoint=cli; cch={nonce};"


class VolatileSystemClient(Client):
    name: ClassVar[str] = "volatile-system"
    rewrites: ClassVar[bool] = True

    def messages(self, transcript: Transcript, step: int) -> list[Message]:
        messages = super().messages(transcript, step)
        system = messages[0]
        system["content"] = billing_line(transcript.name, step) + "\n" + system["content"]
        return messages

    def claims_rewrite(self, transcript: Transcript, step: int) -> bool:
        return billing_line(transcript.name, step) != billing_line(transcript.name, step - 1)
