"""Who is asking: the tenant namespace and the session the request names (steps 2 of the
request path). Pure functions over the body and headers.

Namespaces isolate tenants: a hash of the bearer token, or one anonymous namespace. The
token itself never leaves this module.

Explicit session identity, in this precedence (body before headers; first match wins):

    body    session_id, prompt_cache_key, user, metadata.user_id ("..._session_<id>")
    header  x-session-id, x-session-affinity, session_id, x-litellm-session-id

``x-parent-session-id`` marks a sub-agent of the named parent session.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import blake3

ANONYMOUS = "anon"
MAX_KEY_CHARS = 256

BODY_KEYS = ("session_id", "prompt_cache_key", "user")
HEADER_KEYS = ("x-session-id", "x-session-affinity", "session_id", "x-litellm-session-id")
PARENT_HEADER = "x-parent-session-id"

# Claude Code sends metadata.user_id = "user_<hash>_account_<uuid>_session_<uuid>".
_CLAUDE_SESSION = re.compile(r"_session_([0-9A-Za-z-]+)$")


@dataclass(frozen=True, slots=True)
class ExplicitIdentity:
    key: str
    source: str  # where it came from, for the log and the /sessions view
    parent: str | None = None


def namespace_of(headers: Mapping[str, str]) -> str:
    """The tenant namespace: a 16-hex-digit blake3 of the bearer token, else anonymous."""
    authorization = headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return ANONYMOUS
    return "t-" + blake3.blake3(token.encode()).hexdigest()[:16]


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
    text = _clean(value)
    if text is None:
        return None
    match = _CLAUDE_SESSION.search(text)
    return match.group(1) if match else text


def _clean(value: object) -> str | None:
    if not isinstance(value, str):
        return None
    value = value.strip()
    if not value or len(value) > MAX_KEY_CHARS:
        return None
    return value
