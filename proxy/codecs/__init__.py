"""Client wire formats: one codec per format, registered once.

A *codec* is everything the proxy does differently for one API a client speaks, and
nothing else (``proxy.codecs.base.Codec``):

- ``parse``: the body as a ``ClientRequest``, or the ``ClientError`` naming the field;
- the streamed answer: ``media_type``, ``headers``, ``opening`` (the first bytes, sent
  with the headers), ``stream`` (the per-client encoder of the engine's frames, with
  ``flush`` for what it held back, and ``heartbeat``, the keep-alive after silence where
  that client's stream is: an SSE comment, an NDJSON leading space, Anthropic's ``ping``
  once ``message_start`` went out) and ``late_error`` (the error after the headers);
- ``whole``: the one body of a ``stream: false`` client, usage filled in;
- ``error_response``: the error before any byte, in this format's shape;
- where usage and cached tokens live, and their filling from the engine's figures (inside
  ``stream`` and ``whole``);
- ``reply``: the assistant message of a finished generation (the turn the planner commits).

What is the same for every format is not a codec's: the pacing loop (frames batched as they
come, a heartbeat after ``--heartbeat`` s of silence), the first-byte budget (an engine
error within 60% of ``--first-byte`` keeps its status: ``codec.error_response``; after that
the headers and ``codec.opening`` go out), the wait of a non-streamed client (499 when it
leaves), figures, metrics, join in flight. That is ``proxy.pipeline.relay.respond``, which looks the
codec up with ``codec_of(client)`` and never asks which API it is.

Registered today:

    name                api        engine_api  endpoint     routes
    chat                openai     openai      chat         /v1/chat/completions, /chat/completions
    completions         openai     openai      completions  /v1/completions
    ollama-chat         ollama     ollama      chat         /api/chat
    ollama-completions  ollama     ollama      completions  /api/generate
    anthropic           anthropic  openai      chat         /v1/messages
    responses           responses  openai      chat         /v1/responses
    llama-completions   llama      llama       completions  /completion, /completions
    llama-infill        llama      llama       infill       /infill

``engine_api`` is the API the engine is asked in. The Anthropic and Responses codecs
convert their bodies to a chat body in ``parse`` (as llama-server converts them itself) and
translate the engine's chat stream back, so any lane that serves chat serves them
(``docs/design.md``, section 5, has the rules each conversion keeps).

Adding an API is adding a codec, not a branch:

1. Name the format in ``proxy.pipeline.validation.Api`` and give the codec its ``engine_api``; a
   conversation keeps ``endpoint`` "chat" (what the planner, repair and the metrics key on).
2. Write ``proxy/codecs/<format>.py`` with a class that has every member of ``Codec``
   (mypy checks it at ``register``). ``parse`` reuses ``proxy.pipeline.validation``'s checks; the
   ``ClientRequest`` it returns carries ``api``, its ``body`` is what the planner forwards
   (a chat body for a converted format, the client's own kept in ``source``). ``stream``
   returns the per-client encoder; ``encode`` is the hot path (once per batch): no work
   per frame beyond choosing or rewriting it, constants built at import.
3. ``register(YourCodec(...))`` below, with its routes; ``register`` refuses a second
   codec with the same name, the same ``(api, endpoint)`` or a route already taken.
4. Its routes are served from the registry (``proxy.listen.app``); add its ``engine_api`` to
   ``serves`` of each engine kind that answers it (``proxy.engine.engines``; with no lane of
   such a kind the route is a 404 ``api_not_served``).
5. ``tests/unit/test_codecs.py`` checks the registry as it is; add the format's own wire
   tests (its clients' SDKs parse its stream, its whole body, its errors).
"""

from __future__ import annotations

from collections.abc import Mapping

from prefixpin.proxy.codecs.anthropic import AnthropicCodec
from prefixpin.proxy.codecs.base import Codec, StreamEncoder
from prefixpin.proxy.codecs.llama_native import LlamaNativeCodec
from prefixpin.proxy.codecs.ollama_ndjson import OllamaCodec
from prefixpin.proxy.codecs.openai_sse import OpenAICodec
from prefixpin.proxy.codecs.responses import ResponsesCodec
from prefixpin.proxy.pipeline.validation import Api, ClientRequest, Endpoint

__all__ = ["Codec", "StreamEncoder", "codec_at", "codec_for", "codec_of", "codecs",
           "register", "routes"]

_CODECS: list[Codec] = []
_BY_WIRE: dict[tuple[Api, Endpoint], Codec] = {}
_BY_ROUTE: dict[str, Codec] = {}


def register(codec: Codec) -> Codec:
    """Add a codec; a second one with the same name, wire or route is refused."""
    if any(known.name == codec.name for known in _CODECS):
        raise ValueError(f"a codec named {codec.name!r} is registered already")
    if (codec.api, codec.endpoint) in _BY_WIRE:
        raise ValueError(f"{_BY_WIRE[codec.api, codec.endpoint]!r} already answers "
                         f"{codec.api} {codec.endpoint}")
    if not codec.routes or len(set(codec.routes)) != len(codec.routes):
        raise ValueError(f"{codec!r} needs its routes, each once")
    for path in codec.routes:
        if path in _BY_ROUTE:
            raise ValueError(f"{path} is {_BY_ROUTE[path]!r}'s route already")
    _CODECS.append(codec)
    _BY_WIRE[codec.api, codec.endpoint] = codec
    _BY_ROUTE.update(dict.fromkeys(codec.routes, codec))
    return codec


OPENAI_CHAT = register(OpenAICodec("chat", ("/v1/chat/completions", "/chat/completions")))
OPENAI_COMPLETIONS = register(OpenAICodec("completions", ("/v1/completions",)))
OLLAMA_CHAT = register(OllamaCodec("chat", ("/api/chat",)))
OLLAMA_GENERATE = register(OllamaCodec("completions", ("/api/generate",)))
# Converted to chat completions on the way in, and their answers from the engine's chat
# stream on the way out: any lane that serves OpenAI chat serves them.
ANTHROPIC_MESSAGES = register(AnthropicCodec())
OPENAI_RESPONSES = register(ResponsesCodec())
# llama-server's native API (bare /completions is its native route, not OpenAI's): only
# llama-server lanes serve it, asked on the client's own path.
LLAMA_COMPLETION = register(LlamaNativeCodec("completions",
                                             ("/completion", "/completions")))
LLAMA_INFILL = register(LlamaNativeCodec("infill", ("/infill",)))


def codecs() -> tuple[Codec, ...]:
    """Every registered codec, in registration order."""
    return tuple(_CODECS)


def routes() -> Mapping[str, Codec]:
    """Every registered client path and its codec."""
    return dict(_BY_ROUTE)


def codec_for(api: Api, endpoint: Endpoint) -> Codec:
    """The codec of a wire format (``KeyError`` for one that is not registered)."""
    return _BY_WIRE[api, endpoint]


def codec_of(client: ClientRequest) -> Codec:
    """The codec a parsed request was read with, and so answers in."""
    return _BY_WIRE[client.api, client.endpoint]


def codec_at(path: str) -> Codec | None:
    """The codec of a registered route; None for a path no codec serves."""
    return _BY_ROUTE.get(path)
