"""Bad input: malformed and hostile requests, hand-written and hypothesis-generated, sent
over real TCP to the proxy under a real uvicorn (with the server limits it is served with)
in front of the fake engine.

Each request gets a 4xx with an OpenAI-shaped error, or a correct 200 when it is in fact
valid; the proxy keeps serving; every request carries a bearer token and the token never
appears in a log line. The engine's model file is the real SmolLM2 GGUF, so implicit
identity (tokenizer and fingerprints) runs on every hostile body too.
"""

from __future__ import annotations

import json
import logging
import socket
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixpin.proxy.listen.app import create_app
from prefixpin.proxy.listen.http_limits import MAX_HEAD_BYTES, http_options
from prefixpin.proxy.ops.logs import JSONFormatter
from prefixpin.proxy.settings import Settings
from tests.fakes.fake_llama import FakeLlamaConfig, FakeLlamaServer
from tests.fakes.servers import serve_in_thread
from tests.reporting import print_uncaptured
from tests.rig.models import ensure_model

SECRET = "sk-canary-4f1d9b7e2c0a"  # every request's bearer token: must never be logged
AUTH = {"authorization": f"Bearer {SECRET}"}
MAX_BODY = 4 * 1024 * 1024
MAX_MESSAGES = 20_000
CHAT = "/v1/chat/completions"
GOOD: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

STATS: Counter[str] = Counter()  # inputs tried, per source and per status


