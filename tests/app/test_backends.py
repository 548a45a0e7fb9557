"""Several backends in one process (no Redis): placement by session identity, escape when a
backend is down or overloaded, the baselines, and the single-upstream path left as it was.

The engines are the fake llama-server (wire format only); cache behaviour across real
engines and replicas is tested in tests/e2e/test_replicas_llama.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from prefixpin.proxy.engine.backends import MemoryHomes, rendezvous, session_identity
from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.settings import Settings
from tests.app.conftest import ProxyClient, clients_of, lanes_ready
from tests.asgi_transport import StreamingASGITransport
from tests.fakes.fake_llama import FakeLlamaConfig, FakeLlamaServer

pytestmark = pytest.mark.anyio

URLS = ["http://engine-a:8080", "http://engine-b:8080", "http://engine-c:8080"]
LABELS = ["engine-a:8080", "engine-b:8080", "engine-c:8080"]


class Switch(httpx.AsyncBaseTransport):
    """An engine's connection that can be cut (the engine is down) and restored."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.down = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        return await self.inner.handle_async_request(request)


@asynccontextmanager
async def several(n: int = 3, *, n_slots: int = 2, **settings: Any
                  ) -> AsyncIterator[tuple[ProxyClient, list[FakeLlamaServer],
                                           list[Switch]]]:
    engines = [FakeLlamaServer(FakeLlamaConfig(n_slots=n_slots)) for _ in range(n)]
    switches = [Switch(StreamingASGITransport(e.app())) for e in engines]
    config = Settings(upstream=URLS[0], upstreams=URLS[1:n], health_interval_s=0.2,
                      **settings)
    apps = create_apps(config, transports=dict(zip(URLS, switches, strict=False)))
    app = apps.tenant
    async with app.router.lifespan_context(app):
        await lanes_ready(app)
        async with clients_of(apps) as client:
            yield client, engines, switches


def turn(history: list[dict[str, str]], text: str) -> list[dict[str, str]]:
    return [*history, {"role": "user", "content": text}]


async def chat(client: httpx.AsyncClient, messages: list[dict[str, str]],
               key: str | None = None) -> dict[str, Any]:
    headers = {"x-session-id": key} if key else {}
    response = await client.post("/v1/chat/completions", headers=headers,
                                 json={"model": "m", "messages": messages, "max_tokens": 4})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def engine_of(engines: list[FakeLlamaServer], before: list[int]) -> int:
    """The one engine that received a chat request since ``before`` (request counts)."""
    grown = [i for i, e in enumerate(engines) if len(e.requests) > before[i]]
    assert len(grown) == 1, grown
    return grown[0]


async def converse(client: httpx.AsyncClient, engines: list[FakeLlamaServer], key: str | None,
                   turns: int, seed: str) -> list[int]:
    """Run a session; return the engine index each turn went to."""
    history = [{"role": "system", "content": "You are terse."}]
    where = []
    for i in range(turns):
        history = turn(history, f"{seed} question {i}")
        before = [len(e.requests) for e in engines]
        reply = await chat(client, history, key)
        where.append(engine_of(engines, before))
        history.append({"role": "assistant",
                        "content": reply["choices"][0]["message"]["content"]})
    return where


async def test_a_session_stays_on_one_backend_and_sessions_spread() -> None:
    async with several() as (client, engines, _):
        placements = []
        for s in range(6):
            where = await converse(client, engines, f"session-{s}", 3, f"s{s}")
            assert len(set(where)) == 1, where  # every turn on the session's backend
            placements.append(where[0])
        # 6 sessions, 3 backends of 2 slots, occupancy limit 1 session per slot: all used.
        assert sorted(placements) == [0, 0, 1, 1, 2, 2]
        sessions = (await client.admin.get("/sessions")).json()
        assert [b["upstream"] for b in sessions["backends"]] == LABELS
        health = (await client.get("/healthz")).json()
        assert [u["status"] for u in health["upstreams"]] == ["ok"] * 3


async def test_keyless_sessions_are_placed_by_their_first_messages() -> None:
    async with several() as (client, engines, _):
        first = await converse(client, engines, None, 3, "alpha")
        second = await converse(client, engines, None, 3, "beta")
        assert len(set(first)) == 1
        assert len(set(second)) == 1


