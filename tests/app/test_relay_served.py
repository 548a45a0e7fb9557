"""Every streamed answer through the served proxy and its relay
(``proxy.pipeline.relay.LiveStream``): real uvicorn and real sockets on both sides (the fake
engine in its own thread). A client reads the engine's events, in order, with the same end,
whatever happens midway (the finish, a second client joining, the heartbeat timer, an
engine fault, the client leaving, events of other shapes). (These tests ran on the compiled
relay too, while there was one: ``relay`` is the Python relay's name.) Streams of
``/v1/completions`` and of the Anthropic and Responses encoders are tested in process
(``test_relay.py``).
"""

from __future__ import annotations

import gc
import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from prefixpin.proxy.listen.app import ProxyApps, create_apps
from prefixpin.proxy.listen.http_limits import ConnectionLimits, http_options
from prefixpin.proxy.pipeline.relay import LiveStream
from prefixpin.proxy.settings import Settings
from tests.collector import collector_off
from tests.fakes import event_shapes
from tests.fakes.event_shapes import Reshaped, Rewrite, data_of_answer
from tests.fakes.fake_llama import LINGER_S, FakeLlamaConfig, FakeLlamaServer
from tests.fakes.servers import ServedURL, serve_in_thread, serve_proxy

WORDS = 60
REPLY = " ".join(f"w{i}" for i in range(WORDS))
CHAT = "/v1/chat/completions"


@pytest.fixture(params=["python"])
def relay(request: pytest.FixtureRequest) -> str:
    """The relay the served proxy writes streams with: the Python relay, the only one."""
    name: str = request.param
    return name


class Served:
    """A served proxy in front of a fake engine."""

    def __init__(self, url: ServedURL, engine: FakeLlamaServer, shaped: Reshaped,
                 http: object, apps: ProxyApps) -> None:
        self.url = url
        self.engine = engine
        self.shaped = shaped  # the engine's app as served: its answers as sent
        self.http = http
        self.apps = apps

    def last_replies(self) -> list[Any]:
        """The reply each session committed (read across threads: after the answers)."""
        store = self.apps.tenant.state.prefixpin.router.store
        return [session.repair.last_reply for session in store]

    def engine_data(self, index: int = -1) -> list[Any]:
        """The data payloads of the engine's ``index``-th streamed answer, as it sent them."""
        return data_of_answer(bytes(self.shaped.answers[index]))

    def engine_blocks(self, index: int = -1) -> list[bytes]:
        return blocks_of(bytes(self.shaped.answers[index]))


@contextmanager
def served(relay: str, config: FakeLlamaConfig | None = None, *,
           rewrite: Rewrite | None = None, limits: ConnectionLimits | None = None,
           **settings: Any) -> Iterator[Served]:
    """The proxy on ``relay`` in front of a fake engine (``config``: its reply is ``REPLY``,
    a token every 2 ms, unless given), whose answers pass through ``rewrite``."""
    assert relay == "python"
    engine = FakeLlamaServer(config or FakeLlamaConfig(reply=REPLY, token_delay_s=0.002))
    shaped = Reshaped(engine.app(), rewrite)
    options = http_options(limits=limits)
    with serve_in_thread(shaped) as engine_url:
        apps = create_apps(Settings(upstream=engine_url, **settings))
        with serve_proxy(apps, **options) as url:
            yield Served(url, engine, shaped, options["http"], apps)


def chat(text: str, **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 400,
            "stream": True, **fields}


EVENT_END = re.compile(rb"(\r\n\r\n|\n\n)")


def blocks_of(body: bytes) -> list[bytes]:
    """The SSE events of a body as sent, each with its ending (LF or CRLF); not the part
    of one that did not end."""
    pieces = EVENT_END.split(body)
    return [piece + end for piece, end in zip(pieces[::2], pieces[1::2], strict=False)]


def events_of(body: str | bytes) -> tuple[list[str], list[Any]]:
    """(comments, data payloads) of a streamed answer, in order."""
    comments: list[str] = []
    data: list[Any] = []
    raw = body.encode() if isinstance(body, str) else body
    for block in blocks_of(raw):
        for line in block.decode().replace("\r\n", "\n").split("\n"):  # (not at U+2028)
            if line.startswith(":"):
                comments.append(line[1:].strip())
            elif line.startswith("data: "):
                payload = line[6:]
                data.append(payload if payload == "[DONE]" else json.loads(payload))
    return comments, data


