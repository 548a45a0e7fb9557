"""The fake behaves as Ollama does where a proxy can observe it: response timing, the prefix
cache and its counts per version, model lifecycle with keep_alive, faults and cancellation."""

from __future__ import annotations

import json
import math
from collections.abc import MutableMapping
from typing import Any

import anyio
import httpx
import pytest

from tests.fakes.fake_ollama import (
    NEW_VERSION,
    OLD_VERSION,
    FakeModel,
    Fault,
    create_fake_ollama,
    fake_ollama_state,
    render_chat,
    tokenize,
)

from .conftest import MODELS, FakeClock, MakeClient, make_config

Message = MutableMapping[str, Any]
USER = [{"role": "user", "content": "Say hello."}]
REPLY = MODELS[0].reply


def ndjson(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in response.text.splitlines()]


async def chat(client: httpx.AsyncClient, messages: list[dict[str, Any]], **extra: Any
               ) -> dict[str, Any]:
    response = await client.post("/api/chat", json={"model": "fake-smol", "messages": messages,
                                                      "stream": False} | extra)
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


async def call_asgi(app: Any, path: str, body: dict[str, Any],
                    disconnect: anyio.Event | None = None,
                    sent: list[Message] | None = None) -> list[Message]:
    """Drive the ASGI app directly; every message it sends is appended to ``sent``."""
    sent = [] if sent is None else sent
    request_sent = False

    async def receive() -> Message:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(),
                    "more_body": False}
        await (disconnect or anyio.Event()).wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("fake", 80)}
    with anyio.fail_after(10):
        await app(scope, receive, send)
    return sent


def started(sent: list[Message]) -> bool:
    return any(m["type"] == "http.response.start" for m in sent)


# ------------------------------------------------------------------------ response timing

@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/api/chat", "/v1/chat/completions"])
async def test_nothing_is_sent_before_the_first_chunk(path: str) -> None:
    """Load, every prefill batch and the first token are waited for with no headers out."""
    sent: list[Message] = []
    waits: list[tuple[float, bool]] = []

    async def sleep(seconds: float) -> None:
        waits.append((seconds, started(sent)))
        await anyio.lowlevel.checkpoint()

    app = create_fake_ollama(make_config(sleep=sleep, batch_tokens=4))
    body = {"model": "fake-smol", "messages": USER, "stream": True}
    await call_asgi(app, path, body, sent=sent)

    record = fake_ollama_state(app).requests[0]
    batches = math.ceil(record.evaluated_tokens / 4)
    before_headers = [seconds for seconds, was_started in waits if not was_started]
    assert len(before_headers) == 1 + batches + 1  # load, prefill batches, first token
    assert all(was_started for _, was_started in waits[len(before_headers):])
    assert sent[0]["type"] == "http.response.start"
    assert sent[0]["status"] == 200


@pytest.mark.anyio
async def test_a_failure_before_the_first_chunk_keeps_its_status(make_client: MakeClient) -> None:
    app, client = await make_client(make_config())
    fake_ollama_state(app).inject(Fault("error_before_headers", status=503, message="busy"))
    response = await client.post("/api/chat", json={"model": "fake-smol", "messages": USER})
    assert (response.status_code, response.json()) == (503, {"error": "busy"})


@pytest.mark.anyio
async def test_a_failure_after_the_first_chunk_is_one_more_line(make_client: MakeClient) -> None:
    app, client = await make_client(make_config())
    fake_ollama_state(app).inject(Fault("error_mid_stream", after_chunks=3, message="boom"))
    response = await client.post("/api/chat", json={"model": "fake-smol", "messages": USER})
    lines = ndjson(response)
    assert response.status_code == 200
    assert [("error" in line) for line in lines] == [False, False, False, True]
    assert lines[-1] == {"error": "boom"}
    assert fake_ollama_state(app).requests[0].outcome == "error"


@pytest.mark.anyio
async def test_v1_loses_the_error_text_after_the_first_chunk(make_client: MakeClient) -> None:
    app, client = await make_client(make_config())
    fake_ollama_state(app).inject(Fault("error_mid_stream", after_chunks=2, message="boom"))
    response = await client.post("/v1/chat/completions", json={
        "model": "fake-smol", "messages": USER, "stream": True})
    frames = [f.removeprefix("data: ") for f in response.text.split("\n\n") if f]
    assert "[DONE]" not in frames
    assert "boom" not in response.text
    last = json.loads(frames[-1])
    assert last["model"] == ""
    assert last["choices"][0]["delta"] == {"content": ""}


