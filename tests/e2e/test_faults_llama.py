"""Engine faults against the real llama-server: killed (SIGKILL) during prefill and during
generation, restarted, and its connection reset mid-stream.

Every client attached to the failed generation (three identical streams and a folded
twin, joined in flight, plus an unrelated stream) gets an OpenAI-shaped error and the end
of its stream within a second of the kill, measured; the sessions become unverified; the
restart is detected and the slot map reset; bytes decide again on the next turn. This
module runs its own llama-server (it kills it), so the session's shared one is untouched.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.listen.http_limits import http_options
from prefixpin.proxy.settings import Settings
from tests.e2e.helpers import filler
from tests.fakes.servers import ServedURL, serve_proxy
from tests.fakes.tcp_tap import run_tap
from tests.reporting import print_uncaptured
from tests.rig.llama_process import LlamaServerProcess, restart, run_llama_server

pytestmark = pytest.mark.llama

KILL_DEADLINE_S = 1.0
WAIT_S = 60.0
COUNTS: Counter[str] = Counter()


@pytest.fixture(scope="module")
def engine() -> Iterator[LlamaServerProcess]:
    """A llama-server of this module's own (2 slots of 4k): the tests kill it."""
    with run_llama_server("smollm2", slots=2, ctx_per_slot=4096) as handle:
        yield handle


@pytest.fixture(scope="module", autouse=True)
def print_counts(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    print_uncaptured(request, f"\nfault suite (llama-server): {dict(sorted(COUNTS.items()))}")


@contextmanager
def proxy(upstream: str, **settings: Any) -> Iterator[ServedURL]:
    options: dict[str, Any] = {"heartbeat_s": 0.1, "health_interval_s": 0.25, **settings}
    with serve_proxy(create_apps(Settings(upstream=upstream, **options)),
                     **http_options()) as url:
        yield url


@dataclass(slots=True)
class Client:
    """One client in its own thread: what it received, and when its stream ended."""

    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    status: int = 0
    comments: list[str] = field(default_factory=list)
    data: list[Any] = field(default_factory=list)
    folded: Any = None
    ended: float | None = None
    thread: threading.Thread | None = None

    def start(self, url: str) -> Client:
        self.thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self.thread.start()
        return self

    def _run(self, url: str) -> None:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=self.body,
                          headers=self.headers, timeout=WAIT_S) as response:
            self.status = response.status_code
            if not self.body.get("stream"):
                self.folded = json.loads(response.read())
            else:
                buffer = b""
                for chunk in response.iter_raw():
                    buffer += chunk
                    while b"\n\n" in buffer:
                        block, buffer = buffer.split(b"\n\n", 1)
                        self._record(block.decode())
        self.ended = time.monotonic()

    def _record(self, block: str) -> None:
        COUNTS["events checked"] += 1
        if block.startswith(":"):
            self.comments.append(block[1:].strip())
        elif block.startswith("data: "):
            text = block[6:]
            self.data.append(text if text == "[DONE]" else json.loads(text))

    def join(self) -> None:
        assert self.thread is not None
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the client never saw the end of its stream"

    def prefilling(self) -> bool:
        return any(c.startswith("prefill ") for c in self.comments)

    def generating(self) -> bool:
        return any(isinstance(d, dict) and any((c.get("delta") or {}).get("content")
                                               for c in d.get("choices") or [])
                   for d in self.data)

    def error(self) -> dict[str, Any]:
        last = self.data[-1] if self.body.get("stream") else self.folded
        assert isinstance(last, dict), last
        error = last.get("error")
        assert isinstance(error, dict), last
        assert isinstance(error.get("message"), str), error
        assert error["message"], error
        assert {"type", "code", "param"} <= set(error), error
        COUNTS["errors checked"] += 1
        return error


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def sessions(url: ServedURL) -> list[dict[str, Any]]:
    body = httpx.get(f"{url.admin}/sessions", timeout=10).json()
    return [s for ns in body["namespaces"].values() for s in ns]


def kill_and_check(engine: LlamaServerProcess, clients: list[Client], phase: str) -> None:
    """SIGKILL the engine; every client ends with an OpenAI error within the deadline."""
    killed = time.monotonic()
    engine.kill()
    COUNTS[f"engine kills ({phase})"] += 1
    for client in clients:
        client.join()
    for client in clients:
        assert client.error()["code"] == "upstream_unavailable", client.error()
        assert client.ended is not None
        ended_after = client.ended - killed
        COUNTS[f"max ms kill->end ({phase})"] = max(COUNTS[f"max ms kill->end ({phase})"],
                                                    round(ended_after * 1000))
        assert ended_after < KILL_DEADLINE_S, f"stream ended {ended_after:.3f} s after the kill"
        assert "[DONE]" not in client.data