def text_of(data: list[Any]) -> str:
    """The text of a chat stream's deltas (its reasoning too), in order."""
    return "".join(delta.get("content") or delta.get("reasoning_content") or ""
                   for payload in data if isinstance(payload, dict)
                   for choice in payload.get("choices") or []
                   for delta in [choice.get("delta") or {}])


def is_token(block: bytes) -> bool:
    return b'"delta":{"content":"' in block or b'"delta":{"reasoning_content":"' in block


def as_asked(engine: list[Any], *, usage: bool, progress: bool) -> list[Any]:
    """The engine's payloads as a client gets them: progress events only if it asked for
    progress, and the usage chunk only if it asked for usage (else its timings go back on
    the finish chunk, where the engine puts them for a client that did not ask)."""
    usage_chunk = next((p for p in engine if isinstance(p, dict) and p.get("choices") == []
                        and "usage" in p), None)
    out = []
    for payload in engine:
        if isinstance(payload, dict) and "prompt_progress" in payload and not progress:
            continue
        if payload is usage_chunk and not usage:
            continue
        if (not usage and usage_chunk is not None and isinstance(payload, dict)
                and any(c.get("finish_reason") for c in payload.get("choices") or [])):
            payload = {**payload, "timings": usage_chunk["timings"]}
        out.append(payload)
    return out


def assert_the_engines_events(proxy: Served, body: bytes, *, usage: bool = False,
                              progress: bool = False) -> list[Any]:
    """The client's answer is a comment, then the engine's events as the client asked for
    them, in order, each token event byte for byte as the engine sent it; its payloads."""
    _, data = events_of(body)
    assert body.startswith(b": "), body[:40]
    assert data == as_asked(proxy.engine_data(), usage=usage, progress=progress)
    tokens = [block for block in blocks_of(body) if is_token(block)]
    assert tokens == [block for block in proxy.engine_blocks() if is_token(block)]
    return data


class Reader(threading.Thread):
    """A client streaming one answer in its own thread: ``midway`` is set once it has read
    ``midway_after`` token events (or the answer ended); with ``leave`` it stops reading
    there, and closes the connection once ``go`` is set."""

    def __init__(self, url: str, body: dict[str, Any], *, midway_after: int,
                 headers: dict[str, str] | None = None, leave: bool = False) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.headers = url, body, headers or {}
        self.midway_after, self.leave = midway_after, leave
        self.midway = threading.Event()
        self.go = threading.Event()
        self.received = b""
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.Client(timeout=60) as client, client.stream(
                    "POST", self.url + CHAT, json=self.body, headers=self.headers) as response:
                for chunk in response.iter_raw():
                    self.received += chunk
                    if sum(map(is_token, blocks_of(self.received))) >= self.midway_after:
                        self.midway.set()
                        if self.leave:
                            self.go.wait(10)
                            return  # (leaving the stream closes the connection)
        except BaseException as exc:  # (reported by the test's thread: ``answer``)
            self.failure = exc
        finally:
            self.midway.set()

    def answer(self, timeout_s: float = 30) -> bytes:
        self.join(timeout_s)
        assert not self.is_alive(), "the stream did not end"
        if self.failure is not None:
            raise self.failure
        return self.received