@pytest.mark.anyio
async def test_a_fault_can_target_one_path(make_client: MakeClient) -> None:
    app, client = await make_client(make_config())
    fake_ollama_state(app).inject(Fault("error_before_headers", path="/v1/completions"))
    assert (await client.post("/api/generate", json={
        "model": "fake-smol", "prompt": "hi", "stream": False})).status_code == 200
    response = await client.post("/v1/completions", json={"model": "fake-smol", "prompt": "hi"})
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "api_error"


@pytest.mark.anyio
async def test_a_disconnect_during_prefill_keeps_the_evaluated_part() -> None:
    """llama-server keeps what it evaluated before the cancel; a retry reuses it."""
    disconnect = anyio.Event()
    prefill_calls = 0

    async def sleep(seconds: float) -> None:
        nonlocal prefill_calls
        if seconds == pytest.approx(4 * 0.0002):  # a full 4-token prefill batch
            prefill_calls += 1
            if prefill_calls == 3:
                disconnect.set()
                await anyio.sleep(5)  # cancelled by the disconnect
        await anyio.lowlevel.checkpoint()

    app = create_fake_ollama(make_config(sleep=sleep, batch_tokens=4,
                                         prefill_seconds_per_token=0.0002))
    long_user = [{"role": "user", "content": "word " * 40}]
    body = {"model": "fake-smol", "messages": long_user, "stream": True}
    sent = await call_asgi(app, "/api/chat", body, disconnect)

    engine = fake_ollama_state(app)
    assert not started(sent)
    assert engine.requests[0].outcome == "cancelled"
    assert len(engine.slot_tokens("fake-smol")[0]) == 2 * 4  # two batches were evaluated

    prefill_calls = 10  # let the retry run
    await call_asgi(app, "/api/chat", body)
    assert engine.requests[1].cached_tokens == 8


# ------------------------------------------------------------------- prefix cache, versions

@pytest.mark.anyio
async def test_cached_count_is_the_common_prefix_with_the_last_turn(
        make_client: MakeClient) -> None:
    _, client = await make_client(make_config(version=NEW_VERSION))
    first = await chat(client, USER)
    second_messages = [*USER, {"role": "assistant", "content": REPLY},
                       {"role": "user", "content": "And again?"}]
    second = await chat(client, second_messages)

    first_prompt = len(tokenize(render_chat(USER, [])))
    assert first["prompt_eval_cached_count"] == 0
    assert first["prompt_eval_count"] == first_prompt
    # the slot holds the first prompt and the reply it generated
    assert second["prompt_eval_cached_count"] == first_prompt + first["eval_count"]
    assert second["prompt_eval_count"] == len(tokenize(render_chat(second_messages, [])))


@pytest.mark.anyio
async def test_an_identical_prompt_reevaluates_one_token(make_client: MakeClient) -> None:
    _, client = await make_client(make_config())
    await chat(client, USER)
    again = await chat(client, USER)
    assert again["prompt_eval_cached_count"] == again["prompt_eval_count"] - 1


@pytest.mark.anyio
async def test_a_rewritten_history_loses_the_cache_from_the_change(
        make_client: MakeClient) -> None:
    _, client = await make_client(make_config())
    history = [{"role": "system", "content": "You are terse."}, *USER]
    await chat(client, history)
    edited = [{"role": "system", "content": "You are verbose."}, *USER]
    result = await chat(client, edited)
    common = len(tokenize("<|im_start|>system\nYou are"))
    assert result["prompt_eval_cached_count"] == common


@pytest.mark.anyio
async def test_old_versions_report_no_cached_fields(make_client: MakeClient) -> None:
    _, client = await make_client(make_config(version=OLD_VERSION))
    await chat(client, USER)
    native = await chat(client, USER)
    assert "prompt_eval_cached_count" not in native
    assert native["prompt_eval_count"] == len(tokenize(render_chat(USER, [])))
    v1 = (await client.post("/v1/chat/completions", json={
        "model": "fake-smol", "messages": USER})).json()
    assert "prompt_tokens_details" not in v1["usage"]
    assert v1["usage"]["prompt_tokens"] == native["prompt_eval_count"]


@pytest.mark.anyio
async def test_0_30_0_counts_only_evaluated_prompt_tokens(make_client: MakeClient) -> None:
    """Before PR #16428 prompt_eval_count was llama-server's prompt_n alone."""
    _, client = await make_client(make_config(version="0.30.0"))
    first = await chat(client, USER)
    again = await chat(client, USER)
    assert first["prompt_eval_count"] == len(tokenize(render_chat(USER, [])))
    assert again["prompt_eval_count"] == 1


