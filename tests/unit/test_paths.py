"""The canonical request path (``proxy.listen.paths``): systematically generated aliases of every
pipeline route and of engine paths each map to exactly the path they mean or are refused;
arbitrary bytes never raise anything but ``PathRejected``; the middleware rewrites the
scope or answers 400, and leaves a canonical path untouched.
"""

from __future__ import annotations

import json
import posixpath
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixpin.proxy.codecs import routes
from prefixpin.proxy.listen.paths import PathRejected, canonical_path, canonical_paths, is_canonical

ENGINE_PATHS = ("/slots/0", "/completion", "/api/delete", "/props", "/api/tags")
PATHS = (*routes(), *ENGINE_PATHS)
REJECT = None  # the expected outcome of an alias that must be refused

Alias = tuple[str, bytes, str | None]  # (how it was made, raw bytes, expected path or REJECT)


def slashes(path: str) -> list[int]:
    return [i for i, char in enumerate(path) if char == "/"]


def at(path: str, i: int, insert: str, drop: int = 0) -> bytes:
    return (path[:i] + insert + path[i + drop:]).encode("latin-1")


def aliases(path: str) -> Iterator[Alias]:
    """Every alias of ``path`` we know how to make, each with the outcome it must have."""
    yield "itself", path.encode(), path
    for i in slashes(path):
        yield f"/./ at {i}", at(path, i, "/."), path
        yield f"// at {i}", at(path, i, "/"), path
        yield f"/// at {i}", at(path, i, "//"), path
        yield f"/x/../ at {i}", at(path, i, "/x/.."), path
        yield f"/./././ at {i}", at(path, i, "/./././"), path
        yield f"/a/b/../../ at {i}", at(path, i, "/a/b/../.."), path
        yield f"/.. at {i} (above the root)", at(path, i, "/.." * (path[:i].count("/") + 1)), \
            REJECT
        yield f"//../ at {i} (ambiguous)", at(path, i, "/x//.."), REJECT
        yield f"%2F for / at {i}", at(path, i, "%2F", 1), REJECT
        yield f"%2f for / at {i}", at(path, i, "%2f", 1), REJECT
        yield f"%5C for / at {i}", at(path, i, "%5C", 1), REJECT
        yield f"%5c for / at {i}", at(path, i, "%5c", 1), REJECT
        yield f"\\ for / at {i}", at(path, i, "\\", 1), REJECT
        yield f"\\ after / at {i}", at(path, i + 1, "\\"), REJECT
        yield f"%C0%AF (overlong /) at {i}", at(path, i, "%C0%AF", 1), REJECT
        yield f"%EF%BC%8F (full-width /) at {i}", at(path, i, "%EF%BC%8F", 1), REJECT
        yield f"raw full-width / at {i}", at(path, i, "\xef\xbc\x8f", 1), REJECT
        yield f"%252F (double-encoded /) at {i}", at(path, i, "%252F", 1), REJECT
        yield f"/%2e/ at {i}", at(path, i, "/%2e"), REJECT
        yield f"/%2E%2E/ at {i}", at(path, i, "/x/%2E%2E"), REJECT
        yield f"/.%2e/ at {i}", at(path, i, "/x/.%2e"), REJECT
        yield f"/%C0%AE/ (overlong .) at {i}", at(path, i, "/%C0%AE"), REJECT
        yield f"/... at {i}", at(path, i, "/..."), REJECT
    for i, char in enumerate(path):
        for hexed in (f"%{ord(char):02X}", f"%{ord(char):02x}"):
            expected = REJECT if char in "/." else path
            yield f"{hexed} for {char!r} at {i}", at(path, i, hexed, 1), expected
        yield f"%00 at {i}", at(path, i, "%00"), REJECT
        yield f"NUL at {i}", at(path, i, "\x00"), REJECT
        yield f"%0A at {i}", at(path, i, "%0A"), REJECT
        yield f"TAB at {i}", at(path, i, "\t"), REJECT
        yield f"%7F at {i}", at(path, i, "%7F"), REJECT
        yield f"; at {i}", at(path, i + 1, ";"), REJECT
        yield f"%3B at {i}", at(path, i + 1, "%3B"), REJECT
        yield f"%25 at {i}", at(path, i + 1, "%25"), REJECT
        yield f"bad escape % at {i}", at(path, i + 1, "%"), REJECT
        yield f"bad escape %4z at {i}", at(path, i + 1, "%4z"), REJECT
        yield f"bad escape %G1 at {i}", at(path, i + 1, "%G1"), REJECT
        yield f"%20 at {i}", at(path, i + 1, "%20"), REJECT
        yield f"%3F at {i}", at(path, i + 1, "%3F"), REJECT
        yield f"%23 at {i}", at(path, i + 1, "%23"), REJECT
        yield f"\\x80 at {i}", at(path, i + 1, "\x80"), REJECT
    body = "".join(char if char == "/" else f"%{ord(char):02X}" for char in path)
    yield "every character but / encoded", body.encode(), path
    yield "every character encoded", "".join(f"%{ord(c):02x}" for c in path).encode(), REJECT
    # A trailing slash is refused, also where dot segments leave one (RFC 3986: "/a/x/.."
    # is "/a/"); "/a/.." is the root, which is canonical.
    for suffix in ("/", "/.", ".", "..", "//", "/./", "/x/..", "/x/./..", "%2F", "%2E", "%00",
                   ";x", ";", "\\", "%5C", "%20", " ", "/.;/"):
        yield f"trailing {suffix!r}", (path + suffix).encode("latin-1"), REJECT
    yield "trailing '/..'", (path + "/..").encode(), "/" if path.count("/") == 1 else REJECT
    yield "'/x/..' before the last segment", at(path, path.rindex("/"), "/x/.."), path
    yield "leading ..", ("/.." + path).encode(), REJECT
    yield "no leading /", path[1:].encode(), REJECT
    # Mixed: several mapping aliases at once map; one refused part refuses the whole.
    first = path.index("/", 1) if "/" in path[1:] else len(path)
    yield "mixed //./x/../ + encoded letter", \
        ("//./x/../" + f"%{ord(path[1]):02x}" + path[2:]).encode(), path
    yield "mixed //./ + %2F", ("//./" + path[1:first] + "%2F" + path[first + 1:]).encode() \
        if first < len(path) else ("//./" + path[1:] + "%2F").encode(), REJECT
    yield "mixed /./ + ;x", ("/." + path + ";x").encode(), REJECT
    yield "mixed /x/../ + %00", ("/x/.." + path + "%00").encode(), REJECT


