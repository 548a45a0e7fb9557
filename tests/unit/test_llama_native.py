"""llama-server's native completion API (``/completion``, ``/completions``, ``/infill``):
its events as frames, the whole answer folded from them, its cache figures, its bodies,
its planning, and the pipeline end to end in process, against a fake that streams what the
real llama-server streams (recorded from it; ``tests/e2e/test_native_llama.py`` compares
the proxy with the real one)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from prefixpin.adapters.base import FrameKind
from prefixpin.adapters.llama_native import NativeClassifier, classify, is_final, prompt_count
from prefixpin.adapters.llama_server import LlamaServerAdapter
from prefixpin.core.errors import BadRequestError, QueueTimeoutError, UpstreamStatusError
from prefixpin.core.figures import figures_from
from prefixpin.core.frames import Frame, Progress
from prefixpin.core.sse import SSEDecoder
from prefixpin.proxy.codecs import codec_at, codec_for
from prefixpin.proxy.codecs.llama_native import LlamaNativeCodec, fold, nested_values
from prefixpin.proxy.engine.engines import ENGINES
from prefixpin.proxy.pipeline.validation import ClientRequest, Endpoint, parse_llama_request
from prefixpin.proxy.session.affinity import infill_identity, planned_body
from prefixpin.proxy.session.history import Committed, decide
from tests.app.conftest import running_proxy
from tests.fakes.fake_llama import FakeLlamaServer

Json = dict[str, Any]

SETTINGS: Json = {"temperature": 0.0, "n_predict": 3, "stream": True, "n_probs": 0}


def progress_event(total: int, cache: int, processed: int) -> Json:
    return {"index": 0, "content": "", "tokens": [0], "stop": False, "id_slot": -1,
            "tokens_predicted": 0, "tokens_evaluated": total,
            "prompt_progress": {"total": total, "cache": cache, "processed": processed,
                                "time_ms": 1}}


def token_event(text: str, token: int, n: int, *, index: int = 0, evaluated: int = 5,
                probs: list[Json] | None = None) -> Json:
    event: Json = {"index": index, "content": text, "tokens": [token], "stop": False,
                   "id_slot": -1, "tokens_predicted": n, "tokens_evaluated": evaluated}
    if probs is not None:
        event["completion_probabilities"] = probs
    return event


def final_event(*, index: int = 0, evaluated: int = 5, predicted: int = 3, cache_n: int = 4,
                stop_type: str = "limit", stopping_word: str = "", slot: int = 1) -> Json:
    """llama-server's streamed final event: content and tokens empty, ``stream: true``."""
    return {"index": index, "content": "", "tokens": [], "id_slot": slot, "stop": True,
            "model": "m.gguf", "tokens_predicted": predicted, "tokens_evaluated": evaluated,
            "generation_settings": {**SETTINGS, "n_predict": predicted},
            "prompt": "The capital of France is", "has_new_line": False, "truncated": False,
            "stop_type": stop_type, "stopping_word": stopping_word,
            "tokens_cached": evaluated + predicted - 1,
            "timings": {"cache_n": cache_n, "prompt_n": evaluated - cache_n, "prompt_ms": 12.5,
                        "predicted_n": predicted, "predicted_ms": 30.0}}


