"""The compiled relay (``core.compiled_relay``) in the served proxy: real uvicorn, real
sockets on both sides (the fake engine in its own thread), the relay on. Every stream
must read as the Python relay writes it (the same events, in order, then the same end),
whatever takes the stream back from the relay: the finish, a second client joining, the
heartbeat timer, an engine fault, the client leaving. Each test also checks that the
relay did relay (its count of events), so none passes with the relay idle."""

from __future__ import annotations

import gc
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from prefixpin.proxy.app import create_apps
from prefixpin.proxy.http_limits import compiled_relay_of, http_options
from prefixpin.proxy.relay import LiveStream
from prefixpin.proxy.settings import Settings
from tests.fakes.fake_llama import FakeLlamaConfig, FakeLlamaServer
from tests.fakes.servers import serve_in_thread, serve_proxy
from tests.rig.parts import require_compiled_relay

require_compiled_relay()

WORDS = 60
REPLY = " ".join(f"w{i}" for i in range(WORDS))


def chat(text: str, **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 400,
            "stream": True, **fields}


class Served:
    def __init__(self, url: str, engine: FakeLlamaServer, protocol: Any, apps: Any) -> None:
        self.url = url
        self.engine = engine
        self._protocol = protocol
        self.apps = apps

    def last_replies(self) -> list[Any]:
        """The reply each session committed (read across threads: after the answers)."""
        store = self.apps.tenant.state.prefixpin.router.store
        return [session.repair.last_reply for session in store]

    @property
    def relayed(self) -> int:
        """Token events the compiled relay wrote and gave back so far."""
        relay = compiled_relay_of(self._protocol)
        return 0 if relay is None else int(relay.relayed)

    @property
    def held(self) -> int:
        relay = compiled_relay_of(self._protocol)
        return 0 if relay is None else relay.held


@contextmanager
def served(*, compiled: bool = True, token_delay_s: float = 0.002, fault_at: int = 30,
           stall_s: float = 0.0, **settings: Any) -> Iterator[Served]:
    engine = FakeLlamaServer(FakeLlamaConfig(reply=REPLY, token_delay_s=token_delay_s,
                                             fault_at=fault_at, stall_s=stall_s))
    options = http_options(compiled_relay=compiled)
    with serve_in_thread(engine.app()) as engine_url:
        apps = create_apps(Settings(upstream=engine_url, **settings))
        with serve_proxy(apps, **options) as url:
            yield Served(url, engine, options["http"], apps)


def events_of(response: httpx.Response) -> tuple[list[str], list[Any]]:
    """(comments, data payloads) of a streamed answer, in order."""
    comments: list[str] = []
    data: list[Any] = []
    for block in response.text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith(":"):
                comments.append(line[1:].strip())
            elif line.startswith("data: "):
                payload = line[6:]
                data.append(payload if payload == "[DONE]" else json.loads(payload))
    return comments, data


def text_of(data: list[Any]) -> str:
    return "".join((choice.get("delta") or {}).get("content") or ""
                   for payload in data if isinstance(payload, dict)
                   for choice in payload.get("choices") or [])


def comparable(data: list[Any]) -> list[Any]:
    """The payloads without what differs between two runs (ids, times, timings)."""
    out = []
    for payload in data:
        if isinstance(payload, dict):
            payload = {k: v for k, v in payload.items()
                       if k not in ("id", "created", "timings", "usage")}
        out.append(payload)
    return out


def test_a_stream_through_the_compiled_relay_reads_as_the_python_relays() -> None:
    answers = {}
    for compiled in (False, True):
        with served(compiled=compiled) as proxy, httpx.Client(timeout=30) as client:
            response = client.post(proxy.url + "/v1/chat/completions",
                                   json=chat("same question", stream_options={
                                       "include_usage": True}))
            assert response.status_code == 200
            answers[compiled] = events_of(response)[1]
            relayed = proxy.relayed
        if compiled:
            assert relayed >= WORDS - 5  # all but the tokens before the shape was learned
        else:
            assert relayed == 0
    assert comparable(answers[True]) == comparable(answers[False])
    assert text_of(answers[True]).split() == REPLY.split()
    assert answers[True][-1] == "[DONE]"


