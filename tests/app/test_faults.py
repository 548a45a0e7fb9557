"""Engine faults, in process: the proxy (in this event loop) reaches the fake engine (real
uvicorn, its own thread) over real TCP through a tap that can kill, reset and stall
connections. Every client of a failed generation gets an OpenAI-shaped error and an end
of stream in bounded time; the proxy keeps serving; a restart is noticed.

The faults and how the proxy must answer them:

    engine killed mid-prefill / mid-generation   error event (upstream_unavailable) < 1 s
    engine resets the connection                 502, or an error event after headers
    engine slow to accept / silent               heartbeats; past --read-timeout a 504
    malformed SSE, invalid JSON, no [DONE], ...  error event (upstream_protocol_error)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from prefixpin.adapters.http import send_with_stale_retry
from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.settings import Settings
from tests.app.conftest import ProxyClient, clients_of
from tests.fakes.fake_llama import FakeLlamaConfig, FakeLlamaServer
from tests.fakes.servers import serve_in_thread
from tests.fakes.tcp_tap import TcpTap, run_tap
from tests.reporting import print_uncaptured

pytestmark = pytest.mark.anyio

COUNTS: Counter[str] = Counter()  # faults injected and events checked, printed at the end
KILL_DEADLINE_S = 1.0
CLIENT_DEADLINE_S = 20.0  # no client of these tests may wait longer for its stream's end
WAIT_S = 10.0  # for a state the test waits on (a prefill under way, a restart seen)


def chat(text: str, **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 400, **fields}


@dataclass(slots=True)
class Capture:
    """One client's view: status, each SSE comment and data event with its arrival time."""

    status: int = 0
    comments: list[tuple[float, str]] = field(default_factory=list)
    data: list[tuple[float, Any]] = field(default_factory=list)
    body: Any = None
    ended: float | None = None

    def saw_prefill(self) -> bool:
        return any(text.startswith("prefill ") for _, text in self.comments)

    def saw_output(self) -> bool:
        return any(isinstance(d, dict) and any(
            (c.get("delta") or {}).get("content") for c in d.get("choices") or [])
            for _, d in self.data)

    def final_error(self) -> dict[str, Any]:
        """The OpenAI error this client ended with: the last event, or the error body."""
        last = self.data[-1][1] if self.data else self.body
        assert isinstance(last, dict), f"no error at the end: {last!r}"
        return assert_openai_error(last)


def assert_openai_error(payload: dict[str, Any]) -> dict[str, Any]:
    error = payload.get("error")
    assert isinstance(error, dict), payload
    assert isinstance(error.get("message"), str), payload
    assert error["message"], payload
    assert isinstance(error.get("type"), str), payload
    assert set(error) >= {"message", "type", "code", "param"}, payload
    COUNTS["errors checked"] += 1
    return error


async def read(client: httpx.AsyncClient, body: dict[str, Any], capture: Capture,
               headers: dict[str, str] | None = None) -> Capture:
    """Send one request and record everything, within CLIENT_DEADLINE_S (a hung stream
    fails the test instead of hanging it)."""
    async with asyncio.timeout(CLIENT_DEADLINE_S):
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers=headers) as response:
            capture.status = response.status_code
            if not response.headers.get("content-type", "").startswith("text/event-stream"):
                capture.body = json.loads(await response.aread())
                capture.ended = time.monotonic()
                return capture
            buffer = b""
            async for chunk in response.aiter_raw():
                buffer += chunk
                while b"\n\n" in buffer:
                    block, buffer = buffer.split(b"\n\n", 1)
                    _record(capture, block.decode(), time.monotonic())
    capture.ended = time.monotonic()
    return capture


def _record(capture: Capture, block: str, at: float) -> None:
    COUNTS["events checked"] += 1
    if block.startswith(":"):
        capture.comments.append((at, block[1:].strip()))
    elif block.startswith("data: "):
        text = block[6:]
        capture.data.append((at, text if text == "[DONE]" else json.loads(text)))


@contextmanager
def engine_behind_tap(config: FakeLlamaConfig | None = None,
                      **tap_options: Any) -> Iterator[tuple[FakeLlamaServer, TcpTap]]:
    engine = FakeLlamaServer(config or FakeLlamaConfig())
    with serve_in_thread(engine.app()) as url, \
            run_tap("127.0.0.1", int(url.rsplit(":", 1)[1]), **tap_options) as tap:
        yield engine, tap


