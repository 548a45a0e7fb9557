"""The fake's responses have the recorded fixtures' shapes: per chunk kind the same keys,
value types and constants, the same sequence of chunk kinds, status, content type and framing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.fakes.fake_ollama import NEW_VERSION, OLD_VERSION, Fault, fake_ollama_state

from .conftest import MakeClient, make_config
from .wire import (
    all_fixture_names,
    compress,
    fixture_units,
    kinds,
    load_fixture,
    parse_body,
    shapes_by_kind,
)

USER = [{"role": "user", "content": "Say hello."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
USAGE = {"stream_options": {"include_usage": True}}


@dataclass(frozen=True)
class Scenario:
    method: str
    path: str
    body: dict[str, Any] | None = None
    version: str = NEW_VERSION
    fault: Fault | None = None
    before: tuple[tuple[str, str, dict[str, Any] | None], ...] = field(default=())


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-smol", "messages": USER} | extra


def generate(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-smol", "prompt": "Why is the sky blue?"} | extra


def v1_chat(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-smol", "messages": USER} | extra


SCENARIOS: dict[str, Scenario] = {
    "native/chat_stream_new": Scenario("POST", "/api/chat", chat()),
    "native/chat_stream_old": Scenario("POST", "/api/chat", chat(), OLD_VERSION),
    "native/chat_stream_tools_new": Scenario("POST", "/api/chat", chat(tools=TOOLS)),
    "native/chat_stream_tools_old": Scenario("POST", "/api/chat", chat(tools=TOOLS), OLD_VERSION),
    "native/chat_nonstream_tools_new": Scenario("POST", "/api/chat",
                                                chat(tools=TOOLS, stream=False)),
    "native/chat_stream_thinking_new": Scenario("POST", "/api/chat",
                                                {"model": "fake-think", "messages": USER}),
    "native/chat_nonstream_new": Scenario("POST", "/api/chat", chat(stream=False, format="json")),
    "native/chat_nonstream_old": Scenario("POST", "/api/chat", chat(stream=False, format="json"),
                                          OLD_VERSION),
    "native/error_model_not_found": Scenario("POST", "/api/chat",
                                             {"model": "no-such-model:latest", "messages": USER}),
    "native/error_midstream": Scenario("POST", "/api/generate", generate(),
                                       fault=Fault("error_mid_stream", after_chunks=4)),
    "native/error_before_first_chunk": Scenario(
        "POST", "/api/chat", chat(), fault=Fault("error_before_headers", status=500)),
    "native/chat_load": Scenario("POST", "/api/chat", {"model": "fake-smol", "messages": []}),
    "native/chat_unload": Scenario("POST", "/api/chat",
                                   {"model": "fake-smol", "messages": [], "keep_alive": 0}),
    "native/generate_stream_old": Scenario("POST", "/api/generate", generate(), OLD_VERSION),
    "native/generate_stream_new": Scenario("POST", "/api/generate", generate()),
    "native/generate_nonstream_old": Scenario("POST", "/api/generate", generate(stream=False),
                                              OLD_VERSION),
    "native/generate_nonstream_new": Scenario("POST", "/api/generate", generate(stream=False)),
    "meta/version": Scenario("GET", "/api/version"),
    "meta/root": Scenario("GET", "/"),
    "meta/tags": Scenario("GET", "/api/tags"),
    "meta/ps": Scenario("GET", "/api/ps",
                        before=(("POST", "/api/chat", {"model": "fake-smol", "messages": []}),)),
    "meta/show": Scenario("POST", "/api/show", {"model": "fake-smol"}),
    "meta/show_not_found": Scenario("POST", "/api/show", {"model": "no-such-model"}),
    "openai/chat_stream_old": Scenario("POST", "/v1/chat/completions",
                                       v1_chat(stream=True, **USAGE), OLD_VERSION),
    "openai/chat_stream_new": Scenario("POST", "/v1/chat/completions",
                                       v1_chat(stream=True, **USAGE)),
    "openai/chat_stream_no_usage": Scenario("POST", "/v1/chat/completions", v1_chat(stream=True)),
    "openai/chat_stream_tools": Scenario("POST", "/v1/chat/completions",
                                         v1_chat(stream=True, tools=TOOLS)),
    "openai/chat_stream_reasoning": Scenario(
        "POST", "/v1/chat/completions", {"model": "fake-think", "messages": USER, "stream": True}),
    "openai/chat_nonstream_old": Scenario("POST", "/v1/chat/completions", v1_chat(), OLD_VERSION),
    "openai/chat_nonstream_new": Scenario("POST", "/v1/chat/completions", v1_chat()),
    "openai/completions_stream_old": Scenario(
        "POST", "/v1/completions", generate(stream=True, **USAGE), OLD_VERSION),
    "openai/completions_stream_new": Scenario("POST", "/v1/completions",
                                              generate(stream=True, **USAGE)),
    "openai/completions_nonstream_old": Scenario("POST", "/v1/completions", generate(),
                                                 OLD_VERSION),
    "openai/completions_nonstream_new": Scenario("POST", "/v1/completions", generate()),
    "openai/models": Scenario("GET", "/v1/models"),
    "openai/error_not_found": Scenario("POST", "/v1/chat/completions",
                                       {"model": "no-such-model", "messages": USER,
                                        "stream": True}),
    "openai/error_bad_request": Scenario("POST", "/v1/chat/completions",
                                         {"model": "fake-smol", "messages": []}),
    "openai/error_midstream": Scenario("POST", "/v1/chat/completions",
                                       v1_chat(stream=True, **USAGE),
                                       fault=Fault("error_mid_stream", after_chunks=2)),
}


def test_every_fixture_has_a_scenario() -> None:
    assert sorted(SCENARIOS) == all_fixture_names()


def test_every_fixture_cites_its_source() -> None:
    for name in all_fixture_names():
        source = load_fixture(name)["source"]
        assert source["basis"] in {"recorded", "code", "doc", "derived"}, name
        assert source["refs"], name
        for ref in source["refs"]:
            assert "url" in ref or {"repo", "path", "commit"} <= ref.keys(), (name, ref)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_fixture_is_self_consistent(name: str) -> None:
    """A recorded raw body parses to the fixture's units, and each kind has one shape."""
    fixture = load_fixture(name)
    response = fixture["response"]
    if "raw" in response:
        parsed = parse_body(response["framing"], response["raw"].encode())
        assert parsed.units == fixture_units(response)
    units = fixture_units(response)
    for kind, shapes in shapes_by_kind(kinds(fixture, units), units).items():
        assert all(s == shapes[0] for s in shapes), (name, kind)