def sse(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def frames_of(events: Sequence[Any], prompts: int = 1) -> list[Frame]:
    decoder, classifier = SSEDecoder(), NativeClassifier(prompts)
    raw = b"".join(e if isinstance(e, bytes) else sse(e) for e in events)
    return [classifier(event) for event in decoder.feed(raw)]


PARIS = [progress_event(5, 4, 4), progress_event(5, 4, 5), token_event(" Paris", 7042, 1),
         token_event(".", 30, 2), token_event("\n", 198, 3), final_event()]


# ------------------------------------------------------------------ classification

def test_events_classify_as_llama_server_streams_them() -> None:
    """Progress (no text) is PROGRESS, text is a CHUNK with output, the ``"stop": true``
    event ends the stream (DONE: there is no ``[DONE]``), a comment or ``null`` is a PING,
    an error event is ERROR."""
    frames = frames_of([b": ping\n\n", b"data: null\n\n", *PARIS,
                        {"error": {"code": 500, "message": "boom", "type": "server_error"}}])
    kinds = [f.kind for f in frames]
    assert kinds == [FrameKind.PING, FrameKind.PING, FrameKind.PROGRESS, FrameKind.PROGRESS,
                     FrameKind.CHUNK, FrameKind.CHUNK, FrameKind.CHUNK, FrameKind.DONE,
                     FrameKind.ERROR]
    assert frames[2].progress == Progress(total=5, cache=4, processed=4, time_ms=1.0)
    assert [f.has_output for f in frames[4:8]] == [True, True, True, False]
    assert frames[4].raw == sse(PARIS[2])  # the engine's own bytes
    assert is_final(frames[7].data)
    assert not is_final(frames[6].data)


def test_several_prompts_end_with_the_last_final_event() -> None:
    """An array of prompts streams one final event per prompt, interleaved: only the last
    ends the generation; the others are chunks like any event."""
    events = [token_event("a", 1, 1), token_event("b", 2, 1, index=1), final_event(),
              token_event("c", 3, 2, index=1), final_event(index=1)]
    kinds = [f.kind for f in frames_of(events, prompts=2)]
    assert kinds == [FrameKind.CHUNK, FrameKind.CHUNK, FrameKind.CHUNK, FrameKind.CHUNK,
                     FrameKind.DONE]
    assert classify(next(iter(SSEDecoder().feed(sse(final_event()))))).kind is FrameKind.DONE


@pytest.mark.parametrize(("path", "prompt", "count"), [
    ("/completion", "text", 1), ("/completion", [12, 34, "mixed", 56], 1),
    ("/completion", ["one", "two", "three"], 3), ("/completion", [[1, 2], [3]], 2),
    ("/completions", [{"prompt_string": "a"}, "b"], 2), ("/completion", [], 1),
    ("/infill", ["x", "y"], 1), ("/completion", None, 1),
])
def test_the_prompts_counted_are_llama_servers(path: str, prompt: object, count: int) -> None:
    assert prompt_count(path, {"prompt": prompt}) == count


# ------------------------------------------------------------------------- figures

def test_figures_come_from_the_final_event() -> None:
    """The prompt is ``tokens_evaluated``, the cached part ``timings.cache_n`` (never
    ``tokens_cached``: that is the slot's whole length after the answer)."""
    figures = figures_from(frames_of(PARIS), Progress(5, 4, 5, 1.0))
    assert (figures.prompt_tokens, figures.cached_tokens, figures.completion_tokens,
            figures.prompt_ms) == (5, 4, 3, 12.5)
    assert figures.cached_fraction == 0.8


def test_figures_fall_back_on_progress_and_sum_over_prompts() -> None:
    bare = {k: v for k, v in final_event().items() if k not in ("timings", "tokens_evaluated")}
    figures = figures_from(frames_of([progress_event(5, 4, 5), bare]), Progress(5, 4, 5, 1.0))
    assert (figures.prompt_tokens, figures.cached_tokens) == (5, 4)
    two = frames_of([final_event(evaluated=5, cache_n=4),
                     final_event(index=1, evaluated=7, cache_n=0, predicted=2)], prompts=2)
    figures = figures_from(two, None)
    assert (figures.prompt_tokens, figures.cached_tokens, figures.completion_tokens) == (
        12, 4, 5)
    assert figures.prompt_ms == 25.0


def test_a_cached_count_over_the_prompt_is_clamped() -> None:
    lying = final_event(evaluated=5, cache_n=9)
    assert figures_from(frames_of([lying]), None).cached_tokens == 5


# ---------------------------------------------------------------------------- fold

def test_the_whole_answer_is_the_final_event_with_the_streamed_text() -> None:
    """As llama-server answers ``stream: false``: the text, no tokens unless asked for,
    ``generation_settings.stream`` false, every other field of the final event in order."""
    [whole] = fold(frames_of(PARIS), {"prompt": "x"})
    final = final_event()
    assert list(whole) == list(final)
    assert whole["content"] == " Paris.\n"
    assert whole["tokens"] == []
    assert whole["generation_settings"] == {**final["generation_settings"], "stream": False}
    assert {k: v for k, v in whole.items() if k not in (
        "content", "generation_settings")} == {k: v for k, v in final.items() if k not in (
            "content", "generation_settings")}
    [with_tokens] = fold(frames_of(PARIS), {"return_tokens": True})
    assert with_tokens["tokens"] == [7042, 30, 198]  # not the progress events' [0]


def test_probabilities_drop_the_stop_words_tokens() -> None:
    """llama-server drops the stop word's tokens from a whole answer's probabilities: the
    trailing events that carried no text, at least the one that completed the word."""
    def probs(text: str) -> list[Json]:
        return [{"id": 1, "token": text, "bytes": [], "logprob": -0.1, "top_logprobs": []}]

    one = [token_event(" Paris", 1, 1, probs=probs(" Paris")),
           token_event(" ", 2, 2, probs=probs(" ")),
           final_event(stop_type="word", stopping_word="United")]
    [whole] = fold(frames_of(one), {})
    assert whole["content"] == " Paris "
    assert [p["token"] for p in whole["completion_probabilities"]] == [" Paris"]
    assert list(whole)[-1] == "completion_probabilities"  # appended, as llama-server does
    two = [token_event(" Paris", 1, 1, probs=probs(" Paris")),
           token_event("", 2, 2, probs=probs("")), token_event("", 3, 3, probs=probs("")),
           final_event(stop_type="word", stopping_word="The United")]
    [whole] = fold(frames_of(two), {})
    assert [p["token"] for p in whole["completion_probabilities"]] == [" Paris"]
    [plain] = fold(frames_of(PARIS), {})
    assert "completion_probabilities" not in plain


def test_the_n_indent_cut_is_replayed() -> None:
    """llama-server streams a line's text before it finds the line under-indented; its
    whole answer cuts that line before its text (``n_indent``)."""
    parts = ["#", "   x", " = x", " + 1", "\n", "   ", " return"]
    events = [token_event(p, i, i + 1) for i, p in enumerate(parts)]
    events.append(final_event(predicted=len(parts)))
    [cut] = fold(frames_of(events), {"n_indent": 8})
    assert cut["content"] == "#   x = x + 1\n    "
    [kept] = fold(frames_of(events), {"n_indent": 4})  # indented enough: nothing to cut
    assert kept["content"] == "".join(parts)
    [eos] = fold(frames_of([*events[:-1], final_event(stop_type="eos")]), {"n_indent": 8})
    assert eos["content"] == "".join(parts)  # llama-server stopped for another reason


def test_several_prompts_fold_into_one_answer_each_by_index() -> None:
    events = [token_event("b", 2, 1, index=1), token_event("a", 1, 1), final_event(index=1),
              final_event()]
    answers = fold(frames_of(events, prompts=2), {})
    assert [(a["index"], a["content"]) for a in answers] == [(0, "a"), (1, "b")]


def test_nested_values_are_llama_servers() -> None:
    answer = final_event()
    assert nested_values(["content", "timings/prompt_n", "x/y", "content", "", "stop"],
                         answer) == {"content": "", "timings/prompt_n": 1, "stop": True}


# ---------------------------------------------------------------------------- codec

def client_of(body: Json, path: str = "/completion") -> ClientRequest:
    endpoint: Endpoint = "infill" if path == "/infill" else "completions"
    return parse_llama_request(json.dumps(body).encode(), endpoint, path)


def test_the_routes_are_the_native_codecs() -> None:
    completion, infill = codec_for("llama", "completions"), codec_for("llama", "infill")
    assert codec_at("/completion") is codec_at("/completions") is completion
    assert codec_at("/infill") is infill
    assert codec_at("/v1/completions") is codec_for("openai", "completions")
    assert completion.name != infill.name  # another in-flight namespace each
    assert "llama" in ENGINES["llama-server"].serves
    assert "llama" not in ENGINES["embedded"].serves  # llama-cpp-python has no /completion
    assert "llama" not in ENGINES["ollama"].serves


def test_errors_keep_the_engines_body_and_the_proxys_reason() -> None:
    """The engine's JSON error byte for byte (llama-server's ``code`` is the status); the
    proxy's own in core.errors' OpenAI-like shape, its reason as ``code``; after the
    headers, llama-server's ``data: {"error": ...}`` event."""
    codec = LlamaNativeCodec("completions", ("/completion",))
    refused = codec.error_response(BadRequestError("'prompt' is required", param="prompt"))
    assert refused.status_code == 400
    assert json.loads(bytes(refused.body)) == {"error": {
        "message": "'prompt' is required", "type": "invalid_request_error", "param": "prompt",
        "code": None}}
    busy = codec.error_response(QueueTimeoutError("no slot", retry_after_s=3))
    assert busy.status_code == 503
    assert busy.headers["retry-after"] == "3"
    assert json.loads(bytes(busy.body))["error"]["code"] == "queue_timeout"
    own = b'{"error":{"code":501,"message":"Infill is not supported","type":"x"}}'
    engine = codec.error_response(UpstreamStatusError(501, own, "application/json"))
    assert (engine.status_code, bytes(engine.body)) == (501, own)
    late = codec.late_error(BadRequestError("gone"))
    assert late.startswith(b'data: {"error":{"message":"gone"')
    assert late.endswith(b"}}\n\n")
    assert codec.heartbeat("prefill 1/2 cached 0") == b": prefill 1/2 cached 0\n\n"
    assert codec.opening == b": prefixpin\n\n"
    assert codec.reply(frames_of(PARIS)) is None


def test_a_stream_hides_the_progress_it_did_not_ask_for() -> None:
    codec = LlamaNativeCodec("completions", ("/completion",))
    frames = frames_of([b": engine ping\n\n", *PARIS])
    plain = codec.stream(client_of({"prompt": "x", "stream": True}), None,  # type: ignore[arg-type]
                         fill_cached=True).encode(frames)
    assert plain == b"".join(sse(e) for e in PARIS[2:])
    asked = codec.stream(client_of({"prompt": "x", "stream": True, "return_progress": True}),
                         None, fill_cached=True).encode(frames)  # type: ignore[arg-type]
    assert asked == b"".join(sse(e) for e in PARIS)


def test_a_streamed_final_event_keeps_only_the_response_fields() -> None:
    codec = LlamaNativeCodec("completions", ("/completion",))
    client = client_of({"prompt": "x", "stream": True,
                        "response_fields": ["content", "timings/prompt_n", "tokens_cached"]})
    out = codec.stream(client, None, fill_cached=True).encode(  # type: ignore[arg-type]
        frames_of(PARIS))
    *tokens, last = [json.loads(e.removeprefix(b"data: ")) for e in out.split(b"\n\n") if e]
    assert last == {"content": "", "timings/prompt_n": 1, "tokens_cached": 7}
    assert tokens == PARIS[2:5]  # only the final event is cut


# ------------------------------------------------------------------------ requests

def test_a_native_body_is_llama_servers_to_judge() -> None:
    """Only what the proxy reads is checked: ``logit_bias`` as pairs passes, ``stream``
    defaults to false, the engine controls (with ``n``, ``n_cmpl``'s alias) are dropped."""
    client = client_of({"prompt": [[1, 2], "b"], "logit_bias": [[15043, False]], "n": 2,
                        "n_cmpl": 2, "id_slot": 0, "cache_prompt": True})
    assert (client.api, client.endpoint, client.path, client.stream) == (
        "llama", "completions", "/completion", False)
    assert client.body == {"prompt": [[1, 2], "b"], "logit_bias": [[15043, False]]}
    assert client_of({"prompt": {"prompt_string": "x"}, "stream": True}).stream
    for bad in ({}, {"prompt": None}, {"prompt": 3}, {"prompt": "x", "stream": "yes"}):
        with pytest.raises(BadRequestError):
            client_of(bad)


@pytest.mark.parametrize(("body", "message"), [
    ({"input_suffix": ""}, '"input_prefix" is required'),
    ({"input_prefix": "", "input_suffix": 3}, '"input_suffix" is required'),
    ({"input_prefix": "", "input_suffix": "", "prompt": 1}, '"prompt" must be a string'),
    ({"input_prefix": "", "input_suffix": "", "input_extra": {}}, '"input_extra" must be'),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a"}]},
     'must contain a "text" field'),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"text": "", "filename": 1}]},
     '"filename" field must be a string'),
])
def test_infill_bodies_are_checked_as_llama_server_checks_them(body: Json,
                                                               message: str) -> None:
    with pytest.raises(BadRequestError, match=message):
        client_of(body, "/infill")


