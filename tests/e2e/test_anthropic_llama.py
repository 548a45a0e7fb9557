"""Anthropic Messages (``/v1/messages``) through the proxy in front of the real llama-server,
with the official ``anthropic`` SDK as the client.

llama-server answers ``/v1/messages`` itself; through prefixpin (converted to chat
completions, the answer translated back) the answer must be the same: the same text, stop
reason and token counts, greedy. A Claude Code-like session (billing line whose ``cch=``
changes every turn, ``cache_control`` moved to the latest message, the answer echoed back
as content blocks) reuses the whole previous prompt on its next turn; a bad body is an
Anthropic 400; an engine that fails mid-stream gives an ``event: error`` and a clean end.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import pytest

from prefixpin.proxy.codecs.anthropic import AnthropicCodec
from tests.e2e.conftest import ProxyRunner
from tests.e2e.helpers import filler
from tests.fakes.tcp_tap import run_tap
from tests.rig.llama_process import LlamaServerProcess
from tests.rig.scrape import prefilled

pytestmark = pytest.mark.llama

KEY = "sk-ant-prefixpin-e2e"  # one tenant: the engine's host cache is shared by its slots
EPHEMERAL = {"type": "ephemeral"}
GREEDY = {"temperature": 0}


_CLIENTS: dict[str, anthropic.Anthropic] = {}


def client(url: str) -> anthropic.Anthropic:
    """The SDK's client of ``url`` (one per address, closed after each test)."""
    if url not in _CLIENTS:
        _CLIENTS[url] = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0,
                                            timeout=300)
    return _CLIENTS[url]


@pytest.fixture(autouse=True)
def close_clients() -> Iterator[None]:
    yield
    while _CLIENTS:
        _CLIENTS.popitem()[1].close()


def billing(stamp: str) -> dict[str, Any]:
    # The version's suffix (a hash of the conversation's first message) as prefixpin makes
    # every one of them, which llama-server keeps as it comes: so the prompts compared
    # here are the same; the stamp both make constant.
    return {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.101.fff; "
                                    f"cc_entrypoint=cli; cch={stamp};"}


def request(messages: list[dict[str, Any]], *, stamp: str = "a5145", max_tokens: int = 12,
            **fields: Any) -> dict[str, Any]:
    return {"model": "smol", "max_tokens": max_tokens, "extra_body": GREEDY,
            "system": [billing(stamp), {"type": "text", "text": "You are a terse assistant.",
                                        "cache_control": EPHEMERAL}],
            "messages": messages, **fields}


QUESTION = [{"role": "user", "content": [{"type": "text", "text": "Say hello in three words.",
                                          "cache_control": EPHEMERAL}]}]


def streamed(url: str, body: dict[str, Any]) -> anthropic.types.Message:
    with client(url).messages.stream(**body) as stream:
        return stream.get_final_message()


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def prompt_tokens(message: anthropic.types.Message) -> int:
    return message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def raw_events(url: str, body: dict[str, Any]) -> list[str]:
    """The event names of a stream, read off the wire."""
    wire = {k: v for k, v in body.items() if k != "extra_body"} | body["extra_body"]
    with httpx.stream("POST", f"{url}/v1/messages", json={**wire, "stream": True},
                      headers={"x-api-key": KEY}, timeout=300) as response:
        assert response.status_code == 200
        return [line.removeprefix("event: ") for line in response.iter_lines()
                if line.startswith("event: ")]


