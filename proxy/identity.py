"""Who is asking: the tenant namespace and the session the request names (steps 2 of the
request path). Pure functions over the body and headers.

Namespaces isolate tenants: a hash of the bearer token, or one anonymous namespace. The
token itself never leaves this module.

Explicit session identity, in this precedence (body before headers; first match wins):

    body    session_id, prompt_cache_key, user, metadata.user_id
    header  x-session-id, x-session-affinity, session_id, x-litellm-session-id,
            x-claude-code-session-id, session-id, thread-id

Who sends which: OpenCode the ``x-session-affinity``/``x-session-id`` headers; Codex
``prompt_cache_key`` (the session id, also in its ``session-id`` and ``thread-id``
headers); Claude Code ``metadata.user_id`` (a JSON string whose ``session_id`` is the
``X-Claude-Code-Session-Id`` header's value; older versions sent
``user_<hash>_account_<uuid>_session_<uuid>``). The Anthropic and Responses codecs keep
these body fields in the chat body they convert to, so the one lookup here serves all.

``x-parent-session-id`` marks a sub-agent of the named parent session.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import blake3

ANONYMOUS = "anon"
MAX_KEY_CHARS = 256

BODY_KEYS = ("session_id", "prompt_cache_key", "user")
HEADER_KEYS = ("x-session-id", "x-session-affinity", "session_id", "x-litellm-session-id",
               "x-claude-code-session-id", "session-id", "thread-id")
PARENT_HEADER = "x-parent-session-id"

# Claude Code before 2.1 sent metadata.user_id = "user_<hash>_account_<uuid>_session_<uuid>".
_CLAUDE_SESSION = re.compile(r"_session_([0-9A-Za-z-]+)$")


@dataclass(frozen=True, slots=True)
class ExplicitIdentity:
    key: str
    source: str  # where it came from, for the log and the /sessions view
    parent: str | None = None


def namespace_of(headers: Mapping[str, str]) -> str:
    """The tenant namespace: a 16-hex-digit blake3 of the client's key, else anonymous.

    The key is the bearer token (OpenAI clients, Codex), else the ``x-api-key`` header
    (Anthropic clients: the SDK and Claude Code send their key there); the same key in
    either header is the same tenant."""
    token = _bearer(headers.get("authorization", "")) or headers.get("x-api-key", "").strip()
    if not token:
        return ANONYMOUS
    return "t-" + blake3.blake3(token.encode()).hexdigest()[:16]


def _bearer(authorization: str) -> str:
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def explicit_identity(body: Mapping[str, Any],
                      headers: Mapping[str, str]) -> ExplicitIdentity | None:
    parent = _clean(headers.get(PARENT_HEADER))
    for name in BODY_KEYS:
        key = _clean(body.get(name))
        if key is not None:
            return ExplicitIdentity(key, f"body.{name}", parent)
    metadata = body.get("metadata")
    if isinstance(metadata, Mapping):
        key = _claude_code_session(metadata.get("user_id"))
        if key is not None:
            return ExplicitIdentity(key, "body.metadata.user_id", parent)
    for name in HEADER_KEYS:
        key = _clean(headers.get(name))
        if key is not None:
            return ExplicitIdentity(key, f"header.{name}", parent)
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
