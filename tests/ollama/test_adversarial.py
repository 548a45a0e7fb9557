"""Tenant B attacks tenant A on an Ollama lane, through the tenant listener (issue 16).

Ollama cannot be installed on these machines: the engine here is the fake
(``tests.fakes.fake_ollama``), which replays Ollama's wire formats as recorded from its
documentation, source and third-party recordings. What is tested is the proxy's side:
which paths a tenant reaches, and that every Ollama (whose cached prefixes are shared by
all requests) serves one namespace unless the operator opts in with
``--allow-shared-cache`` (documented in ``proxy.listen.isolation``: tenants may then learn each
other's cached prefixes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .conftest import MODEL, proxy_rig

pytestmark = pytest.mark.anyio

A = {"authorization": "Bearer tenant-a-secret-token", "x-session-id": "a-desk"}
B = {"authorization": "Bearer tenant-b-other-token"}


def tenants(tmp_path: Path, *, dedicated: bool) -> dict[str, Any]:
    """Tenants a and b configured (their keys A's and B's); ``dedicated``: the Ollama lane
    is tenant a's."""
    path = tmp_path / "tenants.toml"
    path.write_text('[tenants]\na = "tenant-a-secret-token"\nb = "tenant-b-other-token"\n')
    return {"tenants_file": path,
            **({"upstream_namespaces": {"http://fake-ollama": ["a"]}} if dedicated else {})}
SECRET = "You are tenant A's assistant. Confidential: " + "the vault code is 4711. " * 30
CHAT = {"model": MODEL, "stream": False,
        "messages": [{"role": "system", "content": SECRET},
                     {"role": "user", "content": "hello"}]}

# Ollama's model management and everything else not read-only: operator paths.
ATTACKS = [
    ("DELETE", "/api/delete", {"model": MODEL}),
    ("DELETE", "/api/delete", {"name": MODEL}),
    ("POST", "/api/pull", {"model": MODEL, "stream": False}),
    ("POST", "/api/pull", {"model": "evil/model", "insecure": True}),
    ("POST", "/api/create", {"model": MODEL, "from": MODEL, "system": "leak everything"}),
    ("POST", "/api/copy", {"source": MODEL, "destination": "stolen"}),
    ("POST", "/api/push", {"model": MODEL}),
    ("POST", "/api/blobs/sha256:0000", None),
    ("HEAD", "/api/blobs/sha256:0000", None),
    ("POST", "/api/embed", {"model": MODEL, "input": SECRET}),
    ("POST", "/api/embeddings", {"model": MODEL, "prompt": SECRET}),
    ("GET", "/api/tags/../../api/delete", None),
    ("GET", "/", None), ("GET", "/sessions", None), ("GET", "/metrics", None),
]


@pytest.mark.parametrize(("method", "path", "body"), ATTACKS)
async def test_model_management_is_refused_in_ollamas_shape(
        method: str, path: str, body: object) -> None:
    async with proxy_rig(recorder=True) as rig:
        first = await rig.client.post("/api/chat", headers=A, json=CHAT)
        assert first.status_code == 200, first.text
        assert rig.recorder is not None
        forwarded = len(rig.recorder.bodies)
        response = await rig.client.request(method, path, headers=B, json=body)
        assert response.status_code in (400, 403), response.text
        if response.status_code == 403 and method != "HEAD":
            error = response.json()["error"]
            if path.startswith("/api/"):
                assert isinstance(error, str), error  # Ollama's shape: {"error": "..."}
                assert "--admin-listen" in error
            else:
                assert error["code"] == "operator_only"
        assert len(rig.recorder.bodies) == forwarded  # nothing reached the engine
        tags = (await rig.admin.get("/api/tags")).json()  # A's model is still there
        assert any(m["name"].startswith(MODEL) for m in tags["models"]), tags
        again = await rig.client.post("/api/chat", headers=A, json=CHAT)
        assert again.status_code == 200, again.text


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate", "/v1/chat/completions",
                                  "/v1/completions"])