def attached_clients(prompt: str, key: str, **fields: Any) -> list[Client]:
    body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, **fields}
    twin = {k: v for k, v in body.items() if k != "stream"}
    other = {**body, "messages": [{"role": "user", "content": "Another question: " + prompt}]}
    headers = {"x-session-id": key}
    return ([Client(body, headers) for _ in range(3)] + [Client(twin, headers)]
            + [Client(other, {"x-session-id": key + "-other"})])


def test_a_killed_engine_ends_every_stream_within_a_second_and_a_restart_is_seen(
        engine: LlamaServerProcess) -> None:
    """Killed mid-prefill, then (restarted) mid-generation: every attached client gets an
    OpenAI error event (the folded twin a 502) within 1 s. Sessions are unverified while
    the engine is gone; the restart is detected, the slot map reset, and the next turn
    is decided by bytes again (its slot is not trusted: no cache read, then cache again)."""
    with proxy(engine.url) as url:
        # Kill during prefill: ~1.5k tokens take seconds on 2 cores; the first progress
        # report (before prefill) has arrived, no output yet.
        clients = attached_clients(filler(1100), "agent", stream=True, max_tokens=8)
        for client in clients:
            client.start(url)
        streaming = [c for c in clients if c.body.get("stream")]
        # Every stream is open (prefilling, or queued behind one that is) and the engine
        # has begun the prompt.
        wait_for(lambda: all(c.comments for c in streaming)
                 and any(c.prefilling() for c in streaming), "prefill under way")
        time.sleep(0.3)
        assert not any(c.generating() for c in streaming), "the prefill finished too soon"
        kill_and_check(engine, clients, "prefill")
        assert clients[3].status == 502
        wait_for(lambda: all(s["last_decision"] == "unverified" for s in sessions(url)),
                 "sessions unverified")
        assert all(s["last_reason"].startswith("engine unreachable") for s in sessions(url))

        restart(engine)
        COUNTS["engine restarts"] += 1
        wait_for(lambda: any(s["last_reason"] == "engine restarted" for s in sessions(url)),
                 "restart detected")
        slots = httpx.get(f"{url.admin}/sessions").json()["slots"]
        assert all(s["session"] is None and s["tokens"] == 0 for s in slots), slots

        # Kill during generation.
        clients = attached_clients("Count from one to one thousand.", "agent", stream=True,
                                   max_tokens=3000, ignore_eos=True)
        for client in clients:
            client.start(url)
        streaming = [c for c in clients if c.body.get("stream")]
        wait_for(lambda: all(c.comments for c in streaming)
                 and any(c.generating() for c in streaming), "generation under way")
        kill_and_check(engine, clients, "generation")
        restart(engine)
        COUNTS["engine restarts"] += 1
        wait_for(lambda: any(s["last_reason"] == "engine restarted" for s in sessions(url)),
                 "second restart detected")

        # Bytes decide again: a turn, then the same conversation one message longer.
        messages = [{"role": "user", "content": "Name a colour."}]
        turn = {"messages": messages, "max_tokens": 4, "temperature": 0,
                "stream_options": {"include_usage": True}}
        first = httpx.post(f"{url}/v1/chat/completions", json=turn,
                           headers={"x-session-id": "agent-2"}, timeout=WAIT_S).json()
        reply = first["choices"][0]["message"]
        longer = {**turn, "messages": [*messages, {"role": "assistant",
                                                   "content": reply["content"]},
                                       {"role": "user", "content": "Another one."}]}
        second = httpx.post(f"{url}/v1/chat/completions", json=longer,
                            headers={"x-session-id": "agent-2"}, timeout=WAIT_S).json()
        agent = next(s for s in sessions(url) if s["key"] == "agent-2")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert agent["last_decision"] == "resumed", agent
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
        first["usage"]["prompt_tokens"] - 1


def test_a_reset_engine_connection_is_an_error_and_frees_the_slot(
        engine: LlamaServerProcess) -> None:
    """The connection to the engine is reset mid-generation: the client gets an error
    event at once, llama-server frees the slot, and the next request is served."""
    if engine.process.poll() is not None:
        restart(engine)
    body = {"messages": [{"role": "user", "content": "Count slowly."}], "stream": True,
            "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    with run_tap("127.0.0.1", engine.port) as tap, proxy(tap.url) as url:
        client = Client(body).start(url)
        wait_for(client.generating, "generation under way")
        tap.reset_after_bytes_down = 1  # the next bytes from the engine cut the connection
        client.join()
        COUNTS["connection resets"] += 1
        assert client.error()["code"] == "upstream_unavailable"
        reset = max((c.reset for c in tap.connections if c.reset is not None), default=None)
        assert reset is not None, "the tap never cut the connection"
        assert client.ended is not None
        assert client.ended - reset < KILL_DEADLINE_S, client.ended - reset
        tap.reset_after_bytes_down = None
        wait_for(lambda: not any(s["is_processing"] for s in httpx.get(
            f"{engine.url}/slots", timeout=10).json()), "the engine freed the slot")
        again = httpx.post(f"{url}/v1/chat/completions", timeout=WAIT_S, json={
            "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3})
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["message"]["content"]