def test_the_answer_through_the_proxy_is_llama_servers_own(
        llama: LlamaServerProcess, run_proxy: ProxyRunner,
        erase_slots: Callable[[], None]) -> None:
    """Streamed and whole, the SDK reads the same message through prefixpin as from
    llama-server's own /v1/messages: text, stop reason, prompt and output token counts,
    and the same events on the wire. Every answer is served from a warm cache (the first
    request warms it), so the numerics of a cold prefill do not enter."""
    body = request(QUESTION, max_tokens=6)  # fewer than the model's own answer takes
    client(llama.url).messages.create(**body)  # warm: every answer below reads the cache
    direct_whole = client(llama.url).messages.create(**body)
    direct_stream = streamed(llama.url, body)
    # Heartbeats every 10 ms: every silence of the engine (before its first chunk, between
    # tokens) gets the proxy's keep-alives on every run, as a loaded machine's 2 s do.
    with run_proxy(heartbeat_s=0.01) as url:
        via_whole = client(url).messages.create(**body)
        via_stream = streamed(url, body)
        via_events = raw_events(url, body)
    direct_events = raw_events(llama.url, body)
    assert text_of(direct_whole)
    for via, direct in ((via_whole, direct_whole), (via_stream, direct_stream)):
        assert text_of(via) == text_of(direct)
        assert via.stop_reason == direct.stop_reason == "max_tokens"
        assert via.stop_sequence is None
        assert via.usage.output_tokens == direct.usage.output_tokens == 6
        assert prompt_tokens(via) == prompt_tokens(direct)
        assert isinstance(via.usage.cache_read_input_tokens, int)
        assert via.id != direct.id
        assert [b.type for b in via.content] == [b.type for b in direct.content] == ["text"]
    # the proxy's own keep-alives (``ping`` after --heartbeat s of engine silence, as on a
    # loaded machine) are the only events it may add, and never before message_start (SSE
    # comments keep a stream alive until then)
    assert [e for e in via_events if e != "ping"] == direct_events
    assert via_events[0] == "message_start"
    assert via_events[-2:] == ["message_delta", "message_stop"]
    # The stream followed the whole answer on the slot the proxy pinned: all but the last
    # prompt token from cache, and the input tokens are the ones that were not.
    assert via_stream.usage.cache_read_input_tokens is not None
    assert via_stream.usage.cache_read_input_tokens >= prompt_tokens(via_stream) - 1
    assert via_stream.usage.input_tokens == (prompt_tokens(via_stream)
                                             - via_stream.usage.cache_read_input_tokens)


def test_a_stop_sequence_ends_and_is_named_as_llama_server_names_it(
        llama: LlamaServerProcess, run_proxy: ProxyRunner,
        erase_slots: Callable[[], None]) -> None:
    """The stop string that ended the answer is the message's stop_sequence, through the
    proxy as directly (llama-server says end_turn for it)."""
    body = request(QUESTION, max_tokens=24)
    client(llama.url).messages.create(**body)  # warm
    free = client(llama.url).messages.create(**body)
    words = text_of(free).split()
    assert len(words) >= 2, text_of(free)
    stop = words[1]  # the second word of the free answer ends it
    body = request(QUESTION, max_tokens=24, stop_sequences=["zzzq", stop])
    direct = client(llama.url).messages.create(**body)
    with run_proxy() as url:
        via_whole = client(url).messages.create(**body)
        via_stream = streamed(url, body)
    for via in (via_whole, via_stream):
        assert text_of(via) == text_of(direct)
        assert (via.stop_reason, via.stop_sequence) == (direct.stop_reason,
                                                        direct.stop_sequence)
    assert (direct.stop_reason, direct.stop_sequence) == ("end_turn", stop)
    assert stop not in text_of(direct)


def test_the_conversion_renders_llama_servers_prompt_without_cache_control(
        llama: LlamaServerProcess) -> None:
    """The converted body renders what llama-server renders for the Anthropic body itself
    (its own token count of it), and the dropped cache_control changes nothing rendered."""
    anthropic_body = {
        "model": "smol", "max_tokens": 8,
        "system": [billing("a5145"), {"type": "text", "text": "You are terse.",
                                      "cache_control": EPHEMERAL}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Say hello.",
                                          "cache_control": EPHEMERAL}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Greet.", "signature": ""},
                {"type": "text", "text": "Hello."},
                {"type": "tool_use", "id": "c1", "name": "look", "input": {"at": "sky"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "c1", "content": "blue"},
                {"type": "text", "text": "And?", "cache_control": EPHEMERAL}]}]}
    converted = AnthropicCodec().parse(json.dumps(anthropic_body).encode(), "/v1/messages",
                                       max_messages=100).body
    assert "cache_control" not in json.dumps(converted)
    # llama-server's own conversion keeps each one-block content as a block list, its
    # cache_control mark included; ours has the text (and no mark): the same prompt
    kept = json.loads(json.dumps(converted))
    for index in (1, 3):
        text = kept["messages"][index]["content"]
        assert isinstance(text, str)
        kept["messages"][index]["content"] = [{"type": "text", "text": text,
                                              "cache_control": EPHEMERAL}]

    def render(body: dict[str, Any]) -> str:
        response = httpx.post(f"{llama.url}/apply-template", json=body, timeout=30)
        assert response.status_code == 200, response.text
        return str(response.json()["prompt"])

    prompt = render(converted)
    assert prompt == render(kept)
    assert "cch=fffff;" in prompt
    tokens = httpx.post(f"{llama.url}/tokenize", timeout=30, json={
        "content": prompt, "add_special": True, "parse_special": True}).json()["tokens"]
    counted = httpx.post(f"{llama.url}/v1/messages/count_tokens", json=anthropic_body,
                         timeout=30)
    assert counted.status_code == 200, counted.text
    assert counted.json() == {"input_tokens": len(tokens)}


