"""History repair: keep a session's prefix byte-stable when its client rewrites history.

Agent clients strip reasoning from earlier turns, re-serialize tool-call arguments, trim
or clear old tool results, drop their oldest messages, put timestamps in the system prompt
and reorder tools. Each rewrite moves the first differing token to the earliest point it
touched, and the engine re-prefills everything after it. Repair turns the incoming history
back into the session's committed one, message by message, by named policies:

    reasoning     an assistant message whose visible content is unchanged but whose
                  reasoning (``reasoning_content``, a ``<think>`` block; Ollama's
                  ``thinking`` and ``reasoning``) was dropped
    tool_calls    tool-call arguments re-serialized (key order, spacing), same JSON value
                  (Ollama's native arguments are objects), or a call's ``id``/``index``
                  dropped (ollama-python keeps only a call's name and arguments)
    tool_results  a tool result (same ``tool_call_id``, or Ollama's ``tool_name``)
                  shortened, truncated or cleared
    window        early messages dropped (a moved compaction point): they are re-added
    volatile      system text whose only change is a volatile value (dates, times, the
                  Claude Code billing line, request nonces): the first value is kept
    tools         the same tool set in another order or key order
    reminders     a user message whose only change is in its ``<system-reminder>`` blocks
                  (Claude Code adds, drops and moves them between turns): the committed
                  message is kept

Rules. A policy only ever restores bytes this same session forwarded before (the
committed history, or the reply the proxy returned to it), only at a message whose
predecessors already equal the committed history, and only within a token budget (85% of
the engine's per-slot context). Over budget, tool results are trimmed by the proxy itself,
deterministically, before a cut point pinned in the session; when the cut must move, it
moves to 70% of the budget so that it does not move again next step. The same input
always gives the same output. Every repair is counted by policy and logged.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixpin.proxy.session.history import canonical, canonical_bytes, digest

POLICIES = ("reasoning", "tool_calls", "tool_results", "window", "volatile", "tools",
            "reminders")
TRIM_CHARS = 400
TRIM_MARK = "\n[... trimmed by prefixpin to fit the context]"

Message = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class VolatileRule:
    name: str
    pattern: re.Pattern[str]


DEFAULT_VOLATILE = (
    VolatileRule("claude_billing", re.compile(r"x-anthropic-billing-header:[^\n]*")),
    VolatileRule("iso_datetime", re.compile(
        r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?")),
    VolatileRule("clock_time", re.compile(r"\b\d{1,2}:\d{2}:\d{2}(?:\.\d+)?\b")),
    VolatileRule("text_date", re.compile(
        r"\b(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]*,? \d{1,2} [A-Z][a-z]+ \d{4}\b"
        r"|\b(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)[a-z]* [A-Z][a-z]{2} \d{1,2},? \d{4}\b"
        r"|\b[A-Z][a-z]+ \d{1,2}, \d{4}\b")),
    VolatileRule("nonce", re.compile(r"(?i)\b(?:nonce|request[-_ ]?id)\s*[:=]\s*[\w.-]+")),
    VolatileRule("unix_time", re.compile(r"\b1[6-9]\d{8}(?:\.\d+)?\b")),
)


@dataclass(frozen=True, slots=True)
class RepairConfig:
    enabled: frozenset[str] = frozenset(POLICIES)
    volatile: tuple[VolatileRule, ...] = DEFAULT_VOLATILE
    budget_fraction: float = 0.85
    move_fraction: float = 0.70

    @classmethod
    def from_switches(cls, switches: Mapping[str, bool],
                      extra_rules: Sequence[str] = ()) -> RepairConfig:
        rules = DEFAULT_VOLATILE + tuple(VolatileRule(f"custom_{i}", re.compile(r))
                                         for i, r in enumerate(extra_rules))
        return cls(frozenset(p for p in POLICIES if switches.get(p, True)), rules)


@dataclass(frozen=True, slots=True)
class Applied:
    policy: str
    index: int
    detail: str

    def line(self) -> str:
        return f"{self.policy} at message {self.index}: {self.detail}"


@dataclass(slots=True)
class Repaired:
    body: dict[str, Any]
    applied: list[Applied] = field(default_factory=list)
    complete: bool = False  # the whole committed history was reproduced
    cut_moved: bool = False  # the budget cut point moved: the prefix changed on purpose

    @property
    def changed(self) -> bool:
        return bool(self.applied)


@dataclass(slots=True)
class RepairMemory:
    """What repair keeps per session besides the committed history."""

    last_reply: dict[str, Any] | None = None  # the assistant message the proxy returned
    cut: int = 0  # messages before this index have their tool results trimmed by the proxy
    # ``last_reply``'s bytes, which the session store counts in the namespace's budget
    # (a reply may be megabytes: a long answer, or an engine that floods).
    reply_size: int = 0

    def remember_reply(self, reply: Mapping[str, Any] | None) -> None:
        self.last_reply = dict(reply) if reply is not None else None
        self.reply_size = len(canonical_bytes(self.last_reply)) if reply is not None else 0


class Repairer:
    def __init__(self, config: RepairConfig, count_tokens: Callable[[Sequence[Message]], int]
                 ) -> None:
        self.config = config
        self.count_tokens = count_tokens

    def repair(self, committed: Sequence[Message], committed_body: Mapping[str, Any],
               body: Mapping[str, Any], memory: RepairMemory,
               budget_tokens: int | None) -> Repaired:
        out = dict(body)
        applied: list[Applied] = []
        if "tools" in self.config.enabled:
            self._repair_tools(committed_body, out, applied)
        messages, complete = self._repair_messages(committed, list(body.get("messages") or []),
                                                   memory, applied)
        out["messages"] = messages
        repaired = Repaired(out, applied, complete)
        if budget_tokens is not None and "tool_results" in self.config.enabled:
            self._fit_budget(repaired, memory, budget_tokens)
        return repaired

    def normalize_for_identity(self, messages: Sequence[Message]) -> list[Message]:
        """Volatile values blanked in system messages, so a timestamp line does not change
        the fingerprint of the system segment."""
        if "volatile" not in self.config.enabled:
            return list(messages)
        return [self._blank_volatile(m) if m.get("role") in ("system", "developer") else m
                for m in messages]

    # --- messages ---------------------------------------------------------------------

    def _repair_messages(self, committed: Sequence[Message], incoming: list[Message],
                         memory: RepairMemory, applied: list[Applied]
                         ) -> tuple[list[Message], bool]:
        out: list[Message] = []
        i = j = 0
        while i < len(committed) and j < len(incoming):
            old, new = committed[i], incoming[j]
            if digest(old) == digest(new):
                out.append(old)
                i, j = i + 1, j + 1
                continue
            policies = self._explain(old, new, memory)
            if policies:
                applied.extend(Applied(p, len(out), d) for p, d in policies)
                out.append(old)
                i, j = i + 1, j + 1
                continue
            later = self._find_later(committed, i, new, memory) if "window" in \
                self.config.enabled else None
            if later is None:
                return out + incoming[j:], False
            applied.append(Applied("window", len(out),
                                   f"re-added {later - i} message(s) the client dropped"))
            out.extend(committed[i:later])
            i = later
        if i < len(committed):
            return out + incoming[j:], False
        out.extend(self._repair_reply(incoming[j:], memory, len(out), applied))
        return out, True

    def _explain(self, old: Message, new: Message, memory: RepairMemory
                 ) -> list[tuple[str, str]]:
        """The policies that turn ``new`` back into ``old``, or [] if none does."""
        role = old.get("role")
        if role != new.get("role"):
            return []
        if role == "assistant":
            return self._explain_assistant(old, new)
        if role == "tool" and "tool_results" in self.config.enabled:
            return _explain_tool_result(old, new, memory)
        volatile = role in ("system", "developer") and "volatile" in self.config.enabled
        if volatile and canonical(self._blank_volatile(old)) == canonical(
                self._blank_volatile(new)):
            return [("volatile", "volatile values pinned to the session's first")]
        if role == "user" and "reminders" in self.config.enabled and _has_reminder(
                old, new) and canonical(_without_reminders(old)) == canonical(
                _without_reminders(new)):
            return [("reminders", "kept the <system-reminder> blocks as committed")]
        return []

    def _explain_assistant(self, old: Message, new: Message) -> list[tuple[str, str]]:
        enabled = self.config.enabled
        if _visible_text(old) != _visible_text(new):
            return []
        if _other_fields(old) != _other_fields(new):
            return []
        reasons: list[tuple[str, str]] = []
        if _reasoning(old) != _reasoning(new):
            if "reasoning" not in enabled or _reasoning(new):
                return []  # different reasoning, not dropped reasoning
            reasons.append(("reasoning", "restored the reasoning the client dropped"))
        old_calls, new_calls = old.get("tool_calls") or [], new.get("tool_calls") or []
        if canonical(old_calls) != canonical(new_calls):
            if "tool_calls" not in enabled or not _same_calls(old_calls, new_calls):
                return []
            reasons.append(("tool_calls", "restored the tool-call arguments as produced"))
        return reasons

    def _find_later(self, committed: Sequence[Message], start: int, new: Message,
                    memory: RepairMemory) -> int | None:
        """Where ``new`` stands later in the committed history (the client dropped the
        messages between). Never the system message: the window moves after it."""
        if start == 0:
            return None
        target = digest(new)
        for k in range(start + 1, len(committed)):
            if digest(committed[k]) == target or self._explain(committed[k], new, memory):
                return k
        return None

    def _repair_reply(self, suffix: Sequence[Message], memory: RepairMemory, offset: int,
                      applied: list[Applied]) -> list[Message]:
        """The first suffix message may be the reply the proxy returned: restore the
        reasoning and tool-call text the client dropped from it."""
        if not suffix or memory.last_reply is None:
            return list(suffix)
        reply, first = memory.last_reply, suffix[0]
        if first.get("role") != "assistant" or canonical(reply) == canonical(first):
            return list(suffix)
        policies = self._explain_assistant(reply, first)
        if not policies:
            return list(suffix)
        applied.extend(Applied(p, offset, d + " (the proxy's last reply)") for p, d in policies)
        return [reply, *suffix[1:]]

    # --- request fields -----------------------------------------------------------------

    def _repair_tools(self, committed_body: Mapping[str, Any], out: dict[str, Any],
                      applied: list[Applied]) -> None:
        old, new = committed_body.get("tools"), out.get("tools")
        if not isinstance(old, list) or not isinstance(new, list) or old == new:
            return
        if canonical(old) == canonical(new):
            out["tools"] = old  # only key order differed
        elif sorted(canonical(t) for t in old) == sorted(canonical(t) for t in new):
            out["tools"] = old
        else:
            return
        applied.append(Applied("tools", -1, "the session's first tool serialization kept"))

    # --- budget -------------------------------------------------------------------------

    def _fit_budget(self, repaired: Repaired, memory: RepairMemory, budget: int) -> None:
        messages = list(repaired.body["messages"])
        limit = int(budget * self.config.budget_fraction)
        trimmed = _trim_before(messages, memory.cut)
        if self.count_tokens(trimmed) <= limit:
            if memory.cut:
                repaired.body["messages"] = trimmed
            return
        target = int(budget * self.config.move_fraction)
        cut = memory.cut
        for boundary in _turn_starts(messages):
            if boundary <= cut:
                continue
            cut = boundary
            trimmed = _trim_before(messages, cut)
            if self.count_tokens(trimmed) <= target:
                break
        memory.cut = cut
        repaired.body["messages"] = trimmed
        repaired.cut_moved = True
        repaired.applied.append(Applied("tool_results", cut, "over budget: tool results "
                                        f"before message {cut} trimmed (cut point moved)"))

    def _blank_volatile(self, message: Message) -> Message:
        content = message.get("content")
        if not isinstance(content, str):
            return message
        for rule in self.config.volatile:
            content = rule.pattern.sub(f"<{rule.name}>", content)
        return {**message, "content": content}


def _explain_tool_result(old: Message, new: Message, memory: RepairMemory
                         ) -> list[tuple[str, str]]:
    if old.get("tool_call_id") != new.get("tool_call_id") or old.get(
            "tool_name") != new.get("tool_name"):
        return []
    before, after = _text(old.get("content")), _text(new.get("content"))
    if len(after) < len(before):
        return [("tool_results", f"restored {len(before) - len(after)} characters the "
                                 "client trimmed or cleared")]
    if before == proxy_trim(after):
        return [("tool_results", "kept the proxy's own trim (before the pinned cut)")]
    return []


def proxy_trim(text: str) -> str:
    """The proxy's deterministic trim of a tool result."""
    if len(text) <= TRIM_CHARS + len(TRIM_MARK):
        return text
    return text[:TRIM_CHARS] + TRIM_MARK


