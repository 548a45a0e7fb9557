"""prefixpin in front of Ollama, native API (``/api/chat``, ``/api/generate``) and the
parts of ``/v1`` that differ from llama-server: NDJSON relayed line for line, Ollama-shaped
errors, keep-alive spaces, join in flight, figures measured or estimated (and labelled),
``keep_alive`` passed through, model loads and unloads marking sessions cold.

Ollama cannot be installed here: the engine is the recorded-format fake
(``tests.fakes.fake_ollama``), reached in process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import httpx
import pytest

from tests.fakes.fake_ollama import OLD_VERSION, Fault, go_json

from .conftest import MODEL, REPLY, THINKER, fake_config, proxy_rig

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "Say hello."}]


def lines(body: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in body.splitlines() if line.strip()]


def metric(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name) and (not labels or f"{{{wanted}}}" in line):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict[str, Any]]:
    return [dict(getattr(r, "fields", {})) for r in caplog.records if r.getMessage() == name]


# ---------------------------------------------------------------------------- relaying

async def test_a_native_stream_is_ollamas_lines_after_one_space() -> None:
    """Headers and one space at once, then Ollama's NDJSON lines byte for byte (Go's
    compact JSON, HTML-escaped), the done chunk with Ollama's own metrics last."""
    async with proxy_rig() as rig:
        response = await rig.client.post("/api/chat", json={"model": MODEL, "messages": USER})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/x-ndjson"
    assert response.content.startswith(b" {")
    parts = lines(response.content)
    assert "".join(p["message"]["content"] for p in parts) == REPLY
    assert [p["done"] for p in parts] == [False] * (len(parts) - 1) + [True]
    for raw, part in zip(response.content.strip().split(b"\n"), parts, strict=True):
        assert raw.strip() == go_json(part)  # unchanged Ollama bytes
    assert parts[-1]["prompt_eval_cached_count"] == 0  # Ollama's own, measured


async def test_stream_false_is_one_body_as_ollama_answers_it() -> None:
    """A non-streaming client gets Ollama's folded answer: its content type, no padding,
    the same fields as Ollama's own stream: false answer."""
    async with proxy_rig() as rig:
        via_proxy = await rig.client.post("/api/chat", json={
            "model": MODEL, "messages": USER, "stream": False})
        rig.ollama.unload(MODEL)
        direct = await _direct(rig, "/api/chat", {"model": MODEL, "messages": USER,
                                                  "stream": False})
    assert via_proxy.headers["content-type"] == "application/json; charset=utf-8"
    assert via_proxy.content.startswith(b"{")
    body, expected = via_proxy.json(), direct.json()
    assert list(body) == list(expected)
    assert body["message"] == expected["message"]
    assert (body["prompt_eval_count"], body["eval_count"]) == (
        expected["prompt_eval_count"], expected["eval_count"])


async def test_generate_streams_and_folds_with_context() -> None:
    async with proxy_rig() as rig:
        streamed = await rig.client.post("/api/generate", json={"model": MODEL,
                                                                 "prompt": "Hi"})
        whole = await rig.client.post("/api/generate", json={
            "model": MODEL, "prompt": "Hi", "stream": False})
    parts = lines(streamed.content)
    assert "".join(p["response"] for p in parts) == REPLY
    assert parts[-1]["context"]
    assert whole.json()["response"] == REPLY
    assert whole.json()["context"] == parts[-1]["context"]


async def test_thinking_is_relayed_on_both_apis() -> None:
    async with proxy_rig() as rig:
        native = await rig.client.post("/api/chat", json={
            "model": THINKER, "messages": USER, "stream": False})
        v1 = await rig.client.post("/v1/chat/completions", json={
            "model": THINKER, "messages": USER})
    thinking = "Two plus three is five, so the answer is 5."
    assert native.json()["message"]["thinking"] == thinking
    message = v1.json()["choices"][0]["message"]
    assert message["reasoning"] == thinking  # Ollama's /v1 field, folded by the proxy
    assert message["content"] == "The answer is 5."