class LogCapture(logging.Handler):
    """Every record any logger in this process emits, formatted as the proxy logs it (JSON
    with its fields and traceback), so a secret anywhere in a record is found."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.records: list[logging.LogRecord] = []
        self.formatter_ = JSONFormatter()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.lines.append(self.formatter_.format(record))


@dataclass(slots=True)
class Served:
    url: str
    port: int
    engine: FakeLlamaServer
    logs: LogCapture
    client: httpx.Client
    seen: list[int] = field(default_factory=list)


LOGGERS = ("", "prefixpin", "uvicorn", "uvicorn.error", "uvicorn.access", "asyncio")


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    capture = LogCapture()
    loggers = [logging.getLogger(name) for name in LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(capture)
    logging.getLogger("prefixpin").setLevel(logging.DEBUG)  # the request lines too
    engine = FakeLlamaServer(FakeLlamaConfig(model=str(ensure_model("smollm2"))))
    # allow_shared_cache: the odd-token tests are several namespaces on one fake whose
    # prompt cache is assumed shared (tests/app/test_isolation.py covers the refusal).
    settings_ = Settings(upstream="http://placeholder", max_body_bytes=MAX_BODY,
                         max_messages=MAX_MESSAGES, allow_shared_cache=True)
    try:
        with serve_in_thread(engine.app()) as engine_url, serve_in_thread(
                create_app(settings_.model_copy(update={"upstream": engine_url})),
                **http_options()) as url, httpx.Client(base_url=url, timeout=60) as client:
            yield Served(url, int(url.rsplit(":", 1)[1]), engine, capture, client)
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(capture)
            logger.setLevel(level)


@pytest.fixture(scope="module", autouse=True)
def report(request: pytest.FixtureRequest, served: Served) -> Iterator[None]:
    """Counts in the test output; then the log checks over everything the module sent."""
    yield
    lines = served.logs.lines
    summary = (f"\nbad-input corpus: {STATS['inputs']} inputs tried; "
               f"{dict(sorted((k, v) for k, v in STATS.items() if k != 'inputs'))}; "
               f"{len(lines)} log records checked for the bearer token")
    print_uncaptured(request, summary)
    leaked = [line for line in lines if SECRET in line]
    assert not leaked, leaked[:3]
    crashes = [line for line, record in zip(lines, served.logs.records, strict=True)
               if record.levelno >= logging.ERROR]
    assert not crashes, crashes[:3]


def count(source: str, status: int | None) -> None:
    STATS["inputs"] += 1
    STATS[f"{source}:{status}"] += 1


def assert_openai_error(response: httpx.Response) -> dict[str, Any]:
    assert response.headers.get("content-type", "").startswith("application/json"), \
        response.text[:300]
    error = response.json().get("error")
    assert isinstance(error, dict), response.text[:300]
    assert isinstance(error.get("message"), str), error
    assert error["message"], error
    assert isinstance(error.get("type"), str), error
    return error


def assert_completion(response: httpx.Response, *, stream: bool) -> None:
    assert response.status_code == 200, response.text[:500]
    if stream:
        events = [e for e in response.text.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "data: [DONE]", events[-3:]
        assert all("error" not in json.loads(e[6:]) for e in events[:-1])
    else:
        assert isinstance(response.json()["choices"], list)


def still_serves(served: Served) -> None:
    response = served.client.post(CHAT, json=GOOD, headers=AUTH)
    assert_completion(response, stream=False)


def post(served: Served, content: bytes | Iterator[bytes], *, path: str = CHAT,
         headers: dict[str, str] | None = None) -> httpx.Response:
    return served.client.post(path, content=content,
                              headers={**AUTH, "content-type": "application/json",
                                       **(headers or {})})


def raw_exchange(served: Served, request: bytes, *, leave: bool = False) -> bytes:
    """Send bytes no HTTP client would, read until the server closes (bounded). With
    ``leave``, the client closes its side at once (it gives up)."""
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as sock:
        try:
            sock.sendall(request)
            if leave:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may answer and close before it has read everything
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def parse_raw(answer: bytes) -> tuple[int | None, Any]:
    if not answer:
        return None, None
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if body.startswith(b"{") else body


def dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = {"k": value}
    return value


def chat_with(**fields: Any) -> bytes:
    return dumps({**GOOD, **fields})


def message(**fields: Any) -> bytes:
    return dumps({"messages": [{"role": "user", "content": "hi", **fields}], "max_tokens": 3})


# (name, body, expected status, expected param or None, path)
HANDWRITTEN: list[tuple[str, bytes, int, str | None, str]] = [
    ("empty body", b"", 400, None, CHAT),
    ("whitespace body", b" \n\t ", 400, None, CHAT),
    ("null", b"null", 400, None, CHAT),
    ("array", b"[]", 400, None, CHAT),
    ("string", b'"hello"', 400, None, CHAT),
    ("number", b"42", 400, None, CHAT),
    ("truncated JSON", b'{"messages": [', 400, None, CHAT),
    ("trailing garbage", dumps(GOOD) + b"}", 400, None, CHAT),
    ("invalid UTF-8", b'{"messages":[{"role":"user","content":"\xff\xfe"}]}', 400, None, CHAT),
    ("UTF-16 body", json.dumps(GOOD).encode("utf-16"), 400, None, CHAT),
    ("BOM", b"\xef\xbb\xbf" + dumps(GOOD), 400, None, CHAT),
    ("NaN", chat_with(temperature=float("nan")), 400, None, CHAT),
    ("Infinity", chat_with(temperature=float("inf")), 400, None, CHAT),
    ("1e999", dumps(GOOD)[:-1] + b', "top_p": 1e999}', 400, None, CHAT),
    ("5000-digit integer", dumps(GOOD)[:-1] + b', "seed": ' + b"9" * 5000 + b"}", 400, None,
     CHAT),
    ("lone surrogate", b'{"messages":[{"role":"user","content":"a\\ud800b"}]}', 400, None, CHAT),
    ("lone surrogate in a key", b'{"messages":[{"role":"user","content":"x","\\udfff":1}]}',
     400, None, CHAT),
    ("surrogate pair", b'{"messages":[{"role":"user","content":"\\ud83d\\ude00"}],'
     b'"max_tokens":3}', 200, None, CHAT),
    ("100k-deep nesting", b"[" * 100_000 + b"]" * 100_000, 400, None, CHAT),
    ("101-deep content", message(content=[{"type": "text", "text": "x",
                                           "extra": nested(101)}]), 400, None, CHAT),
    ("40-deep tool schema", chat_with(tools=[{"type": "function", "function": {
        "name": "f", "parameters": nested(40)}}]), 200, None, CHAT),
    ("unknown role", message(role="wizard"), 400, "messages[0].role", CHAT),
    ("role null", message(role=None), 400, "messages[0].role", CHAT),
    ("role number", message(role=1), 400, "messages[0].role", CHAT),
    ("empty content", message(content=""), 200, None, CHAT),
    ("null content", message(content=None), 200, None, CHAT),
    ("empty parts", message(content=[]), 200, None, CHAT),
    ("empty text part", message(content=[{"type": "text", "text": ""}]), 200, None, CHAT),
    ("content number", message(content=5), 400, "messages[0].content", CHAT),
    ("content object", message(content={"text": "x"}), 400, "messages[0].content", CHAT),
    ("content part string", message(content=["x"]), 400, "messages[0].content", CHAT),
    ("tool_calls string", message(role="assistant", tool_calls="x"), 400,
     "messages[0].tool_calls", CHAT),
    ("tool_calls of numbers", message(role="assistant", tool_calls=[1]), 400,
     "messages[0].tool_calls[0]", CHAT),
    ("tool_call function string", message(role="assistant", tool_calls=[{"function": "f"}]),
     400, "messages[0].tool_calls[0].function", CHAT),
    ("name number", message(name=5), 400, "messages[0].name", CHAT),
    ("tool_call_id list", message(role="tool", tool_call_id=[1]), 400,
     "messages[0].tool_call_id", CHAT),
    ("messages null", dumps({"messages": None}), 400, "messages", CHAT),
    ("messages object", dumps({"messages": {"role": "user"}}), 400, "messages", CHAT),
    ("messages string", dumps({"messages": "hi"}), 400, "messages", CHAT),
    ("messages empty", dumps({"messages": []}), 200, None, CHAT),  # the engine judges it
    ("message as pair", dumps({"messages": [["user", "hi"]]}), 400, "messages[0]", CHAT),
    ("stream null", chat_with(stream=None), 200, None, CHAT),
    ("stream string", chat_with(stream="true"), 400, "stream", CHAT),
    ("stream_options null", chat_with(stream_options=None), 200, None, CHAT),
    ("stream_options list", chat_with(stream_options=[]), 400, "stream_options", CHAT),
    ("max_tokens null", chat_with(max_tokens=None), 200, None, CHAT),
    ("max_tokens string", chat_with(max_tokens="5"), 400, "max_tokens", CHAT),
    ("max_tokens 3.0", chat_with(max_tokens=3.0), 200, None, CHAT),
    ("max_tokens 2.5", chat_with(max_tokens=2.5), 400, "max_tokens", CHAT),
    ("max_tokens true", chat_with(max_tokens=True), 400, "max_tokens", CHAT),
    ("temperature string", chat_with(temperature="hot"), 400, "temperature", CHAT),
    ("temperature 0", chat_with(temperature=0), 200, None, CHAT),
    ("model number", chat_with(model=5), 400, "model", CHAT),
    ("model null", chat_with(model=None), 200, None, CHAT),
    ("stop number", chat_with(stop=5), 400, "stop", CHAT),
    ("stop list", chat_with(stop=["\n", "END"]), 200, None, CHAT),
    ("tools object", chat_with(tools={}), 400, "tools", CHAT),
    ("tools null", chat_with(tools=None), 200, None, CHAT),
    ("tool_choice number", chat_with(tool_choice=5), 400, "tool_choice", CHAT),
    ("n true", chat_with(n=True), 400, "n", CHAT),
    ("seed float", chat_with(seed=1.5), 400, "seed", CHAT),
    ("user object", chat_with(user={"id": 1}), 400, "user", CHAT),
    ("metadata string", chat_with(metadata="x"), 400, "metadata", CHAT),
    ("return_progress string", chat_with(return_progress="yes"), 400, "return_progress",
     CHAT),
    ("unknown fields", chat_with(frobnicate={"a": [1, None]}, id_slot="x"), 200, None, CHAT),
    ("prompt missing", dumps({"max_tokens": 3}), 400, "prompt", "/v1/completions"),
    ("prompt number", dumps({"prompt": 5}), 400, "prompt", "/v1/completions"),
    ("prompt empty list", dumps({"prompt": []}), 400, "prompt", "/v1/completions"),
    ("prompt nested lists", dumps({"prompt": [[1, 2]]}), 400, "prompt", "/v1/completions"),
    ("prompt mixed list", dumps({"prompt": ["a", 1], "max_tokens": 3}), 200, None,
     "/v1/completions"),
    ("completions logprobs bool", dumps({"prompt": "a", "logprobs": True}), 400, "logprobs",
     "/v1/completions"),
    ("huge string", dumps({"messages": [{"role": "user", "content": "x" * (3 * 2**20)}],
                           "max_tokens": 3}), 200, None, CHAT),
    ("10k messages", dumps({"messages": [{"role": "user", "content": "hi"}] * 10_000,
                            "max_tokens": 3}), 400, None, CHAT),  # the engine: too long
    ("too many messages", dumps({"messages": [{"role": "user", "content": ""}]
                                 * (MAX_MESSAGES + 1)}), 400, "messages", CHAT),
    ("body over the limit", dumps({"messages": [{"role": "user",
                                                 "content": "x" * (MAX_BODY + 1)}]}),
     413, None, CHAT),
]


@pytest.mark.parametrize(("name", "body", "status", "param", "path"), HANDWRITTEN,
                         ids=[case[0] for case in HANDWRITTEN])
def test_hand_written_bodies(served: Served, name: str, body: bytes, status: int,
                             param: str | None, path: str) -> None:
    """Each hand-written body gets its status: a 4xx with an OpenAI error naming the
    field, or a correct completion; a rejected body never reaches the engine."""
    before = len(served.engine.requests)
    response = post(served, body, path=path)
    count("hand-written", response.status_code)
    assert response.status_code == status, (name, response.text[:300])
    if status == 200:
        assert_completion(response, stream=False)
        assert len(served.engine.requests) == before + 1
    else:
        error = assert_openai_error(response)
        if param is not None:
            assert error["param"] == param, error
        if status == 413 or param is not None:
            assert len(served.engine.requests) == before, "a rejected body was forwarded"
    still_serves(served)


def test_a_body_over_the_limit_without_a_length_is_a_413(served: Served) -> None:
    """Chunked, no Content-Length, three times the limit: a 413 (the proxy stops buffering
    at the limit; the server drains the rest so the connection stays usable)."""
    chunk = b"x" * 65536

    def body() -> Iterator[bytes]:
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(3 * MAX_BODY // len(chunk)):
            yield chunk
        yield b'"}]}'

    response = post(served, body())
    count("chunked", response.status_code)
    assert response.status_code == 413
    assert assert_openai_error(response)["code"] == "payload_too_large"
    still_serves(served)


def test_a_chunked_body_without_a_length_is_read(served: Served) -> None:
    """A valid body sent chunked (no Content-Length) is a normal request."""
    raw = dumps(GOOD)
    response = post(served, iter([raw[:7], raw[7:20], raw[20:]]))
    count("chunked", response.status_code)
    assert_completion(response, stream=False)


@pytest.mark.parametrize(("content_type", "body", "status"), [
    ("text/plain", dumps(GOOD), 200),
    (None, dumps(GOOD), 200),
    ("application/json; charset=latin-1", dumps(GOOD), 200),
    ("application/x-www-form-urlencoded", b"messages=hi&max_tokens=3", 400),
    ("multipart/form-data; boundary=x", b'--x\r\nContent-Disposition: form-data; name="m"'
     b"\r\n\r\nhi\r\n--x--\r\n", 400),
])
def test_content_types(served: Served, content_type: str | None, body: bytes,
                       status: int) -> None:
    """The body is JSON whatever the label says (llama-server does the same): a JSON body
    is served, a form is a 400."""
    headers = {**AUTH}
    if content_type is not None:
        headers["content-type"] = content_type
    response = served.client.post(CHAT, content=body, headers=headers)
    count("content-type", response.status_code)
    assert response.status_code == status, response.text[:300]
    if status != 200:
        assert_openai_error(response)


@pytest.mark.parametrize(("headers", "status"), [
    ({f"x-h{i}": "v" * 100 for i in range(200)}, 200),
    ({f"x-h{i}": "v" * 50 for i in range(2000)}, 431),
    ({"x-big": "v" * 100_000}, 431),
    ({"x-big": "v" * 8_000_000}, 431),
    ({"x-session-id": "s" * 10_000}, 200),
    ({"authorization": "Bearer " + "t" * 40_000}, 200),
], ids=["200 headers", "2000 headers", "100 KB header", "8 MB header", "10 KB session id",
        "40 KB token"])
def test_header_floods(served: Served, headers: dict[str, str], status: int) -> None:
    """Many or large headers: within the head limit a normal answer, past it a 431 with an
    OpenAI error (the head is never buffered past the limit)."""
    raw = (f"POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
           f"authorization: Bearer {SECRET}\r\n").encode()
    body = dumps(GOOD)
    raw += b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items())
    raw += f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body
    got, payload = parse_raw(raw_exchange(served, raw))
    count("headers", got)
    assert got == status, payload
    if status == 431:
        assert payload["error"]["code"] == "headers_too_large"
        assert str(MAX_HEAD_BYTES) in payload["error"]["message"]
    still_serves(served)


@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: abc\r\n\r\n{}",
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: -5\r\n\r\n{}",
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nno colon here\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-nul: a\x00b\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n"
    b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    b"zz\r\n{}\r\n0\r\n\r\n",
    b"POST /" + b"a" * 100_000 + b" HTTP/1.1\r\nhost: x\r\n\r\n",
], ids=["not HTTP", "length not a number", "negative length", "header without colon",
        "NUL in a header", "length and chunked", "bad chunk size", "100 KB URL"])
def test_malformed_http_is_an_openai_error(served: Served, request_bytes: bytes) -> None:
    """What uvicorn refuses before the app sees it still gets an OpenAI-shaped 4xx."""
    status, payload = parse_raw(raw_exchange(served, request_bytes))
    count("malformed HTTP", status)
    assert status in (400, 431), payload
    assert isinstance(payload, dict), payload
    assert payload["error"]["type"] == "invalid_request_error"
    still_serves(served)


def test_a_body_shorter_than_its_length_is_no_crash(served: Served) -> None:
    """The client promises 1000 bytes, sends 10 and goes: nothing is logged as an error."""
    answer = raw_exchange(served, f"POST {CHAT} HTTP/1.1\r\nhost: x\r\n"
                                  "content-length: 1000\r\n\r\n".encode() + b'{"messages',
                          leave=True)
    count("short body", parse_raw(answer)[0])
    still_serves(served)


@pytest.mark.parametrize("token", ["sk-t\xe9st-" + SECRET, SECRET + "\xff", SECRET + " x"])
def test_odd_bearer_tokens_are_forwarded_and_never_logged(served: Served, token: str) -> None:
    """A bearer token with latin-1 bytes or spaces: the request is served (the engine
    judges credentials) and the token reaches no log line (checked at the module's end)."""
    response = served.client.post(CHAT, json=GOOD, headers={
        b"authorization": b"Bearer " + token.encode("latin-1")})
    count("bearer", response.status_code)
    assert_completion(response, stream=False)
    assert served.engine.requests  # forwarded with the request


# -- generated inputs ------------------------------------------------------------------

ROLES = ["system", "developer", "user", "assistant", "tool"]
TEXT = st.text(max_size=40)
JSON_LEAVES = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(
    allow_nan=False, allow_infinity=False) | TEXT
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12)

