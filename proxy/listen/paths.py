"""One canonical form of the request path: what the router matches and what is forwarded.

The proxy routes on the path, and the engine behind it routes on the path too, each after
its own normalisation: uvicorn percent-decodes, httpx resolves dot segments when it builds
the upstream URL, cpp-httplib (llama-server) and Go (Ollama) percent-decode again. An alias
that the proxy's router does not recognise but the engine does (``/./v1/chat/completions``)
used to go out as a pass-through and reach the engine's chat endpoint with no ``id_slot``
and no cache guard. So every request path is reduced to one canonical form *before*
routing (``canonical_paths``, the ASGI middleware), and only that form is ever forwarded
(``proxy.listen.passthrough`` refuses a path that is not canonical). An alias either becomes the
path it means, and is routed and forwarded as that path, or is refused with a 400.

``canonical_path(raw_path)`` takes the path bytes as they came on the wire (without the
query) and returns the canonical path, or raises ``PathRejected`` (a 400 naming the
reason). It is pure, and raises nothing else for any input.

What maps (each has one meaning that every engine agrees on, and real clients produce it):

- **Runs of slashes** collapse (``//v1/chat/completions``, ``/v1//chat/completions`` →
  ``/v1/chat/completions``). Clients joining a base URL that ends in ``/`` with a path
  that starts with one send exactly this; nginx merges them by default.
- **Dot segments** ``.`` and ``..`` are resolved as RFC 3986 §5.2.4 says
  (``/./v1/chat/completions``, ``/v1/x/../chat/completions``). That is what they mean, and
  what httpx, curl and browsers send after normalising.
- **Percent-encoded characters that are allowed in a path anyway** (letters, digits,
  ``-_~``, ``!$&'()*+,=:@``), in upper- or lower-case hex, are decoded once (``/v1/%63hat/
  completions`` → ``/v1/chat/completions``): RFC 3986 §6.2.2 makes them equivalent, and
  uvicorn decodes them before Starlette matches routes anyway.

What is refused (400, ``invalid_path``), because the engines, frameworks and file systems
behind a proxy disagree about what it means, and guessing is how aliases get through:

- an invalid escape (``%``, ``%4``, ``%G0``);
- an encoded ``/`` (``%2F``), ``\\`` (``%5C``), ``.`` (``%2E``) or ``%`` (``%25``: decoded
  once here and once more by the engine it would become another path);
- NUL and control characters, raw or encoded; any byte over 0x7F, raw or encoded (overlong
  UTF-8 such as ``%C0%AF``, the full-width solidus U+FF0F and other look-alikes never reach
  a router);
- a backslash (some servers read it as ``/``); a ``;`` (path parameters: Tomcat, Jetty and
  others drop ``;x`` from a segment); any other character outside RFC 3986's ``pchar``
  (space, quotes, ``<>[]{}|^```, an encoded ``?`` or ``#``);
- a segment ending in ``.`` that is not a dot segment (``completions.``, ``...``: Windows
  and IIS strip trailing dots, old servers read ``...`` as ``../..``);
- a ``..`` above the root (``/../v1/chat/completions``);
- a ``..`` whose meaning depends on whether ``//`` is collapsed first (``/a//../b`` is
  ``/a/b`` by RFC 3986 and ``/b`` after merging slashes);
- a **trailing slash** on anything but the root (``/v1/chat/completions/``, and the same
  reached through ``/.`` or ``/x/..`` at the end). No client of these APIs sends one, and
  Ollama's router redirects it while llama-server's 404s it: strict is the only answer
  both engines agree with. The root ``/`` itself is canonical;
- a path that is empty or does not start with ``/``.

Letter case is kept: paths are case-sensitive in every engine here.

The canonical form is exactly the paths matching ``_CANONICAL`` (ASCII ``pchar`` without
``%`` and ``;``, no empty segment, no segment ending in ``.``): it is its own raw form, so
``scope["raw_path"]`` and ``scope["path"]`` agree after the middleware, httpx neither
re-encodes nor re-normalises it, and ``canonical_path`` is idempotent on it. A path already
canonical is the hot path: one regex match over its bytes, nothing copied.
"""

from __future__ import annotations

import re
import string
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from prefixpin.core.errors import BadRequestError, error_response
from prefixpin.proxy.ops.logs import get_logger

__all__ = ["PathRejected", "canonical_path", "canonical_paths", "is_canonical"]


class PathRejected(BadRequestError):
    """A request path with no single meaning: answered 400, never routed or forwarded."""

    code = "invalid_path"

    def __init__(self, reason: str) -> None:
        super().__init__(f"invalid request path: {reason}")
        self.reason = reason


# RFC 3986 pchar, without pct-encoded and without ";" (path parameters); "." separately.
_SEGMENT_CHARS = string.ascii_letters + string.digits + "-_~" + "!$&'()*+,=" + ":@"
_CLASS = "A-Za-z0-9\\-_~!$&'()*+,=:@"
# Every segment non-empty and ending in a non-dot character (so neither "." nor "..", nor
# "x." nor "..."); no trailing slash except the root itself.
_PATTERN = f"/|(?:/[{_CLASS}.]*[{_CLASS}])+"
_CANONICAL = re.compile(_PATTERN.encode("ascii"))
_CANONICAL_STR = re.compile(_PATTERN, re.ASCII)

# Raw bytes that may appear on the wire in a path before decoding.
_RAW_OK = (_SEGMENT_CHARS + "/.%").encode("ascii")
_DECODED_OK = frozenset(_SEGMENT_CHARS)
_HEX = frozenset(string.hexdigits)
_ENCODED_REFUSED = {
    0x2F: "an encoded '/' (%2F)",
    0x5C: "an encoded backslash (%5C)",
    0x2E: "an encoded '.' (%2E)",
    0x25: "an encoded '%' (%25)",
}