async def test_meta_endpoints_pass_through() -> None:
    async with proxy_rig() as rig:
        tags = await rig.client.get("/api/tags")
        show = await rig.client.post("/api/show", json={"model": MODEL})
        version = await rig.client.get("/api/version")
        models = await rig.client.get("/v1/models")
        ps = await rig.client.get("/api/ps")
    assert MODEL + ":latest" in {m["name"] for m in tags.json()["models"]}
    assert show.json()["details"]["family"] == "llama"
    assert version.json() == {"version": fake_config().version}
    assert {m["id"] for m in models.json()["data"]} >= {MODEL + ":latest"}
    assert ps.status_code == 200


# ------------------------------------------------------------------------------ errors

@pytest.mark.parametrize("stream", [True, False])
async def test_an_unknown_model_keeps_ollamas_status_and_body(stream: bool) -> None:
    async with proxy_rig() as rig:
        response = await rig.client.post("/api/chat", json={
            "model": "nope", "messages": USER, "stream": stream})
    assert response.status_code == 404
    assert response.json() == {"error": "model 'nope' not found"}


@pytest.mark.parametrize(("body", "param"), [
    (b"{not json", None), (b'{"model": "m", "messages": "hi"}', "messages"),
    (b'{"model": "m", "messages": [{"role": "user"}], "stream": "yes"}', "stream"),
    (b'{"model": 3, "prompt": "hi"}', "model"),
])
async def test_bad_requests_get_ollama_shaped_errors(body: bytes, param: str | None) -> None:
    """The proxy's own 400s speak Ollama's shape ({"error": "..."}) on the native API."""
    path = "/api/generate" if b"prompt" in body else "/api/chat"
    async with proxy_rig() as rig:
        response = await rig.client.post(path, content=body)
        assert not rig.ollama.requests
    assert response.status_code == 400
    error = response.json()["error"]
    assert isinstance(error, str)
    if param is not None:
        assert param in error


async def test_a_late_failure_is_ollamas_error_line() -> None:
    """After the first chunk, a runner failure is one more {"error"} line, no done chunk."""
    async with proxy_rig() as rig:
        rig.ollama.inject(Fault("error_mid_stream", after_chunks=3))
        response = await rig.client.post("/api/chat", json={"model": MODEL, "messages": USER})
    parts = lines(response.content)
    assert response.status_code == 200
    assert "fake fault" in parts[-1]["error"]
    assert len(parts) == 4
    assert not any(p.get("done") for p in parts)


async def test_a_cut_stream_ends_with_an_error_line() -> None:
    async with proxy_rig() as rig:
        rig.ollama.inject(Fault("drop_mid_stream", after_chunks=2))
        response = await rig.client.post("/api/chat", json={"model": MODEL, "messages": USER})
    parts = lines(response.content)
    assert "closed the stream before it finished" in parts[-1]["error"]


async def test_a_failure_during_a_long_prefill_keeps_its_status_only_without_streaming(
        ) -> None:
    """Ollama fails after the proxy committed to 200 (headers and keep-alive went out): a
    streaming client gets the error as Ollama's late-error line; a stream: false client
    gets the real status, since nothing was sent."""
    config = fake_config(sleep=asyncio.sleep, load_seconds=0.0,
                         prefill_seconds_per_token=0.01)
    prompt = [{"role": "user", "content": "word " * 30}]
    async with proxy_rig(config, first_byte_ms=50, heartbeat_s=0.05) as rig:
        for _ in range(2):  # fails after the prefill, before the first token
            rig.ollama.inject(Fault("error_mid_stream", after_chunks=0, status=503,
                                    message="server busy"))
        streamed = await rig.client.post("/api/chat", json={"model": MODEL,
                                                             "messages": prompt})
        whole = await rig.client.post("/api/chat", json={
            "model": MODEL, "messages": prompt + USER, "stream": False})
    assert streamed.status_code == 200
    assert lines(streamed.content) == [{"error": "server busy"}]
    assert (whole.status_code, whole.json()) == (503, {"error": "server busy"})


# -------------------------------------------------------------- keep-alive during prefill

