"""The shared-prompt-cache gate (``proxy.isolation``) in front of real llama-servers: with
its default --cache-ram the proxy reads the flag from the server's command line (/proc)
and serves one namespace; with --cache-ram 0 every namespace is served."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from proxy.app import create_apps
from proxy.settings import Settings
from proxy.testing.servers import serve_proxy
from tests.e2e.conftest import ProxyRunner
from tests.rig.llama_process import run_llama_server

pytestmark = pytest.mark.llama

SYSTEM = "You are the assistant of tenant A. " + "Its private instructions follow. " * 12


def ask(url: str, token: str) -> httpx.Response:
    body: dict[str, Any] = {"model": "m", "max_tokens": 2, "temperature": 0,
                            "messages": [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": f"hello from {token}"}]}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {token}"})


def test_default_cache_ram_serves_one_namespace(run_proxy: ProxyRunner) -> None:
    with run_proxy() as url:
        first = ask(url, "tenant-a")
        guess = ask(url, "tenant-b")
        health = httpx.get(f"{url}/healthz", timeout=30).json()
    assert first.status_code == 200, first.text
    assert guess.status_code == 403
    assert guess.json()["error"]["code"] == "shared_prompt_cache"
    reason = health["upstreams"][0]["shared_cache"]
    assert "--cache-ram not on the command line of process" in reason, reason


def test_cache_ram_0_serves_every_namespace() -> None:
    with run_llama_server("smollm2", slots=2, ctx_per_slot=2048,
                          extra=["--cache-ram", "0"]) as llama:
        config = Settings(upstream=llama.url)
        with serve_proxy(create_apps(config)) as url:
            answers = [ask(url, token) for token in ("tenant-a", "tenant-b", "tenant-a")]
            health = httpx.get(f"{url}/healthz", timeout=30).json()
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    assert health["upstreams"][0]["shared_cache"] is None
