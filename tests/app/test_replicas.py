"""Two proxy replicas sharing state in a real redis-server, in one process, in front of fake
engines (wire format only): sessions, slot locks and in-flight joins cross replicas.

The same behaviour against real llama-servers and replica processes (`prefixpin serve`):
tests/e2e/test_replicas_llama.py.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import pytest
import redis

from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.settings import Settings
from tests.app.conftest import ProxyClient, clients_of, lanes_ready
from tests.asgi_transport import StreamingASGITransport
from tests.fakes.fake_llama import FakeLlamaConfig, FakeLlamaServer
from tests.rig.redis_process import RedisProcess, run_redis_server

pytestmark = [pytest.mark.anyio,
              pytest.mark.usefixtures("redis_server_binary")]

URLS = ["http://engine-a:8080", "http://engine-b:8080"]
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisProcess]:
    with run_redis_server() as handle:
        yield handle


class SlotWatch(httpx.AsyncBaseTransport):
    """Counts requests running on each pinned slot at once (a stream runs until closed)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.running: dict[int, int] = {}
        self.most: dict[int, int] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        slot = None
        if request.url.path.endswith("/completions"):
            import json

            slot = json.loads(request.content or b"{}").get("id_slot")
        response = await self.inner.handle_async_request(request)
        if not isinstance(slot, int):
            return response
        self.running[slot] = self.running.get(slot, 0) + 1
        self.most[slot] = max(self.most.get(slot, 0), self.running[slot])
        return httpx.Response(response.status_code, headers=response.headers,
                              stream=_Counted(response, lambda: self._done(slot)))

    def _done(self, slot: int) -> None:
        self.running[slot] -= 1


class _Counted(httpx.AsyncByteStream):
    def __init__(self, response: httpx.Response, done: Any) -> None:
        self.response = response
        self.done = done
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.response.aiter_raw():
            yield chunk

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.done()
            await self.response.aclose()


@asynccontextmanager
async def replicas(redis_url: str, engines: list[FakeLlamaServer], n: int = 2,
                   **settings: Any) -> AsyncIterator[tuple[list[ProxyClient],
                                                           list[SlotWatch]]]:
    prefix = f"test{next(_prefixes)}"
    watches = [SlotWatch(StreamingASGITransport(e.app())) for e in engines]
    async with AsyncExitStack() as stack:
        clients = []
        for i in range(n):
            config = Settings(upstream=URLS[0], upstreams=URLS[1:len(engines)],
                              redis=redis_url, redis_prefix=prefix, replica_id=f"replica-{i}",
                              health_interval_s=0.5, **settings)
            apps = create_apps(config, transports=dict(zip(URLS, watches, strict=False)))
            app = apps.tenant
            await stack.enter_async_context(app.router.lifespan_context(app))
            await lanes_ready(app)
            clients.append(await stack.enter_async_context(
                clients_of(apps, base_url=f"http://replica-{i}")))
        yield clients, watches


async def chat(client: httpx.AsyncClient, messages: list[dict[str, Any]], key: str,
               **extra: Any) -> dict[str, Any]:
    response = await client.post("/v1/chat/completions", headers={"x-session-id": key},
                                 json={"model": "m", "messages": messages, "max_tokens": 6,
                                       **extra})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def test_turns_alternating_between_replicas_continue_one_session(
        redis_server: RedisProcess) -> None:
    engines = [FakeLlamaServer(FakeLlamaConfig(n_slots=2)) for _ in URLS]
    async with replicas(redis_server.url, engines) as (clients, _):
        history: list[dict[str, Any]] = [{"role": "system", "content": "be terse " * 100}]
        cached = []
        for i in range(6):
            history.append({"role": "user", "content": f"question number {i}"})
            reply = await chat(clients[i % 2], history, "alternating")
            cached.append(reply["usage"]["prompt_tokens_details"]["cached_tokens"]
                          / reply["usage"]["prompt_tokens"])
            history.append(reply["choices"][0]["message"])
        assert cached[0] == 0
        assert all(c >= 0.9 for c in cached[1:]), cached
        used = [i for i, e in enumerate(engines) if e.requests]
        assert len(used) == 1  # one backend, whichever replica asked
        slots = {r.get("id_slot") for r in engines[used[0]].requests}
        assert len(slots) == 1  # one slot: the session's
        views = [(await c.admin.get("/sessions")).json()["namespaces"]["anon"] for c in clients]
        ids = [{s["id"] for s in view if s["key"] == "alternating"} for view in views]
        assert ids[0] == ids[1]
        assert len(ids[0]) == 1
        reasons = [s["last_reason"] for v in views for s in v]
        assert all("extends committed history" in r for r in reasons), reasons