async def test_a_long_prefill_sends_spaces_only_to_streaming_clients() -> None:
    """During a 1.5 s prefill the streaming client receives headers and a space at once,
    then a space per heartbeat; Ollama itself would send nothing at all. A stream: false
    client receives nothing until its one body."""
    config = fake_config(sleep=asyncio.sleep, load_seconds=0.0,
                         prefill_seconds_per_token=0.03, batch_tokens=8)
    prompt = [{"role": "user", "content": "word " * 25}]
    async with proxy_rig(config, heartbeat_s=0.1) as rig:
        arrivals: list[tuple[float, bytes]] = []
        start = time.monotonic()
        async with rig.client.stream("POST", "/api/chat", json={
                "model": MODEL, "messages": prompt}) as response:
            headers_after = time.monotonic() - start
            async for chunk in response.aiter_raw():
                arrivals.append((time.monotonic() - start, chunk))
        whole = await rig.client.post("/api/chat", json={
            "model": MODEL, "messages": [{"role": "user", "content": "x " * 50}],
            "stream": False})
        heartbeats = metric(await rig.metrics(), "prefixpin_heartbeats_total")
    assert headers_after < 0.5
    body = b"".join(chunk for _, chunk in arrivals)
    padding = len(body) - len(body.lstrip(b" "))
    assert padding >= 8  # one at once, then one per 0.1 s of a 1.5 s prefill
    assert arrivals[0][1].startswith(b" ")
    assert arrivals[0][0] < 0.5
    assert "".join(p["message"]["content"] for p in lines(body)) == REPLY
    assert whole.content.startswith(b"{")
    assert heartbeats >= 7


# ---------------------------------------------------------------------- join in flight

async def test_identical_native_requests_share_one_generation() -> None:
    """A resend during a slow prefill (marked a retry, as the SDKs mark theirs) joins the
    generation in flight; a stream: false and a streaming client share it too; the same
    body on /v1 is another answer."""
    config = fake_config(sleep=asyncio.sleep, load_seconds=0.0,
                         prefill_seconds_per_token=0.01)
    prompt = [{"role": "user", "content": "word " * 40}]
    body = {"model": MODEL, "messages": prompt}
    async with proxy_rig(config) as rig:
        first = asyncio.create_task(rig.client.post("/api/chat", json=body))
        await asyncio.sleep(0.1)
        second = asyncio.create_task(rig.client.post(
            "/api/chat", json={**body, "stream": False},
            headers={"x-stainless-retry-count": "1"}))
        openai = asyncio.create_task(rig.client.post("/v1/chat/completions", json=body))
        streamed, whole, v1 = await asyncio.gather(first, second, openai)
        requests = [r.path for r in rig.ollama.requests]
        joins = metric(await rig.metrics(), "prefixpin_inflight_joins_total")
    assert requests == ["/api/chat", "/v1/chat/completions"]
    assert joins == 1
    assert whole.json()["message"]["content"] == REPLY
    assert lines(streamed.content)[-1]["done"]
    assert v1.json()["choices"][0]["message"]["content"] == REPLY


# ------------------------------------------------------------------ figures and estimates

async def _two_turns(rig: Any, path: str = "/api/chat") -> list[Any]:
    headers = {"x-session-id": "agent"}
    first = await rig.client.post(path, headers=headers, json={
        "model": MODEL, "messages": USER, "stream": False})
    reply = (first.json()["message"] if path == "/api/chat"
             else first.json()["choices"][0]["message"])
    second = await rig.client.post(path, headers=headers, json={
        "model": MODEL, "messages": [*USER, reply, {"role": "user", "content": "Again."}],
        "stream": False})
    return [first, second]


async def test_new_ollama_cached_counts_are_measured(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="prefixpin")
    async with proxy_rig() as rig:
        first, second = await _two_turns(rig)
        text = await rig.metrics()
        actual = [r.cached_tokens for r in rig.ollama.requests]
    assert [first.json()["prompt_eval_cached_count"],
            second.json()["prompt_eval_cached_count"]] == actual
    assert actual[1] > 0
    assert metric(text, "prefixpin_cached_tokens_count", source="measured",
                  upstream="fake-ollama") == 2
    assert metric(text, "prefixpin_cached_tokens_count", source="estimated",
                  upstream="fake-ollama") == 0
    logged = events(caplog, "request")
    assert [e["cached_tokens"] for e in logged] == actual
    assert not any("cached_tokens_estimated" in e for e in logged)