def test_an_infill_body_passes() -> None:
    client = client_of({"input_prefix": "def f(", "input_suffix": ")\n", "prompt": "x",
                        "input_extra": [{"filename": "a.py", "text": "import os\n",
                                         "time": 3}], "id_slot": 1}, "/infill")
    assert (client.endpoint, client.path, client.api) == ("infill", "/infill", "llama")
    assert "id_slot" not in client.body


def test_prepare_asks_the_native_paths_for_progress_and_the_whole_final_event() -> None:
    """No ``stream_options`` on a native path (it has no usage chunk); ``response_fields``
    stays with the codec; ``return_progress`` and the proxy's slot go in."""
    adapter = LlamaServerAdapter(httpx.AsyncClient(base_url="http://engine"))
    body = {"prompt": "x", "response_fields": ["content"], "stream": False}
    call = adapter.prepare("/completion", body, slot=1)
    assert call.path == "/completion"
    assert call.body == {"prompt": "x", "stream": True, "return_progress": True, "id_slot": 1}
    openai = adapter.prepare("/v1/completions", body, slot=None)
    assert openai.body["stream_options"] == {"include_usage": True}
    assert openai.body["response_fields"] == ["content"]
    assert body == {"prompt": "x", "response_fields": ["content"], "stream": False}


