"""Openings against the real llama-server: new sessions of one namespace share a system
prompt; the first saves it, the next ones start from it on whatever slot they get.

The hybrid model is the rig's tiny random-weight ``qwen35`` (``tests.rig.tiny_models``):
what it says is noise; its recurrent state, the slot files and Qwen3.5's real template
are real. A new session on an empty slot of that model prefills everything: llama-server
has no checkpoint to start from there. SmolLM2 (full attention) shows the same on an empty
slot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixpin.adapters.llama_server import LlamaServerAdapter
from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.parking.anchor import prompt_tokens
from prefixpin.proxy.parking.openings import PER_NAMESPACE, first_turn_tokens, request_opening
from prefixpin.proxy.session.tokens import common_prefix
from prefixpin.proxy.settings import Settings
from tests.app.conftest import ProxyClient, clients_of, lanes_ready
from tests.app.test_parking import events, metric, park_files
from tests.e2e.helpers import filler
from tests.rig.llama_process import LlamaServerProcess, run_llama_server
from tests.rig.tiny_models import ensure_tiny_model

pytestmark = [pytest.mark.llama, pytest.mark.anyio]

Json = dict[str, Any]
SYSTEM = "You are a coding agent in this repository. " + filler(400, seed=5)
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file. " + filler(60, seed=6),
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]


@pytest.fixture
def park(tmp_path: Path) -> Path:
    path = tmp_path / "slots"
    path.mkdir()
    return path


@pytest.fixture(params=["qwen35-tiny", "smollm2"])
def engine(request: pytest.FixtureRequest, park: Path) -> Iterator[LlamaServerProcess]:
    model = request.param
    with run_llama_server(ensure_tiny_model(model) if model.endswith("-tiny") else model,
                          slots=2, ctx_per_slot=8192, slot_save_path=park, threads=1,
                          extra=["--cache-ram", "0"]) as handle:
        yield handle


def first_turn(name: str) -> Json:
    task = f"Task {name}: " + filler(30, seed=len(name))
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": task}],
            "tools": TOOLS, "max_tokens": 4, "temperature": 0}


async def start(client: ProxyClient, name: str, tenant: str = "team") -> Json:
    response = await client.post("/v1/chat/completions", json=first_turn(name),
                                 headers={"x-session-id": name,
                                          "authorization": f"Bearer {tenant}"})
    assert response.status_code == 200, response.text
    usage: Json = response.json()["usage"]
    return usage


async def opening_length(url: str) -> int:
    adapter = LlamaServerAdapter(httpx.AsyncClient(base_url=url, timeout=60))
    try:
        opening = await request_opening(adapter, first_turn("any"))
    finally:
        await adapter.aclose()
    assert opening is not None
    return len(opening)


def settings(engine: LlamaServerProcess, park: Path, openings: bool) -> Settings:
    return Settings(upstream=engine.url, park_dir=park, park_index_dir=park.with_name("index"),
                    park_min_tokens=32, opening_min_tokens=64, openings=openings,
                    park_ahead=False, health_interval_s=0.5)


@pytest.mark.parametrize("openings", [True, False])
async def test_new_sessions_start_from_their_namespace_opening(
        engine: LlamaServerProcess, park: Path, openings: bool) -> None:
    """Three sessions start one after the other on two slots: the first saves the opening,
    the next two (an empty slot, then the first session's evicted slot) read it from cache
    and prefill only their own first user turn. Without openings the second, on an empty
    slot, prefills it all."""
    apps = create_apps(settings(engine, park, openings))
    app = apps.tenant
    shared = await opening_length(engine.url)
    async with app.router.lifespan_context(app), clients_of(apps, timeout=120) as client:
        await lanes_ready(app, timeout_s=60)
        usage = [await start(client, name) for name in ("first", "second", "third")]
        saved = await metric(client, "prefixpin_openings_total", outcome="saved")
        restored = await metric(client, "prefixpin_openings_total", outcome="restored")
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usage]
    if not openings:
        assert (saved, restored) == (0, 0)
        assert cached[1] < shared // 2, usage  # an empty slot: everything prefilled
        return
    assert (saved, restored) == (1, 2), usage
    assert cached[0] >= shared  # its own opening, evaluated and saved just before
    for later in usage[1:]:
        differs = later["prompt_tokens"] - shared
        assert later["prompt_tokens"] - later["prompt_tokens_details"]["cached_tokens"] \
            <= differs + 16, (shared, usage)


async def test_openings_never_cross_namespaces(engine: LlamaServerProcess, park: Path,
                                               caplog: pytest.LogCaptureFixture,
                                               tenant_file: Callable[..., Path]) -> None:
    """The same system prompt under another tenant saves an opening of its own; the files
    go when the proxy stops."""
    caplog.set_level(logging.INFO, "prefixpin")
    config = settings(engine, park, openings=True).model_copy(
        update={"tenants_file": tenant_file("team-a", "team-b")})
    apps = create_apps(config)
    app = apps.tenant
    async with app.router.lifespan_context(app), clients_of(apps, timeout=120) as client:
        await lanes_ready(app, timeout_s=60)
        await start(client, "ours", tenant="team-a")
        await start(client, "theirs", tenant="team-b")
        saved = await metric(client, "prefixpin_openings_total", outcome="saved")
        restored = await metric(client, "prefixpin_openings_total", outcome="restored")
        files = {e["file"] for e in events(caplog, "opening saved")}
        assert len(files) == 2
        assert files <= {p.name for p in park_files(park)}
    assert (saved, restored) == (2, 0)
    assert not files & {p.name for p in park_files(park)}


@pytest.fixture
def smollm2(park: Path) -> Iterator[LlamaServerProcess]:
    with run_llama_server("smollm2", slots=1, ctx_per_slot=4096, slot_save_path=park,
                          threads=1, extra=["--cache-ram", "0"]) as handle:
        yield handle


async def test_a_namespace_keeps_its_most_recent_openings(
        smollm2: LlamaServerProcess, park: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Six agents of one namespace, each with a system prompt of its own: at most
    PER_NAMESPACE openings stay, the least recently used file deleted first; the one used
    again just before the last save stays."""
    caplog.set_level(logging.INFO, "prefixpin")
    apps = create_apps(settings(smollm2, park, openings=True))
    app = apps.tenant

    async def agent(kind: int, name: str) -> None:
        body = first_turn(name)
        body["messages"][0]["content"] = f"You are sub-agent {kind}. " + SYSTEM
        response = await client.post("/v1/chat/completions", json=body,
                                     headers={"x-session-id": name})
        assert response.status_code == 200, response.text

    async with app.router.lifespan_context(app), clients_of(apps, timeout=120) as client:
        await lanes_ready(app, timeout_s=60)
        for kind in range(PER_NAMESPACE):
            await agent(kind, f"first-{kind}")
        await agent(0, "again-0")  # kind 0 used again: kind 1 is now the oldest
        await agent(PER_NAMESPACE, "newest")
        saved = [e["file"] for e in events(caplog, "opening saved")]
        on_disk = {p.name for p in park_files(park)}
        assert await metric(client, "prefixpin_openings_total", outcome="restored") == 1
    assert len(saved) == PER_NAMESPACE + 1
    assert saved[1] not in on_disk  # kind 1: least recently used
    assert {saved[0], *saved[2:]} <= on_disk


REMINDER = "<system-reminder>\nThe project's conventions. " + filler(150, seed=8) + \
    "\n</system-reminder>\n"


async def test_siblings_share_their_first_turns_reminders_too(
        engine: LlamaServerProcess, park: Path) -> None:
    """Claude Code opens every session's first user turn with the same reminders: the second
    session restores the template's opening and saves a longer one, up to where its prompt
    parts from the first's; the third starts from that and prefills only what differs from
    its sibling's prompt (tokens the test reads from the engine itself)."""
    apps = create_apps(settings(engine, park, openings=True))
    app = apps.tenant

    def body(name: str) -> Json:
        turn = first_turn(name)
        turn["messages"][1]["content"] = REMINDER + f"Task {name}: " + filler(30, seed=len(name))
        return turn

    async def prompt_of(http: httpx.AsyncClient, name: str) -> list[int]:
        text = (await http.post("/apply-template", json=body(name))).json()["prompt"]
        tokens = (await http.post("/tokenize", json={"content": text, "add_special": True,
                                                     "parse_special": True})).json()["tokens"]
        return [int(t) for t in tokens]

    async with app.router.lifespan_context(app), clients_of(apps, timeout=120) as client:
        await lanes_ready(app, timeout_s=60)
        usage = []
        for name in ("ann", "bob", "cleo"):
            response = await client.post("/v1/chat/completions", json=body(name),
                                         headers={"x-session-id": name})
            assert response.status_code == 200, response.text
            usage.append(response.json()["usage"])
        saved = await metric(client, "prefixpin_openings_total", outcome="saved")
        restored = await metric(client, "prefixpin_openings_total", outcome="restored")
    async with httpx.AsyncClient(base_url=engine.url, timeout=60) as http:
        bob, cleo = await prompt_of(http, "bob"), await prompt_of(http, "cleo")
    shared = common_prefix(bob, cleo)
    assert shared > await opening_length(engine.url) + 100  # the reminder is shared too
    assert (saved, restored) == (2, 2), usage
    third = usage[2]
    assert third["prompt_tokens"] == len(cleo)
    assert third["prompt_tokens"] - third["prompt_tokens_details"]["cached_tokens"] \
        <= len(cleo) - shared + 16, (shared, usage)


async def test_a_new_session_with_a_long_history_is_judged_on_its_first_turn(
        engine: LlamaServerProcess) -> None:
    """A new session that arrives with a history (a resumed conversation, a sub-agent
    handed a long context) is judged on the tokens its prompt starts with up to the end of
    its first turn, never its whole history rendered and tokenized on the path to its first
    token: a prefix of its prompt's tokens, the whole first turn and little more."""
    history = first_turn("long")
    for step in range(6):
        history["messages"] += [{"role": "assistant", "content": filler(60, seed=step)},
                                {"role": "user", "content": filler(60, seed=step + 10)}]
    adapter = LlamaServerAdapter(httpx.AsyncClient(base_url=engine.url, timeout=60))
    try:
        judged = await first_turn_tokens(adapter, history)
        whole = await prompt_tokens(adapter, history)
        alone = await prompt_tokens(adapter, first_turn("long"))
    finally:
        await adapter.aclose()
    assert judged is not None
    assert whole is not None
    assert alone is not None
    assert whole[:len(judged)] == judged
    assert len(alone) - 8 <= len(judged) <= len(alone) + 4
    assert len(judged) < len(whole) // 2