def _trim_before(messages: Sequence[Message], cut: int) -> list[Message]:
    out: list[Message] = []
    for index, message in enumerate(messages):
        if index < cut and message.get("role") == "tool":
            content = _text(message.get("content"))
            trimmed = proxy_trim(content)
            if trimmed != content:
                message = {**message, "content": trimmed}
        out.append(message)
    return out


def _turn_starts(messages: Sequence[Message]) -> list[int]:
    """Cut points fall on turn boundaries: the index of each user message."""
    return [i for i, m in enumerate(messages) if m.get("role") == "user" and i > 0]


_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)
_REMINDER = re.compile(r"<system-reminder>.*?</system-reminder>\s*", re.DOTALL)


def _has_reminder(*messages: Message) -> bool:
    return any("<system-reminder>" in _text(m.get("content")) for m in messages)


def _without_reminders(message: Message) -> Message:
    """The message with every ``<system-reminder>`` block cut out of its text, and the
    content parts left empty by that dropped (Claude Code sends a reminder as a part of
    its own)."""
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": _REMINDER.sub("", content)}
    if not isinstance(content, list):
        return message
    parts: list[Any] = []
    for part in content:
        if isinstance(part, Mapping) and isinstance(part.get("text"), str):
            text = _REMINDER.sub("", part["text"])
            if not text.strip():
                continue
            part = {**part, "text": text}
        parts.append(part)
    return {**message, "content": parts}


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    return canonical(content)


