"""Windowed renderings: a conversation's template rendering, the engine rendering only the
turns from its last user message on.

Anchoring and the prompt-end snapshot (``anchor``) need several renderings of the whole
conversation after each turn, the restore check one before a restore, and the planner's
comparison of a rewritten history two (``session.affinity``). Only the engine's template
knows how a conversation renders
(Qwen3.5's rewrites earlier assistant turns), so the engine renders it (``/apply-template``),
but not the whole of it every time. A rendering here is spliced from the session's previous
one and a *window*: the template applied to the leading system messages and the messages
from a user message on. Templates render each turn from the turn itself, the messages after
it and the last user query (Qwen3.5 drops the reasoning of assistant turns before it): a
window that starts at a user message the previous rendering already had sees everything a
turn after it depends on, and the turns before it render as they did.

Nothing of that is assumed: the window the previous rendering would have had is rendered
too (or kept from the previous splice), and it must end with the same text as the previous
rendering, after a start that is the previous rendering's own start (the header: the
system messages, the tools). The text the two share at their ends is what the window's
messages render to in the whole conversation; the new window's text from the same point
takes its place, once it is seen to start as the previous window did through the text of
its first message (the same message in both). A template whose header or turns depend on
what a window leaves out (a count of messages) fails those checks, or refuses to render a
window at all (Gemma's alternation check), and the conversation is rendered whole; so is
a body whose tools or template flags changed. Counted in
``prefixpin_template_renderings_total``, the reason logged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from prefixpin.core.errors import ProxyError
from prefixpin.proxy.session.tokens import common_text_prefix, common_text_suffix

Render = Callable[[Mapping[str, Any]], Awaitable[str]]
Messages = Sequence[Mapping[str, Any]]

R = TypeVar("R")

_HEAD_ROLES = frozenset({"system", "developer"})
# Request fields no chat template reads (sampling, streaming, the engine's own controls):
# renderings whose bodies differ only in these are spliced; any other difference (tools,
# ``chat_template_kwargs``, ...) has the conversation rendered whole.
_UNRENDERED = frozenset({
    "model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "n_predict",
    "temperature", "top_p", "top_k", "min_p", "typical_p", "seed", "stop", "logit_bias",
    "logprobs", "top_logprobs", "n_probs", "presence_penalty", "frequency_penalty",
    "repeat_penalty", "repeat_last_n", "dynatemp_range", "dynatemp_exponent", "mirostat",
    "mirostat_tau", "mirostat_eta", "xtc_probability", "xtc_threshold", "dry_multiplier",
    "dry_base", "dry_allowed_length", "dry_penalty_last_n", "samplers", "n", "user",
    "metadata", "cache_prompt", "id_slot", "return_progress", "timings_per_token",
    "t_max_predict_ms", "n_keep", "n_discard", "n_cmpl"})


@dataclass(frozen=True, slots=True)
class Rendered:
    """A body's rendering, and the window it was spliced with: ``window`` is the template
    applied to the leading system messages and ``messages[start:]`` (``start`` 0: none)."""

    messages: tuple[Mapping[str, Any], ...]
    rest: Mapping[str, Any]  # the body but its messages: the tools, the template's flags
    text: str
    start: int = 0
    window: str = ""


class LastRenderings(Generic[R]):
    """Each session's last rendering (a ``Rendered`` text, or its tokens:
    ``renderings.Rendering``), for the next one to build on: ``bound`` sessions at most,
    the least recently kept out first."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._kept: OrderedDict[str, R] = OrderedDict()

    def get(self, session_id: str) -> R | None:
        return self._kept.get(session_id)

    def keep(self, session_id: str, rendered: R) -> None:
        self._kept[session_id] = rendered
        self._kept.move_to_end(session_id)
        while len(self._kept) > self.bound:
            self._kept.popitem(last=False)

    def forget(self, session_id: str) -> None:
        self._kept.pop(session_id, None)

    def clear(self) -> None:
        self._kept.clear()


@dataclass(frozen=True, slots=True)
class Outcome:
    rendered: Rendered
    how: str  # "first", "window" or "whole" (a window did not fit, ``why`` says why)
    why: str = ""


