"""Many sessions at once: more sessions than engine slots, turns interleaved.

Imitates a daily driver's traffic (docs/design.md "Sessions evict each other"; issue 7): a main
agent, its sub-agents (OpenCode sends them with ``x-parent-session-id``) and a second
project in another terminal, all talking to one llama-server with 1-4 slots. Each
session only extends its own history; what breaks reuse is that the sessions take turns,
round-robin, so a session's slot has been handed to another session by the time it
returns. The harness checks that the run really had more sessions than slots.
"""

from __future__ import annotations

from typing import ClassVar

from bench.clients.base import Client

SESSIONS = 6


class InterleavedClient(Client):
    name: ClassVar[str] = "interleaved"
    rewrites: ClassVar[bool] = False