# The OpenAI types of request fields (from the API reference, independent of the proxy).
OPENAI_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,), "max_tokens": (int,), "n": (int,), "seed": (int,),
    "temperature": (int, float), "top_p": (int, float), "presence_penalty": (int, float),
    "frequency_penalty": (int, float), "stop": (str, list), "user": (str,),
    "tools": (list,), "tool_choice": (str, dict), "parallel_tool_calls": (bool,),
    "response_format": (dict,), "logprobs": (bool,), "metadata": (dict,),
    "stream": (bool,), "stream_options": (dict,),
}


def valid_message() -> st.SearchStrategy[dict[str, Any]]:
    part = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
    return st.fixed_dictionaries(
        {"role": st.sampled_from(ROLES),
         "content": st.one_of(TEXT, st.none(), st.lists(part, max_size=3))},
        optional={"name": TEXT, "tool_call_id": TEXT,
                  "tool_calls": st.lists(st.fixed_dictionaries(
                      {"id": TEXT, "type": st.just("function"),
                       "function": st.fixed_dictionaries({"name": TEXT,
                                                          "arguments": TEXT})}), max_size=2)})


def valid_bodies() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {"messages": st.lists(valid_message(), min_size=1, max_size=8),
         "max_tokens": st.integers(1, 4)},
        optional={"model": TEXT, "temperature": st.floats(0, 2), "stop": st.lists(TEXT,
                                                                                  max_size=2),
                  "stream": st.booleans(), "seed": st.integers(0, 2**31),
                  "user": TEXT, "stream_options": st.just({"include_usage": True}),
                  "frobnicate": JSON_VALUES})