def wait_for(condition: Any, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


# -- the events, in order -----------------------------------------------------------------


def test_a_stream_is_a_comment_then_the_engines_events_in_order(relay: str) -> None:
    """First bytes are a comment; the engine's events follow unchanged (the tokens byte for
    byte), without the progress and usage the proxy asked the engine for on the client's
    behalf, and the timings back on the finish chunk, where the engine puts them for a
    client that did not ask for usage."""
    with served(relay) as proxy, httpx.Client(timeout=30) as client:
        response = client.post(proxy.url + CHAT, json=chat("hello there"))
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        data = assert_the_engines_events(proxy, response.content)
        # The proxy asked the engine for progress and usage on the client's behalf.
        assert proxy.engine.requests[0]["return_progress"] is True
        assert proxy.engine.requests[0]["stream_options"] == {"include_usage": True}
    assert text_of(data).split() == REPLY.split()
    assert data[-1] == "[DONE]"
    assert all("prompt_progress" not in p and p.get("choices") != [] for p in data[:-1])
    finish = [p for p in data[:-1] if p["choices"][0].get("finish_reason")]
    assert len(finish) == 1
    assert finish[0]["timings"]["prompt_n"] > 0
    assert data.index(finish[0]) == len(data) - 2, "the finish chunk must stay in order"


def test_usage_and_progress_reach_clients_that_ask_for_them(relay: str) -> None:
    """include_usage gets the usage chunk with cached_tokens; return_progress gets the
    progress events: every event the engine sent, in order."""
    body = chat("hello there", stream_options={"include_usage": True}, return_progress=True)
    with served(relay) as proxy, \
            httpx.Client(timeout=30) as client:
        first = client.post(proxy.url + CHAT, json=body)
        assert_the_engines_events(proxy, first.content, usage=True, progress=True)
        second = client.post(proxy.url + CHAT, json=body)
        data = assert_the_engines_events(proxy, second.content, usage=True, progress=True)
    assert any("prompt_progress" in p for p in events_of(first.content)[1][:-1])
    usage = next(p for p in data[:-1] if p.get("choices") == [])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert text_of(data).split() == REPLY.split()


def test_many_streams_at_once_each_get_every_event_in_order(relay: str) -> None:
    with served(relay) as proxy:
        results: dict[int, bytes] = {}

        def one(index: int) -> None:
            with httpx.Client(timeout=60) as client:
                results[index] = client.post(proxy.url + CHAT,
                                             json=chat(f"question {index}")).content

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert sorted(results) == list(range(8))
        answers = {events_of(body)[1][0]["id"]: body for body in results.values()}
        assert len(answers) == len(proxy.shaped.answers) == 8
        for index in range(8):  # each engine answer to its own client, whole
            engine = proxy.engine_data(index)
            _, data = events_of(answers[engine[0]["id"]])
            assert data == as_asked(engine, usage=False, progress=False)
            assert text_of(data).split() == REPLY.split()
            assert data[-1] == "[DONE]"


@pytest.mark.parametrize("shape", ["crlf", "comment", "split", "reasoning", "escapes",
                                   "utf8", "batched"])
def test_events_of_other_shapes_reach_the_client_as_the_engine_sent_them(
        relay: str, shape: str) -> None:
    """Events not of the stream's token shape midway (CRLF line endings, an engine's
    comment, an event split over two writes, reasoning tokens, texts with escapes and
    characters outside ASCII, several events per write): the client gets each as the
    engine sent it, in order."""
    reply = REPLY
    config: dict[str, Any] = {}
    rewrite: Rewrite | None = None
    if shape == "crlf":
        rewrite = event_shapes.crlf(20, 30)
    elif shape == "comment":
        rewrite = event_shapes.comment_before(20)
    elif shape == "split":
        rewrite = event_shapes.split(20)
    elif shape == "reasoning":
        rewrite = event_shapes.reasoning(20, 30)
    elif shape in ("escapes", "utf8"):  # (ASCII with \u escapes, as the fake writes JSON;
        # or UTF-8, as llama-server does)
        reply = " ".join([*REPLY.split()[:10], "caf\u00e9", "\u65e5\u672c", "\U0001f600",
                          'a"b', "c\\d", "</s>", "x\u2028y", "e\u0301", "nul\u0000x",
                          *REPLY.split()[10:]])
        rewrite = event_shapes.utf8() if shape == "utf8" else None
    elif shape == "batched":
        config["events_per_write"] = 3
    with served(relay, FakeLlamaConfig(reply=reply, token_delay_s=0.002, **config),
                rewrite=rewrite) as proxy, \
            httpx.Client(timeout=30) as client:
        response = client.post(proxy.url + CHAT, json=chat("shapes"))
        data = assert_the_engines_events(proxy, response.content)
        if shape == "crlf":  # given back as sent: CRLF endings and all
            crlf = [b for b in blocks_of(response.content) if b.endswith(b"\r\n\r\n")]
            assert len(crlf) == 11
    assert text_of(data).split() == reply.split()
    if shape == "comment":
        assert "keep-alive" not in response.text  # (an engine's comments are its own)


# -- the answer's commit and its end ------------------------------------------------------


def test_the_answer_is_committed_whole_so_the_next_turn_continues_the_session(
        relay: str) -> None:
    """What the relay wrote reaches the generation's log, so the reply committed to the
    session is the whole reply: the next turn (which carries it) continues the session
    on its slot (resumed, no prefix break, the first turn's prompt cached)."""
    with served(relay) as proxy, \
            httpx.Client(timeout=30) as client:
        first = client.post(proxy.url + CHAT, json=chat("first turn", stream_options={
            "include_usage": True}))
        _, first_data = events_of(first.content)
        reply = text_of(first_data)
        assert reply.split() == REPLY.split()
        (committed,) = proxy.last_replies()
        assert committed["content"] == reply  # every token, those the relay wrote too
        second = client.post(proxy.url + CHAT, json={
            **chat("second turn", stream_options={"include_usage": True}),
            "messages": [{"role": "user", "content": "first turn"},
                         {"role": "assistant", "content": reply},
                         {"role": "user", "content": "second turn"}]})
        assert text_of(events_of(second.content)[1]).split() == REPLY.split()
        metrics = httpx.get(proxy.url.admin + "/metrics").text
        slots = httpx.get(proxy.url.admin + "/sessions").json()["slots"]
    first_usage, second_usage = (
        next(p for p in data if isinstance(p, dict) and p.get("usage"))["usage"]
        for data in (first_data, events_of(second.content)[1]))
    # The second turn resumed the first's session (its committed history matched)...
    decisions = {line.split("outcome=")[1].split('"')[1]: float(line.rsplit(" ", 1)[1])
                 for line in metrics.splitlines()
                 if line.startswith("prefixpin_affinity_decisions_total{")}
    assert decisions.get("resumed") == 1.0, metrics
    breaks = [line for line in metrics.splitlines()
              if line.startswith("prefixpin_prefix_breaks_total") and not line.endswith(" 0.0")]
    assert breaks == [], breaks
    # ... on the first's slot, its cache holding all of the first turn's prompt and reply.
    requests = proxy.engine.requests
    assert requests[0]["id_slot"] == requests[1]["id_slot"], slots
    assert (second_usage["prompt_tokens_details"]["cached_tokens"]
            >= first_usage["prompt_tokens"]), (first_usage, second_usage)


def test_a_reply_past_max_reply_bytes_ends_with_an_error_event(relay: str) -> None:
    """A few large events (half a kilobyte of text each here; an engine's may be megabytes:
    a non-streaming client's log holds them all until the end) pass ``--max-reply-bytes``
    long before ``--max-reply-events``: the client gets what came before, then a clean
    error event."""
    words = [f"w{i}" + "x" * 500 for i in range(400)]
    with served(relay, FakeLlamaConfig(reply=" ".join(words), token_delay_s=0.0005),
                max_reply_bytes=65536) as proxy, \
            httpx.Client(timeout=30) as client:
        response = client.post(proxy.url + CHAT, json=chat("long", max_tokens=1000))
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert "--max-reply-bytes" in events[-1], events[-1]
    assert " w40x" in response.text
    assert " w200x" not in response.text  # about 100 events of 650 bytes pass 64 KiB


def test_an_engine_writing_more_than_a_read_at_a_time_reaches_the_client_intact(
        relay: str) -> None:
    """An engine that writes 200 events a chunk (30 KB, more than a read) as fast as it is
    read: the relay relays the whole reply, every token intact."""
    words = [f"w{i}" for i in range(2000)]
    config = FakeLlamaConfig(reply=" ".join(words), token_delay_s=0.0, events_per_write=200)
    with served(relay, config) as proxy, \
            httpx.Client(timeout=30) as client:
        response = client.post(proxy.url + CHAT, json=chat("fast", max_tokens=2500))
        data = assert_the_engines_events(proxy, response.content)
    assert text_of(data).split() == words


def test_metrics_have_histograms_with_values_after_a_stream(relay: str) -> None:
    """/metrics exposes the cache and latency histograms, filled by a streamed request."""
    with served(relay) as proxy, httpx.Client(timeout=30) as client:
        client.post(proxy.url + CHAT, json=chat("hello there"))
        text = client.get(proxy.url.admin + "/metrics").text
    for name in ("prefixpin_prompt_tokens_count", "prefixpin_cached_tokens_count",
                 "prefixpin_cached_fraction_count", "prefixpin_ttft_seconds_count",
                 "prefixpin_prefill_seconds_count"):
        line = next(line for line in text.splitlines() if line.startswith(name))
        assert float(line.rsplit(" ", 1)[1]) == 1.0, line
    assert 'prefixpin_requests_total{api="openai",endpoint="chat",outcome="ok"} 1.0' in text


def test_the_answer_ends_with_the_engines_done_not_its_body(relay: str) -> None:
    """A client's answer ends at the engine's [DONE]: the end of the engine's body (which a
    busy server may send late) and the slot's release come after, off the client's latency.
    The turn is committed before the client can send its next one."""
    with served(relay) as proxy, httpx.Client(timeout=30) as client:
        proxy.engine.faults.append("linger")
        started = time.monotonic()
        response = client.post(proxy.url + CHAT, json=chat(
            "hello there", stream_options={"include_usage": True}),
                               headers={"x-session-id": "A"})
        elapsed = time.monotonic() - started
        sessions = client.get(proxy.url.admin + "/sessions").json()["namespaces"]
        assert response.status_code == 200
        data = assert_the_engines_events(proxy, response.content, usage=True)
    assert data[-1] == "[DONE]"
    assert elapsed < LINGER_S / 2, f"the client waited {elapsed:.2f} s for the engine's body"
    [session] = [s for group in sessions.values() for s in group]
    assert session["last_decision"] == "new"
    assert session["committed_tokens"] > 0


# -- what takes the stream back midway ----------------------------------------------------


def test_a_retry_joining_mid_stream_gets_every_event_from_the_start(relay: str) -> None:
    """A retry that says so joins the generation midway, and reads every event from the
    start; one engine request serves both."""
    config = FakeLlamaConfig(reply=REPLY, token_delay_s=0.01)
    with served(relay, config) as proxy:
        first = Reader(proxy.url, chat("join me"), midway_after=10)
        first.start()
        assert first.midway.wait(10)
        retry = joined_retry(proxy, first, chat("join me"))
    assert text_of(events_of(retry)[1]).split() == REPLY.split()


def joined_retry(proxy: Served, first: Reader, body: dict[str, Any]) -> bytes:
    """A retry of ``body`` (marked as the SDKs mark theirs) while ``first`` streams it: one
    engine request served both, each got the engine's events; the retry's answer."""
    with httpx.Client(timeout=60) as client:
        retry = client.post(proxy.url + CHAT, json=body,
                            headers={"x-stainless-retry-count": "1"}).content
    answers = [first.answer(), retry]
    assert len(proxy.engine.requests) == 1
    for answer in answers:
        assert_the_engines_events(proxy, answer)
    return retry


def test_a_slow_prefill_gets_heartbeats_with_progress(relay: str) -> None:
    """While the engine prefills, heartbeat comments carry its progress; the tokens follow."""
    config = FakeLlamaConfig(reply=REPLY, token_delay_s=0.002, prefill_s_per_token=0.01,
                             batch=8)
    with served(relay, config, heartbeat_s=0.05) as proxy, httpx.Client(timeout=30) as client:
        response = client.post(proxy.url + CHAT, json=chat("word " * 40))
        metrics = client.get(proxy.url.admin + "/metrics").text
        assert_the_engines_events(proxy, response.content)
    comments, data = events_of(response.content)
    assert any(c.startswith("prefill ") and " cached 0" in c for c in comments), comments
    assert "prefixpin_heartbeats_total 0.0" not in metrics
    assert text_of(data).split() == REPLY.split()


def test_an_engine_silent_mid_stream_still_gets_heartbeats(relay: str) -> None:
    """Heartbeats go out during a stall in the middle of the tokens, after every event
    written before it, and only then (none while tokens flow)."""
    config = FakeLlamaConfig(reply=REPLY, token_delay_s=0.006, fault_at=40, stall_s=0.5)
    with served(relay, config, heartbeat_s=0.1) as proxy, httpx.Client(timeout=60) as client:
        proxy.engine.faults.append("stall")
        response = client.post(proxy.url + CHAT, json=chat("stall"))
        assert_the_engines_events(proxy, response.content)
    blocks = [b for b in response.text.split("\n\n") if b]
    beats = [i for i, b in enumerate(blocks) if b == ": generating"]
    assert len(beats) >= 3
    before = [json.loads(b[6:]) for b in blocks[:beats[0]] if b.startswith("data: ")]
    assert text_of(before).split() == REPLY.split()[:40]  # every token before the stall
    assert beats == list(range(beats[0], beats[0] + len(beats)))  # all within the stall
    assert text_of(events_of(response.content)[1]).split() == REPLY.split()


@pytest.mark.parametrize(("fault", "code", "fragment"), [
    ("bad_json", "upstream_protocol_error", "not JSON"),
    ("non_object", "upstream_protocol_error", "not a JSON object"),
    ("error_event", "upstream_protocol_error", "fault injected"),
    ("crash", "upstream_unavailable", "incomplete"),
    ("close", "upstream_protocol_error", "before it finished"),
    ("huge_event", "upstream_protocol_error", "SSE event larger than"),
])
def test_an_engine_fault_mid_stream_is_a_clean_error_event(
        relay: str, fault: str, code: str, fragment: str) -> None:
    """A fault at the 30th token: every token before it, then an OpenAI-shaped error event
    naming it, and no [DONE]; the proxy serves the next request."""
    config = FakeLlamaConfig(reply=REPLY, token_delay_s=0.002, fault_at=30)
    with served(relay, config) as proxy, \
            httpx.Client(timeout=30) as client:
        proxy.engine.faults.append(fault)
        response = client.post(proxy.url + CHAT, json=chat("fault"))
        _, data = events_of(response.content)
        assert text_of(data).split() == REPLY.split()[:30]  # every token before the fault
        error = data[-1]
        assert isinstance(error, dict), data[-3:]
        assert error["error"]["code"] == code, error
        assert fragment in error["error"]["message"], error
        tokens = [block for block in blocks_of(response.content) if is_token(block)]
        assert tokens == [block for block in proxy.engine_blocks() if is_token(block)]
        again = client.post(proxy.url + CHAT, json=chat("after"))
        assert_the_engines_events(proxy, again.content)


def test_a_client_leaving_mid_stream_releases_the_engine(relay: str) -> None:
    """A client that leaves midway: the relay lets the stream go, the engine's request is
    cancelled (no grace for a retry) long before its answer would have ended, and the next
    request is served whole."""
    config = FakeLlamaConfig(reply=REPLY, token_delay_s=0.03)  # (1.8 s of tokens)
    with served(relay, config, retry_grace_s=0) as proxy:
        leaving = Reader(proxy.url, chat("leave"), midway_after=10, leave=True)
        leaving.start()
        assert leaving.midway.wait(10)
        leaving.go.set()
        leaving.answer()
        assert wait_for(lambda: not any(slot.busy.locked() for slot in proxy.engine.slots), 5)
        # (It stopped at once: its answer would have had WORDS tokens, 1.8 s of them.)
        assert sum(map(is_token, proxy.engine_blocks(0))) < WORDS // 2
        with httpx.Client(timeout=30) as client:
            again = client.post(proxy.url + CHAT, json=chat("next", max_tokens=10))
            assert_the_engines_events(proxy, again.content)
            assert text_of(events_of(again.content)[1]).split() == REPLY.split()[:10]


def test_a_finished_stream_is_freed_without_waiting_for_the_collector(relay: str) -> None:
    """Nothing of the relay keeps a finished stream in a reference cycle: its live stream
    (and the generation and frames it holds) goes as soon as the answer is done, not at
    the next full collection (``serve`` runs the collector rarely: a cycle per stream grew
    the process by 60 MiB a round at 256 streams)."""
    with served(relay) as proxy, \
            httpx.Client(timeout=30) as client:
        with collector_off():
            for index in range(5):
                response = client.post(proxy.url + CHAT, json=chat(f"question {index}"))
                assert text_of(events_of(response.content)[1]).split() == REPLY.split()
            time.sleep(0.3)  # (the proxy's thread finishes each response's task)
            left = sum(1 for thing in gc.get_objects() if isinstance(thing, LiveStream))
        assert left == 0