async def send(client: httpx.AsyncClient, method: str, path: str,
               body: dict[str, Any] | None) -> httpx.Response:
    return await client.request(method, path, json=body) if body is not None else \
        await client.request(method, path)


@pytest.mark.anyio
@pytest.mark.parametrize("name", sorted(SCENARIOS))
async def test_fake_matches_fixture(name: str, make_client: MakeClient) -> None:
    fixture, scenario = load_fixture(name), SCENARIOS[name]
    app, client = await make_client(make_config(version=scenario.version))
    if scenario.fault is not None:
        fake_ollama_state(app).inject(scenario.fault)
    for method, path, body in scenario.before:
        (await send(client, method, path, body)).raise_for_status()

    response = await send(client, scenario.method, scenario.path, scenario.body)

    expected = fixture["response"]
    assert response.status_code == expected["status"]
    assert response.headers["content-type"] == expected["content_type"]
    got = parse_body(expected["framing"], response.content)
    want_units = fixture_units(expected)
    if expected["framing"] == "text":
        assert got.units == want_units
    got_kinds, want_kinds = kinds(fixture, got.units), kinds(fixture, want_units)
    assert compress(got_kinds) == compress(want_kinds)
    want_shapes = shapes_by_kind(want_kinds, want_units)
    for kind, shapes in shapes_by_kind(got_kinds, got.units).items():
        for got_shape in shapes:
            assert got_shape == want_shapes[kind][0], kind