@pytest.mark.parametrize("path", ["/api/chat", "/v1/chat/completions"])
async def test_old_ollama_cached_counts_are_estimated_and_never_shown_to_clients(
        path: str, caplog: pytest.LogCaptureFixture) -> None:
    """Ollama 0.33.2 reports no cached count. The proxy estimates it from the session (the
    committed prompt's tokens when the request extends it), labels it in the metrics and
    the log, and adds nothing to what the client receives."""
    caplog.set_level(logging.INFO, logger="prefixpin")
    async with proxy_rig(fake_config(version=OLD_VERSION)) as rig:
        first, second = await _two_turns(rig, path)
        streamed = await rig.client.post(path, json={
            "model": MODEL, "messages": USER, "stream": True,
            "stream_options": {"include_usage": True}})
        text = await rig.metrics()
        actual = [r.cached_tokens for r in rig.ollama.requests]
    if path == "/api/chat":
        assert "prompt_eval_cached_count" not in first.json()
        assert "prompt_eval_cached_count" not in second.json()
        assert "prompt_eval_cached_count" not in lines(streamed.content)[-1]
        committed = first.json()["prompt_eval_count"]
    else:
        assert "prompt_tokens_details" not in first.json()["usage"]
        assert "prompt_tokens_details" not in second.json()["usage"]
        assert b"cached_tokens" not in streamed.content
        committed = first.json()["usage"]["prompt_tokens"]
    logged = [e for e in events(caplog, "request") if e.get("session")]
    assert [e["cached_tokens"] for e in logged] == [None, None, None]
    assert [e["cached_tokens_estimated"] for e in logged][:2] == [0, committed]
    assert committed <= actual[1]  # the estimate never claims more than was reused
    assert metric(text, "prefixpin_cached_tokens_count", source="estimated",
                  upstream="fake-ollama") == 3
    assert metric(text, "prefixpin_cached_tokens_count", source="measured",
                  upstream="fake-ollama") == 0


# --------------------------------------------------------------------- model lifecycle

async def test_keep_alive_is_passed_through() -> None:
    async with proxy_rig(recorder=True) as rig:
        await rig.client.post("/api/chat", json={"model": MODEL, "messages": USER,
                                                 "keep_alive": "10m", "stream": False})
        ps = (await rig.client.get("/api/ps")).json()["models"]
        assert rig.recorder is not None
        forwarded = [b for p, b in rig.recorder.bodies if p == "/api/chat"]
    assert forwarded[0]["keep_alive"] == "10m"
    assert forwarded[0]["stream"] is True  # the proxy always streams from Ollama
    assert len(ps) == 1


async def test_a_model_reload_marks_its_sessions_cold(
        caplog: pytest.LogCaptureFixture) -> None:
    """Ollama unloaded the model (expiry, eviction): the next request's load_duration
    jumps. That request's estimate is 0, the other sessions on the model turn cold (their
    committed history kept), and a resumed cold session is estimated at 0 until it ran."""
    caplog.set_level(logging.INFO, logger="prefixpin")
    async with proxy_rig(fake_config(version=OLD_VERSION)) as rig:
        a = {"x-session-id": "a"}
        b = {"x-session-id": "b"}
        turn_a = {"model": MODEL, "messages": USER, "stream": False}
        b_first: list[Any] = [{"role": "user", "content": "Other session."}]
        turn_b = {"model": MODEL, "stream": False, "messages": b_first}
        await rig.client.post("/api/chat", headers=a, json=turn_a)
        await rig.client.post("/api/chat", headers=b, json=turn_b)
        rig.ollama.unload(MODEL)  # expired: the cache went with the runner
        reply = (await rig.client.post("/api/chat", headers=a, json=turn_a)).json()["message"]
        sessions = {s["key"]: s for s in await rig.sessions()}
        assert sessions["b"]["last_decision"] == "cold"
        assert "loaded again" in sessions["b"]["last_reason"]
        assert sessions["b"]["committed_messages"] == 1  # the history is kept
        assert sessions["a"]["last_decision"] == "resumed"
        await rig.client.post("/api/chat", headers=b, json={
            **turn_b, "messages": [*b_first, reply,
                                   {"role": "user", "content": "More."}]})
        text = await rig.metrics()
    logged = [e for e in events(caplog, "request") if e.get("session")]
    assert logged[2]["load_ms"] >= 500
    assert logged[2]["cached_tokens_estimated"] == 0  # a cold load: nothing reused
    assert logged[2]["cache"].startswith("cold: model loaded")
    assert logged[3]["cached_tokens_estimated"] == 0  # b resumed, but cold
    assert logged[3]["cache"].startswith("cold: model")
    assert metric(text, "prefixpin_cache_lost_total", reason="model_loaded",
                  upstream="fake-ollama") == 1


