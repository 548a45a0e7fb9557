"""Browsers on the tenant port, answered as the engine behind it answers them; none on the
operator listener.

A page that calls the API from another origin (a chat UI on ``localhost:3000``, an
extension) sends ``Origin``, and before a request with ``Authorization`` or a JSON body an
``OPTIONS`` preflight; the browser lets the page read an answer only when it carries
``Access-Control-Allow-Origin``. Which origins are allowed is ``--cors-origins``
(``Settings.cors_origins``), read as the engine reads its own setting:

- **llama-server** (and the embedded engine; ``llama_server_rules``): its ``--cors-origins``.
  ``localhost`` (the default here) allows ``http(s)://`` ``localhost``, ``127.0.0.1`` and
  ``[::1]`` on any port; ``*`` every origin; anything else is a comma-separated list of
  exact origins. A preflight is a 200 with an empty body, whatever the origin; an allowed
  origin is reflected, with credentials, ``GET, POST, DELETE, OPTIONS`` and any header.
- **Ollama** (``ollama_rules``): its ``OLLAMA_ORIGINS``, the given entries added to Ollama's
  own list (``envconfig.AllowedOrigins``: ``localhost``, ``127.0.0.1``, ``0.0.0.0`` over
  http and https on any port, ``app://``, ``file://``, ``tauri://``, ``vscode-webview://``,
  ``vscode-file://``); a ``*`` in an entry is a wildcard, ``*`` alone any origin (answered
  ``*``, not reflected). Its preflight is gin-contrib/cors's: 204 for an allowed origin,
  403 for another.

Both are answered here, in front of everything else: before the tenant key is checked,
so a preflight says nothing about keys or tenants, and the same whatever the path. A
request from a refused origin is a 403 that never reaches the pipeline (llama-server would
serve it, unreadable to the page: prefixpin does not spend the engine's time on an answer
nobody may read). A request whose ``Origin`` is its own host (``http://`` + ``Host``) is
no cross-origin request, and passes untouched, as in gin-contrib/cors.

The operator listener (``browser_gate``) serves no other origin: a request carrying an
``Origin`` other than its own, or that the browser marks as coming from another site
(``Sec-Fetch-Site``), preflights included, is a 403; its own status page is same-origin.
``proxy.listen.passthrough`` drops an engine's own ``Access-Control-*`` headers on both
listeners, so the engine's answer never opens what these rules close.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from prefixpin.core.errors import openai_error

# Header names as the engines write them (cpp-httplib as set, Go canonical): the same on the
# wire, and some clients (llama.cpp's own test harness) read them case-sensitively.
Headers = list[tuple[bytes, bytes]]

LOCALHOST = "localhost"
LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
LLAMA_SERVER_METHODS = b"GET, POST, DELETE, OPTIONS"
# gin-contrib/cors 1.7 as Ollama configures it (server/routes.go): its default methods, the
# headers Ollama lists (canonical case, joined as gin joins them), its default max age.
OLLAMA_METHODS = b"GET,POST,PUT,PATCH,DELETE,HEAD,OPTIONS"
OLLAMA_HEADERS = (b"Authorization,Content-Type,User-Agent,Accept,X-Requested-With,Openai-Beta,"
                  b"X-Stainless-Arch,X-Stainless-Async,X-Stainless-Custom-Poll-Interval,"
                  b"X-Stainless-Helper-Method,X-Stainless-Lang,X-Stainless-Os,"
                  b"X-Stainless-Package-Version,X-Stainless-Poll-Helper,"
                  b"X-Stainless-Retry-Count,X-Stainless-Runtime,X-Stainless-Runtime-Version,"
                  b"X-Stainless-Timeout")
OLLAMA_MAX_AGE = b"43200"
OLLAMA_OWN_ORIGINS = (
    *(f"{scheme}://{host}{port}" for host in ("localhost", "127.0.0.1", "0.0.0.0")
      for port in ("", ":*") for scheme in ("http", "https")),
    "app://*", "file://*", "tauri://*", "vscode-webview://*", "vscode-file://*",
)


@dataclass(frozen=True, slots=True)
class Answer:
    """A response the rules give without the app: its status, headers and body."""

    status: int
    headers: Headers
    body: bytes = b""


class CorsRules(Protocol):
    """How one engine kind answers browsers."""

    def preflight(self, origin: str | None) -> Answer:
        """The answer to an ``OPTIONS`` request carrying ``origin`` (None: none)."""
        ...

    def allowed(self, origin: str) -> Headers | None:
        """The headers an allowed origin's response gets; None: the origin is refused."""
        ...

    def refusal(self) -> Answer:
        """The answer to a refused origin's request (not a preflight)."""
        ...