def test_many_streams_at_once_each_get_every_event_in_order() -> None:
    with served() as proxy:
        results: dict[int, list[Any]] = {}

        def one(index: int) -> None:
            with httpx.Client(timeout=60) as client:
                response = client.post(proxy.url + "/v1/chat/completions",
                                       json=chat(f"question {index}"))
                results[index] = events_of(response)[1]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert sorted(results) == list(range(8))
        for data in results.values():
            assert text_of(data).split() == REPLY.split()
            assert data[-1] == "[DONE]"
        assert proxy.relayed > 8 * (WORDS // 2)


def test_the_answer_is_committed_whole_so_the_next_turn_continues_the_session() -> None:
    """What the relay wrote reaches the generation's log, so the reply committed to the
    session is the whole reply: the next turn (which carries it) continues the session
    on its slot exactly as through the Python relay (the same decisions, no prefix
    break, the same cached tokens)."""
    seen = {}
    for compiled in (False, True):
        with served(compiled=compiled) as proxy, httpx.Client(timeout=30) as client:
            first = client.post(proxy.url + "/v1/chat/completions", json=chat("first turn"))
            reply = text_of(events_of(first)[1])
            assert reply.split() == REPLY.split()
            (committed,) = proxy.last_replies()
            assert committed["content"] == reply  # every token, those the relay wrote too
            second = client.post(proxy.url + "/v1/chat/completions", json={
                **chat("second turn", stream_options={"include_usage": True}),
                "messages": [{"role": "user", "content": "first turn"},
                             {"role": "assistant", "content": reply},
                             {"role": "user", "content": "second turn"}]})
            usage = next(p for p in events_of(second)[1]
                         if isinstance(p, dict) and p.get("usage"))["usage"]
            admin = proxy.url.admin  # type: ignore[attr-defined]
            metrics = [line for line in httpx.get(admin + "/metrics").text.splitlines()
                       if line.startswith(("prefixpin_affinity_decisions_total",
                                           "prefixpin_prefix_breaks_total"))]
            slots = httpx.get(admin + "/sessions").json()["slots"]
            seen[compiled] = (usage, metrics, slots)
            relayed = proxy.relayed
        assert (relayed > WORDS) if compiled else relayed == 0
    assert seen[True] == seen[False]
    # The second turn resumed the first's session (its committed history matched).
    assert any('outcome="resumed"' in line for line in seen[True][1]), seen[True][1]


def test_a_retry_joining_mid_stream_gets_every_event_from_the_start() -> None:
    with served(token_delay_s=0.01) as proxy:
        answers: dict[str, list[Any]] = {}

        def ask(name: str, headers: dict[str, str]) -> None:
            with httpx.Client(timeout=60) as client:
                response = client.post(proxy.url + "/v1/chat/completions",
                                       json=chat("join me"), headers=headers)
                answers[name] = events_of(response)[1]

        first = threading.Thread(target=ask, args=("first", {}))
        first.start()
        deadline = time.monotonic() + 10
        while proxy.held == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert proxy.held == 1  # the relay holds the first stream now
        ask("retry", {"x-stainless-retry-count": "1"})
        first.join(30)
        assert len(proxy.engine.requests) == 1
        assert text_of(answers["first"]).split() == REPLY.split()
        assert text_of(answers["retry"]).split() == REPLY.split()
        assert comparable(answers["retry"]) == comparable(answers["first"])


def test_an_engine_silent_mid_stream_still_gets_heartbeats() -> None:
    """The heartbeat timer takes the stream back from the relay to see how long the
    client has been silent (the relay's last write): heartbeats go out during a stall in
    the middle of the tokens, after every event the relay wrote, and only then (none
    while the relay writes tokens), and the relay takes the stream again."""
    with served(token_delay_s=0.006, heartbeat_s=0.1, fault_at=40, stall_s=0.5) as proxy, \
            httpx.Client(timeout=60) as client:
        proxy.engine.faults.append("stall")
        response = client.post(proxy.url + "/v1/chat/completions", json=chat("stall"))
        assert proxy.relayed > WORDS // 2
    blocks = [b for b in response.text.split("\n\n") if b]
    beats = [i for i, b in enumerate(blocks) if b == ": generating"]
    assert len(beats) >= 3
    before = [json.loads(b[6:]) for b in blocks[:beats[0]] if b.startswith("data: ")]
    assert text_of(before).split() == REPLY.split()[:40]  # every token before the stall
    assert beats == list(range(beats[0], beats[0] + len(beats)))  # all within the stall
    _, data = events_of(response)
    assert text_of(data).split() == REPLY.split()


@pytest.mark.parametrize("fault", ["bad_json", "error_event", "crash", "close"])
def test_an_engine_fault_while_the_relay_holds_the_stream_is_a_clean_error_event(
        fault: str) -> None:
    with served(fault_at=30) as proxy, httpx.Client(timeout=30) as client:
        proxy.engine.faults.append(fault)
        response = client.post(proxy.url + "/v1/chat/completions", json=chat("fault"))
        _, data = events_of(response)
        assert text_of(data).split() == REPLY.split()[:30]  # every token before the fault
        error = data[-1]
        assert isinstance(error, dict), data[-3:]
        assert isinstance(error.get("error"), dict), data[-3:]
        assert proxy.relayed >= 20
        again = client.post(proxy.url + "/v1/chat/completions", json=chat("after"))
        assert text_of(events_of(again)[1]).split() == REPLY.split()


def test_a_client_leaving_mid_stream_releases_the_relay_and_the_engine() -> None:
    with served(token_delay_s=0.03, retry_grace_s=0) as proxy:
        with httpx.Client(timeout=30) as client, client.stream(
                "POST", proxy.url + "/v1/chat/completions", json=chat("leave")) as response:
            held = 0
            for _ in response.iter_bytes():  # (a token every 30 ms: 1.8 s of stream)
                if held := proxy.held:
                    break  # (leaving the iteration closes the response: the client leaves)
            assert held == 1, "the stream ended before the relay held it"
        deadline = time.monotonic() + 5
        while proxy.held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proxy.held == 0
        with httpx.Client(timeout=30) as client:
            again = client.post(proxy.url + "/v1/chat/completions", json=chat("next"))
            assert text_of(events_of(again)[1]).split() == REPLY.split()


def test_a_stream_the_relay_gave_back_is_freed_without_waiting_for_the_collector() -> None:
    """Nothing of the relay keeps a finished stream in a reference cycle: its live stream
    (and the generation and frames it holds) goes as soon as the answer is done, as on
    the Python relay, not at the next full collection (``serve`` runs the collector
    rarely: a cycle per stream grew the process by 60 MiB a round at 256 streams)."""
    with served() as proxy, httpx.Client(timeout=30) as client:
        gc.collect()
        gc.disable()
        try:
            for index in range(5):
                response = client.post(proxy.url + "/v1/chat/completions",
                                       json=chat(f"question {index}"))
                assert text_of(events_of(response)[1]).split() == REPLY.split()
            time.sleep(0.3)  # (the proxy's thread finishes each response's task)
            left = sum(1 for thing in gc.get_objects() if isinstance(thing, LiveStream))
        finally:
            gc.enable()
        assert proxy.relayed > 5 * (WORDS // 2)
        assert left == 0