async def test_a_zero_cached_count_on_a_resumed_session_marks_the_model_cold() -> None:
    """/v1 carries no load_duration; on a new Ollama, a resumed session that gets no
    cached token at all says the model lost its cache."""
    async with proxy_rig() as rig:
        await rig.client.post("/v1/chat/completions", headers={"x-session-id": "b"},
                              json={"model": MODEL, "messages": [
                                  {"role": "user", "content": "Other."}]})
        first, second = await _two_turns(rig, "/v1/chat/completions")
        rig.ollama.unload(MODEL)
        messages = [*USER, first.json()["choices"][0]["message"],
                    {"role": "user", "content": "Again."},
                    second.json()["choices"][0]["message"],
                    {"role": "user", "content": "Once more."}]
        third = await rig.client.post("/v1/chat/completions", headers={"x-session-id": "agent"},
                                      json={"model": MODEL, "messages": messages})
        assert third.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        sessions = {s["key"]: s for s in await rig.sessions()}
        text = await rig.metrics()
    assert sessions["b"]["last_decision"] == "cold"
    assert "0 cached tokens" in sessions["b"]["last_reason"]
    assert sessions["agent"]["last_decision"] == "resumed"
    assert metric(text, "prefixpin_cache_lost_total", reason="cached_dropped",
                  upstream="fake-ollama") == 1


@pytest.mark.parametrize(("keep_alive", "reason"), [(0, "unloaded"), ("0s", "unloaded"),
                                                     (None, "model_loaded")])
async def test_load_and_unload_requests_pass_through_and_mark_sessions_cold(
        keep_alive: Any, reason: str) -> None:
    """An empty messages list loads a model, with keep_alive 0 unloads it (Ollama's
    lifecycle requests): passed through, and a load of an unloaded model or an unload
    makes its sessions cold."""
    async with proxy_rig() as rig:
        await rig.client.post("/api/chat", headers={"x-session-id": "a"},
                              json={"model": MODEL, "messages": USER, "stream": False})
        if reason == "model_loaded":
            rig.ollama.unload(MODEL)
        request = {"model": MODEL, "messages": []}
        if keep_alive is not None:
            request["keep_alive"] = keep_alive
        response = await rig.client.post("/api/chat", json=request)
        loaded = rig.ollama.is_loaded(MODEL)
        sessions = await rig.sessions()
        text = await rig.metrics()
    expected = "unload" if reason == "unloaded" else "load"
    assert response.json()["done_reason"] == expected
    assert loaded == (expected == "load")
    assert [s["last_decision"] for s in sessions] == ["cold"]
    assert metric(text, "prefixpin_cache_lost_total", reason=reason,
                  upstream="fake-ollama") == 1


async def test_keep_alive_zero_on_a_request_makes_every_session_of_the_model_cold() -> None:
    async with proxy_rig() as rig:
        await rig.client.post("/api/chat", headers={"x-session-id": "a"}, json={
            "model": MODEL, "messages": USER, "stream": False, "keep_alive": 0})
        loaded = rig.ollama.is_loaded(MODEL)
        sessions = await rig.sessions()
    assert not loaded
    assert sessions[0]["last_decision"] == "cold"


# ---------------------------------------------------------------------------- helpers

async def _direct(rig: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    transport = httpx.ASGITransport(app=rig.fake)
    async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
        return await client.post(path, json=body)
