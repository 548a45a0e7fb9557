"""Which session a request names (step 2 of the request path; its tenant namespace is
``proxy.listen.tenants``'). Pure functions over the body and headers.

Explicit session identity, in this precedence (body before headers; first match wins;
header names are matched in lower case, as the router passes them: ``headers_of``):

    body    session_id, prompt_cache_key, user, metadata.user_id
    header  x-dynamo-session-id, x-session-id, x-session-affinity, session_id,
            x-litellm-session-id, x-claude-code-session-id, session-id, thread-id,
            x-qwen-code-session-id, x-kilocode-taskid, x-roo-task-id, x-task-id

Then, whatever named the session:

- ``x-claude-code-agent-id`` makes the request a sub-agent, its own session: key
  ``<session>/<agent-id>``, parent ``<session>`` (the main agent's key), or
  ``<session>/<parent-agent-id>`` with ``x-claude-code-parent-agent-id`` (a sub-agent's
  sub-agent). Claude Code's session id is in ``metadata.user_id`` as well as in its header,
  so the agent id is joined to the body's session too.
- otherwise ``x-parent-session-id`` (OpenCode), else ``x-dynamo-parent-session-id``, names
  the parent session of a sub-agent;
- ``x-dynamo-session-final`` true (``true``, ``1``, ``yes``; any case) ends the session
  after this request: its slot and parked file are released (``AffinityPlanner.commit``).

Who sends which (where each name was checked):

    Claude Code  X-Claude-Code-Session-Id; metadata.user_id JSON ``session_id`` (same id);
                 X-Claude-Code-Agent-Id / -Parent-Agent-Id on sub-agents only (captured
                 2.1.328: research/agents-observed.md; agent headers: Claude Code's gateway
                 protocol page and ai-dynamo/dynamo lib/llm/src/protocols/agents.rs)
    Codex        prompt_cache_key, session-id and thread-id headers, all the session uuid
                 (captured 0.169.0: research/agents-observed.md)
    OpenCode     x-session-affinity and x-session-id (same ses_ id), x-parent-session-id on
                 sub-agents (captured 1.18.33: research/opencode-observed.md;
                 packages/opencode/src/session/llm/request.ts via research/peers.md)
    Cline        X-Task-ID (its own cline provider), session_id (its openai-codex provider)
                 (cline/cline sdk/packages/llms/src/providers/request-headers.ts)
    Roo Code     session_id header = task id (openai-native, openai-codex providers),
                 X-Roo-Task-ID (its roo provider) (RooCodeInc/Roo-Code src/api/providers)
    Kilo Code    X-KiloCode-TaskId (extension), X-KILOCODE-TASKID with x-session-affinity and
                 X-Session-Id (CLI, an OpenCode fork) (stored Kilo sources, research/peers.md)
    Qwen Code    X-Qwen-Code-Session-Id, only with telemetry on and, by default, only to
                 DashScope hosts (``telemetry.sessionIdHeaderHosts``; QwenLM/qwen-code
                 PR #4390, its correlation fetch wrapper)
    pi           session_id + x-session-affinity (OpenAI completions), x-session-affinity or
                 x-session-id (Anthropic), session-id (Responses), when the model's compat
                 sets ``sendSessionAffinityHeaders`` (pi-mono packages/ai, research/peers.md)
    Dynamo       X-Dynamo-Session-ID, X-Dynamo-Parent-Session-ID, X-Dynamo-Session-Final
                 (ai-dynamo/dynamo lib/llm/src/protocols/agents.rs)

Older Claude Code sent ``metadata.user_id`` as ``user_<hash>_account_<uuid>_session_<uuid>``.
The Anthropic and Responses codecs keep these body fields in the chat body they convert
to, so the one lookup here serves all.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_KEY_CHARS = 256

BODY_KEYS = ("session_id", "prompt_cache_key", "user")
HEADER_KEYS = ("x-dynamo-session-id", "x-session-id", "x-session-affinity", "session_id",
               "x-litellm-session-id", "x-claude-code-session-id", "session-id", "thread-id",
               "x-qwen-code-session-id", "x-kilocode-taskid", "x-roo-task-id", "x-task-id")
PARENT_HEADERS = ("x-parent-session-id", "x-dynamo-parent-session-id")
AGENT_HEADER = "x-claude-code-agent-id"
PARENT_AGENT_HEADER = "x-claude-code-parent-agent-id"
FINAL_HEADER = "x-dynamo-session-final"
_TRUE = frozenset({"true", "1", "yes"})

# Claude Code before 2.1 sent metadata.user_id = "user_<hash>_account_<uuid>_session_<uuid>".
_CLAUDE_SESSION = re.compile(r"_session_([0-9A-Za-z-]+)$")


@dataclass(frozen=True, slots=True)
class ExplicitIdentity:
    key: str
    source: str  # where it came from, for the log and the /sessions view
    parent: str | None = None
    final: bool = False  # the client ends the session with this request


def explicit_identity(body: Mapping[str, Any],
                      headers: Mapping[str, str]) -> ExplicitIdentity | None:
    """The session the request names (the module docstring's precedence), its parent
    session for a sub-agent, and whether the client ends the session with it."""
    named = _named_session(body, headers)
    if named is None:
        return None
    key, source = named
    final = (headers.get(FINAL_HEADER) or "").strip().lower() in _TRUE
    agent = _clean(headers.get(AGENT_HEADER))
    if agent is not None:  # a Claude Code sub-agent: its own session under the main one
        parent_agent = _clean(headers.get(PARENT_AGENT_HEADER))
        return ExplicitIdentity(f"{key}/{agent}", f"{source}+header.{AGENT_HEADER}",
                                f"{key}/{parent_agent}" if parent_agent else key, final)
    parent = next((p for name in PARENT_HEADERS if (p := _clean(headers.get(name)))), None)
    return ExplicitIdentity(key, source, parent, final)


def _named_session(body: Mapping[str, Any],
                   headers: Mapping[str, str]) -> tuple[str, str] | None:
    """The first session key found, and where: body fields, then headers."""
    for name in BODY_KEYS:
        key = _clean(body.get(name))
        if key is not None:
            return key, f"body.{name}"
    metadata = body.get("metadata")
    if isinstance(metadata, Mapping):
        key = _claude_code_session(metadata.get("user_id"))
        if key is not None:
            return key, "body.metadata.user_id"
    for name in HEADER_KEYS:
        key = _clean(headers.get(name))
        if key is not None:
            return key, f"header.{name}"
    return None


def _claude_code_session(value: object) -> str | None:
    """The session in Claude Code's ``metadata.user_id``: its JSON form's ``session_id``
    (the device id beside it names a machine, not a conversation), its older underscore
    form's ``_session_<id>``, else the whole value."""
    text = _clean(value)
    if text is None:
        return None
    if text.startswith("{"):
        try:
            fields = json.loads(text)
        except ValueError:
            fields = None
        if isinstance(fields, Mapping):
            session = _clean(fields.get("session_id"))
            if session is not None:
                return session
    match = _CLAUDE_SESSION.search(text)
    return match.group(1) if match else text


def _clean(value: object) -> str | None:
    if not isinstance(value, str):
        return None
    value = value.strip()
    if not value or len(value) > MAX_KEY_CHARS:
        return None
    return value
