"""OpenAI Responses (``/v1/responses``) through the proxy in front of the real llama-server,
with the official ``openai`` SDK's ``responses`` API as the client.

llama-server answers ``/v1/responses`` itself; through prefixpin (converted to chat
completions, the answer translated back) the answer must be the same: the same text,
status and token counts, greedy, streamed or not. A Codex-like session (``instructions``,
developer and user messages, ``prompt_cache_key``, the previous answer's output items
echoed back each turn) reuses the whole previous prompt on every follow-up turn;
``previous_response_id`` (stored state no engine here keeps) and a bad body are 400s
naming the field.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import ProxyRunner
from tests.e2e.helpers import filler
from tests.rig.llama_process import LlamaServerProcess
from tests.rig.scrape import prefilled

pytestmark = pytest.mark.llama

KEY = "sk-prefixpin-responses-e2e"
GREEDY: dict[str, Any] = {"temperature": 0}

_CLIENTS: dict[str, openai.OpenAI] = {}


def client(url: str) -> openai.OpenAI:
    """The SDK's client of ``url`` (one per address, closed after each test)."""
    if url not in _CLIENTS:
        _CLIENTS[url] = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0,
                                      timeout=300)
    return _CLIENTS[url]


@pytest.fixture(autouse=True)
def close_clients() -> Iterator[None]:
    yield
    while _CLIENTS:
        _CLIENTS.popitem()[1].close()


def question(max_output_tokens: int = 12) -> dict[str, Any]:
    return {"model": "smol", "max_output_tokens": max_output_tokens, **GREEDY,
            "instructions": "You are a terse assistant.",
            "input": [{"role": "user", "content": "Say hello in three words."}]}


def streamed(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The streamed answer as (text, status, usage), read from the events the SDK parses
    (``responses.create(stream=True)``, which llama-server's own stream also satisfies)."""
    text: list[str] = []
    completed: Any = None
    for event in client(url).responses.create(**body, stream=True):
        if event.type == "response.output_text.delta":
            text.append(event.delta)
        elif event.type == "response.completed":
            completed = event.response
    assert completed is not None, "no response.completed"
    assert completed.output_text == "".join(text)
    return {"text": completed.output_text, "status": completed.status,
            "usage": usage_of(completed.usage)}


def whole(url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client(url).responses.create(**body)
    return {"text": response.output_text, "status": response.status,
            "usage": usage_of(response.usage)}


def usage_of(usage: Any) -> dict[str, Any]:
    """The usage fields as sent (llama-server's own leaves some of the SDK's out)."""
    assert usage is not None
    fields: dict[str, Any] = usage.to_dict()
    return fields


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_answer_through_prefixpin_is_llama_servers_own(
        llama: LlamaServerProcess, run_proxy: ProxyRunner, erase_slots: Callable[[], None],
        stream: bool) -> None:
    """Same text, status, input and output tokens as llama-server's /v1/responses; the
    proxy's usage carries ``input_tokens_details.cached_tokens``."""
    read = streamed if stream else whole
    direct = read(llama.url, question())
    erase_slots()
    with run_proxy() as url:
        proxied = read(url, question())
        again = read(url, question())
    assert direct["text"]
    assert proxied["text"] == direct["text"]
    assert proxied["status"] == direct["status"] == "completed"
    for name in ("input_tokens", "output_tokens", "total_tokens"):
        assert proxied["usage"][name] == direct["usage"][name], name
    assert isinstance(proxied["usage"]["input_tokens_details"]["cached_tokens"], int)
    assert proxied["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}
    # The same question again, on the session's slot: all but the last token from cache.
    assert again["text"] == direct["text"]
    cached = again["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached >= again["usage"]["input_tokens"] - 2


def test_the_sdk_stream_helper_reads_the_proxy(
        run_proxy: ProxyRunner, erase_slots: Callable[[], None]) -> None:
    """``client.responses.stream()`` (the SDK's accumulator, which wants every index and
    a whole Response in each lifecycle event) gets its final response through the proxy."""
    with run_proxy() as url, client(url).responses.stream(**question()) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas)
    assert final.output_text
    assert final.model == "smol"
    assert final.usage is not None
    assert final.usage.input_tokens_details.cached_tokens >= 0


def _codex_items(response: Any) -> list[dict[str, Any]]:
    """The output items as Codex echoes them: no ids or statuses, text as output_text."""
    items: list[dict[str, Any]] = []
    for item in response.output:
        if item.type == "message":
            items.append({"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": part.text} for part in item.content]})
        elif item.type == "reasoning":
            items.append({"type": "reasoning", "summary": [], "encrypted_content": "",
                          "content": [part.model_dump() for part in item.content or []]})
        elif item.type == "function_call":
            items.append({"type": "function_call", "name": item.name,
                          "arguments": item.arguments, "call_id": item.call_id})
    return items


def _user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


@pytest.mark.parametrize("echo", ["codex", "sdk"])
def test_a_codex_session_reuses_the_whole_previous_prompt_every_turn(
        llama: LlamaServerProcess, run_proxy: ProxyRunner, erase_slots: Callable[[], None],
        echo: str) -> None:
    """Each turn sends the whole conversation again: two developer messages, the AGENTS.md
    and environment messages, every previous answer's output items echoed (Codex's way, or
    the SDK's ``response.output`` as it is), the new question. Every follow-up turn is
    served from cache up to the previous answer's end: the engine prefills only the new
    turn."""
    base: dict[str, Any] = {
        "model": "smol", "max_output_tokens": 16, **GREEDY,
        "instructions": "You are a coding agent. " + filler(60, seed=3),
        "prompt_cache_key": f"codex-session-{echo}", "store": False,
        "include": ["reasoning.encrypted_content"], "parallel_tool_calls": False,
        "tool_choice": "auto", "reasoning": None,
        "tools": [{"type": "function", "name": "shell", "description": "Run a command",
                   "strict": False, "parameters": {
                       "type": "object", "required": ["command"],
                       "properties": {"command": {"type": "array",
                                                  "items": {"type": "string"}}}}}]}
    conversation: list[Any] = [
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "<permissions instructions>Sandboxed."
                                           "</permissions instructions>"}]},
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "<collaboration_mode>Be brief."
                                           "</collaboration_mode>"}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "# AGENTS.md\nUse pytest."},
            {"type": "input_text", "text": "<environment_context><cwd>/work</cwd>"
                                           "</environment_context>"}]},
        _user("What does a test runner do?"),
    ]
    turns: list[dict[str, Any]] = []
    with run_proxy() as url:
        for number in range(4):
            before = prefilled([llama])
            with client(url).responses.stream(**base, input=conversation) as stream:
                response = stream.get_final_response()
            assert response.usage is not None
            turns.append({"input": response.usage.input_tokens,
                          "output": response.usage.output_tokens,
                          "cached": response.usage.input_tokens_details.cached_tokens,
                          "prefilled": prefilled([llama]) - before})
            # The SDK's way: ``response.output`` as it is (the SDK serializes its items).
            echoed = _codex_items(response) if echo == "codex" else list(response.output)
            conversation = [*conversation, *echoed, _user(f"And step {number + 2}?")]
    for previous, turn in itertools.pairwise(turns):
        assert turn["input"] > previous["input"] + previous["output"], turns
        assert turn["cached"] >= previous["input"] - 2, turns
        # Only the new turn is prefilled: the previous answer and question at most.
        assert turn["prefilled"] <= turn["input"] - previous["input"] + 2, turns