async def test_a_second_namespace_is_refused_on_the_ollama_lane(path: str,
                                                              tmp_path: Path) -> None:
    """Every Ollama shares cached prefixes across requests: with the lane dedicated to
    tenant a, B, guessing A's system prompt exactly, is refused before anything reaches
    the engine, on every API."""
    body: dict[str, object] = dict(CHAT)
    if path in ("/api/generate", "/v1/completions"):
        body = {"model": MODEL, "stream": False, "prompt": SECRET, "system": SECRET}
    async with proxy_rig(recorder=True, **tenants(tmp_path, dedicated=True)) as rig:
        first = await rig.client.post("/api/chat", headers=A, json=CHAT)
        assert first.status_code == 200, first.text
        assert rig.recorder is not None
        forwarded = len(rig.recorder.bodies)
        guess = await rig.client.post(path, headers=B, json={
            **body, "keep_alive": -1, "options": {"num_ctx": 8192}})
        health = (await rig.admin.get("/healthz")).json()
        assert len(rig.recorder.bodies) == forwarded
    assert guess.status_code == 403, guess.text
    error = guess.json()["error"]
    if path.startswith("/api/"):
        assert isinstance(error, str)
        assert "dedicated to other namespaces" in error
    else:
        assert error["code"] == "namespace_not_served"
    assert "Ollama" in health["upstreams"][0]["shared_cache"]
    assert health["upstreams"][0]["namespaces"] == ["a"]


async def test_a_retry_from_another_namespace_is_refused_too(tmp_path: Path) -> None:
    """x-stainless-retry-count and A's Idempotency-Key do not make B's request A's."""
    async with proxy_rig(**tenants(tmp_path, dedicated=True)) as rig:
        first = await rig.client.post("/api/chat", headers=A, json=CHAT)
        assert first.status_code == 200, first.text
        guess = await rig.client.post("/api/chat", json=CHAT, headers={
            **B, "x-session-id": "a-desk", "x-stainless-retry-count": "1",
            "idempotency-key": "a-1"})
    assert guess.status_code == 403, guess.text


async def test_allow_shared_cache_is_the_documented_opt_in(tmp_path: Path) -> None:
    """With --allow-shared-cache the operator accepts that tenants may learn each other's
    cached prefixes: B is served (its own generation), and the lane says it is shared."""
    async with proxy_rig(recorder=True, allow_shared_cache=True,
                         **tenants(tmp_path, dedicated=False)) as rig:
        first = await rig.client.post("/api/chat", headers=A, json=CHAT)
        assert rig.recorder is not None
        forwarded = len(rig.recorder.bodies)
        guess = await rig.client.post("/api/chat", headers=B, json=CHAT)
        health = (await rig.admin.get("/healthz")).json()
        assert len(rig.recorder.bodies) == forwarded + 1  # B's own request to the engine
        # The tenant port is still the tenant port: the opt-in opens no operator path.
        delete = await rig.client.request("DELETE", "/api/delete", headers=B,
                                          json={"model": MODEL})
    assert first.status_code == 200, first.text
    assert guess.status_code == 200, guess.text
    assert health["upstreams"][0]["shared_cache"]
    assert health["upstreams"][0]["gated"] is False
    assert delete.status_code == 403


async def test_a_tenants_key_never_reaches_ollama_on_a_model_load_or_unload(
        tmp_path: Path) -> None:
    """Configured tenants: a model unload from tenant a (the lane is a's) goes to Ollama
    without a's key, as a chat does."""
    async with proxy_rig(recorder=True, **tenants(tmp_path, dedicated=True)) as rig:
        unload = await rig.client.post("/api/generate", headers=A,
                                       json={"model": MODEL, "keep_alive": 0})
        chat = await rig.client.post("/api/chat", headers=A, json=CHAT)
        assert rig.recorder is not None
        sent = rig.recorder.credentials
    assert unload.status_code == chat.status_code == 200, (unload.text, chat.text)
    assert sent
    assert all("tenant-a-secret-token" not in str(c) for c in sent), sent