def wrong_type(allowed: tuple[type, ...]) -> st.SearchStrategy[Any]:
    def wrong(value: Any) -> bool:
        if value is None:
            return False
        if isinstance(value, bool):
            return bool not in allowed
        if isinstance(value, float) and value.is_integer() and int in allowed:
            return False  # 3.0 is an integer in JSON
        return not isinstance(value, allowed)
    return JSON_VALUES.filter(wrong)


@st.composite
def invalid_bodies(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    """A valid body with one field made invalid; returns it with the param the error
    must name."""
    body = draw(valid_bodies())
    messages = body["messages"]
    index = draw(st.integers(0, len(messages) - 1))
    where = f"messages[{index}]"
    kind = draw(st.sampled_from(["field", "message", "role", "content", "tool_calls",
                                 "name", "messages"]))
    if kind == "field":
        name = draw(st.sampled_from(sorted(OPENAI_TYPES)))
        body[name] = draw(wrong_type(OPENAI_TYPES[name]))
        return body, name
    if kind == "messages":
        body["messages"] = draw(wrong_type((list,)))
        return body, "messages"
    if kind == "message":
        messages[index] = draw(wrong_type((dict,)))
        return body, where
    if kind == "role":
        messages[index]["role"] = draw(JSON_VALUES.filter(lambda r: r not in (*ROLES,
                                                                               "function")))
        return body, f"{where}.role"
    if kind == "content":
        messages[index]["content"] = draw(wrong_type((str, list)) | st.lists(
            wrong_type((dict,)), min_size=1, max_size=3))
        return body, f"{where}.content"
    if kind == "tool_calls":
        messages[index]["tool_calls"] = draw(wrong_type((list,)))
        return body, f"{where}.tool_calls"
    messages[index]["name"] = draw(wrong_type((str,)))
    return body, f"{where}.name"


FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.filter_too_much])