@pytest.mark.anyio
async def test_v1_usage_carries_the_cached_count(make_client: MakeClient) -> None:
    _, client = await make_client(make_config(version=NEW_VERSION))
    await chat(client, USER)
    response = await client.post("/v1/chat/completions", json={
        "model": "fake-smol", "messages": USER, "stream": True,
        "stream_options": {"include_usage": True}})
    frames = [f.removeprefix("data: ") for f in response.text.split("\n\n") if f]
    usage = json.loads(frames[-2])["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": usage["prompt_tokens"] - 1}


@pytest.mark.anyio
async def test_generate_context_continues_the_conversation(make_client: MakeClient) -> None:
    _, client = await make_client(make_config())
    first = (await client.post("/api/generate", json={
        "model": "fake-smol", "prompt": "Hi", "stream": False})).json()
    second = (await client.post("/api/generate", json={
        "model": "fake-smol", "prompt": "More", "context": first["context"],
        "stream": False})).json()
    assert second["prompt_eval_cached_count"] == len(first["context"])


@pytest.mark.anyio
async def test_num_predict_and_max_tokens_cut_with_length(make_client: MakeClient) -> None:
    _, client = await make_client(make_config())
    native = await chat(client, USER, options={"num_predict": 3})
    assert (native["eval_count"], native["done_reason"]) == (3, "length")
    v1 = (await client.post("/v1/chat/completions", json={
        "model": "fake-smol", "messages": USER, "max_tokens": 2})).json()
    assert v1["choices"][0]["finish_reason"] == "length"
    assert v1["usage"]["completion_tokens"] == 2


# ------------------------------------------------------------------------ model lifecycle

@pytest.mark.anyio
async def test_keep_alive_zero_unloads_and_the_next_request_loads_cold(
        make_client: MakeClient) -> None:
    app, client = await make_client(make_config(load_seconds=0.25))
    await chat(client, USER)
    warm = await chat(client, USER, keep_alive=0)
    assert not fake_ollama_state(app).is_loaded("fake-smol")
    cold = await chat(client, USER)
    assert warm["load_duration"] < 250_000_000 <= cold["load_duration"]
    assert cold["prompt_eval_cached_count"] == 0
    assert [r.cold_load for r in fake_ollama_state(app).requests] == [True, False, True]


@pytest.mark.anyio
async def test_keep_alive_expires_on_the_clock(make_client: MakeClient, clock: FakeClock) -> None:
    _app, client = await make_client(make_config(clock=clock))
    await chat(client, USER, keep_alive="1m30s")
    clock.advance(89)
    assert [m["name"] for m in (await client.get("/api/ps")).json()["models"]] == [
        "fake-smol:latest"]
    clock.advance(2)
    assert (await client.get("/api/ps")).json() == {"models": []}
    assert (await chat(client, USER))["prompt_eval_cached_count"] == 0


@pytest.mark.anyio
async def test_v1_requests_use_the_default_keep_alive(make_client: MakeClient,
                                                      clock: FakeClock) -> None:
    app, client = await make_client(make_config(clock=clock, default_keep_alive_seconds=300))
    await client.post("/v1/chat/completions", json={"model": "fake-smol", "messages": USER})
    clock.advance(299)
    assert fake_ollama_state(app).is_loaded("fake-smol")
    clock.advance(2)
    assert not fake_ollama_state(app).is_loaded("fake-smol")


@pytest.mark.anyio
async def test_a_request_without_keep_alive_keeps_the_runners(make_client: MakeClient,
                                                              clock: FakeClock) -> None:
    """sched.go only replaces a runner's sessionDuration when the request sets keep_alive."""
    app, client = await make_client(make_config(clock=clock, default_keep_alive_seconds=300))
    await chat(client, USER, keep_alive="1h")
    await client.post("/v1/chat/completions", json={"model": "fake-smol", "messages": USER})
    clock.advance(3599)
    assert fake_ollama_state(app).is_loaded("fake-smol")
    clock.advance(2)
    assert not fake_ollama_state(app).is_loaded("fake-smol")


@pytest.mark.anyio
async def test_negative_keep_alive_never_expires(make_client: MakeClient,
                                                 clock: FakeClock) -> None:
    app, client = await make_client(make_config(clock=clock))
    await chat(client, USER, keep_alive=-1)
    clock.advance(10**9)
    assert fake_ollama_state(app).is_loaded("fake-smol")