async def test_a_session_whose_backend_is_down_re_primes_elsewhere_and_says_so() -> None:
    async with several() as (client, engines, switches) :
        history = [{"role": "system", "content": "You are terse."}]
        history = turn(history, "first")
        before = [len(e.requests) for e in engines]
        reply = await chat(client, history, "moving")
        home = engine_of(engines, before)
        history += [reply["choices"][0]["message"], {"role": "user", "content": "second"}]
        switches[home].down = True
        for _ in range(100):  # the engine watch sees it within a probe
            health = (await client.get("/healthz")).json()
            if health["upstreams"][home]["status"] != "ok":
                break
            await asyncio.sleep(0.05)
        before = [len(e.requests) for e in engines]
        reply = await chat(client, history, "moving")
        new_home = engine_of(engines, before)
        assert new_home != home
        sessions = (await client.admin.get("/sessions")).json()["namespaces"]["anon"]
        reason = next(s["last_reason"] for s in sessions if s["key"] == "moving")
        assert f"re-primed on {LABELS[new_home]}: backend {LABELS[home]} down" in reason
        # The backend comes back: the session stays where its cache now is.
        switches[home].down = False
        await asyncio.sleep(0.5)
        history += [reply["choices"][0]["message"], {"role": "user", "content": "third"}]
        before = [len(e.requests) for e in engines]
        await chat(client, history, "moving")
        assert engine_of(engines, before) == new_home


async def test_round_robin_baseline_spreads_one_session_over_backends() -> None:
    async with several(placement="round-robin") as (client, engines, _):
        where = await converse(client, engines, "rr", 3, "rr")
        assert sorted(where) == [0, 1, 2]


async def test_least_loaded_baseline_answers() -> None:
    async with several(placement="least-loaded") as (client, engines, _):
        where = await converse(client, engines, "ll", 2, "ll")
        assert all(0 <= w < 3 for w in where)


async def test_pass_through_goes_to_the_first_backend_answering() -> None:
    async with several() as (client, engines, switches):
        before = [len(e.requests) for e in engines]
        assert (await client.get("/props")).status_code == 200
        switches[0].down = True
        await asyncio.sleep(0.6)
        assert (await client.get("/props")).status_code == 200
        assert [len(e.requests) for e in engines] == before  # no generation went anywhere


def test_rendezvous_is_stable_and_moves_only_the_removed_backends_identities() -> None:
    identities = [f"id-{i}" for i in range(300)]
    weights = dict.fromkeys(LABELS, 1.0)
    first = {i: rendezvous(i, weights)[0] for i in identities}
    assert first == {i: rendezvous(i, weights)[0] for i in identities}
    counts = {label: sum(1 for v in first.values() if v == label) for label in LABELS}
    assert min(counts.values()) > 60  # roughly even: 100 expected each
    without_c = dict.fromkeys(LABELS[:2], 1.0)
    for identity, label in first.items():
        if label != LABELS[2]:
            assert rendezvous(identity, without_c)[0] == label


def test_rendezvous_weights_bias_the_first_choice() -> None:
    weights = {LABELS[0]: 3.0, LABELS[1]: 1.0}
    firsts = [rendezvous(f"id-{i}", weights)[0] for i in range(400)]
    share = firsts.count(LABELS[0]) / len(firsts)
    assert 0.65 < share < 0.85  # 0.75 expected


async def test_memory_homes_assign_the_first_backend_with_room() -> None:
    now = [0.0]
    homes = MemoryHomes(live_s=10.0, clock=lambda: now[0])
    ranked = [("a", 1.0), ("b", 1.0)]
    assert await homes.assign("x", ranked) == "a"
    assert await homes.assign("y", ranked) == "b"  # a is full
    assert await homes.assign("z", ranked) == "a"  # both full: the first in order
    now[0] = 20.0  # everyone idle past the live window: room again
    assert await homes.counts(["a", "b"]) == {"a": 0, "b": 0}


def test_session_identity_uses_the_key_else_the_first_two_messages() -> None:
    system = {"role": "system", "content": "s"}
    a = {"messages": [system, {"role": "user", "content": "a"}]}
    a_later = {"messages": [*a["messages"], {"role": "assistant", "content": "x"},
                            {"role": "user", "content": "y"}]}
    b = {"messages": [system, {"role": "user", "content": "b"}]}
    assert session_identity("anon", a, {}) == session_identity("anon", a_later, {})
    assert session_identity("anon", a, {}) != session_identity("anon", b, {})
    keyed = session_identity("anon", a, {"x-session-id": "k"})
    assert keyed == session_identity("anon", b, {"x-session-id": "k"})
    assert keyed != session_identity("t-1", a, {"x-session-id": "k"})
