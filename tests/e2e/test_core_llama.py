"""The proxy core in front of a real llama-server: relay, heartbeats, figures, errors."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.e2e.conftest import ProxyRunner
from tests.e2e.helpers import filler, stream_chat
from tests.fakes.tcp_tap import run_tap
from tests.rig.llama_process import LlamaServerProcess

pytestmark = pytest.mark.llama

SMALL = {"messages": [{"role": "user", "content": "Say hello in three words."}],
         "max_tokens": 6, "temperature": 0}


def occupy_slot(url: str, slot: int, tokens: int) -> threading.Thread:
    """Keep one llama-server slot busy generating, straight to the engine."""
    body = {"prompt": "Count slowly:", "n_predict": tokens, "ignore_eos": True,
            "id_slot": slot, "temperature": 0}
    thread = threading.Thread(target=lambda: httpx.post(f"{url}/completion", json=body,
                                                        timeout=120), daemon=True)
    thread.start()
    return thread


def wait_slots(llama: LlamaServerProcess, busy: bool, timeout: float = 30) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        slots = httpx.get(f"{llama.url}/slots", timeout=5).json()
        if all(s["is_processing"] == busy for s in slots):
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"slots never became busy={busy}")


def test_openai_sdk_streams_and_folds_through_the_proxy(
        run_proxy: ProxyRunner, erase_slots: Callable[[], None]) -> None:
    """The openai SDK streams (with usage) and gets folded responses, with cached_tokens."""
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Say hello in three words."}]
    with run_proxy() as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        stream = client.chat.completions.create(
            model="smol", messages=messages, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        folded = client.chat.completions.create(
            model="smol", messages=messages, max_tokens=6, temperature=0)
    assert text
    assert usage is not None
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 0
    # Greedy and the same prompt: the folded answer is the streamed one, now from cache.
    assert folded.choices[0].message.content == text
    assert folded.usage is not None
    assert folded.usage.prompt_tokens_details is not None
    assert folded.usage.prompt_tokens_details.cached_tokens == folded.usage.prompt_tokens - 1


def test_busy_slots_and_a_long_prefill_still_get_first_bytes_and_progress(
        llama: LlamaServerProcess, run_proxy: ProxyRunner,
        erase_slots: Callable[[], None]) -> None:
    """Both slots busy, then a ~4k-token prefill: bytes within 120 ms, heartbeats while
    queued and with progress while prefilling; the identical resend is served from cache."""
    body = {"messages": [{"role": "system", "content": "You summarise."},
                         {"role": "user", "content": filler(3000)}],
            "max_tokens": 4, "temperature": 0, "stream_options": {"include_usage": True}}
    with run_proxy(heartbeat_s=0.5) as url:
        stream_chat(url, SMALL)  # warm the proxy's connection pool and code paths
        busy = [occupy_slot(llama.url, slot, 400) for slot in (0, 1)]
        wait_slots(llama, busy=True)
        first = stream_chat(url, body)
        for thread in busy:
            thread.join()
        resend = stream_chat(url, body)
    assert first.status == 200
    assert first.first_byte_s is not None
    # Within --first-byte (100 ms by default) and 20 ms to write and read it.
    assert first.first_byte_s < 0.120, f"first byte after {first.first_byte_s:.3f} s"
    queued = [text for _, text in first.comments if text == "waiting for the engine"]
    prefill = [text for _, text in first.comments if text.startswith("prefill ")]
    assert queued, first.comments
    assert prefill, first.comments
    usage = first.usage()
    assert usage["prompt_tokens"] >= 3500
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    again = resend.usage()
    assert again["prompt_tokens"] == usage["prompt_tokens"]
    assert again["prompt_tokens_details"]["cached_tokens"] >= again["prompt_tokens"] - 1


def test_a_client_disconnect_closes_the_engine_request_and_frees_the_slot(
        llama: LlamaServerProcess, run_proxy: ProxyRunner,
        erase_slots: Callable[[], None]) -> None:
    """A client that leaves mid-generation: the proxy closes its engine connection within
    1 s (seen on the wire by a TCP tap), and /slots then shows the slot idle again."""
    body = {"prompt": "Count slowly:", "max_tokens": 4000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with run_tap("127.0.0.1", llama.port) as tap, run_proxy(upstream=tap.url,
                                                           retry_grace_s=0) as url:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break  # a token arrived: the engine is generating
            generating = [c for c in tap.connections if c.bytes_down > 0]
            closed_at = time.monotonic()
        idle_after = wait_slots(llama, busy=False, timeout=10)
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and any(c.closed is None for c in generating):
            time.sleep(0.01)
    engine_connection = max(generating, key=lambda c: c.bytes_down)
    assert engine_connection.closed_by_client is not None, "proxy never closed its request"
    closed_after = engine_connection.closed_by_client - closed_at
    assert closed_after < 1.0, f"engine request closed {closed_after:.2f} s after the client"
    # llama-server itself notices a closed stream on its next write or 1 s poll.
    assert idle_after < 5.0


@pytest.mark.parametrize("stream", [False, True])
def test_context_too_long_keeps_the_engine_status_and_body(
        run_proxy: ProxyRunner, stream: bool) -> None:
    """llama-server's 400 exceed_context_size_error reaches the client as is."""
    body = {"messages": [{"role": "user", "content": filler(7000)}], "max_tokens": 4,
            "stream": stream}
    with run_proxy(first_byte_ms=3000) as url:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "exceed_context_size_error"
    assert error["n_ctx"] == 8192


def test_llama_server_endpoints_pass_through(llama: LlamaServerProcess,
                                             run_proxy: ProxyRunner) -> None:
    """/props, /tokenize, /apply-template and /v1/models answer through the proxy as direct."""
    with run_proxy() as url:
        for method, path, body in [
            ("GET", "/props", None), ("GET", "/v1/models", None),
            ("POST", "/tokenize", {"content": "hello world"}),
            ("POST", "/apply-template", {"messages": SMALL["messages"]}),
        ]:
            via = httpx.request(method, f"{url}{path}", json=body, timeout=30)
            direct = httpx.request(method, f"{llama.url}{path}", json=body, timeout=30)
            assert via.status_code == direct.status_code == 200, path
            if path != "/v1/models":  # carries a creation timestamp
                assert via.json() == direct.json(), path


def test_metrics_and_the_slot_gauge_after_real_requests(
        run_proxy: ProxyRunner, erase_slots: Callable[[], None]) -> None:
    """After requests, the histograms have values and the slot gauge holds the cached
    tokens of the slot's last request (the slot is read back from /slots)."""
    with run_proxy() as url:
        stream_chat(url, SMALL)
        resend = stream_chat(url, {**SMALL, "stream_options": {"include_usage": True}})
        deadline = time.monotonic() + 5
        gauge: list[str] = []
        while time.monotonic() < deadline and not gauge:
            text = httpx.get(f"{url.admin}/metrics").text
            gauge = [line for line in text.splitlines()
                     if line.startswith("prefixpin_slot_cached_tokens{")]
            time.sleep(0.05)
    cached = resend.usage()["prompt_tokens_details"]["cached_tokens"]
    assert any(line.endswith(f" {float(cached)}") for line in gauge), gauge
    count = next(line for line in text.splitlines()
                 if line.startswith("prefixpin_cached_fraction_count"))
    assert float(count.rsplit(" ", 1)[1]) == 2.0
