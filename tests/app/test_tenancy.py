"""Tenant isolation at the listeners (issue 16): the tenant port serves the pipeline, the
health check and read-only engine paths; every other engine path, and the operator views,
only on the operator listener, behind --admin-token when one is set."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from prefixpin.proxy.listen.server import serve
from prefixpin.proxy.settings import Settings
from tests.app.conftest import running_proxy
from tests.app.test_parking import metric

pytestmark = pytest.mark.anyio

OPERATOR = "127.0.0.1:8089"  # the default: loopback, --port + 1
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}

REFUSED = [
    ("POST", "/slots/0?action=erase"), ("POST", "/slots/0?action=save"),
    ("POST", "/slots/0?action=restore"), ("GET", "/slots"),
    ("GET", "/metrics"), ("GET", "/sessions"), ("GET", "/"),
    ("GET", "/_prefixpin/status.js"), ("POST", "/props"), ("GET", "/no-such-endpoint"),
    ("POST", "/v1/embeddings"), ("DELETE", "/v1/models"),
]
ALLOWED = [
    ("GET", "/v1/models", None), ("GET", "/models", None), ("GET", "/health", None),
    ("GET", "/props", None), ("POST", "/tokenize", {"content": "hello"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("POST", "/apply-template", {"messages": [{"role": "user", "content": "hi"}]}),
]


@pytest.mark.parametrize(("method", "path"), REFUSED)
async def test_what_is_not_a_tenants_is_refused_naming_the_operator_port(
        method: str, path: str) -> None:
    async with running_proxy() as (client, engine):
        before = len(engine.requests)
        response = await client.request(method, path, json={"id_slot": 0, "prompt": "x"})
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["type"] == "permission_error"
    assert error["code"] == "operator_only"
    assert f"operator port {OPERATOR} (--admin-listen)" in error["message"]
    assert len(engine.requests) == before  # nothing reached the engine


async def test_the_operator_address_given_is_the_one_named() -> None:
    async with running_proxy(admin_listen="[::1]:9999") as (client, _):
        response = await client.get("/slots")
    assert "operator port [::1]:9999 (--admin-listen)" in response.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/completion", "/completions", "/infill"])
async def test_llama_servers_native_routes_are_the_pipelines(path: str) -> None:
    """llama-server's native /completion, /completions and /infill are pipeline routes now
    (the proxy's slot and cache controls; tests/unit/test_llama_native.py): not refused."""
    async with running_proxy() as (client, _):
        response = await client.post(path, json={"id_slot": 0, "prompt": "x",
                                                 "input_prefix": "", "input_suffix": ""})
    assert response.status_code != 403, response.text
    assert "operator_only" not in response.text


@pytest.mark.parametrize(("method", "path", "body"), ALLOWED)
async def test_read_only_engine_paths_pass_on_the_tenant_port(
        method: str, path: str, body: object) -> None:
    async with running_proxy() as (client, _):
        response = await client.request(method, path, json=body)
    assert response.status_code != 403, response.text
    assert response.status_code < 500, response.text


async def test_the_operator_listener_serves_views_and_every_engine_path() -> None:
    async with running_proxy() as (client, engine):
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert (await client.get("/healthz")).status_code == 200  # stays a tenant's
        admin = client.admin
        assert (await admin.get("/healthz")).status_code == 200
        assert "prefixpin_requests_total" in (await admin.get("/metrics")).text
        assert "namespaces" in (await admin.get("/sessions")).json()
        assert (await admin.get("/")).status_code == 200
        slots = await admin.get("/slots")
        assert [s["id"] for s in slots.json()] == list(range(engine.config.n_slots))


async def test_the_operator_token_is_enforced() -> None:
    async with running_proxy(admin_token="s3cret") as (client, _):
        admin = client.admin
        for path in ("/sessions", "/metrics", "/slots", "/", "/healthz"):
            missing = await admin.get(path)
            assert missing.status_code == 401, path
            assert missing.json()["error"]["type"] == "authentication_error"
            wrong = await admin.get(path, headers={"authorization": "Bearer s3cre"})
            assert wrong.status_code == 401, path
            given = await admin.get(path, headers={"authorization": "Bearer s3cret"})
            assert given.status_code == 200, path
        # The tenant port needs no operator token, and an operator token opens nothing there.
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/sessions", headers={
            "authorization": "Bearer s3cret"})).status_code == 403


def test_an_operator_listener_beyond_loopback_needs_a_token(
        capsys: pytest.CaptureFixture[str]) -> None:
    for listen in ("0.0.0.0:8089", "192.0.2.1:8089", "operator.example:8089"):
        assert serve(Settings(upstream="http://127.0.0.1:9", admin_listen=listen)) == 2
        line = capsys.readouterr().err.strip()
        assert "\n" not in line, line
        assert "--admin-token" in line, line
    assert Settings(admin_listen="0.0.0.0:8089", admin_token="t").admin_problem() is None
    assert Settings(admin_listen="[::1]:8089").admin_problem() is None
    assert Settings(admin_listen="localhost:8089").admin_problem() is None
    assert Settings(port=9000).admin_address() == ("127.0.0.1", 9001)
    with pytest.raises(ValueError, match="HOST:PORT"):
        Settings(admin_listen="8089")


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", CHAT),
                                           ("/v1/completions", {"prompt": "hi"})])
async def test_slot_and_cache_controls_never_reach_the_engine(
        path: str, body: dict[str, object]) -> None:
    """A tenant's id_slot, n_cmpl and cache_prompt are dropped: the proxy pins the slot."""
    async with running_proxy(affinity=False) as (client, engine):
        response = await client.post(path, json={**body, "id_slot": 1, "n_cmpl": 2,
                                                 "cache_prompt": True})
        assert response.status_code == 200, response.text
    forwarded = engine.requests[-1]
    assert not {"id_slot", "n_cmpl", "cache_prompt"} & set(forwarded)


async def test_slot_controls_are_dropped_when_pinned_too() -> None:
    async with running_proxy() as (client, engine):
        for _ in range(2):
            response = await client.post("/v1/chat/completions", headers={"x-session-id": "a"},
                                         json={**CHAT, "id_slot": 1, "cache_prompt": True})
            assert response.status_code == 200, response.text
    assert engine.requests[0]["id_slot"] == engine.requests[1]["id_slot"]
    assert "cache_prompt" not in engine.requests[1]


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_pass_through_body_over_max_body_is_a_413_and_never_sent(
        chunked: bool) -> None:
    """The tenant port's pass-through POSTs (tokenizer, template) take --max-body too,
    declared or streamed in chunks."""
    body = b'{"content": "' + b"x" * 4096 + b'"}'

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 512):
            yield body[start:start + 512]

    async with running_proxy(max_body_bytes=2048) as (client, engine):
        before = len(engine.requests)
        response = await client.post("/tokenize", content=chunks() if chunked else body,
                                     headers={"content-type": "application/json"})
        small = await client.post("/tokenize", json={"content": "hi"})
        counted = await metric(client, "prefixpin_limit_refusals_total", limit="body_size")
    assert counted == 1
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "payload_too_large"
    assert small.status_code == 200
    assert len(engine.requests) == before
