"""The embedded engine's exception tree, translated to llama-server's error JSON at the edge.

    EmbeddedEngineError
     ├── ModelLoadError          the GGUF is missing, unreadable or rejected by llama.cpp
     ├── EngineBackendError      llama.cpp refused a context, a decode or a state file
     └── ApiError                a request llama-server would answer with an error body
          └── ContextSizeError   the prompt does not fit the slot (exceed_context_size_error)

Only ``ApiError`` reaches clients; ``http`` turns it into llama-server's shape
``{"error": {"code", "message", "type"}}`` with the matching HTTP status.
"""

from __future__ import annotations

# llama-server's error "type" string -> HTTP status: tools/server/server-common.cpp,
# format_error_response.
ERROR_TYPES: dict[str, int] = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "not_found_error": 404,
    "server_error": 500,
    "permission_error": 403,
    "not_supported_error": 501,
    "unavailable_error": 503,
    "exceed_context_size_error": 400,
}


class EmbeddedEngineError(Exception):
    """Base class of every error the embedded engine raises."""


class ModelLoadError(EmbeddedEngineError):
    """The model file is missing, unreadable or not a GGUF llama.cpp can load.

    The message is one line meant for a terminal; no traceback is needed to act on it.
    """


class EngineBackendError(EmbeddedEngineError):
    """llama.cpp failed an operation (context creation, decode, state file I/O)."""


class ApiError(EmbeddedEngineError):
    """An error answered to the client exactly as llama-server would answer it."""

    def __init__(self, message: str, error_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.error_type = error_type

    @property
    def status_code(self) -> int:
        return ERROR_TYPES[self.error_type]

    def to_json(self) -> dict[str, object]:
        """The inner object of llama-server's ``{"error": ...}`` body."""
        return {"code": self.status_code, "message": self.message, "type": self.error_type}


class ContextSizeError(ApiError):
    """The prompt has at least as many tokens as the slot context (llama-server rejects it)."""

    def __init__(self, n_prompt_tokens: int, n_ctx: int) -> None:
        super().__init__(
            f"request ({n_prompt_tokens} tokens) exceeds the available context size "
            f"({n_ctx} tokens), try increasing it",
            "exceed_context_size_error",
        )
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx

    def to_json(self) -> dict[str, object]:
        body = super().to_json()
        body["n_prompt_tokens"] = self.n_prompt_tokens
        body["n_ctx"] = self.n_ctx
        return body
