"""System messages in the middle of a conversation, for chat templates that refuse them.

Claude Code (2.1.208 and later) sends ``role: "system"`` messages inside ``messages``
(its agent list, hook output), Codex ``developer`` ones after its instructions (which
llama-server renders as system messages), and so do other harnesses that inject per-turn
context.
Qwen3.x chat templates raise "System message must be at the beginning." on any system
message that is not the first, so llama-server answers every such request with a 500.
Gateways that hoist those messages into the leading system prompt make the request
render, but move bytes into the prefix every turn: the cache is lost from the first one.

prefixpin renders each such message where it stands instead, as a user turn whose text is
the system text inside ``<system-reminder>`` tags (the form Claude Code itself uses for
system text it puts in user turns). The rewrite depends on the message alone, so the same
history renders to the same bytes every turn, and the prefix holds. Only lanes whose
template refuses a mid-conversation system message get it (asked once per engine start,
``refuses_mid_system``); every other template keeps the client's messages as they are.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

from prefixpin.adapters.base import Adapter
from prefixpin.core.errors import UpstreamError
from prefixpin.proxy.session.resent import PrefixMemo

OPEN, CLOSE = "<system-reminder>\n", "\n</system-reminder>"

# A conversation any chat template renders, but for the second system message.
_PROBE = [{"role": "system", "content": "You are terse."},
          {"role": "user", "content": "Hello."},
          {"role": "assistant", "content": "Hi."},
          {"role": "system", "content": "Answer in English."},
          {"role": "user", "content": "Bye."}]


async def refuses_mid_system(adapter: Adapter) -> bool:
    """Whether the engine's template refuses the probe conversation but renders it without
    its second system message (an engine that renders neither is left alone)."""
    if not adapter.capabilities.render:
        return False
    try:
        await adapter.apply_template({"messages": _PROBE})
    except UpstreamError:
        try:
            await adapter.apply_template({"messages": [m for i, m in enumerate(_PROBE)
                                                       if i != 3]})
        except UpstreamError:
            return False
        return True
    return False


# llama-server renders a ``developer`` message as a system one (Codex sends its permissions
# and instructions so, after the leading system message its Responses body converts to).
SYSTEM_ROLES = frozenset({"system", "developer"})


def has_mid_system(messages: object) -> bool:
    return isinstance(messages, list) and any(
        isinstance(m, Mapping) and m.get("role") in SYSTEM_ROLES for m in messages[1:])


def in_place(messages: Sequence[Any]) -> list[Any]:
    """``messages`` with every system message after the first position as a user turn."""
    return [messages[0], *(_as_user_turn(m) for m in messages[1:])] if messages else []


class SystemTurns:
    """``in_place`` for a router's requests: a follow-up's resent messages (the earlier
    request's objects) take their earlier rewrites, the very same objects, so only what
    the turn added is looked at, and later stages find the rewritten messages by identity
    as they find the client's."""

    def __init__(self) -> None:
        self._rewritten: PrefixMemo[Any] = PrefixMemo()

    def in_place(self, messages: object) -> list[Any] | None:
        """``in_place(messages)``, or None where no message past the first is a system
        message (nothing to rewrite)."""
        if not isinstance(messages, list) or len(messages) < 2:
            return None
        done = self._rewritten.shared(messages)
        rest = messages[len(done):]
        if not done:
            out = [messages[0], *(_as_user_turn(m) for m in rest[1:])]
        else:
            out = [*done, *(_as_user_turn(m) for m in rest)]
        self._rewritten.keep(messages, out)
        return None if all(map(operator.is_, out, messages)) else out


def _as_user_turn(message: Any) -> Any:
    if not isinstance(message, Mapping) or message.get("role") not in SYSTEM_ROLES:
        return message
    return {"role": "user", "content": OPEN + _text(message.get("content")) + CLOSE}


def _text(content: object) -> str:
    """A system message's text: a string, or its text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(part.get("text", "")) for part in content
                         if isinstance(part, Mapping) and part.get("type") == "text")
    return ""