def test_a_claude_code_turn_reuses_the_whole_previous_prompt(
        llama: LlamaServerProcess, run_proxy: ProxyRunner,
        erase_slots: Callable[[], None]) -> None:
    """Turn 2 echoes turn 1's answer as content blocks, moves cache_control to its new last
    message and carries another billing stamp: the proxy resumes the session named by
    Claude Code's metadata.user_id, and the engine reads all of turn 1's prompt from
    cache (its own prefill counter agrees)."""
    session = str(uuid.uuid4())
    metadata = {"user_id": json.dumps({"device_id": "d" * 64, "account_uuid": "",
                                       "session_id": session})}
    notes = "Notes: " + filler(120, seed=5)
    first_messages = [{"role": "user", "content": [
        {"type": "text", "text": notes},
        {"type": "text", "text": "Name one colour.", "cache_control": EPHEMERAL}]}]
    with run_proxy() as url:
        first = streamed(url, request(first_messages, metadata=metadata, max_tokens=8))
        before = prefilled([llama])
        second_messages: list[dict[str, Any]] = [
            {"role": "user", "content": [{"type": "text", "text": notes},
                                         {"type": "text", "text": "Name one colour."}]},
            {"role": "assistant", "content": first.content},  # as the SDK echoes it
            {"role": "user", "content": [{"type": "text", "text": "Another one.",
                                          "cache_control": EPHEMERAL}]}]
        second = streamed(url, request(second_messages, stamp="9e0c2", metadata=metadata,
                                       max_tokens=8))
        processed = prefilled([llama]) - before
        view = httpx.get(f"{url.admin}/sessions", timeout=10).json()
    sessions = [s for ns in view["namespaces"].values() for s in ns if s["key"] == session]
    assert len(sessions) == 1, view
    assert sessions[0]["last_decision"] == "resumed", sessions[0]
    assert prompt_tokens(first) > 150
    cached = second.usage.cache_read_input_tokens
    assert cached is not None
    assert cached >= prompt_tokens(first) - 2, (cached, prompt_tokens(first))
    assert second.usage.input_tokens == prompt_tokens(second) - cached
    assert processed == second.usage.input_tokens
    assert processed <= prompt_tokens(second) - prompt_tokens(first) + 2


def test_a_bad_body_is_an_anthropic_400(run_proxy: ProxyRunner) -> None:
    with run_proxy() as url:
        with pytest.raises(anthropic.BadRequestError) as refused:
            client(url).messages.create(model="smol", max_tokens=8, messages=[
                {"role": "tool", "content": "x"}])  # type: ignore[list-item, misc]
        raw = httpx.post(f"{url}/v1/messages", headers={"x-api-key": KEY}, timeout=30,
                         json={"max_tokens": 8, "messages": [{"role": "tool",
                                                              "content": "x"}]})
    expected = {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "'messages[0].role' must be \"user\" or \"assistant\" (or \"system\"), "
                   "got 'tool'"}}
    assert refused.value.status_code == 400
    assert refused.value.body == expected
    assert raw.status_code == 400
    assert raw.json() == expected


def _events(lines: Iterator[str]) -> Iterator[tuple[str, Any]]:
    name = ""
    for line in lines:
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            yield name, json.loads(line.removeprefix("data: "))


