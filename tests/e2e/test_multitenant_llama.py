"""Three tenants on one real llama-server (``--cache-ram 0``, 2 slots, its --slot-save-path
the proxy's --park-dir): two sessions each, three turns each, interleaved round robin, so
six sessions take turns on two slots and slots change namespace all the time.

- every follow-up turn is fully cached (restored from its own park file when its slot was
  taken meanwhile): ``cached_tokens >= previous prompt_tokens - 1``;
- no namespace is ever served a prefix another one cached: the same two system prompts
  are used by every namespace (the worst case: each tenant's prompt is a right guess of
  the others'), yet a session's first turn sees at most the template's shared opening
  (measured: the common prefix of the two rendered prompts) plus ``SLACK``;
- every request that landed on a slot last held by another namespace (read from the
  proxy's ``request`` log lines, sessions mapped to namespaces by ``/sessions`` on the
  operator listener) was sent with ``cache_prompt: false`` or restored from its own park.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.listen.http_limits import http_options
from prefixpin.proxy.settings import Settings
from tests.e2e.helpers import filler
from tests.fakes.servers import serve_in_thread
from tests.rig.llama_process import LlamaServerProcess, run_llama_server

pytestmark = [pytest.mark.llama, pytest.mark.slow]

Json = dict[str, Any]
SLACK = 8
TOKENS = ("tenant-one-token", "tenant-two-token", "tenant-three-token")
SYSTEMS = ("You are the billing assistant. " + filler(200, seed=3),
           "You are the release engineer. " + filler(200, seed=5))
TURNS = 3


@pytest.fixture(scope="module")
def park_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("park")


@pytest.fixture(scope="module")
def engine(park_dir: Path) -> Iterator[LlamaServerProcess]:
    with run_llama_server("smollm2", slots=2, ctx_per_slot=4096, slot_save_path=park_dir,
                          extra=["--cache-ram", "0"]) as handle:
        yield handle


def shared_opening(engine: LlamaServerProcess) -> int:
    """Tokens the two sessions' first prompts have in common (the template's opening)."""
    rendered = []
    for system in SYSTEMS:
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": "turn 0"}]
        prompt = httpx.post(f"{engine.url}/apply-template", json={"messages": messages},
                            timeout=30).json()["prompt"]
        rendered.append(httpx.post(f"{engine.url}/tokenize", json={"content": prompt},
                                   timeout=30).json()["tokens"])
    common = 0
    for x, y in zip(*rendered, strict=False):
        if x != y:
            break
        common += 1
    return common


def test_three_namespaces_interleaved(engine: LlamaServerProcess, park_dir: Path,
                                      caplog: pytest.LogCaptureFixture,
                                      tenant_file: Callable[..., Path]) -> None:
    caplog.set_level(logging.INFO, "prefixpin")
    for slot in range(2):
        httpx.post(f"{engine.url}/slots/{slot}", params={"action": "erase"}, json={},
                   timeout=30).raise_for_status()
    opening = shared_opening(engine)
    assert opening < 16, opening
    config = Settings(upstream=engine.url, park_dir=park_dir, health_interval_s=0.5,
                      park_min_tokens=128, park_index_dir=park_dir.with_name("park-index"),
                      tenants_file=tenant_file(*TOKENS))
    apps = create_apps(config)
    histories: dict[tuple[int, int], list[Json]] = {}
    usages: dict[tuple[int, int], list[Json]] = {}
    with serve_in_thread(apps.tenant_listener, **http_options()) as url, serve_in_thread(
            apps.operator_listener, **http_options()) as admin:
        for turn in range(TURNS):
            for session in range(2):
                for tenant, token in enumerate(TOKENS):
                    key = (tenant, session)
                    history = histories.setdefault(
                        key, [{"role": "system", "content": SYSTEMS[session]}])
                    history.append({"role": "user",
                                    "content": f"tenant {tenant} session {session} turn {turn}"})
                    response = httpx.post(
                        f"{url}/v1/chat/completions", timeout=300,
                        headers={"authorization": f"Bearer {token}",
                                 "x-session-id": f"session-{session}"},
                        json={"model": "m", "max_tokens": 6, "temperature": 0,
                              "messages": history})
                    assert response.status_code == 200, response.text
                    body = response.json()
                    history.append({"role": "assistant",
                                    "content": body["choices"][0]["message"]["content"]})
                    usages.setdefault(key, []).append(body["usage"])
        view = httpx.get(f"{admin}/sessions", timeout=30).json()
    # Every namespace's follow-up turns fully cached; every first turn cold.
    for key, turns in usages.items():
        first = turns[0]["prompt_tokens_details"]["cached_tokens"]
        assert first <= opening + SLACK, (key, turns)
        for before, after in itertools.pairwise(turns):
            assert after["prompt_tokens_details"]["cached_tokens"] >= \
                before["prompt_tokens"] - 1, (key, turns)
    # Every request on a slot another namespace held last: cache off, or its own park.
    namespace_of = {s["id"]: ns for ns, group in view["namespaces"].items() for s in group}
    assert len(set(namespace_of.values())) == 3, view
    requests = [dict(getattr(r, "fields", {})) for r in caplog.records
                if r.getMessage() == "request"]
    assert len(requests) == 3 * 2 * TURNS, requests
    holder: dict[int, str] = {}
    crossings = 0
    for event in requests:
        slot, namespace = event["slot"], namespace_of[event["session"]]
        assert slot is not None, event
        previous = holder.get(slot)
        if previous != namespace:
            crossings += 1
            restored = str(event.get("park", "")).startswith("restored")
            blocked = str(event.get("cache", "")).startswith("blocked")
            assert restored or blocked, event
        holder[slot] = namespace
    assert crossings >= 3 * 2 * TURNS - 3, requests  # round robin: nearly every one