ALIASES = [(path, *alias) for path in PATHS for alias in aliases(path)]


@pytest.mark.parametrize("path", PATHS)
def test_every_route_is_canonical(path: str) -> None:
    assert is_canonical(path)
    assert canonical_path(path.encode()) == path


def test_aliases_map_to_the_path_they_mean_or_are_refused() -> None:
    wrong: list[str] = []
    mapped = refused = 0
    for path, how, raw, expected in ALIASES:
        try:
            got: str | None = canonical_path(raw)
        except PathRejected:
            got = REJECT
        if got != expected:
            wrong.append(f"{path}: {how}: {raw!r} gave {got!r}, expected {expected!r}")
        elif got is REJECT:
            refused += 1
        else:
            mapped += 1
            assert is_canonical(got)
    assert not wrong, "\n".join(wrong[:40])
    assert mapped > 100  # the generator did generate
    assert refused > 1000


def test_no_alias_reaches_another_path() -> None:
    """The invariant the router relies on, whatever the expected outcome above: an alias
    of one path never canonicalises to a different route or engine path."""
    for path, how, raw, _ in ALIASES:
        try:
            got = canonical_path(raw)
        except PathRejected:
            continue
        assert got == path or got not in PATHS, (path, how, raw, got)


@pytest.mark.parametrize(("raw", "expected"), [
    (b"/", "/"),
    (b"/.", "/"),
    (b"/./", "/"),
    (b"//", "/"),
    (b"/a/..", "/"),
    (b"/.well-known/x", "/.well-known/x"),
    (b"/api/blobs/sha256:0a1b", "/api/blobs/sha256:0a1b"),
    (b"/a//./b", "/a/b"),
    (b"//a/../b", "/b"),
    (b"/%7Euser/%40x%3Ay", "/~user/@x:y"),
    (b"/V1/Chat/Completions", "/V1/Chat/Completions"),  # case is kept, not folded
])
def test_mapped(raw: bytes, expected: str) -> None:
    assert canonical_path(raw) == expected


