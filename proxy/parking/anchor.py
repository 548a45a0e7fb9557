"""Anchoring: the slot made to hold what the session's next request will start with, before
it is parked, so that a restore of its file is an extension.

On recurrent and hybrid memory (Qwen3.5/3.6, Qwen3-Next, Nemotron-H, ...) the engine cannot
roll a slot back: it resumes from a context checkpoint at or before the first token that
changed, and a restored slot has none. After a turn the slot holds the prompt and the
reply as generated; the next request renders that reply again (Qwen3.5's template drops
its reasoning), so it parts from the slot a few tokens before its end, and a restored file
would be re-processed from token 0. Anchoring evaluates, on the session's own idle slot
and generating nothing, the history with the reply as the next request will render it, up
to where that request starts to differ (its next user turn); the file saved then is a
prefix of every next request. The cost is the re-rendered reply, which the next turn would
pay anyway, moved into the time the user or the tool takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adapters.base import Adapter
from proxy.tokens import common_prefix

# Two next user turns that differ from their first character: what the two renderings share
# is what every next request will start with.
_NEXT_TURNS = ("A", "0\n")


async def next_request_opening(adapter: Adapter, body: Mapping[str, Any],
                               reply: Mapping[str, Any] | None) -> list[int] | None:
    """The tokens every next request of this conversation starts with: ``body``'s messages,
    the ``reply`` as the template renders an earlier assistant turn, up to the next user
    turn's text. None for a body without messages, or no reply to anchor."""
    messages = body.get("messages")
    if not isinstance(messages, list) or reply is None:
        return None
    renderings = []
    for text in _NEXT_TURNS:
        prompt = await adapter.apply_template(
            {**body, "messages": [*messages, dict(reply), {"role": "user", "content": text}]})
        renderings.append(await adapter.tokenize(prompt, add_special=True))
    first, second = renderings
    return first[:common_prefix(first, second)]