@asynccontextmanager
async def proxy_to(upstream: str, **settings: Any) -> AsyncIterator[ProxyClient]:
    options: dict[str, Any] = {"heartbeat_s": 0.05, "health_interval_s": 0.2, **settings}
    apps = create_apps(Settings(upstream=upstream, **options))
    app = apps.tenant
    async with app.router.lifespan_context(app), clients_of(
            apps, timeout=CLIENT_DEADLINE_S) as client:
        yield client


async def still_serves(client: httpx.AsyncClient) -> None:
    """The proxy answers a normal request after the fault."""
    response = await client.post("/v1/chat/completions", json=chat("are you there", max_tokens=3))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]
    COUNTS["follow-up requests"] += 1


@pytest.fixture(autouse=True, params=["httptools", "httpx"])
def engine_http(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every fault against both engine transports: httptools' (``adapters/h1.py``, the
    default) and httpx's own, the pure-Python path where httptools has no wheel."""
    transport = str(request.param)
    if transport == "httpx":
        monkeypatch.setenv("PREFIXPIN_ENGINE_HTTP", "httpx")
    else:
        monkeypatch.delenv("PREFIXPIN_ENGINE_HTTP", raising=False)
    return transport


@pytest.fixture(autouse=True)
def no_unexpected_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """No fault may surface as an unexpected exception: not in the app's handler, not as
    an asyncio task that died with nobody to hear it."""
    caplog.set_level(logging.WARNING)
    yield
    # uvicorn's own records come from the fake engine's server (faults raise in it).
    crashes = [r for r in caplog.records
               if r.levelno >= logging.ERROR and not r.name.startswith("uvicorn")]
    assert not crashes, [r.getMessage() for r in crashes]


@pytest.fixture(scope="module", autouse=True)
def print_counts(request: pytest.FixtureRequest) -> Iterator[None]:
    """The counts in the test output (past pytest's capture), as the issue asks."""
    yield
    print_uncaptured(request, f"\nfault suite (in process): {dict(sorted(COUNTS.items()))}")


async def wait_until(predicate: Callable[[], bool]) -> None:
    """Poll: the state lives in other tasks' captures (and the engine's thread)."""
    async with asyncio.timeout(WAIT_S):
        while True:
            if predicate():
                return
            await asyncio.sleep(0.01)


async def sessions_when(client: ProxyClient,
                        predicate: Callable[[list[dict[str, Any]]], bool]
                        ) -> list[dict[str, Any]]:
    """The /sessions view once ``predicate`` holds for its sessions (all namespaces)."""
    async with asyncio.timeout(WAIT_S):
        while True:
            body = (await client.admin.get("/sessions")).json()
            sessions = [s for ns in body["namespaces"].values() for s in ns]
            if predicate(sessions):
                return sessions
            await asyncio.sleep(0.02)


@pytest.mark.parametrize("phase", ["prefill", "generation"])
async def test_a_killed_engine_ends_every_attached_stream_with_an_error_within_a_second(
        phase: str) -> None:
    """Three identical streams (one request resent: joined to one generation), a
    non-streaming twin and an
    unrelated stream; the engine dies: each streaming client gets an OpenAI error event
    and the end of its stream within 1 s, the folded client an error status."""
    config = (FakeLlamaConfig(prefill_s_per_token=0.01, batch=4) if phase == "prefill"
              else FakeLlamaConfig(reply="word " * 2000, token_delay_s=0.01))
    prompt = "please think about this " * 60
    with engine_behind_tap(config) as (engine, tap):
        async with proxy_to(tap.url) as client:
            captures = [Capture() for _ in range(5)]
            bodies = [chat(prompt, stream=True)] * 3 + [chat(prompt),
                                                        chat(prompt + " other", stream=True)]
            # One request resent (one idempotency key): a join, not independent samples.
            same = {"idempotency-key": "one"}
            tasks = [asyncio.create_task(read(client, body, capture, same if i < 4 else None))
                     for i, (body, capture) in enumerate(zip(bodies, captures, strict=True))]
            streaming = [c for c, b in zip(captures, bodies, strict=True) if b.get("stream")]
            started = Capture.saw_prefill if phase == "prefill" else Capture.saw_output
            await wait_until(lambda: all(started(c) for c in streaming))
            killed = time.monotonic()
            await asyncio.to_thread(tap.kill)
            COUNTS[f"engine kills ({phase})"] += 1
            await asyncio.gather(*tasks)
            for capture in captures:
                error = capture.final_error()
                assert error["code"] == "upstream_unavailable", error
                assert capture.ended is not None
                assert capture.ended - killed < KILL_DEADLINE_S, capture.ended - killed
                assert all(d != "[DONE]" for _, d in capture.data)
            assert captures[3].status == 502
            assert all(c.status == 200 for c in streaming)
            tap.revive()
            await still_serves(client)
    # The three identical streams and the folded twin shared one engine request.
    assert len(engine.requests) == 3


