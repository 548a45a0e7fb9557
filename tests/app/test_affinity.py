"""Session affinity in process, against the fake engine (which honours id_slot and keeps a
toy prefix cache per slot). Cache figures against the real engine are in tests/e2e."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from prefixpin.fingerprint import edge_texts, fingerprint_view
from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.session.affinity import AffinityPlanner
from prefixpin.proxy.session.history import digest
from prefixpin.proxy.session.implicit import Fingerprinter
from prefixpin.proxy.settings import Settings
from tests.app.conftest import clients_of, running_proxy
from tests.app.test_parking import SlotFileFakeLlama, metric, park_files
from tests.app.test_parking import settings as park_settings
from tests.asgi_transport import StreamingASGITransport
from tests.fakes.fake_llama import FakeLlamaConfig, FakeLlamaServer
from tests.rig.models import ensure_model

pytestmark = pytest.mark.anyio

SYSTEM = {"role": "system", "content": "You are a careful coding agent. " * 10}


def conversation(name: str, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [SYSTEM]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{name} asks question {turn} " * 5})
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": f"{name} answer {turn}"})
    return messages


async def ask(client: httpx.AsyncClient, messages: list[dict[str, Any]],
              headers: dict[str, str] | None = None, **fields: Any) -> dict[str, Any]:
    response = await client.post("/v1/chat/completions", headers=headers or {},
                                 json={"messages": messages, "max_tokens": 2, **fields})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def cached(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_interleaved_sessions_each_keep_their_slot() -> None:
    """A and B alternate on a 2-slot engine: each turn after the first is a cache hit on
    the slot its session holds."""
    previous: dict[str, int] = {}
    async with running_proxy() as (client, engine):
        for turn in range(1, 4):
            for name in ("A", "B"):
                body = await ask(client, conversation(name, turn), {"x-session-id": name})
                if turn > 1:  # all of the previous prompt came from the cache
                    assert cached(body) >= previous[name], (name, turn)
                previous[name] = body["usage"]["prompt_tokens"]
        sessions = (await client.admin.get("/sessions")).json()
    slots = [r["id_slot"] for r in engine.requests]
    assert slots[0::2] == [slots[0]] * 3
    assert slots[1::2] == [slots[1]] * 3
    assert slots[0] != slots[1]
    anon = sessions["namespaces"]["anon"]
    assert {s["key"]: s["last_decision"] for s in anon} == {"A": "resumed", "B": "resumed"}


async def test_a_title_request_under_the_same_key_is_a_side_history() -> None:
    """OpenCode's title request (same session id, other system prompt) does not displace
    the main thread: it becomes a second, side history under the key."""
    title = [{"role": "system", "content": "You are a title generator."},
             {"role": "user", "content": "Make a title"}]
    async with running_proxy() as (client, engine):
        await ask(client, conversation("A", 1), {"x-session-id": "A"})
        await ask(client, title, {"x-session-id": "A"})
        again = await ask(client, conversation("A", 2), {"x-session-id": "A"})
        sessions = (await client.admin.get("/sessions")).json()["namespaces"]["anon"]
    assert cached(again) > 0
    kinds = sorted((s["kind"], s["last_decision"]) for s in sessions)
    assert kinds == [("main", "resumed"), ("side", "declined")]
    assert engine.requests[0]["id_slot"] == engine.requests[2]["id_slot"]
    assert engine.requests[1]["id_slot"] != engine.requests[0]["id_slot"]


async def test_an_edited_last_message_rewinds_the_same_session() -> None:
    """Same key, last user message edited: the session is rewound on its slot, so the
    engine still reuses everything before the edit."""
    async with running_proxy() as (client, engine):
        first = conversation("A", 2)
        await ask(client, first, {"x-session-id": "A"})
        edited = [*first[:-1], {"role": "user", "content": "an edited question"}]
        body = await ask(client, edited, {"x-session-id": "A"})
        session = (await client.admin.get("/sessions")).json()["namespaces"]["anon"][0]
    assert session["last_decision"] == "rewound"
    assert "diverged at message 3" in session["last_reason"]
    assert engine.requests[0]["id_slot"] == engine.requests[1]["id_slot"]
    assert cached(body) > 0


async def test_keyless_conversations_resume_by_their_bytes() -> None:
    """No key: a request that repeats a session's committed history as its prefix resumes
    it; a different conversation does not."""
    async with running_proxy() as (client, engine):
        await ask(client, conversation("A", 1))
        await ask(client, conversation("B", 1))
        body = await ask(client, conversation("A", 2))
    assert engine.requests[2]["id_slot"] == engine.requests[0]["id_slot"]
    assert cached(body) > 0


async def test_tenants_never_share_a_session_or_a_cached_prefix(
        tenant_file: Callable[..., Path]) -> None:
    """Same session key, two bearer tokens: two sessions. On a 1-slot engine the second
    tenant's request takes the slot with cache_prompt off, so it cannot learn, from its
    cached tokens, anything of what the first tenant's history holds. (The engine keeps
    its prompt cache per slot, --cache-ram 0: on one with a shared host cache the second
    tenant is refused instead, tests/app/test_isolation.py.)"""
    engine = FakeLlamaServer(FakeLlamaConfig(n_slots=1, cache_ram=0))
    history = conversation("A", 2)
    async with running_proxy(engine, tenants_file=tenant_file("one", "two")) as (client, _):
        await ask(client, history, {"x-session-id": "A", "authorization": "Bearer one"})
        other = await ask(client, history, {"x-session-id": "A", "authorization": "Bearer two"})
        sessions = (await client.admin.get("/sessions")).json()["namespaces"]
    assert cached(other) == 0
    assert engine.requests[1]["cache_prompt"] is False
    assert len(sessions) == 2
    assert all(len(group) == 1 for group in sessions.values())
    assert "Bearer" not in json.dumps(sessions)


async def test_the_rollback_switch_leaves_a_plain_pass_through() -> None:
    """PREFIXPIN_AFFINITY=0: no id_slot, no sessions; the engine chooses."""
    async with running_proxy(affinity=False) as (client, engine):
        await ask(client, conversation("A", 1), {"x-session-id": "A"})
        sessions = (await client.admin.get("/sessions")).json()
    assert "id_slot" not in engine.requests[0]
    assert sessions["affinity"] is False
    assert sessions["namespaces"] == {}


async def test_decisions_are_counted_by_tier_and_outcome() -> None:
    """/metrics counts affinity decisions and declines by cause."""
    async with running_proxy() as (client, _):
        await ask(client, conversation("A", 1), {"x-session-id": "A"})
        await ask(client, conversation("A", 2), {"x-session-id": "A"})
        await ask(client, [SYSTEM, {"role": "user", "content": "other"}], {"x-session-id": "A"})
        text = (await client.admin.get("/metrics")).text
    assert 'prefixpin_affinity_decisions_total{outcome="new",tier="explicit"} 1.0' in text
    assert 'prefixpin_affinity_decisions_total{outcome="resumed",tier="explicit"} 1.0' in text
    assert 'prefixpin_affinity_declines_total{cause="edited"} 1.0' in text


async def test_only_keyless_requests_are_fingerprinted() -> None:
    """A named session is found by its key alone, so a keyed request never pays for the
    fingerprint (tokenizing a long history); a keyless one is fingerprinted, and its
    resend costs no tokenization at all (the memo of prefix chains)."""
    engine = FakeLlamaServer()
    apps = create_apps(Settings(upstream="http://fake-llama", tokenizer=ensure_model("smollm2")),
                       transport=StreamingASGITransport(engine.app()))
    app = apps.tenant
    async with app.router.lifespan_context(app), clients_of(apps) as client:
        planner = app.state.prefixpin.service.planner
        assert isinstance(planner, AffinityPlanner)
        assert planner.fingerprinter is not None
        stats = planner.fingerprinter.cache.stats
        await ask(client, conversation("A", 3), {"x-session-id": "A"})
        await ask(client, conversation("A", 4), {"x-session-id": "A"})
        assert (stats.hits, stats.misses, len(planner.fingerprinter.memo)) == (0, 0, 0)
        await ask(client, conversation("B", 3))
        misses = stats.misses
        # each message tokenized once: its view, or a long view's two edges
        markers = planner.fingerprinter.markers
        assert misses == sum(len(edge_texts(fingerprint_view(m), markers))
                             for m in conversation("B", 3))
        body = await ask(client, conversation("B", 3))
        assert stats.misses == misses
    assert cached(body) > 0


async def test_a_follow_up_its_history_decides_is_tokenized_after_its_answer() -> None:
    """A keyless follow-up that repeats its session's committed history byte for byte is
    planned without its fingerprint chain (the chain only nominates the other candidates):
    its new messages are tokenized at the commit, once the engine has answered, and the
    session keeps the chain of the whole request all the same."""
    engine = FakeLlamaServer()
    inner = engine.app()
    misses_when_asked: list[int] = []
    planners: list[AffinityPlanner] = []

    async def watched(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/chat/completions":
            fingerprinter = planners[0].fingerprinter
            assert fingerprinter is not None
            misses_when_asked.append(fingerprinter.cache.stats.misses)
        await inner(scope, receive, send)

    apps = create_apps(Settings(upstream="http://fake-llama", tokenizer=ensure_model("smollm2")),
                       transport=StreamingASGITransport(watched))
    app = apps.tenant
    async with app.router.lifespan_context(app), clients_of(apps) as client:
        planner = app.state.prefixpin.service.planner
        assert isinstance(planner, AffinityPlanner)
        assert planner.fingerprinter is not None
        planners.append(planner)
        stats = planner.fingerprinter.cache.stats
        await ask(client, conversation("B", 3))
        first = stats.misses
        assert misses_when_asked == [first]  # a new history: its chain nominated candidates
        history = conversation("B", 4)
        await ask(client, history)
        for _ in range(100):  # the commit follows the answer's end
            if stats.misses > first:
                break
            await anyio.sleep(0.01)
        assert misses_when_asked == [first, first]
        assert stats.misses > first
        (session,) = planner.store.keyless("anon")
        fresh = Fingerprinter(planner.fingerprinter.tokenizer, planner.fingerprinter.markers)
        assert session.chain == await fresh.chain_of_messages(
            history, [digest(m) for m in history], planner._normalize_for_identity, "anon")


def claude_turns(name: str, turns: int) -> list[dict[str, Any]]:
    """A Claude Code conversation on /v1/messages: user and assistant turns."""
    messages: list[dict[str, Any]] = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{name} asks question {turn} " * 5})
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": f"{name} answer {turn}"})
    return messages


async def ask_claude(client: httpx.AsyncClient, messages: list[dict[str, Any]], session: str,
                     agent: str | None = None, parent_agent: str | None = None
                     ) -> dict[str, Any]:
    """As Claude Code asks: its session in the header and in metadata.user_id; a
    sub-agent adds its agent id (and a sub-agent's sub-agent its parent's)."""
    headers = {"x-claude-code-session-id": session}
    if agent is not None:
        headers["x-claude-code-agent-id"] = agent
    if parent_agent is not None:
        headers["x-claude-code-parent-agent-id"] = parent_agent
    user_id = json.dumps({"device_id": "d1", "account_uuid": "", "session_id": session})
    response = await client.post("/v1/messages", headers=headers, json={
        "model": "fake", "max_tokens": 2, "system": SYSTEM["content"], "messages": messages,
        "metadata": {"user_id": user_id}})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def test_claude_code_sub_agents_are_side_sessions_that_spare_the_main_slot() -> None:
    """Same X-Claude-Code-Session-Id (and metadata.user_id), an agent id: each sub-agent is
    its own side session under its parent. The first takes the free slot; the second,
    with every slot held, evicts the cheaper side history, never the main agent's, whose
    next turn is still cached on its slot."""
    async with running_proxy(FakeLlamaServer(FakeLlamaConfig(n_slots=2))) as (client, engine):
        await ask_claude(client, claude_turns("main", 1), "S")
        await ask_claude(client, claude_turns("explore", 1), "S", agent="a1")
        await ask_claude(client, claude_turns("nested", 1), "S", agent="a2", parent_agent="a1")
        again = await ask_claude(client, claude_turns("main", 2), "S")
        sessions = (await client.admin.get("/sessions")).json()["namespaces"]["anon"]
    main_slot, side_slot = engine.requests[0]["id_slot"], engine.requests[1]["id_slot"]
    assert main_slot != side_slot
    assert [r["id_slot"] for r in engine.requests] == [main_slot, side_slot, side_slot,
                                                       main_slot]
    assert again["usage"]["cache_read_input_tokens"] > 0
    view = {s["key"]: (s["kind"], s["parent"], s["last_decision"]) for s in sessions}
    assert view == {"S": ("main", None, "resumed"), "S/a1": ("side", "S", "new"),
                    "S/a2": ("side", "S/a1", "new")}


def slot_of(view: dict[str, Any], session: str) -> list[int]:
    return [s["slot"] for s in view["slots"] if s["session"] == session]


async def test_dynamo_session_final_releases_the_sessions_slot() -> None:
    """X-Dynamo-Session-Final: true on a session's last turn: once it committed, no slot is
    pinned to the session and it leaves /sessions; the next session takes the freed slot,
    not reading what it held from cache."""
    async with running_proxy(FakeLlamaServer(FakeLlamaConfig(n_slots=2))) as (client, engine):
        await ask(client, conversation("A", 1), {"x-dynamo-session-id": "A"})
        before = (await client.admin.get("/sessions")).json()
        [a_id] = [s["id"] for s in before["namespaces"]["anon"]]
        assert slot_of(before, a_id) == [engine.requests[0]["id_slot"]]
        await ask(client, conversation("A", 2), {"x-dynamo-session-id": "A",
                                                 "x-dynamo-session-final": "true"})
        after = (await client.admin.get("/sessions")).json()
        await ask(client, conversation("B", 1), {"x-dynamo-session-id": "B"})
    assert engine.requests[1]["id_slot"] == engine.requests[0]["id_slot"]  # resumed first
    assert slot_of(after, a_id) == []
    assert all(s["session"] is None for s in after["slots"])
    assert after["namespaces"].get("anon", []) == []
    assert engine.requests[2]["id_slot"] == engine.requests[0]["id_slot"]
    assert engine.requests[2]["cache_prompt"] is False


async def test_dynamo_session_final_removes_the_sessions_parked_file(tmp_path: Path) -> None:
    """One slot, parking on: A is parked when B takes the slot, restored for its final
    turn (B parked in turn); the final commit removes A's file and record, so a restarted
    proxy revives only B."""
    engine = SlotFileFakeLlama(tmp_path)
    async with running_proxy(engine, **park_settings(tmp_path)) as (client, _):
        await ask(client, conversation("A", 1), {"x-session-id": "A"})
        await ask(client, conversation("B", 1), {"x-session-id": "B"})
        await ask(client, conversation("A", 2), {"x-session-id": "A",
                                                 "x-dynamo-session-final": "1"})
        assert await metric(client, "prefixpin_park_removals_total", reason="final") == 1
        parked = (await client.admin.get("/sessions")).json()["parking"]["parked"]
        assert [p["key"] for p in parked] == ["B"]
        assert len(park_files(tmp_path)) == 1
    async with running_proxy(engine, **park_settings(tmp_path)) as (client, _):
        await ask(client, conversation("A", 3), {"x-session-id": "A"})
        assert await metric(client, "prefixpin_park_revivals_total") == 0


async def test_a_prefix_break_is_counted_with_its_cause() -> None:
    """One slot: B's new history takes the slot A's long prompt held: the break is another
    history's (it used to be counted as cause "unknown", whatever happened)."""
    engine = FakeLlamaServer(FakeLlamaConfig(n_slots=1, cache_ram=0))
    long_system = {"role": "system", "content": "You are a careful agent. " * 120}
    async with running_proxy(engine) as (client, _):
        await ask(client, [long_system, {"role": "user", "content": "A one"}],
                  {"x-session-id": "A"})
        await ask(client, [{"role": "system", "content": "Other. " * 200},
                           {"role": "user", "content": "B one"}], {"x-session-id": "B"})
        other = await metric(client, "prefixpin_prefix_breaks_total",
                             upstream="fake-llama", cause="other_history")
        unknown = await metric(client, "prefixpin_prefix_breaks_total",
                               upstream="fake-llama", cause="unknown")
    assert other == 1
    assert unknown == 0