def _visible_text(message: Message) -> str:
    return _THINK.sub("", _text(message.get("content"))).strip()


# Where engines put an assistant message's reasoning: llama-server, Ollama's native API,
# Ollama's OpenAI-compatible API.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Tool-call fields a client may drop (ollama-python keeps only name and arguments).
_DROPPABLE_CALL_FIELDS = frozenset({"id", "type", "index", "function.index"})


def _reasoning(message: Message) -> str:
    inline = "".join(re.findall(r"<think>(.*?)</think>", _text(message.get("content")),
                                re.DOTALL))
    return "".join(str(message.get(name) or "") for name in REASONING_FIELDS) + inline


def _other_fields(message: Message) -> str:
    return canonical({k: v for k, v in message.items()
                      if k not in ("content", "tool_calls", *REASONING_FIELDS)})


def _same_calls(old: Sequence[Any], new: Sequence[Any]) -> bool:
    """The same calls, the arguments compared as JSON values (a string re-serialized, or
    Ollama's object), and at most ``_DROPPABLE_CALL_FIELDS`` missing from ``new``: restoring
    a field the client dropped brings back only bytes this session received."""
    if len(old) != len(new):
        return False
    for before, after in zip(old, new, strict=True):
        a, b = _flat_call(before), _flat_call(after)
        if a is None or b is None or not set(b) <= set(a):
            return False
        if set(a) - set(b) - _DROPPABLE_CALL_FIELDS:
            return False
        if any(canonical(a[key]) != canonical(b[key]) for key in b):
            return False
    return True


def _flat_call(call: object) -> dict[str, Any] | None:
    """A tool call as flat fields, its arguments parsed when they are a JSON string."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return None
    function = call["function"]
    arguments = function.get("arguments")
    if isinstance(arguments, str) or arguments is None:
        try:
            arguments = json.loads(arguments or "null")
        except ValueError:
            return None
    flat = {key: value for key, value in call.items() if key != "function"}
    flat |= {f"function.{key}": value for key, value in function.items() if key != "arguments"}
    flat["function.arguments"] = arguments
    return flat