# ------------------------------------------------------------------------ planning

def infill(extra: list[Json], prefix: str = "x = ", prompt: str = "1") -> Json:
    return {"input_prefix": prefix, "input_suffix": "\n", "prompt": prompt,
            "input_extra": extra}


def test_an_infill_request_is_planned_by_its_chunks() -> None:
    """The cursor moving (prefix, suffix, prompt) keeps the history; a chunk added at the
    end extends it; a chunk dropped from the front diverges."""
    a, b = {"filename": "a.py", "text": "A"}, {"filename": "b.py", "text": "B"}
    first = planned_body("/infill", infill([a]))
    committed = Committed.of_completion(first)
    moved = planned_body("/infill", infill([a], prefix="y = 2\nz = ", prompt="f("))
    assert decide(committed, moved).identical
    assert decide(committed, planned_body("/infill", infill([a, b]))).extends
    assert not decide(committed, planned_body("/infill", infill([b]))).resumable
    assert infill_identity(infill([])) == infill_identity({"input_prefix": "", "x": 1})
    # a completion prompt is never taken for an infill history, nor the reverse
    assert not decide(committed, {"prompt": "A"}).resumable
    assert not decide(Committed.of_completion({"prompt": "a.py"}), first).resumable
    body = {"prompt": "p"}
    assert planned_body("/completion", body) is body


