"""A real llama-server's token events are of one shape (``SameShapeTokens``): the bytes
around each token's text are the same from one token to the next, so the proxy classifies
them without parsing them whole, and gets the frames it got by parsing them."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from prefixpin.adapters.openai_sse import classify_whole
from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.listen.http_limits import compiled_relay_of, http_options
from prefixpin.proxy.settings import Settings
from tests.fakes.servers import serve_proxy
from tests.rig.llama_process import LlamaServerProcess
from tests.rig.parts import require_compiled_relay
from tests.unit.test_same_shape_tokens import counted_frames


def stream_events(llama: LlamaServerProcess, body: dict[str, Any]) -> list[bytes]:
    """The engine's SSE events, each as the one read it would be (``data: ...\\n\\n``)."""
    response = httpx.post(f"{llama.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return [event + b"\n\n" for event in response.content.split(b"\n\n") if event]


@pytest.mark.parametrize("extra", [
    {"reasoning_format": "none"},
    {"return_progress": True, "stream_options": {"include_usage": True}},
])
def test_a_real_streams_tokens_take_the_shortcut_to_the_same_frames(
        llama: LlamaServerProcess, monkeypatch: pytest.MonkeyPatch,
        extra: dict[str, Any]) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me about the sea."}],
            "stream": True, "max_tokens": 40, "temperature": 0, **extra}
    reads = stream_events(llama, body)
    tokens = sum(1 for read in reads
                 if (frame := classify_whole(read)) is not None and frame.delta_text)
    assert tokens >= 30, reads[:5]  # a stream of plain token events to read
    counted = counted_frames(reads, monkeypatch)  # each read's frame: classify_whole's
    # Two tokens parsed to learn the shape, again for each second "created" moved on;
    # the role, progress, finish and usage events parsed; every other token not.
    assert counted.parsed <= len(reads) - tokens + 2 + 2 * 3, (counted.parsed, len(reads),
                                                                tokens)


@pytest.mark.parametrize("usage", [False, True])
def test_the_compiled_relay_writes_a_real_stream_as_the_python_relay_does(
        llama: LlamaServerProcess, usage: bool) -> None:
    """The served proxy with the compiled relay (``core.compiled_relay``) in front of the
    real llama-server: the same greedy stream as through the Python relay, event for
    event (ids and times aside), most of its tokens written by the relay."""
    require_compiled_relay()
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "stream": True, "max_tokens": 60, "temperature": 0,
        **({"stream_options": {"include_usage": True}} if usage else {})}
    answers = {}
    for compiled in (False, True):
        options = http_options(compiled_relay=compiled)
        with serve_proxy(create_apps(Settings(upstream=llama.url)), **options) as url:
            response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            relay = compiled_relay_of(options["http"])
            relayed = 0 if relay is None else relay.relayed
        answers[compiled] = [_comparable(block) for block in response.text.split("\n\n")
                             if block.startswith("data: ")]
        if compiled:
            assert relayed >= 30, relayed
        else:
            assert relayed == 0
    assert answers[True] == answers[False]
    assert answers[True][-1] == "[DONE]"


def _comparable(block: str) -> Any:
    """An event's payload without what differs between two runs of one greedy request."""
    if block == "data: [DONE]":
        return "[DONE]"
    payload = json.loads(block[6:])
    return {k: v for k, v in payload.items()
            if k not in ("id", "created", "timings", "usage", "system_fingerprint")}