def test_an_engine_failing_mid_stream_is_an_error_event_and_a_clean_end(
        llama: LlamaServerProcess, run_proxy: ProxyRunner,
        erase_slots: Callable[[], None]) -> None:
    """The engine's connection is reset while it generates: the client's stream gets an
    Anthropic error event and ends (no message_stop)."""
    body = {"model": "smol", "max_tokens": 2000, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Count from 1 to 1000, one per line."}]}
    received: list[tuple[str, Any]] = []
    with run_tap("127.0.0.1", llama.port) as tap, run_proxy(upstream=tap.url,
                                                           retry_grace_s=0) as url:
        with httpx.stream("POST", f"{url}/v1/messages", json=body, timeout=60,
                          headers={"x-api-key": KEY}) as response:
            assert response.status_code == 200
            for event in _events(response.iter_lines()):
                received.append(event)
                if event[0] == "content_block_delta" and tap.reset_after_bytes_down is None:
                    tap.reset_after_bytes_down = 1  # the engine's next bytes cut it
        tap.reset_after_bytes_down = None
        assert any(c.reset is not None for c in tap.connections), "the tap never cut it"
    names = [name for name, _ in received if name != "ping"]  # heartbeats while it waits
    assert names[0] == "message_start"
    assert "message_stop" not in names
    assert received[-1][0] == "error"
    error = received[-1][1]
    assert error["type"] == "error"
    assert error["error"]["type"] == "api_error"
    assert error["error"]["message"]


def test_the_sdk_raises_an_engine_failure_mid_stream(
        llama: LlamaServerProcess, run_proxy: ProxyRunner,
        erase_slots: Callable[[], None]) -> None:
    """The same fault read by the SDK: it raises the error event as an APIStatusError."""
    count: list[dict[str, Any]] = [{"role": "user",
                                    "content": "Count from 1 to 1000, one per line."}]
    params = request(count, max_tokens=2000)
    deltas = 0
    with run_tap("127.0.0.1", llama.port) as tap, run_proxy(upstream=tap.url,
                                                           retry_grace_s=0) as url:
        with pytest.raises(anthropic.APIStatusError) as raised:  # noqa: PT012 (reads events until it fails)
            for event in client(url).messages.create(stream=True, **params):
                if event.type == "content_block_delta":
                    deltas += 1
                    tap.reset_after_bytes_down = 1
        tap.reset_after_bytes_down = None
    assert deltas >= 1
    assert isinstance(raised.value.body, dict)
    assert raised.value.body["type"] == "error"
    assert raised.value.body["error"]["type"] == "api_error"


# ------------------------------------------------- parked sessions (one slot, no host cache)

@pytest.fixture(scope="module")
def one_slot() -> Iterator[LlamaServerProcess]:
    """One slot and no host-RAM prompt cache: a session evicted by another comes back
    only through prefixpin's parking (the engine's own slot save directory)."""
    from tests.rig.llama_process import run_llama_server

    with run_llama_server("smollm2", slots=1, ctx_per_slot=4096,
                          extra=("--cache-ram", "0")) as handle:
        yield handle


def claude_turn(session: str, turn: int, answers: list[Any]) -> dict[str, Any]:
    """A Claude Code request: its environment as a system-role message (a block list with
    cache_control on turn 1, the same text as a plain string afterwards, as Claude Code
    2.1 sends it), the answers so far echoed back as blocks, the marker on the newest
    user message, its session in metadata.user_id."""
    environment = f"# Environment\nWorking directory: /work/{session}\n" + filler(400)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>Be brief.</system-reminder>"},
            {"type": "text", "text": f"Say hello to {session}."}]},
        {"role": "system", "content": [{"type": "text", "text": environment,
                                        "cache_control": EPHEMERAL}]
         if turn == 1 else environment}]
    for index, answer in enumerate(answers):
        messages.append({"role": "assistant", "content": answer.content})
        messages.append({"role": "user", "content": [{"type": "text",
                                                      "text": f"Turn {index + 2}, go on."}]})
    messages[-1]["content"][-1]["cache_control"] = EPHEMERAL
    user_id = json.dumps({"device_id": "d", "account_uuid": "", "session_id": session})
    return request(messages, metadata={"user_id": user_id})


def test_an_evicted_claude_code_session_is_restored_from_its_parked_slot(
        one_slot: LlamaServerProcess, run_proxy: ProxyRunner) -> None:
    """Two Claude Code sessions on one slot, the engine's host cache off: each turn evicts
    the other session, which prefixpin parks; the returning session is restored and reads
    its whole previous prompt from cache, although Claude Code rewrote an earlier message
    (its environment, from blocks to a string) and moved its cache_control marker."""
    with run_proxy(upstream=one_slot.url) as url:
        answers: dict[str, list[Any]] = {"ann": [], "bob": []}
        prompts: dict[str, int] = {}
        for turn in (1, 2, 3):
            for session in ("ann", "bob"):
                message = client(url).messages.create(
                    **claude_turn(session, turn, answers[session]))
                if turn > 1:
                    cached = message.usage.cache_read_input_tokens or 0
                    assert cached >= prompts[session] - 32, (session, turn, message.usage)
                prompts[session] = prompt_tokens(message)
                answers[session].append(message)
        metrics = httpx.get(f"{url.admin}/metrics", timeout=10).text
    assert 'prefixpin_restores_total{outcome="restored"} 4.0' in metrics