@FUZZ
@given(body=valid_bodies(), extra_headers=st.dictionaries(
    st.from_regex(r"x-[a-z0-9-]{1,20}", fullmatch=True),
    st.from_regex(r"[!-~][ -~]{0,60}", fullmatch=True).map(str.strip), max_size=5))
def test_generated_valid_bodies_are_served(served: Served, body: dict[str, Any],
                                           extra_headers: dict[str, str]) -> None:
    """Any well-typed body (any extra headers) is a correct completion, streamed or not."""
    response = served.client.post(CHAT, json=body, headers={**extra_headers, **AUTH})
    count("generated valid", response.status_code)
    assert_completion(response, stream=bool(body.get("stream")))


@FUZZ
@given(case=invalid_bodies())
def test_generated_invalid_bodies_name_their_field(served: Served,
                                                   case: tuple[dict[str, Any], str]) -> None:
    """One field of the wrong type or value: a 400 whose error names that field; the
    engine never sees the request."""
    body, param = case
    before = len(served.engine.requests)
    response = post(served, dumps(body))
    count("generated invalid", response.status_code)
    assert response.status_code == 400, (param, response.text[:300])
    assert assert_openai_error(response)["param"] == param
    assert len(served.engine.requests) == before


@FUZZ
@given(body=JSON_VALUES | st.dictionaries(st.sampled_from(["messages", "prompt", "stream",
                                                           "max_tokens", "model", "tools"]),
                                          JSON_VALUES, max_size=4),
       path=st.sampled_from([CHAT, "/v1/completions"]))
def test_arbitrary_json_is_a_400_or_a_completion(served: Served, body: Any, path: str) -> None:
    """Any JSON value at all: never a 5xx; a 400 with an OpenAI error or a completion."""
    response = post(served, dumps(body), path=path)
    count("generated JSON", response.status_code)
    assert response.status_code in (200, 400), response.text[:300]
    if response.status_code == 400:
        assert_openai_error(response)
    else:
        assert_completion(response, stream=bool(isinstance(body, dict) and body.get("stream")))


@FUZZ
@given(raw=st.binary(max_size=300))
def test_arbitrary_bytes_are_a_400(served: Served, raw: bytes) -> None:
    """Random bytes as the body: a 400 with an OpenAI error."""
    response = post(served, raw)
    count("generated bytes", response.status_code)
    assert response.status_code == 400, response.text[:300]
    assert_openai_error(response)


def test_the_proxy_still_serves_after_the_corpus(served: Served) -> None:
    """After everything above, a normal streamed request is served."""
    response = served.client.post(CHAT, json={**GOOD, "stream": True}, headers=AUTH)
    assert_completion(response, stream=True)
