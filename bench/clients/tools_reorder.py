"""Tools reordered and tool-call arguments re-serialized.

Imitates clients whose tool list is rebuilt per request from a registry with no stable
order (MCP servers reconnecting, maps iterated in insertion or hash order), and clients
that keep tool-call arguments as parsed objects and re-stringify them on replay, e.g. the
Vercel AI SDK, which OpenCode uses, with ``JSON.stringify`` (compact, no spaces) where the
model wrote ``{"path": "..."}`` (docs/design.md §1, "Clients rewrite, they don't
extend"; issue 4's client 7). Here the order changes every request (a deterministic
shuffle per step), and every assistant message except the newest is re-serialized with
sorted keys and compact separators: in a live session the engine holds the model's raw
text for the newest call; in the replay the previous request holds it.
"""

from __future__ import annotations

import json
import random
from typing import ClassVar

from bench.clients.base import Client
from bench.transcript import JSON, Message, Transcript


def reserialize(arguments: str) -> str:
    return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"))


def tool_order(transcript: Transcript, step: int) -> list[int]:
    """A permutation of the tools that differs from the previous step's."""
    order = list(range(len(transcript.tools)))
    random.Random(f"{transcript.name}:tools:{step}").shuffle(order)
    if step > 0 and order == tool_order(transcript, step - 1):
        order = order[1:] + order[:1]
    return order


class ToolsReorderClient(Client):
    name: ClassVar[str] = "tools-reorder"
    rewrites: ClassVar[bool] = True

    def tools(self, transcript: Transcript, step: int) -> list[JSON]:
        tools = super().tools(transcript, step)
        return [tools[i] for i in tool_order(transcript, step)]

    def messages(self, transcript: Transcript, step: int) -> list[Message]:
        messages = super().messages(transcript, step)
        newest = max((i for i, m in enumerate(messages) if m["role"] == "assistant"),
                     default=-1)
        for index, message in enumerate(messages):
            if index == newest:
                continue
            for call in message.get("tool_calls", []):
                call["function"]["arguments"] = reserialize(call["function"]["arguments"])
        return messages

    def claims_rewrite(self, transcript: Transcript, step: int) -> bool:
        return tool_order(transcript, step) != tool_order(transcript, step - 1)