def is_localhost_origin(origin: str) -> bool:
    """llama-server's ``origin_is_localhost``: an http(s) URL whose host is localhost,
    127.0.0.1 or [::1], on any port (user info and a path ignored, as it parses them)."""
    scheme, separator, rest = origin.partition("://")
    if not separator or scheme not in ("http", "https"):
        return False
    authority = rest.partition("/")[0].rpartition("@")[2]
    if authority.startswith("["):
        host, bracket, after = authority[1:].partition("]")
        if not bracket or (after and not after.startswith(":")):
            return False
        port = after[1:]
    else:
        host, _, port = authority.partition(":")
    return host in LOCAL_HOSTS and (port == "" or port.isdigit())


def split_origins(value: str) -> list[str]:
    return [entry.strip() for entry in value.split(",") if entry.strip()]


@dataclass(frozen=True, slots=True)
class LlamaServerRules:
    """llama-server's (``server-http.cpp``, its pre-routing handler)."""

    allows: Callable[[str], bool]

    def preflight(self, origin: str | None) -> Answer:
        headers = self.allowed(origin) if origin else None
        return Answer(200, [*(headers or []),
                            (b"Access-Control-Allow-Credentials", b"true"),
                            (b"Access-Control-Allow-Methods", LLAMA_SERVER_METHODS),
                            (b"Access-Control-Allow-Headers", b"*"),
                            (b"Content-Type", b"text/html"),
                            (b"Content-Length", b"0")])

    def allowed(self, origin: str) -> Headers | None:
        if not self.allows(origin):
            return None
        return [(b"Access-Control-Allow-Origin", origin.encode("latin-1")),
                (b"Vary", b"Origin")]

    def refusal(self) -> Answer:
        body = json.dumps(openai_error(
            "this origin may not call this API (prefixpin --cors-origins)",
            "permission_error", code="origin_not_allowed")).encode()
        return Answer(403, [(b"Content-Type", b"application/json"),
                            (b"Content-Length", str(len(body)).encode())], body)


def llama_server_rules(origins: str | None) -> LlamaServerRules:
    """llama-server's ``--cors-origins``: ``localhost`` (also when not given), ``*``, or a
    list of exact origins."""
    value = (origins or LOCALHOST).strip()
    if value == LOCALHOST:
        return LlamaServerRules(is_localhost_origin)
    if value == "*":
        return LlamaServerRules(lambda origin: True)
    listed = frozenset(split_origins(value))
    return LlamaServerRules(listed.__contains__)


@dataclass(frozen=True, slots=True)
class OriginPattern:
    """One of gin-contrib/cors's allowed origins: exact, or with one ``*`` wildcard."""

    prefix: str
    suffix: str | None  # None: exact

    def matches(self, origin: str) -> bool:
        if self.suffix is None:
            return origin == self.prefix
        return origin.startswith(self.prefix) and origin.endswith(self.suffix)


def origin_pattern(entry: str) -> OriginPattern:
    # gin-contrib/cors compares the allowed origins lower-cased, the Origin as it came.
    entry = entry.strip().lower()
    if "*" not in entry:
        return OriginPattern(entry, None)
    prefix, _, suffix = entry.partition("*")
    return OriginPattern(prefix, suffix)


