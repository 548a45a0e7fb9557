"""The codec registry: each wire format is one codec, registered once, and every route the
proxy answers in a format maps to exactly one codec."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from prefixpin.core.errors import BadRequestError, UpstreamStatusError
from prefixpin.proxy.codecs import Codec, codec_at, codec_for, codec_of, codecs, register, routes

# The smallest body each format accepts, by (api, endpoint).
MINIMAL: dict[tuple[str, str], dict[str, Any]] = {
    ("openai", "chat"): {"messages": [{"role": "user", "content": "hi"}]},
    ("openai", "completions"): {"prompt": "hi"},
    ("ollama", "chat"): {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    ("ollama", "completions"): {"model": "m", "prompt": "hi"},
    ("anthropic", "chat"): {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    ("responses", "chat"): {"input": "hi"},
    ("llama", "completions"): {"prompt": "hi"},
    ("llama", "infill"): {"input_prefix": "", "input_suffix": ""},
}


def test_each_codec_is_registered_once() -> None:
    """No codec twice, no two codecs with one name or one wire format, and the eight wire
    formats the proxy speaks (OpenAI chat and completions, Ollama chat and generate,
    Anthropic Messages, OpenAI Responses, llama-server native completion and infill) are
    all there."""
    registered = codecs()
    assert len({id(c) for c in registered}) == len(registered)
    assert len({c.name for c in registered}) == len(registered)
    assert len({(c.api, c.endpoint) for c in registered}) == len(registered)
    assert {(c.api, c.endpoint) for c in registered} == set(MINIMAL)
    for codec in registered:
        assert codec_for(codec.api, codec.endpoint) is codec


def test_every_route_maps_to_one_codec() -> None:
    """The route table is exactly the codecs' routes, each path claimed by one codec."""
    table = routes()
    claimed = [path for codec in codecs() for path in codec.routes]
    assert len(claimed) == len(set(claimed))
    assert set(table) == set(claimed)
    for path, codec in table.items():
        assert path in codec.routes
        assert codec_at(path) is codec
        assert sum(path in other.routes for other in codecs()) == 1
    assert codec_at("/v1/models") is None


def test_a_codec_parses_into_requests_it_answers() -> None:
    """What a codec parses is looked up as that codec again (the answer speaks the format
    the request came in); a refused body is its ClientError."""
    for codec in codecs():
        body = json.dumps(MINIMAL[codec.api, codec.endpoint]).encode()
        client = codec.parse(body, codec.routes[0], max_messages=10)
        assert codec_of(client) is codec
        with pytest.raises(BadRequestError):
            codec.parse(b"[]", codec.routes[0], max_messages=10)


@pytest.mark.parametrize("change", [{"routes": ("/elsewhere",)},  # the same name and wire
                                    {"name": "other", "routes": ("/elsewhere",)},  # wire
                                    {"name": "other", "api": "other"},  # a route taken
                                    {"name": "other", "api": "other", "routes": ()}])
def test_a_second_registration_is_refused(change: dict[str, Any]) -> None:
    before = (codecs(), routes())
    twin: Codec = copy.copy(codec_for("openai", "chat"))
    for name, value in change.items():
        setattr(twin, name, value)
    with pytest.raises(ValueError, match=r"already|routes"):
        register(twin)
    assert (codecs(), routes()) == before


def test_keepalives_and_errors_are_each_formats_own() -> None:
    """SSE: a comment to open and to keep alive, ``{"error": {...}}``; NDJSON: a space
    before the next line, ``{"error": "..."}``; an engine's JSON error body as it came."""
    sse, ndjson = codec_for("openai", "chat"), codec_for("ollama", "chat")
    assert sse.opening == b": prefixpin\n\n"
    assert sse.heartbeat("prefill 1/2 cached 0") == b": prefill 1/2 cached 0\n\n"
    assert ndjson.opening == ndjson.heartbeat("anything") == b" "
    assert sse.media_type == "text/event-stream"
    assert ndjson.media_type == "application/x-ndjson"
    refused = BadRequestError("'messages' is required", param="messages")
    assert json.loads(bytes(sse.error_response(refused).body)) == {"error": {
        "message": "'messages' is required", "type": "invalid_request_error",
        "param": "messages", "code": None}}
    assert json.loads(bytes(ndjson.error_response(refused).body)) == {
        "error": "'messages' is required"}
    assert ndjson.error_response(refused).status_code == 400
    assert sse.late_error(refused).startswith(b'data: {"error":{')
    assert ndjson.late_error(refused) == b'{"error":"\'messages\' is required"}\n'
    engine = UpstreamStatusError(404, b'{"error":"model \\"x\\" not found"}', "application/json")
    assert ndjson.error_response(engine).body == engine.raw_body
    assert ndjson.error_response(engine).status_code == 404
