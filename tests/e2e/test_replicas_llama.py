"""Two proxy replicas (separate `prefixpin serve` processes) sharing state in a real
redis-server, in front of two real llama-servers (SmolLM2, one thread each).

- a session's turns alternating between the replicas keep their cache;
- a retry on the other replica joins the generation in flight: the engine prefills once;
- a replica killed mid-stream loses only its own clients; the session continues through the
  other replica with its cache.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.helpers import filler
from tests.rig.llama_process import LlamaServerProcess, run_llama_server
from tests.rig.redis_process import RedisProcess, run_redis_server
from tests.rig.replica_process import ReplicaProcess, start_replica
from tests.rig.scrape import prefilled

pytestmark = [pytest.mark.llama, pytest.mark.slow,
              pytest.mark.usefixtures("redis_server_binary")]

REPLICA_ENV = {"PREFIXPIN_HEALTH_INTERVAL_S": "1", "PREFIXPIN_PARKING": "0"}


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisProcess]:
    with run_redis_server() as handle:
        yield handle


@pytest.fixture(scope="module")
def engines() -> Iterator[list[LlamaServerProcess]]:
    with run_llama_server("smollm2", slots=2, ctx_per_slot=4096, threads=1) as a, \
            run_llama_server("smollm2", slots=2, ctx_per_slot=4096, threads=1) as b:
        yield [a, b]


@pytest.fixture
def replicas(redis_server: RedisProcess, engines: list[LlamaServerProcess],
             tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[list[ReplicaProcess]]:
    prefix = re.sub(r"\W", "", request.node.name)[:40]
    started: list[ReplicaProcess] = []
    try:
        for i in range(2):
            started.append(start_replica(
                [e.url for e in engines], tmp_path / f"replica-{i}.log", redis=redis_server.url,
                replica_id=f"replica-{i}", args=["--redis-prefix", prefix], env=REPLICA_ENV))
        yield started
    finally:
        for replica in started:
            replica.stop()


def chat(url: str, messages: list[dict[str, Any]], key: str, *, retry: bool = False,
         **extra: Any) -> dict[str, Any]:
    """``retry``: marked a retry as the SDKs mark theirs (only a retry joins an answer
    still running)."""
    headers = {"x-session-id": key, **({"x-stainless-retry-count": "1"} if retry else {})}
    response = httpx.post(f"{url}/v1/chat/completions", headers=headers,
                          json={"messages": messages, "max_tokens": 8, "temperature": 0,
                                **extra}, timeout=120)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def cached_fraction(reply: dict[str, Any]) -> float:
    usage = reply["usage"]
    return float(usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"])




def system_prompt(seed: int) -> dict[str, str]:
    return {"role": "system", "content": f"Session {seed}. " + filler(220, seed=seed)}


def test_turns_alternating_between_replicas_keep_their_cache(
        replicas: list[ReplicaProcess]) -> None:
    history: list[dict[str, Any]] = [system_prompt(1)]
    fractions = []
    for i in range(4):
        history.append({"role": "user", "content": f"Question {i}: name a colour."})
        reply = chat(replicas[i % 2].url, history, "alternating")
        fractions.append(cached_fraction(reply))
        history.append(reply["choices"][0]["message"])
    print(f"\ncached fraction per turn (replicas 0,1,0,1): {[round(f, 3) for f in fractions]}")
    assert all(f >= 0.9 for f in fractions[1:]), fractions
    views = [httpx.get(f"{r.admin_url}/sessions", timeout=10).json() for r in replicas]
    for view in views:
        mine = [s for s in view["namespaces"]["anon"] if s["key"] == "alternating"]
        assert len(mine) == 1
        assert mine[0]["last_reason"] == "extends committed history"


def test_a_retry_on_the_other_replica_joins_the_generation_in_flight(
        replicas: list[ReplicaProcess], engines: list[LlamaServerProcess]) -> None:
    messages: list[dict[str, Any]] = [system_prompt(2),
                                      {"role": "user", "content": "Say hello."}]
    body = {"messages": messages, "max_tokens": 16, "temperature": 0}
    before = prefilled(engines)
    first: dict[str, Any] = {}
    headers_seen = threading.Event()

    def original() -> None:
        text = []
        with httpx.stream("POST", f"{replicas[0].url}/v1/chat/completions",
                          json={**body, "stream": True, "stream_options": {"include_usage": True}},
                          headers={"x-session-id": "retry"}, timeout=120) as response:
            headers_seen.set()
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    event = httpx.Response(200, content=line[6:]).json()
                    for choice in event.get("choices") or []:
                        text.append(choice["delta"].get("content") or "")
                    if event.get("usage"):
                        first["usage"] = event["usage"]
        first["text"] = "".join(text)

    thread = threading.Thread(target=original)
    thread.start()
    assert headers_seen.wait(30)
    time.sleep(0.5)  # the engine is prefilling the original now
    retry = chat(replicas[1].url, messages, "retry", retry=True, max_tokens=16)
    thread.join(120)
    after = prefilled(engines)
    prompt = first["usage"]["prompt_tokens"]
    print(f"\nengine prompt tokens processed for two identical requests: {after - before:.0f} "
          f"(prompt: {prompt} tokens)")
    assert retry["choices"][0]["message"]["content"] == first["text"]
    assert after - before <= prompt * 1.05  # prefilled once, not twice
    metrics = httpx.get(f"{replicas[1].admin_url}/metrics", timeout=10).text
    assert 'prefixpin_inflight_joins_total{api="openai",endpoint="chat"} 1.0' in metrics


def test_a_killed_replica_loses_only_its_clients_and_sessions_continue(
        replicas: list[ReplicaProcess]) -> None:
    history: list[dict[str, Any]] = [system_prompt(3)]
    for i in range(2):
        history.append({"role": "user", "content": f"Question {i}: name a fruit."})
        reply = chat(replicas[0].url, history, "survivor")
        history.append(reply["choices"][0]["message"])
    history.append({"role": "user", "content": "Now write a long poem about the sea."})
    broken: list[BaseException] = []
    streaming = threading.Event()

    def doomed() -> None:
        try:
            with httpx.stream("POST", f"{replicas[0].url}/v1/chat/completions",
                              json={"messages": history, "max_tokens": 2000, "stream": True,
                                    # never ends on its own before the kill: a sampled
                                    # reply may stop after a line of verse
                                    "ignore_eos": True, "temperature": 0},
                              headers={"x-session-id": "survivor"}, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        streaming.set()
        except httpx.HTTPError as exc:
            broken.append(exc)

    other: dict[str, Any] = {}

    def bystander() -> None:  # another session's stream on the replica that survives
        other["reply"] = chat(replicas[1].url, [system_prompt(4), {
            "role": "user", "content": "Count to twenty."}], "bystander", max_tokens=48)

    thread = threading.Thread(target=doomed)
    thread.start()
    assert streaming.wait(60)
    witness = threading.Thread(target=bystander)
    witness.start()
    time.sleep(0.2)
    replicas[0].kill()
    thread.join(30)
    assert broken, "the killed replica's client saw no error"
    witness.join(120)
    assert other["reply"]["choices"][0]["finish_reason"] in ("length", "stop")
    started = time.monotonic()
    reply = chat(replicas[1].url, history, "survivor")  # the client's retry, elsewhere
    print(f"\nretry after the kill: {time.monotonic() - started:.1f} s, cached "
          f"{cached_fraction(reply):.3f}")
    assert cached_fraction(reply) >= 0.9
    sessions = httpx.get(f"{replicas[1].admin_url}/sessions", timeout=10).json()
    mine = [s for s in sessions["namespaces"]["anon"] if s["key"] == "survivor"]
    assert len(mine) == 1