async def test_a_lost_engine_makes_sessions_unverified_and_a_restart_resets_the_slot_map(
        ) -> None:
    """Sessions are unverified from the moment the engine stops answering until bytes
    decide again; the restarted engine (new start time) is seen and the slot map reset."""
    first = FakeLlamaServer(FakeLlamaConfig(token_delay_s=0.01, reply="word " * 500))
    second = FakeLlamaServer()
    with serve_in_thread(first.app()) as first_url, serve_in_thread(second.app()) as second_url, \
            run_tap("127.0.0.1", int(first_url.rsplit(":", 1)[1])) as tap:
        async with proxy_to(tap.url) as client:
            messages = [{"role": "user", "content": "remember the number 7"}]
            headers = {"x-session-id": "agent-1"}
            done = await client.post("/v1/chat/completions", headers=headers,
                                     json={"messages": messages, "max_tokens": 3})
            assert done.status_code == 200
            before = (await client.admin.get("/sessions")).json()
            assert [s["session"] for s in before["slots"]].count(None) == 1, before["slots"]
            capture = Capture()
            task = asyncio.create_task(read(client, chat("a long answer", stream=True), capture))
            await wait_until(capture.saw_output)
            await asyncio.to_thread(tap.kill)
            await task
            assert capture.final_error()["code"] == "upstream_unavailable"
            lost = await sessions_when(
                client, lambda s: all(x["last_decision"] == "unverified" for x in s))
            reasons = {s["last_reason"] for s in lost}
            assert all(r.startswith("engine unreachable") for r in reasons), reasons
            # The engine comes back as another process: a new start time.
            tap.target_port = int(second_url.rsplit(":", 1)[1])
            tap.revive()
            COUNTS["engine restarts"] += 1
            await sessions_when(
                client, lambda s: any(x["last_reason"] == "engine restarted" for x in s))
            slots = (await client.admin.get("/sessions")).json()["slots"]
            assert all(s["session"] is None and s["tokens"] == 0 for s in slots), slots
            # Bytes decide again: the session's next turn is judged on its history.
            messages += [{"role": "assistant", "content": "ok"},
                         {"role": "user", "content": "which number?"}]
            again = await client.post("/v1/chat/completions", headers=headers,
                                      json={"messages": messages, "max_tokens": 3})
            assert again.status_code == 200
            sessions = await sessions_when(client, lambda s: True)
            agent = next(s for s in sessions if s["key"] == "agent-1")
            assert agent["last_decision"] == "resumed", agent
            # The restarted engine's slot is not trusted to hold anything: no cache read.
            assert second.requests[-1]["cache_prompt"] is False


@pytest.mark.parametrize("stream", [True, False])
async def test_an_engine_slow_to_accept_gets_heartbeats_then_answers(stream: bool) -> None:
    """The engine takes 0.5 s to take the connection: a streaming client gets heartbeats
    meanwhile; both kinds of client get the full answer."""
    with engine_behind_tap() as (_, tap):
        async with proxy_to(tap.url) as client:
            tap.accept_delay_s = 0.5
            await asyncio.to_thread(tap.kill)  # no pooled connection escapes the delay
            tap.revive()
            capture = await read(client, chat("hello", stream=stream, max_tokens=4), Capture())
    COUNTS["slow accepts"] += 1
    assert capture.status == 200
    if stream:
        assert capture.data[-1][1] == "[DONE]"
        assert [t for _, t in capture.comments].count("waiting for the engine") >= 3
    else:
        assert capture.body["choices"][0]["message"]["content"]


@pytest.mark.parametrize("stream", [True, False])
async def test_an_engine_silent_past_the_read_timeout_is_a_504(stream: bool) -> None:
    """An engine that accepts but never answers (or stops mid-way) does not hang anyone:
    past --read-timeout the client gets upstream_timeout."""
    with engine_behind_tap(accept_delay_s=30) as (_, tap):
        async with proxy_to(tap.url, read_timeout_s=0.5, probe_timeout_s=0.5) as client:
            started = time.monotonic()
            capture = await read(client, chat("hello", stream=stream), Capture())
            elapsed = time.monotonic() - started
            COUNTS["silent engines"] += 1
            assert capture.final_error()["code"] == "upstream_timeout"
            assert capture.status == (200 if stream else 504)
            assert elapsed < 3.0
            health = await client.get("/healthz")  # the probe has its own deadline
            assert health.status_code == 503


