"""Tenants and the shared-prompt-cache gate (``proxy.listen.tenants``,
``proxy.listen.isolation``) in
front of real llama-servers: with no tenants configured, one person's clients, whatever
keys they send, are all served at llama-server's default flags; with several tenants, its
default --cache-ram (read from the server's command line, /proc) serves none of them
unless the backend is dedicated; with --cache-ram 0 every tenant is served."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.settings import Settings
from tests.e2e.conftest import ProxyRunner
from tests.fakes.servers import serve_proxy
from tests.rig.llama_process import LlamaServerProcess, run_llama_server

pytestmark = pytest.mark.llama

SYSTEM = "You are the assistant of tenant A. " + "Its private instructions follow. " * 12


def ask(url: str, token: str) -> httpx.Response:
    body: dict[str, Any] = {"model": "m", "max_tokens": 2, "temperature": 0,
                            "messages": [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": f"hello from {token}"}]}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {token}"})


def test_one_user_is_served_whatever_keys_at_default_flags(run_proxy: ProxyRunner) -> None:
    with run_proxy() as url:
        answers = [ask(url, token) for token in ("opencode-dummy", "sk-ant-dummy", "x")]
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]


def test_default_cache_ram_serves_no_tenant_of_several_unless_dedicated(
        run_proxy: ProxyRunner, llama: LlamaServerProcess,
        tenant_file: Callable[..., Path]) -> None:
    tenants = tenant_file("tenant-a", "tenant-b")
    with run_proxy(tenants_file=tenants) as url:
        first = ask(url, "tenant-a")
        unknown = ask(url, "tenant-c")
        health = httpx.get(f"{url}/healthz", timeout=30).json()
    with run_proxy(tenants_file=tenants,
                   upstream_namespaces={llama.url: ["tenant-a"]}) as url:
        dedicated, other = ask(url, "tenant-a"), ask(url, "tenant-b")
    assert first.status_code == 403
    assert first.json()["error"]["code"] == "shared_prompt_cache"
    assert unknown.status_code == 401
    reason = health["upstreams"][0]["shared_cache"]
    assert "--cache-ram not on the command line of process" in reason, reason
    assert dedicated.status_code == 200, dedicated.text
    assert other.status_code == 403
    assert other.json()["error"]["code"] == "namespace_not_served"


def test_cache_ram_0_serves_every_tenant(tenant_file: Callable[..., Path]) -> None:
    with run_llama_server("smollm2", slots=2, ctx_per_slot=2048,
                          extra=["--cache-ram", "0"]) as llama:
        config = Settings(upstream=llama.url, tenants_file=tenant_file("tenant-a", "tenant-b"))
        with serve_proxy(create_apps(config)) as url:
            answers = [ask(url, token) for token in ("tenant-a", "tenant-b", "tenant-a")]
            health = httpx.get(f"{url}/healthz", timeout=30).json()
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    assert health["upstreams"][0]["shared_cache"] is None