@pytest.mark.anyio
async def test_a_keep_alive_without_unit_is_refused_as_go_does(make_client: MakeClient) -> None:
    _, client = await make_client(make_config())
    response = await client.post("/api/chat", json={"model": "fake-smol", "messages": USER,
                                                     "keep_alive": "300"})
    assert (response.status_code, response.json()) == (
        400, {"error": 'time: missing unit in duration "300"'})


@pytest.mark.anyio
async def test_load_and_unload_requests(make_client: MakeClient) -> None:
    app, client = await make_client(make_config())
    loaded = await client.post("/api/generate", json={"model": "fake-smol"})
    assert loaded.json()["done_reason"] == "load"
    assert fake_ollama_state(app).is_loaded("fake-smol")
    unloaded = await client.post("/api/generate", json={"model": "fake-smol", "keep_alive": 0})
    assert unloaded.json()["done_reason"] == "unload"
    assert not fake_ollama_state(app).is_loaded("fake-smol")


@pytest.mark.anyio
async def test_loading_a_model_past_the_limit_evicts_an_idle_one(
        make_client: MakeClient) -> None:
    app, client = await make_client(make_config(max_loaded_models=1))
    await chat(client, USER)
    await client.post("/api/chat", json={"model": "fake-other", "messages": USER,
                                         "stream": False})
    engine = fake_ollama_state(app)
    assert not engine.is_loaded("fake-smol")
    assert engine.is_loaded("fake-other")
    assert (await chat(client, USER))["prompt_eval_cached_count"] == 0


@pytest.mark.anyio
async def test_concurrent_requests_share_one_cold_load(make_client: MakeClient) -> None:
    app, client = await make_client(make_config(num_parallel=2))
    async with anyio.create_task_group() as group:
        for _ in range(3):
            group.start_soon(chat, client, USER)
    assert sorted(r.cold_load for r in fake_ollama_state(app).requests) == [False, False, True]


# ------------------------------------------------------------------------- request rules

@pytest.mark.anyio
async def test_think_on_a_model_that_cannot_think_is_refused(make_client: MakeClient) -> None:
    _, client = await make_client(make_config())
    response = await client.post("/api/chat", json={"model": "fake-smol", "messages": USER,
                                                     "think": True})
    assert (response.status_code, response.json()) == (
        400, {"error": '"fake-smol" does not support thinking'})


@pytest.mark.anyio
async def test_thinking_models_think_unless_told_not_to(make_client: MakeClient) -> None:
    _, client = await make_client(make_config())
    body = {"model": "fake-think", "messages": USER, "stream": False}
    thought = (await client.post("/api/chat", json=body)).json()
    plain = (await client.post("/api/chat", json=body | {"think": False})).json()
    assert thought["message"]["thinking"] == MODELS[1].thinking
    assert "thinking" not in plain["message"]
    assert plain["message"]["content"] == thought["message"]["content"] == MODELS[1].reply


@pytest.mark.anyio
async def test_a_tool_result_gets_a_text_answer(make_client: MakeClient) -> None:
    _, client = await make_client(make_config())
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    call = await chat(client, USER, tools=tools)
    [tool_call] = call["message"]["tool_calls"]
    assert tool_call["function"] == {"index": 0, "name": "get_weather",
                                     "arguments": {"city": "Paris"}}
    answer = await chat(client, [*USER, call["message"], {"role": "tool", "content": "sunny"}],
                        tools=tools)
    assert answer["message"]["content"] == REPLY
    assert "tool_calls" not in answer["message"]
    assert answer["prompt_eval_cached_count"] > call["prompt_eval_count"]


@pytest.mark.anyio
async def test_output_is_html_escaped_like_go(make_client: MakeClient) -> None:
    models = (FakeModel("fake-smol:latest", reply="a <b> & c"),)
    _, client = await make_client(make_config(models=models))
    response = await client.post("/api/chat", json={"model": "fake-smol", "messages": USER,
                                                     "stream": False})
    assert b"\\u003cb\\u003e \\u0026 c" in response.content
    assert response.json()["message"]["content"] == "a <b> & c"


@pytest.mark.anyio
async def test_unknown_paths_answer_like_gin(make_client: MakeClient) -> None:
    _, client = await make_client(make_config())
    response = await client.get("/api/nothing")
    assert (response.status_code, response.text) == (404, "404 page not found")

