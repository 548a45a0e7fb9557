"""Reasoning strip: earlier assistant turns come back without their reasoning.

Imitates OpenCode, which drops reasoning parts on replay unless the model's
``interleaved.field`` is ``reasoning_content`` (anomalyco/opencode#19081; docs/design.md
§8; Crow#60 measured 91-99% re-prefill on turn 2), and clients that strip ``<think>``
blocks from earlier turns (docs/design.md, "Clients rewrite"). In a live
session the engine holds the reasoning the model just produced and the client sends it
back without; the replay has no live generation, so this client sends the newest
assistant message as produced and strips it from the next request on, which puts the
same divergence (at the previous assistant message) in front of the engine every turn.

Both renderings are handled: ``reasoning_content`` is dropped, and an inline
``<think>...</think>`` block is cut from the content.
"""

from __future__ import annotations

import re
from typing import ClassVar

from bench.clients.base import Client
from bench.transcript import Message, Transcript

_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def has_reasoning(message: Message) -> bool:
    content = message.get("content") or ""
    return bool(message.get("reasoning_content")) or "<think>" in content


def strip_reasoning(message: Message) -> Message:
    stripped = {key: value for key, value in message.items() if key != "reasoning_content"}
    content = stripped.get("content")
    if isinstance(content, str) and "<think>" in content:
        stripped["content"] = _THINK.sub("", content) or None
    return stripped


def _newest_assistant(messages: list[Message]) -> int:
    return max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)


class ReasoningStripClient(Client):
    name: ClassVar[str] = "reasoning-strip"
    rewrites: ClassVar[bool] = True

    def messages(self, transcript: Transcript, step: int) -> list[Message]:
        messages = super().messages(transcript, step)
        newest = _newest_assistant(messages)
        return [strip_reasoning(m) if m["role"] == "assistant" and i != newest else m
                for i, m in enumerate(messages)]

    def claims_rewrite(self, transcript: Transcript, step: int) -> bool:
        # The previous request's newest assistant message carried reasoning; now it is old.
        previous = transcript.history_before(step - 1)
        newest = _newest_assistant(previous)
        return newest >= 0 and has_reasoning(previous[newest])