def is_canonical(path: str) -> bool:
    """Whether ``path`` is in canonical form (what ``canonical_path`` returns)."""
    return _CANONICAL_STR.fullmatch(path) is not None


def canonical_path(raw_path: bytes) -> str:
    """The canonical form of a request path as it came on the wire (no query string), or
    ``PathRejected`` naming why it has none. See the module docstring for the rules."""
    if _CANONICAL.fullmatch(raw_path) is not None:
        return raw_path.decode("ascii")
    if not raw_path.startswith(b"/"):
        raise PathRejected("the path must start with '/'")
    bad = raw_path.translate(None, _RAW_OK)
    if bad:
        raise PathRejected(_raw_refusal(bad[0]))
    decoded = _decode(raw_path.decode("ascii"))
    return _resolve(decoded[1:].split("/"))


def _raw_refusal(byte: int) -> str:
    if byte == 0x5C:
        return "a backslash"
    if byte == 0x3B:
        return "a ';' (path parameters are not accepted)"
    if byte < 0x20 or byte == 0x7F:
        return f"a control character (0x{byte:02X})"
    if byte > 0x7F:
        return "a non-ASCII byte"
    return f"the character {chr(byte)!r}"


def _decode(path: str) -> str:
    """Percent-escapes decoded once; only characters a path may hold anyway survive."""
    if "%" not in path:
        return path
    first, *rest = path.split("%")
    parts = [first]
    for part in rest:
        if len(part) < 2 or part[0] not in _HEX or part[1] not in _HEX:
            raise PathRejected("an invalid percent-encoding")
        value = int(part[:2], 16)
        if value in _ENCODED_REFUSED:
            raise PathRejected(_ENCODED_REFUSED[value])
        if value < 0x20 or value == 0x7F:
            raise PathRejected(f"an encoded control character (%{part[:2]})")
        if value > 0x7F:
            raise PathRejected(f"an encoded non-ASCII byte (%{part[:2]})")
        char = chr(value)
        if char not in _DECODED_OK:
            raise PathRejected(f"an encoded {char!r} (%{part[:2]})")
        parts.append(char)
        parts.append(part[2:])
    return "".join(parts)


def _resolve(segments: list[str]) -> str:
    """Slashes merged and dot segments resolved; refused where the two orders disagree,
    above the root, on a segment ending in '.', or with a trailing slash."""
    for segment in segments:
        if segment.endswith(".") and segment not in (".", ".."):
            raise PathRejected("a path segment ending in '.'")
    merged = _walk(segments, keep_empty=False)
    if "" in segments and ".." in segments and _walk(segments, keep_empty=True) != merged:
        raise PathRejected("a '..' after '//' (its meaning depends on merging slashes)")
    if merged and segments[-1] in ("", ".", ".."):
        raise PathRejected("a trailing slash")
    return "/" + "/".join(merged)


def _walk(segments: list[str], *, keep_empty: bool) -> list[str]:
    """RFC 3986 remove_dot_segments over segments (``keep_empty``: empty segments count,
    as the RFC has it; else ``//`` is merged first). The result has no empty segment."""
    stack: list[str] = []
    for segment in segments:
        if segment == ".":
            continue
        if segment == "..":
            if not stack:
                raise PathRejected("a '..' above the root")
            stack.pop()
        elif segment or keep_empty:
            stack.append(segment)
    return [segment for segment in stack if segment]


def canonical_paths(app: ASGIApp) -> ASGIApp:
    """``app`` behind the canonical path: for each ``http`` request, ``scope["path"]`` and
    ``scope["raw_path"]`` are replaced by the canonical form of the path on the wire
    (``raw_path``; ``path`` re-encoded when a server gives no ``raw_path``), or the request
    is answered 400 with an OpenAI-shaped error naming the reason and ``app`` never sees
    it. Other scopes (lifespan, websocket) go to ``app`` untouched."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        try:
            scope = _canonical_scope(scope)
        except PathRejected as exc:
            await error_response(exc)(scope, receive, send)
            return
        except Exception:  # a bug here must not route, forward or 500 the request
            get_logger().exception("path canonicalisation failed")
            await error_response(PathRejected("the path could not be read"))(
                scope, receive, send)
            return
        await app(scope, receive, send)

    return middleware


def _canonical_scope(scope: Scope) -> Scope:
    root_path: str = scope.get("root_path", "") or ""
    raw = scope.get("raw_path")
    if not isinstance(raw, bytes):
        raw = _requoted(scope["path"])
    prefix = root_path.encode("latin-1", "replace")
    if prefix and raw.startswith(prefix):
        raw = raw[len(prefix):]
    else:
        prefix, root_path = b"", ""
    path = canonical_path(raw)
    full = root_path + path
    if scope["path"] == full and scope.get("raw_path") == prefix + raw:
        return scope  # already canonical: the hot path
    changed: dict[str, Any] = dict(scope)
    changed["path"] = full
    changed["raw_path"] = prefix + path.encode("ascii")
    return changed


def _requoted(path: str) -> bytes:
    """A decoded ``path`` as the bytes it came from: every character a canonical path may
    hold as is, every other one percent-encoded (UTF-8), so it is refused or decoded once."""
    if _CANONICAL_STR.fullmatch(path) is not None:
        return path.encode("ascii")
    out = bytearray()
    for char in path:
        if char in _DECODED_OK or char in "/.":
            out += char.encode("ascii")
        else:
            out += "".join(f"%{byte:02X}" for byte in char.encode("utf-8", "surrogatepass")
                           ).encode("ascii")
    return bytes(out)