async def test_an_engine_hanging_after_prefill_ends_in_upstream_timeout() -> None:
    """The engine prefills, then goes silent: heartbeats, then upstream_timeout."""
    with engine_behind_tap() as (engine, tap):
        async with proxy_to(tap.url, read_timeout_s=0.5) as client:
            engine.faults.append("hang")
            capture = await read(client, chat("hello", stream=True), Capture())
            COUNTS["faults injected"] += 1
            assert capture.final_error()["code"] == "upstream_timeout"
            assert capture.comments
            await still_serves(client)


async def test_an_engine_that_never_accepts_is_a_connect_timeout() -> None:
    """A port whose accept queue is full (SYNs go unanswered): past --connect-timeout a
    504, not a hang."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        fillers = []
        for _ in range(4):  # fill the accept queue; later connects are never answered
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", port))
            fillers.append(sock)
        try:
            async with proxy_to(f"http://127.0.0.1:{port}", connect_timeout_s=0.5,
                                read_timeout_s=0.5, probe_timeout_s=0.5) as client:
                started = time.monotonic()
                capture = await read(client, chat("hello"), Capture())
                elapsed = time.monotonic() - started
        finally:
            for sock in fillers:
                sock.close()
    COUNTS["unaccepted connects"] += 1
    assert capture.status == 504
    assert capture.final_error()["code"] == "upstream_timeout"
    assert elapsed < 3.0


@pytest.mark.parametrize("after_bytes", [0, 400])
@pytest.mark.parametrize("stream", [True, False])
async def test_connection_resets_are_a_clear_error(after_bytes: int, stream: bool) -> None:
    """The engine's connection is reset before the answer or mid-stream: a 502 or an
    error event, then the proxy serves the next request."""
    with engine_behind_tap(FakeLlamaConfig(token_delay_s=0.005),
                           reset_after_bytes_down=after_bytes) as (_, tap):
        async with proxy_to(tap.url) as client:
            capture = await read(client, chat("hello", stream=stream), Capture())
            COUNTS["connection resets"] += 1
            assert capture.final_error()["code"] == "upstream_unavailable"
            if not stream:
                assert capture.status == 502
            tap.reset_after_bytes_down = None
            await still_serves(client)


@pytest.mark.parametrize(("fault", "code", "fragment"), [
    ("bad_json", "upstream_protocol_error", "not JSON"),
    ("non_object", "upstream_protocol_error", "not a JSON object"),
    ("close", "upstream_protocol_error", "before it finished"),
    ("not_sse", "upstream_protocol_error", "not an event stream"),
    ("huge_event", "upstream_protocol_error", "SSE event larger than"),
    ("crash", "upstream_unavailable", "incomplete"),
    ("error_event", "upstream_protocol_error", "fault injected"),
    ("reset", None, ""),
])
@pytest.mark.parametrize("stream", [True, False])
async def test_malformed_engine_output_is_a_clear_error_never_a_crash(
        fault: str, code: str | None, fragment: str, stream: bool) -> None:
    """Each malformed answer ends in an OpenAI-shaped error naming the problem, within
    bounded time, and the proxy keeps serving."""
    with engine_behind_tap() as (engine, tap):
        async with proxy_to(tap.url) as client:
            engine.faults.append(fault)
            capture = await read(client, chat("hello", stream=stream), Capture())
            COUNTS["faults injected"] += 1
            error = capture.final_error()
            if code is not None:
                assert error["code"] == code, error
            assert fragment in error["message"], error
            if not stream:
                assert capture.status >= 500
            await still_serves(client)


async def test_a_keep_alive_connection_reset_as_it_is_reused_is_retried_once() -> None:
    """The engine closes an idle keep-alive connection just as the proxy reuses it (its
    keep-alive timeout): the reset comes before any response byte, the request never
    reached the engine, and one retry on a fresh connection serves it."""
    served: list[int] = []  # per connection, requests answered

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(0)
        index = len(served) - 1
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            while await reader.readuntil(b"\r\n\r\n"):
                if index == 0 and served[index] == 1:
                    # The second request on the first connection: a reset (linger 0), as a
                    # server closing the connection under the request does.
                    writer.get_extra_info("socket").setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                served[index] += 1
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"content-length: 14\r\n\r\ndata: [DONE]\n\n")
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        for _ in range(2):
            response = await send_with_stale_retry(http, http.build_request("GET", "/x"))
            assert response.status_code == 200
            await response.aread()  # read to the end: the connection goes back to the pool
    COUNTS["keep-alive resets retried"] += 1
    assert served == [1, 1]  # the reset request was answered on a second connection