@dataclass(frozen=True, slots=True)
class OllamaRules:
    """Ollama's: gin-contrib/cors over ``envconfig.AllowedOrigins``."""

    patterns: tuple[OriginPattern, ...]
    allow_all: bool

    def preflight(self, origin: str | None) -> Answer:
        if origin is None:  # not a CORS request: Ollama's router has no OPTIONS route
            return Answer(405, [(b"Content-Length", b"0")])
        headers = self.allowed(origin)
        if headers is None:
            return self.refusal()
        vary = [] if self.allow_all else [(b"Vary", b"Access-Control-Request-Method"),
                                          (b"Vary", b"Access-Control-Request-Headers")]
        return Answer(204, [*headers, *vary,
                            (b"Access-Control-Allow-Methods", OLLAMA_METHODS),
                            (b"Access-Control-Allow-Headers", OLLAMA_HEADERS),
                            (b"Access-Control-Max-Age", OLLAMA_MAX_AGE)])

    def allowed(self, origin: str) -> Headers | None:
        if self.allow_all:
            return [(b"Access-Control-Allow-Origin", b"*")]
        if not any(pattern.matches(origin) for pattern in self.patterns):
            return None
        return [(b"Access-Control-Allow-Origin", origin.encode("latin-1")),
                (b"Vary", b"Origin")]

    def refusal(self) -> Answer:
        return Answer(403, [(b"Content-Length", b"0")])


def ollama_rules(origins: str | None) -> OllamaRules:
    """Ollama's ``OLLAMA_ORIGINS`` (``origins``) before its own list."""
    entries = [*split_origins(origins or ""), *OLLAMA_OWN_ORIGINS]
    return OllamaRules(tuple(origin_pattern(entry) for entry in entries), "*" in entries)


# ---------------------------------------------------------------- the ASGI middlewares

def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


def same_origin(origin: str, scope: Scope) -> bool:
    host = header(scope, b"host")
    return host is not None and origin in (f"http://{host}", f"https://{host}")


async def answer(reply: Answer, send: Send) -> None:
    await send({"type": "http.response.start", "status": reply.status,
                "headers": reply.headers})
    await send({"type": "http.response.body", "body": reply.body})


def with_headers(send: Send, added: Headers) -> Send:
    """``send``, with ``added`` on the response's head."""
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), *added]}
        await send(message)

    return sending


def tenant_cors(app: ASGIApp, rules_of: Callable[[], CorsRules]) -> ASGIApp:
    """``app`` (the tenant listener) behind the engine's CORS rules (``rules_of``: the rules
    of the engines serving now): every ``OPTIONS`` answered here, an allowed origin's
    response given its headers, a refused origin's request answered 403."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        origin = header(scope, b"origin")
        if scope["method"] == "OPTIONS":
            await answer(rules_of().preflight(origin), send)
            return
        if origin is None or same_origin(origin, scope):
            await app(scope, receive, send)
            return
        rules = rules_of()
        added = rules.allowed(origin)
        if added is None:
            await answer(rules.refusal(), send)
            return
        await app(scope, receive, with_headers(send, added))

    return middleware


CROSS_SITE = frozenset({"cross-site", "same-site"})


def browser_gate(app: ASGIApp) -> ASGIApp:
    """``app`` (the operator listener) closed to pages on other origins: such a request,
    or a preflight from one, is a 403 before anything else (the admin token included)."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and from_another_origin(scope):
            body = json.dumps(openai_error(
                "the operator listener serves no other origin than its own",
                "permission_error", code="origin_not_allowed")).encode()
            await answer(Answer(403, [(b"Content-Type", b"application/json"),
                                      (b"Content-Length", str(len(body)).encode())], body),
                         send)
            return
        await app(scope, receive, send)

    return middleware


def from_another_origin(scope: Scope) -> bool:
    origin = header(scope, b"origin")
    if origin is not None and not same_origin(origin, scope):
        return True
    return header(scope, b"sec-fetch-site") in CROSS_SITE


def rules_for(engines: Iterable[str], llama_server: CorsRules, ollama: CorsRules) -> CorsRules:
    """Ollama's rules when every engine serving is Ollama, else llama-server's (the
    embedded engine is llama.cpp; a mix gets llama-server's, whose routes most of it
    serves)."""
    names = list(engines)
    return ollama if names and all(name == "ollama" for name in names) else llama_server
