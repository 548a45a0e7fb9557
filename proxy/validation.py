"""Parse and validate client bodies before anything is forwarded (step 1 of the request path).

Every rejection is a ``ClientError`` with a message that names the field, so a client sees
a clear OpenAI-shaped 4xx and the engine never sees the request.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from proxy.errors import BadRequestError, PayloadTooLargeError

Endpoint = Literal["chat", "completions"]

KNOWN_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


@dataclass(frozen=True, slots=True)
class ClientRequest:
    endpoint: Endpoint
    path: str
    body: dict[str, Any]
    stream: bool
    wants_usage: bool
    wants_progress: bool


async def read_body(chunks: AsyncIterator[bytes], declared_length: str | None,
                    max_bytes: int) -> bytes:
    """The request body, refused as soon as it is known to exceed ``max_bytes``."""
    declared = int(declared_length) if declared_length and declared_length.isdigit() else None
    if declared is not None and declared > max_bytes:
        raise _too_large(max_bytes)
    body = bytearray()
    async for chunk in chunks:
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(max_bytes)
    return bytes(body)


def parse_request(raw: bytes, endpoint: Endpoint, path: str, *, max_messages: int) -> ClientRequest:
    body = _parse_object(raw)
    if endpoint == "chat":
        _check_messages(body.get("messages"), max_messages)
    else:
        _check_prompt(body.get("prompt"))
    stream = _optional_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise BadRequestError("'stream_options' must be an object", param="stream_options")
    wants_usage = bool(options.get("include_usage")) if isinstance(options, Mapping) else False
    return ClientRequest(endpoint, path, body, stream, wants_usage,
                         _optional_bool(body, "return_progress"))


def _parse_object(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise BadRequestError("request body is empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")  # RFC 8259: JSON on the wire is UTF-8, never sniffed
    except UnicodeDecodeError as exc:
        raise BadRequestError(f"request body is not valid UTF-8: {exc.reason} at byte "
                              f"{exc.start}") from exc
    try:
        value = json.loads(text)
    except RecursionError as exc:
        raise BadRequestError("request body nests JSON too deeply") from exc
    except ValueError as exc:
        raise BadRequestError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise BadRequestError("request body must be a JSON object")
    return value


def _check_messages(messages: object, max_messages: int) -> None:
    if not isinstance(messages, list):
        raise BadRequestError("'messages' is required and must be an array", param="messages")
    if not messages:
        raise BadRequestError("'messages' must contain at least one message", param="messages")
    if len(messages) > max_messages:
        raise BadRequestError(f"'messages' has {len(messages)} entries; the limit is "
                              f"{max_messages}", param="messages")
    for index, message in enumerate(messages):
        _check_message(index, message)


def _check_message(index: int, message: object) -> None:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise BadRequestError(f"'{where}' must be an object", param=where)
    role = message.get("role")
    if not isinstance(role, str) or role not in KNOWN_ROLES:
        raise BadRequestError(f"'{where}.role' must be one of {sorted(KNOWN_ROLES)}, "
                              f"got {role!r}", param=f"{where}.role")
    content = message.get("content")
    if content is not None and not isinstance(content, str | list):
        raise BadRequestError(f"'{where}.content' must be a string, an array of parts or null",
                              param=f"{where}.content")
    if isinstance(content, list) and not all(isinstance(part, dict) for part in content):
        raise BadRequestError(f"'{where}.content' parts must be objects", param=f"{where}.content")
    tool_calls = message.get("tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list):
        raise BadRequestError(f"'{where}.tool_calls' must be an array",
                              param=f"{where}.tool_calls")


def _check_prompt(prompt: object) -> None:
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt and all(
        isinstance(item, str | int) and not isinstance(item, bool) for item in prompt
    ):
        return
    raise BadRequestError("'prompt' is required: a string, or an array of strings or token ids",
                          param="prompt")


def _optional_bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequestError(f"'{name}' must be a boolean", param=name)
    return value


def _too_large(max_bytes: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"request body exceeds the limit of {max_bytes} bytes "
                                "(--max-body)")
