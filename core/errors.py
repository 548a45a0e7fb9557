"""The one exception tree of prefixpin, and its translation to OpenAI-shaped errors.

    ProxyError
    ├── ClientError                 the request is at fault: 4xx, nothing was forwarded
    │   ├── BadRequestError         400 invalid JSON, schema, roles
    │   ├── PayloadTooLargeError    413 body over --max-body
    │   └── ClientDisconnectedError 499 the client left before its body was read
    ├── RetryLaterError             busy, not the request at fault: + Retry-After
    │   ├── QueueTimeoutError       503 waited --queue-timeout for a slot
    │   ├── BodiesFullError         503 the bodies read at once hold --max-bodies
    │   └── (proxy.session.placement.QueueFullError 429 the slot queue's share is full)
    ├── GenerationCancelledError    499 every client left and the grace period ran out
    └── UpstreamError               the engine is at fault or unreachable
        ├── UpstreamUnavailableError   502 connect refused / reset / engine gone
        ├── UpstreamTimeoutError       504 a wait on the engine ran out
        ├── UpstreamProtocolError      502 malformed SSE, invalid JSON from the engine
        └── UpstreamStatusError        the engine answered with an error status: kept as is

Foreign exceptions (httpx, json) are translated where they happen with ``raise ... from``;
exactly one place (``error_response`` / ``error_event``) turns the tree into bytes.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse, Response


class ProxyError(Exception):
    status_code = 500
    error_type = "server_error"
    code: str | None = None
    # A bound the request hit, as prefixpin_limit_refusals_total labels it; None: none.
    limit: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return openai_error(self.message, self.error_type, code=self.code, param=self.param)

    def headers(self) -> dict[str, str]:
        return {}


class ClientError(ProxyError):
    status_code = 400
    error_type = "invalid_request_error"


class BadRequestError(ClientError):
    status_code = 400


class PayloadTooLargeError(ClientError):
    status_code = 413
    code = "payload_too_large"
    limit = "body_size"


class ClientDisconnectedError(ClientError):
    status_code = 499
    code = "client_disconnected"


class RetryLaterError(ProxyError):
    """The server is busy, not the request at fault: the same request may succeed after
    ``retry_after_s`` seconds (its ``Retry-After`` header)."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class QueueTimeoutError(RetryLaterError):
    status_code = 503
    error_type = "server_busy"
    code = "queue_timeout"


class BodiesFullError(RetryLaterError):
    """The request bodies being read at once, across every connection, would hold more than
    --max-bodies bytes with this one."""

    status_code = 503
    error_type = "server_busy"
    code = "request_bodies_full"
    limit = "bodies"


class GenerationCancelledError(ProxyError):
    status_code = 499
    error_type = "cancelled"
    code = "cancelled"


class UpstreamError(ProxyError):
    status_code = 502
    error_type = "upstream_error"


class UpstreamUnavailableError(UpstreamError):
    code = "upstream_unavailable"


class UpstreamTimeoutError(UpstreamError):
    status_code = 504
    code = "upstream_timeout"


class UpstreamProtocolError(UpstreamError):
    code = "upstream_protocol_error"


class UpstreamStatusError(UpstreamError):
    """The engine answered with an error status; its status and body are passed on."""

    def __init__(self, status_code: int, body: bytes, content_type: str | None) -> None:
        super().__init__(_message_from_upstream_body(body) or f"upstream status {status_code}")
        self.status_code = status_code
        self.raw_body = body
        self.content_type = content_type

    def body(self) -> dict[str, Any]:
        parsed = _json_object(self.raw_body)
        if parsed is not None and isinstance(parsed.get("error"), dict):
            return parsed
        return openai_error(self.message, self.error_type, code="upstream_status")


def openai_error(
    message: str, error_type: str, *, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(exc: ProxyError) -> Response:
    """The whole response for an error found before any byte was sent to the client."""
    if isinstance(exc, UpstreamStatusError) and _json_object(exc.raw_body) is not None:
        # Keep the engine's own body byte for byte: clients parse llama-server's fields.
        return Response(exc.raw_body, status_code=exc.status_code,
                        media_type=exc.content_type or "application/json")
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers())


def error_event(exc: ProxyError) -> bytes:
    """An SSE error event, the shape llama-server itself uses mid-stream (``data: {"error"}``)."""
    return b"data: " + json.dumps(exc.body(), separators=(",", ":")).encode() + b"\n\n"


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        parsed = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return parsed if isinstance(parsed, dict) else None


def _message_from_upstream_body(raw: bytes) -> str | None:
    parsed = _json_object(raw)
    if parsed is None:
        text = raw[:500].decode("utf-8", "replace").strip()
        return text or None
    error = parsed.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    if isinstance(error, str):
        return error
    return None