async def test_a_retry_on_the_other_replica_joins_the_running_generation(
        redis_server: RedisProcess) -> None:
    engine = FakeLlamaServer(FakeLlamaConfig(n_slots=2, token_delay_s=0.05))
    async with replicas(redis_server.url, [engine]) as (clients, _):
        body = {"model": "m", "max_tokens": 30, "stream": True,
                "messages": [{"role": "user", "content": "tell me a long story"}]}
        first: list[bytes] = []
        started = asyncio.Event()

        async def original() -> None:
            async with clients[0].stream("POST", "/v1/chat/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        started.set()
                    first.append(line.encode())

        task = asyncio.create_task(original())
        await asyncio.wait_for(started.wait(), 10)
        retry = await clients[1].post("/v1/chat/completions", json={**body, "stream": False},
                                      headers={"x-stainless-retry-count": "1"})
        await task
        assert retry.status_code == 200, retry.text
        assert len(engine.requests) == 1  # one engine request for both clients
        text = "".join(c["delta"].get("content") or "" for line in first
                       if line.startswith(b"data: {")
                       for c in httpx.Response(200, content=line[6:]).json()["choices"])
        assert retry.json()["choices"][0]["message"]["content"] == text
        metrics = (await clients[1].admin.get("/metrics")).text
        assert 'prefixpin_inflight_joins_total{api="openai",endpoint="chat"} 1.0' in metrics


async def test_a_retry_waits_for_a_generation_that_fails_and_gets_its_error(
        redis_server: RedisProcess) -> None:
    engine = FakeLlamaServer(FakeLlamaConfig(n_slots=1, n_ctx=64, token_delay_s=0.02))
    async with replicas(redis_server.url, [engine]) as (clients, _):
        body = {"model": "m", "max_tokens": 5,
                "messages": [{"role": "user", "content": "word " * 200}]}  # > n_ctx
        same = {"idempotency-key": "one-request"}  # one request, sent to both replicas
        a, b = await asyncio.gather(
            clients[0].post("/v1/chat/completions", json=body, headers=same),
            clients[1].post("/v1/chat/completions", json=body, headers=same))
        assert a.status_code == b.status_code == 400
        assert a.json() == b.json()
        assert len(engine.requests) == 1


async def test_identical_requests_on_two_replicas_are_independent_samples(
        redis_server: RedisProcess) -> None:
    """pass@k across replicas: the second request is no retry of the first (its client is
    still reading), so the origin refuses the join and it runs its own generation."""
    engine = FakeLlamaServer(FakeLlamaConfig(n_slots=2, token_delay_s=0.05))
    async with replicas(redis_server.url, [engine]) as (clients, _):
        body = {"model": "m", "max_tokens": 20,
                "messages": [{"role": "user", "content": "sample me"}]}
        first = asyncio.create_task(clients[0].post("/v1/chat/completions", json=body))
        await asyncio.sleep(0.3)
        second = await clients[1].post("/v1/chat/completions", json=body)
        assert (await first).status_code == second.status_code == 200
        assert len(engine.requests) == 2
        metrics = (await clients[1].admin.get("/metrics")).text
        assert 'prefixpin_inflight_joins_total{api="openai",endpoint="chat"} 1.0' not in metrics


async def test_a_resend_on_the_other_replica_after_the_client_left_joins(
        redis_server: RedisProcess) -> None:
    engine = FakeLlamaServer(FakeLlamaConfig(n_slots=2, token_delay_s=0.2))
    async with replicas(redis_server.url, [engine], retry_grace_s=5) as (clients, _):
        body = {"model": "m", "max_tokens": 30, "stream": True,
                "messages": [{"role": "user", "content": "a story, again"}]}
        with pytest.raises(TimeoutError):  # the client gives up mid-answer
            await asyncio.wait_for(clients[0].post("/v1/chat/completions", json=body), 0.5)
        await asyncio.sleep(0.1)
        resend = await clients[1].post("/v1/chat/completions", json=body)
        assert resend.status_code == 200
        assert len(engine.requests) == 1


async def test_slot_leases_are_exclusive_across_replicas(redis_server: RedisProcess) -> None:
    engine = FakeLlamaServer(FakeLlamaConfig(n_slots=2, token_delay_s=0.01))
    async with replicas(redis_server.url, [engine]) as (clients, watches):
        async def session(i: int) -> None:
            history: list[dict[str, Any]] = []
            for t in range(3):
                history.append({"role": "user", "content": f"session {i} turn {t}"})
                reply = await chat(clients[(i + t) % 2], history, f"s{i}")
                history.append(reply["choices"][0]["message"])

        await asyncio.gather(*(session(i) for i in range(5)))
        assert len(engine.requests) == 15
        assert set(watches[0].most) <= {0, 1}
        assert max(watches[0].most.values()) == 1  # never two requests on one slot at once


async def test_concurrent_sessions_alternating_replicas_all_keep_their_slots(
        redis_server: RedisProcess) -> None:
    """Four sessions at once on two engines of two slots, every turn on the other replica:
    each keeps its slot and its cache (the slot table read by one request must not erase
    what a lease held by the same replica has learnt: found by bench/multi.py)."""
    engines = [FakeLlamaServer(FakeLlamaConfig(n_slots=2, token_delay_s=0.05))
               for _ in URLS]
    async with replicas(redis_server.url, engines) as (clients, _):
        cached: list[tuple[int, int, int]] = []

        async def session(i: int) -> None:
            await asyncio.sleep(0.1 * i)  # each starts while the others hold their slots
            history: list[dict[str, Any]] = [{"role": "system", "content": f"agent {i} " * 40}]
            for t in range(4):
                history.append({"role": "user", "content": f"session {i} turn {t}"})
                reply = await chat(clients[(i + t) % 2], history, f"k{i}")
                usage = reply["usage"]
                cached.append((t, usage["prompt_tokens_details"]["cached_tokens"],
                               usage["prompt_tokens"]))
                history.append(reply["choices"][0]["message"])

        await asyncio.gather(*(session(i) for i in range(4)))
        later = [c / p for t, c, p in cached if t > 0]
        assert len(later) == 12
        assert min(later) >= 0.8, cached


async def test_redis_gone_is_a_503_that_names_it_not_a_wrong_decision() -> None:
    engine = FakeLlamaServer(FakeLlamaConfig(n_slots=2))
    with run_redis_server() as own:
        async with replicas(own.url, [engine], n=1) as (clients, _):
            history = [{"role": "user", "content": "hello"}]
            await chat(clients[0], history, "k")
            own.process.terminate()
            own.process.wait(10)
            response = await clients[0].post(
                "/v1/chat/completions", headers={"x-session-id": "k"},
                json={"model": "m", "max_tokens": 4,
                      "messages": [*history, {"role": "user", "content": "again"}]})
            assert response.status_code == 503
            assert response.headers["retry-after"] == "2"
            error = response.json()["error"]
            assert error["code"] == "shared_state_unavailable"
            assert "Redis" in error["message"]
            assert len(engine.requests) == 1


async def test_a_session_its_client_ended_is_gone_from_every_replica(
        redis_server: RedisProcess) -> None:
    """``x-dynamo-session-final`` on replica 0: the session leaves the shared table too, so
    the same key's next request on replica 1 starts a new session, not the ended one."""
    engines = [FakeLlamaServer(FakeLlamaConfig(n_slots=2)) for _ in URLS]
    async with replicas(redis_server.url, engines) as (clients, _):
        history: list[dict[str, Any]] = [{"role": "system", "content": "be terse " * 100},
                                         {"role": "user", "content": "first"}]
        await chat(clients[0], history, "ending")
        history += [{"role": "assistant", "content": "ok"},
                    {"role": "user", "content": "last"}]
        final = await clients[0].post(
            "/v1/chat/completions", json={"model": "m", "messages": history, "max_tokens": 6},
            headers={"x-dynamo-session-id": "ending", "x-dynamo-session-final": "true"})
        assert final.status_code == 200, final.text
        views = [(await c.admin.get("/sessions")).json()["namespaces"].get("anon", [])
                 for c in clients]
        table = redis.Redis.from_url(redis_server.url)
        try:  # any test's session records: none is the ended session's
            records = [table.get(k) or b"" for k in table.scan_iter(match="*:s:*")]
        finally:
            table.close()
    assert [s for view in views for s in view if s["key"] == "ending"] == []
    assert not [r for r in records if b'"ending"' in r]