def test_previous_response_id_is_a_400_naming_it(run_proxy: ProxyRunner) -> None:
    with run_proxy() as url:
        with pytest.raises(openai.BadRequestError) as caught:
            client(url).responses.create(**question(), previous_response_id="resp_abc123")
        assert caught.value.status_code == 400
        assert caught.value.param == "previous_response_id"
        assert "previous_response_id" in caught.value.message
        with pytest.raises(openai.BadRequestError) as streaming:
            client(url).responses.create(**question(), previous_response_id="resp_abc123",
                                         stream=True)
        assert streaming.value.param == "previous_response_id"


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "smol"}, "input"),
    ({"model": "smol", "input": [{"role": "user", "content": [
        {"type": "input_file", "file_id": "file_1"}]}]}, "input[0].content[0].type"),
    ({"model": "smol", "input": "hi", "max_output_tokens": "many"}, "max_output_tokens"),
    ({"model": "smol", "input": "hi", "conversation": "conv_1"}, "conversation"),
])
def test_a_bad_body_is_a_400_naming_the_field(run_proxy: ProxyRunner, body: dict[str, Any],
                                              param: str) -> None:
    with run_proxy() as url:
        response = httpx.post(f"{url}/v1/responses", json=body, timeout=30,
                              headers={"authorization": f"Bearer {KEY}"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_the_bare_alias_and_the_token_counters_answer_as_llama_server(
        llama: LlamaServerProcess, run_proxy: ProxyRunner,
        erase_slots: Callable[[], None]) -> None:
    """llama-server serves ``/responses`` as ``/v1/responses``, and counts a request's
    prompt tokens at ``[/v1]/responses/input_tokens`` and
    ``[/v1]/chat/completions/input_tokens`` (nothing generated): all of them through the
    tenant port too, with llama-server's own answers."""
    body = {**question(), "stream": False}
    direct = httpx.post(f"{llama.url}/responses", json=body, timeout=120)
    erase_slots()
    chat = {"model": "smol", "messages": [{"role": "user", "content": "Count me."}]}
    counters = {"/responses/input_tokens": body, "/v1/responses/input_tokens": body,
                "/chat/completions/input_tokens": chat,
                "/v1/chat/completions/input_tokens": chat}
    with run_proxy() as url:
        proxied = httpx.post(f"{url}/responses", json=body, timeout=120)
        counted = {path: (httpx.post(f"{url}{path}", json=sent, timeout=30),
                          httpx.post(f"{llama.url}{path}", json=sent, timeout=30))
                   for path, sent in counters.items()}
    assert direct.status_code == proxied.status_code == 200, proxied.text
    assert proxied.json()["output"][0]["content"][0]["text"] == (
        direct.json()["output"][0]["content"][0]["text"])
    for path, (through, straight) in counted.items():
        assert straight.status_code == 200, (path, straight.text)
        assert (through.status_code, through.json()) == (200, straight.json()), path
