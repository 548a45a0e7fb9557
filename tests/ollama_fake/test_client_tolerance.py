"""What Ollama's own Python client and the openai SDK accept on the wire, beyond what Ollama
sends: the evidence for the keep-alive advice in docs/ollama-wire.md.

A small server replays hand-made bodies over real uvicorn to the real clients:
ollama-python reads NDJSON with ``httpx.Response.iter_lines()`` and ``json.loads`` per line
(``ollama/_client.py``, ``Client._request``), so anything that is not a JSON object on a line
fails; the openai SDK's SSE decoder skips ``:`` comment lines.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import ollama
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.fakes.servers import serve_in_thread

CHUNK = {"model": "m", "created_at": "2026-10-03T14:11:00.866073504Z",
         "message": {"role": "assistant", "content": "Hi"}, "done": False}
DONE = {"model": "m", "created_at": "2026-10-03T14:11:01.137307201Z",
        "message": {"role": "assistant", "content": ""}, "done": True, "done_reason": "stop",
        "prompt_eval_count": 3, "eval_count": 1}


def line(value: dict[str, object]) -> bytes:
    return json.dumps(value).encode() + b"\n"


def sse(value: dict[str, object] | str) -> bytes:
    data = value if isinstance(value, str) else json.dumps(value)
    return f"data: {data}\n\n".encode()


@contextlib.contextmanager
def replaying(body: bytes, content_type: str) -> Iterator[str]:
    async def anything(request: Request) -> Response:
        return Response(body, media_type=content_type)

    routes = [Route("/api/chat", anything, methods=["POST"]),
              Route("/v1/chat/completions", anything, methods=["POST"])]
    with serve_in_thread(Starlette(routes=routes)) as base:
        yield base


def ollama_stream(body: bytes) -> list[str]:
    with replaying(body, "application/x-ndjson") as base, ollama.Client(host=base) as client:
        parts = client.chat(model="m", messages=[{"role": "user", "content": "x"}], stream=True)
        return [part.message.content or "" for part in parts]


def test_ollama_python_parses_ollamas_own_stream() -> None:
    assert ollama_stream(line(CHUNK) + line(DONE)) == ["Hi", ""]


@pytest.mark.parametrize("padding", [b" " * 64, b"\t \t"])
def test_ollama_python_accepts_whitespace_before_an_object(padding: bytes) -> None:
    """Spaces or tabs become the start of the next line, and JSON ignores them: a keep-alive
    the client never sees (but not CR, which splits lines: see the next test)."""
    assert ollama_stream(padding + line(CHUNK) + padding + line(DONE)) == ["Hi", ""]


@pytest.mark.parametrize("keepalive", [b"\n", b": ping\n", b"\r\n", b"\r"])
def test_ollama_python_rejects_blank_and_comment_lines(keepalive: bytes) -> None:
    """A blank line, an SSE-style comment or a bare CR (a line break to str.splitlines)
    reaches json.loads as a line of its own and raises."""
    with pytest.raises(json.JSONDecodeError):
        ollama_stream(line(CHUNK) + keepalive + line(DONE))


def test_ollama_python_splits_lines_on_unicode_separators() -> None:
    """httpx's line decoder breaks lines where str.splitlines does, so a raw U+0085 inside a
    JSON string (Go's encoder leaves it unescaped) cuts the object in two."""
    raw = json.dumps(CHUNK | {"message": {"role": "assistant", "content": "a\u0085b"}},
                     ensure_ascii=False).encode() + b"\n"
    with pytest.raises(json.JSONDecodeError):
        ollama_stream(raw + line(DONE))


def test_ollama_python_accepts_empty_content_chunks() -> None:
    """The other keep-alive that parses: a chunk with empty content (a visible no-op event)."""
    empty = CHUNK | {"message": {"role": "assistant", "content": ""}}
    assert ollama_stream(line(empty) + line(CHUNK) + line(DONE)) == ["", "Hi", ""]


def test_ollama_python_raises_on_an_error_line_after_status_200() -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        ollama_stream(line(CHUNK) + line({"error": "boom"}))
    assert (raised.value.status_code, raised.value.error) == (-1, "boom")


CHAT_CHUNK = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
              "model": "m", "system_fingerprint": "fp_ollama",
              "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"},
                           "finish_reason": None}]}


def openai_stream(body: bytes) -> list[str]:
    with replaying(body, "text/event-stream") as base, openai.OpenAI(
            base_url=f"{base}/v1", api_key="x", max_retries=0) as client:
        chunks = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True)
        return [c.choices[0].delta.content or "" for c in chunks if c.choices]


def test_openai_sdk_skips_sse_comments() -> None:
    body = b": ping\n\n" + sse(CHAT_CHUNK) + b": ping\n\n" + sse("[DONE]")
    assert openai_stream(body) == ["Hi"]


def test_openai_sdk_raises_on_an_error_object_but_not_on_ollamas_late_error() -> None:
    with pytest.raises(openai.APIError):
        openai_stream(sse(CHAT_CHUNK) + sse({"error": {"message": "boom"}}))
    ollama_late_error = CHAT_CHUNK | {"model": "", "choices": [
        {"index": 0, "delta": {"content": ""}, "finish_reason": None}]}
    assert openai_stream(sse(CHAT_CHUNK) + sse(ollama_late_error)) == ["Hi", ""]