@pytest.mark.parametrize(("raw", "reason"), [
    (b"", "start with '/'"),
    (b"*", "start with '/'"),
    (b"v1/chat/completions", "start with '/'"),
    (b"/..", "above the root"),
    (b"/a/../..", "above the root"),
    (b"/a//../b", "after '//'"),
    (b"/a//./../b", "after '//'"),
    (b"/v1/chat/completions/", "trailing slash"),
    (b"/v1/chat/completions/.", "trailing slash"),
    (b"/v1/chat/completions/x/..", "trailing slash"),
    (b"/v1/chat/completions.", "ending in '.'"),
    (b"/v1/chat/completions;a=b", "';'"),
    (b"/v1%2Fchat/completions", "'/'"),
    (b"/v1%5Cchat/completions", "backslash"),
    (b"/v1\\chat/completions", "backslash"),
    (b"/%2e/v1/chat/completions", "'.'"),
    (b"/v1/chat/completions%00", "control character"),
    (b"/v1/chat/completions\x00", "control character"),
    (b"/v1/chat/completions%C0%80", "non-ASCII"),
    (b"/v1/chat/completions\xc3\xa9", "non-ASCII"),
    (b"/v1/chat/completions%", "invalid percent-encoding"),
    (b"/v1/chat/completions%2", "invalid percent-encoding"),
    (b"/v1/chat/completions%zz", "invalid percent-encoding"),
    (b"/v1/chat/completions%252F", "'%'"),
    (b"/v1/chat/completions%3Fx", "'?'"),
    (b"/v1/chat/completions x", "' '"),
])
def test_refused_with_its_reason(raw: bytes, reason: str) -> None:
    with pytest.raises(PathRejected) as refused:
        canonical_path(raw)
    assert reason in refused.value.reason
    assert refused.value.status_code == 400
    assert refused.value.body()["error"]["code"] == "invalid_path"


def _check(raw: bytes) -> None:
    try:
        got = canonical_path(raw)
    except PathRejected:
        return
    assert is_canonical(got)
    assert canonical_path(got.encode()) == got  # idempotent: its own raw form
    # What it means by another implementation: decode once, merge slashes, resolve dots.
    decoded = urllib.parse.unquote(raw.decode("ascii"), errors="strict")
    assert got == posixpath.normpath("/" + decoded.lstrip("/"))


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_never_raise_anything_else(raw: bytes) -> None:
    _check(raw)
    _check(b"/" + raw)


TOKENS = ["/", ".", "..", "a", "v1", "chat", "%2F", "%2f", "%2E", "%2e", "%5C", "\\", ";",
          "%00", "%61", "%41", "%", "%4", "%25", "~", "%7e", ":", "@", "x.", "...", "%C0%AE",
          "\x00", "\x80", " ", "?"]


@settings(max_examples=600, deadline=None)
@given(st.lists(st.sampled_from(TOKENS), max_size=14))
def test_token_soup_never_raises_anything_else(tokens: list[str]) -> None:
    _check("".join(tokens).encode("latin-1"))
    _check(("/" + "".join(tokens)).encode("latin-1"))