# -------------------------------------------------------------- the pipeline, in process

class NativeFake(FakeLlamaServer):
    """The fake llama-server with the native routes: each request streams ``script`` (or,
    for /infill without FIM tokens, llama-server's 501)."""

    def __init__(self) -> None:
        super().__init__()
        self.native: list[tuple[str, Json]] = []
        self.script: list[Any] = PARIS
        self.delay_s = 0.0
        self.fim = True

    def app(self) -> Starlette:
        app = super().app()
        for path in ("/completion", "/completions", "/infill"):
            app.router.routes.append(Route(path, self._native, methods=["POST"]))
        return app

    async def _native(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.native.append((request.url.path, body))
        if request.url.path == "/infill" and not self.fim:
            return JSONResponse({"error": {
                "code": 501, "message": "Infill is not supported by this model",
                "type": "not_supported_error"}}, status_code=501)

        async def events() -> AsyncIterator[bytes]:
            for event in self.script:
                await asyncio.sleep(self.delay_s)
                yield event if isinstance(event, bytes) else sse(event)

        return StreamingResponse(events(), media_type="text/event-stream")


def data_events(text: str) -> list[Any]:
    return [json.loads(block.removeprefix("data: ")) for block in text.split("\n\n")
            if block.startswith("data: ")]


@pytest.mark.anyio
async def test_the_pipeline_serves_the_native_api() -> None:
    """Streamed: the engine's events as they came, after the proxy's opening comment; whole:
    the fold; the request as the engine got it; the figures in the metrics."""
    engine = NativeFake()
    async with running_proxy(engine) as (client, _):
        streamed = await client.post("/completion", json={"prompt": "The capital",
                                                          "stream": True, "n": 3})
        whole = await client.post("/completions", json={"prompt": "The capital"})
        metrics = (await client.admin.get("/metrics")).text
    assert streamed.status_code == whole.status_code == 200
    assert streamed.text.startswith(": prefixpin\n\n")
    assert data_events(streamed.text) == PARIS[2:]
    assert whole.headers["content-type"] == "application/json; charset=utf-8"
    assert whole.json() == fold(frames_of(PARIS), {})[0]
    (path, sent), (bare, _) = engine.native
    assert (path, bare) == ("/completion", "/completions")
    assert sent["stream"] is True
    assert sent["return_progress"] is True
    assert isinstance(sent["id_slot"], int)
    assert "n" not in sent
    assert "stream_options" not in sent
    assert 'prefixpin_requests_total{api="llama",endpoint="completions",outcome="ok"} 2.0' \
        in metrics
    assert 'prefixpin_cached_tokens_sum{source="measured",upstream="fake-llama"} 8.0' in metrics


@pytest.mark.anyio
async def test_a_late_engine_error_is_llama_servers_error_event() -> None:
    engine = NativeFake()
    engine.script = [PARIS[2], {"error": {"code": 500, "message": "boom",
                                          "type": "server_error"}}]
    async with running_proxy(engine) as (client, _):
        response = await client.post("/completion", json={"prompt": "x", "stream": True})
    *tokens, error = data_events(response.text)
    assert tokens == [PARIS[2]]
    assert set(error) == {"error"}
    assert error["error"]["code"] == "upstream_protocol_error"  # the proxy's reason
    assert "boom" in error["error"]["message"]


@pytest.mark.anyio
async def test_an_engine_refusal_of_infill_passes_as_it_came() -> None:
    engine = NativeFake()
    engine.fim = False
    async with running_proxy(engine, first_byte_ms=3000) as (client, _):
        for stream in (False, True):
            response = await client.post("/infill", json={**infill([]), "stream": stream})
            assert response.status_code == 501
            assert response.json()["error"]["type"] == "not_supported_error"


@pytest.mark.anyio
async def test_an_editors_infill_requests_stay_on_one_slot() -> None:
    """The cursor moves, the chunks stay: one session, one slot; the body the engine gets
    is the editor's own (its ``response_fields`` applied by the proxy)."""
    engine = NativeFake()
    chunk = {"filename": "util.py", "text": "def helper():\n    return 1\n"}
    fields = {"response_fields": ["content", "tokens_cached"]}
    async with running_proxy(engine) as (client, _):
        answers = [await client.post("/infill", json={**infill([chunk], prefix=p), **fields})
                   for p in ("a = ", "a = 1\nb = ", "a = 1\nb = 2\nc = ")]
        grown = await client.post("/infill", json={**infill([chunk, chunk]), **fields})
        view = (await client.admin.get("/sessions")).json()
    assert all(a.status_code == 200 for a in [*answers, grown])
    assert answers[0].json() == {"content": " Paris.\n", "tokens_cached": 7}
    slots = {body["id_slot"] for _, body in engine.native}
    assert len(slots) == 1
    sent = engine.native[1][1]
    assert sent["input_prefix"] == "a = 1\nb = "
    assert sent["prompt"] == "1"
    assert "response_fields" not in sent
    sessions = [s for group in view["namespaces"].values() for s in group]
    assert len(sessions) == 1, sessions


def test_figures_of_a_frame_without_data_are_none() -> None:
    assert figures_from([Frame(FrameKind.PING, b":\n\n")], None).prompt_tokens is None
