"""Extend-only: the control. Every request is the previous one plus the new messages.

Imitates a client that replays its history verbatim, as OpenCode does for a model whose
``interleaved.field`` is ``reasoning_content`` (docs/design.md §8) or as the
``openai`` SDK does when the caller appends to one list. Nothing earlier ever changes, so
the engine's own prefix cache should already give full reuse: this is the flat line
every other client is compared with.
"""

from __future__ import annotations

from typing import ClassVar

from bench.clients.base import Client


class ExtendOnlyClient(Client):
    name: ClassVar[str] = "extend-only"
    rewrites: ClassVar[bool] = False