# ------------------------------------------------------------------------ the middleware


class Recorder:
    def __init__(self) -> None:
        self.scopes: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.scopes.append(scope)
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})


async def call(app: Any, scope: dict[str, Any]) -> tuple[int, bytes]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body


def http_scope(raw_path: bytes | None, path: str | None = None,
               root_path: str = "") -> dict[str, Any]:
    scope: dict[str, Any] = {
        "type": "http", "method": "POST", "headers": [], "query_string": b"a=1",
        "root_path": root_path,
        "path": path if path is not None else urllib.parse.unquote(
            (raw_path or b"").decode("latin-1")),
    }
    if raw_path is not None:
        scope["raw_path"] = raw_path
    return scope


@pytest.mark.anyio
async def test_middleware_keeps_a_canonical_scope_as_it_is() -> None:
    inner = Recorder()
    scope = http_scope(b"/v1/chat/completions")
    assert await call(canonical_paths(inner), scope) == (204, b"")
    assert inner.scopes[0] is scope  # the hot path copies nothing


@pytest.mark.anyio
@pytest.mark.parametrize("raw", [b"/./v1/chat/completions", b"//v1/chat/completions",
                                 b"/v1/x/../chat/%63ompletions"])
async def test_middleware_rewrites_path_and_raw_path(raw: bytes) -> None:
    inner = Recorder()
    scope = http_scope(raw)
    assert (await call(canonical_paths(inner), scope))[0] == 204
    seen = inner.scopes[0]
    assert seen["path"] == "/v1/chat/completions"
    assert seen["raw_path"] == b"/v1/chat/completions"
    assert seen["query_string"] == b"a=1"
    assert scope["raw_path"] == raw  # the caller's scope is not mutated


@pytest.mark.anyio
@pytest.mark.parametrize("raw", [b"/v1%2Fchat/completions", b"/../v1/chat/completions",
                                 b"/v1/chat/completions;x", b"/v1\\chat", b"/a%00",
                                 b"/v1/chat/completions/"])
async def test_middleware_answers_400_and_the_app_never_sees_it(raw: bytes) -> None:
    inner = Recorder()
    status, body = await call(canonical_paths(inner), http_scope(raw))
    assert status == 400
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_path"
    assert error["message"].startswith("invalid request path: ")
    assert not inner.scopes


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "status", "expected"), [
    ("/./v1/chat/completions", 204, "/v1/chat/completions"),
    ("/v1/chat/completions", 204, "/v1/chat/completions"),
    ("/a%2Fb", 400, None),  # a decoded '%' is not decoded again: refused
    ("/a/b\\c", 400, None),
    ("/caf\u00e9", 400, None),
])
async def test_middleware_without_raw_path_reads_the_decoded_path(
        path: str, status: int, expected: str | None) -> None:
    inner = Recorder()
    got, _ = await call(canonical_paths(inner), http_scope(None, path=path))
    assert got == status
    if expected is not None:
        assert inner.scopes[0]["path"] == expected
        assert inner.scopes[0]["raw_path"] == expected.encode()


@pytest.mark.anyio
async def test_middleware_keeps_the_root_path() -> None:
    inner = Recorder()
    scope = http_scope(b"/prefix/./v1/chat/completions", root_path="/prefix")
    assert (await call(canonical_paths(inner), scope))[0] == 204
    assert inner.scopes[0]["path"] == "/prefix/v1/chat/completions"
    assert inner.scopes[0]["raw_path"] == b"/prefix/v1/chat/completions"


@pytest.mark.anyio
async def test_middleware_passes_other_scopes_through() -> None:
    inner = Recorder()
    lifespan = {"type": "lifespan"}
    await canonical_paths(inner)(lifespan, None, None)  # type: ignore[arg-type]
    assert inner.scopes == [lifespan]