async def render_body(render: Render, body: Mapping[str, Any],
                      last: Rendered | None) -> Outcome:
    """``body``'s rendering, from a window spliced onto ``last`` where that fits."""
    messages = tuple(body.get("messages") or ())
    rest = {key: value for key, value in body.items() if key != "messages"}
    if last is None:
        return Outcome(await _whole(render, body, messages, rest), "first")
    shared = _shared(last.messages, messages)
    if rest == last.rest and shared == len(messages) == len(last.messages):
        return Outcome(last, "window")  # the very body: nothing to render
    why = _unfit(last, messages, rest, shared)
    start = None if why else _window_start(last.messages, messages, shared)
    if start is None:
        return Outcome(await _whole(render, body, messages, rest), "whole",
                       why or "no user message to start a window at")
    try:
        spliced = await _spliced(render, last, messages, rest, start)
    except ProxyError as exc:  # a template that refuses a window (Gemma's alternation)
        spliced, why = None, f"the template refused a window: {exc.message}"
    if spliced is None:
        return Outcome(await _whole(render, body, messages, rest), "whole",
                       why or "the window's text does not end the whole rendering")
    return Outcome(spliced, "window")


async def _whole(render: Render, body: Mapping[str, Any], messages: tuple[Mapping[str, Any], ...],
                 rest: Mapping[str, Any]) -> Rendered:
    return Rendered(messages, rest, await render(body))


def _unfit(last: Rendered, messages: Messages, rest: Mapping[str, Any], shared: int) -> str:
    """Why no window fits ``messages`` after ``last`` (which shares ``shared`` of them)."""
    changed = sorted(key for key in {*rest, *last.rest} - _UNRENDERED
                     if rest.get(key) != last.rest.get(key))
    if changed:
        return f"the body's {', '.join(changed)} changed"
    head = _head(messages)
    if head != _head(last.messages) or shared < head:
        return "the system messages changed"
    return ""


def _head(messages: Messages) -> int:
    """How many messages lead with the system's roles (every window starts with them)."""
    count = 0
    for message in messages:
        if message.get("role") not in _HEAD_ROLES:
            break
        count += 1
    return count


def _shared(a: Messages, b: Messages) -> int:
    """How many leading messages ``a`` and ``b`` share (the same objects, or equal)."""
    n = min(len(a), len(b))
    for index in range(n):
        if a[index] is not b[index] and a[index] != b[index]:
            return index
    return n


def _window_start(before: Messages, messages: Messages, shared: int) -> int | None:
    """The last user message after the system messages that ``before`` had where
    ``messages`` has it (of the ``shared`` leading ones): the last user query of ``before``
    is at or after it, so every turn before it rendered as it will now."""
    head = _head(messages)
    for index in range(shared - 1, head - 1, -1):  # the message itself shared too
        if before[index].get("role") == "user":
            return index
    return None


async def _spliced(render: Render, last: Rendered, messages: tuple[Mapping[str, Any], ...],
                   rest: Mapping[str, Any], start: int) -> Rendered | None:
    head = list(messages[:_head(messages)])
    if start == len(head):  # the window is the conversation
        text = await render({**rest, "messages": list(messages)})
        return Rendered(messages, rest, text, start, text)
    before = (last.window if last.start == start and last.window else
              await render({**rest, "messages": [*head, *last.messages[start:]]}))
    after = await render({**rest, "messages": [*head, *messages[start:]]})
    tail = common_text_suffix(last.text, before)
    lead = len(before) - tail  # the window's own start: the header, nothing of its turns
    if tail == 0 or lead > len(last.text) - tail or not last.text.startswith(before[:lead]):
        return None
    if not _same_header(before, after, messages[start]):
        return None
    text = last.text[:len(last.text) - tail] + after[lead:]
    return Rendered(messages, rest, text, start, after)


def _same_header(before: str, after: str, first: Mapping[str, Any]) -> bool:
    """The two windows start alike through the text of their first message (the same
    message in both): the header before it did not change with the turns after it."""
    text = _text_of(first)
    shared = common_text_prefix(before, after)
    return bool(text) and before.find(text, 0, shared) >= 0


def _text_of(message: Mapping[str, Any]) -> str:
    """A message's text as a template writes it: its string content, or its first text
    part's."""
    content = message.get("content")
    if isinstance(content, str):
        return content.strip()  # (templates that trim it: Qwen3.5's)
    for part in content if isinstance(content, list) else ():
        if isinstance(part, Mapping) and isinstance(part.get("text"), str):
            return str(part["text"]).strip()
    return ""
