"""Drop-in means nothing lost: what a client gets through prefixpin is what llama-server
itself answers it, measured against the real llama-server.

Whole answers. The proxy always streams from the engine and folds the chunks into the
answer a non-streaming client asked for (``proxy.pipeline.aggregate``); that folded answer must
equal llama-server's own non-streamed answer to the same greedy request, field for field,
except (``EXCLUDED``):

- ``id``: llama-server draws a fresh id for every request;
- ``created``: the clock second the answer was made;
- ``timings`` (and ``__verbose.timings``): the measured durations of that run.

``system_fingerprint`` is compared (the same build on both sides). Both sides run with
nothing reused from cache (the direct request with ``cache_prompt: false``; each proxy
fresh, so its first request on a slot goes with ``cache_prompt: false``), so ``usage``
(cached tokens included) and every logprob are compared exactly too.

An engine started with ``--api-key``. prefixpin's own requests (probes, ``/healthz``, the
tokenizer and template, slot files, ``prefixpin doctor``) carry ``--engine-api-key``; a
client's requests carry the client's own credentials (``Authorization: Bearer`` or
``X-Api-Key``, as llama-server takes them), and a client without any gets llama-server's
401 as llama-server sends it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixpin.adapters.http import FORWARDED, EngineKey
from prefixpin.adapters.llama_server import LlamaServerAdapter
from prefixpin.adapters.ollama import detect_engine
from prefixpin.core.errors import UpstreamStatusError
from prefixpin.proxy.cli import build_parser, parse_upstream_line, settings_from_args
from prefixpin.proxy.engine.engines import http_client
from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.ops import doctor
from prefixpin.proxy.settings import Settings
from tests.e2e.conftest import ProxyRunner
from tests.fakes.servers import serve_proxy
from tests.rig.llama_process import LlamaServerProcess, run_llama_server

KEY = "prefixpin-dropin-key"
# llama-server's answer to a request without a valid key (tools/server/server-http.cpp).
INVALID_KEY = {"error": {"message": "Invalid API Key", "type": "authentication_error",
                         "code": 401}}
EXCLUDED = ("id", "created", "timings")

CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6,
        "temperature": 0}
COMPLETION = {"prompt": "The sky is", "max_tokens": 6, "temperature": 0}


# ---------------------------------------------------------------- without an engine

def own_request_headers(auth: EngineKey, method: str, url: str,
                        **options: Any) -> httpx.Headers:
    request = httpx.Request(method, url, **options)
    return next(auth.auth_flow(request)).headers


def test_the_engine_key_goes_on_the_proxys_own_requests_only() -> None:
    """Probes, tokenizer, template, slot files: the key. A generation (always a client's),
    a forwarded request, a request with its own credentials: as they are."""
    auth = EngineKey(KEY)
    for path in ("/health", "/props", "/metrics", "/v1/models", "/slots", "/slots/1",
                 "/tokenize", "/apply-template", "/api/version", "/api/ps"):
        assert own_request_headers(auth, "GET", f"http://e{path}")["authorization"] == \
            f"Bearer {KEY}", path
    for path in ("/v1/chat/completions", "/v1/completions", "/completion", "/api/chat"):
        assert "authorization" not in own_request_headers(auth, "POST", f"http://e{path}")
    forwarded = own_request_headers(auth, "GET", "http://e/props",
                                    extensions={FORWARDED: True})
    assert "authorization" not in forwarded
    theirs = own_request_headers(auth, "GET", "http://e/props", headers={"x-api-key": "c"})
    assert "authorization" not in theirs
    assert own_request_headers(auth, "GET", "http://e/props",
                               headers={"authorization": "Bearer c"})["authorization"] == \
        "Bearer c"
    prefixed = EngineKey(KEY, "/llama")
    assert "authorization" in own_request_headers(prefixed, "GET", "http://e/llama/props")
    assert "authorization" not in own_request_headers(prefixed, "GET", "http://e/props")


def test_an_upstreams_file_line_gives_its_engine_its_own_key(tmp_path: Path) -> None:
    """``URL api_key=KEY``: that engine's key, instead of ``--engine-api-key``; the key
    is never in the entry's repr."""
    entry = parse_upstream_line("http://a:8080 namespace=anon api_key=sekrit")
    assert (entry.url, entry.namespaces, entry.api_key) == ("http://a:8080", ("anon",),
                                                            "sekrit")
    assert "sekrit" not in repr(entry)
    listing = tmp_path / "upstreams"
    listing.write_text("http://a:8080 api_key=sekrit\nhttp://b:8080\n")
    args = build_parser().parse_args(["serve", "--upstreams-file", str(listing),
                                      "--engine-api-key", "common"])
    settings = settings_from_args(args)
    assert settings.engine_key_for("http://a:8080") == "sekrit"
    assert settings.engine_key_for("http://b:8080") == "common"
    assert "common" not in repr(settings)
    assert Settings(engine_api_key="").engine_key_for("http://b:8080") is None


def test_doctor_takes_the_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXPIN_ENGINE_API_KEY", "from-env")
    parser = argparse.ArgumentParser()
    doctor.add_arguments(parser)
    assert parser.parse_args([]).engine_api_key == "from-env"


# ---------------------------------------------------------------- an engine with --api-key

@pytest.fixture(scope="module")
def keyed() -> Iterator[LlamaServerProcess]:
    """llama-server with --api-key (and --cache-ram 0: every namespace is served, so a
    client without a key reaches the engine rather than the shared-cache gate)."""
    with run_llama_server("smollm2", slots=2, ctx_per_slot=2048,
                          extra=["--api-key", KEY, "--cache-ram", "0"]) as handle:
        yield handle


def healthz(url: str) -> httpx.Response:
    return httpx.get(f"{url}/healthz", timeout=60)


@pytest.mark.llama
def test_the_proxy_is_ready_behind_api_key_only_with_the_engine_key(
        keyed: LlamaServerProcess) -> None:
    """Without the key every probe is refused and /healthz stays 503, naming llama-server's
    answer; with it (``--engine-api-key``, or the URL's own ``api_key=``) it is ready."""
    with serve_proxy(create_apps(Settings(upstream=keyed.url))) as url:
        refused = healthz(url)
    assert refused.status_code == 503
    assert refused.json()["upstreams"][0]["error"] == "Invalid API Key"
    for settings in (Settings(upstream=keyed.url, engine_api_key=KEY),
                     Settings(upstream=keyed.url, upstream_api_keys={keyed.url: KEY})):
        with serve_proxy(create_apps(settings)) as url:
            ready = healthz(url)
        assert ready.status_code == 200, ready.text
        assert ready.json()["upstreams"][0]["slots"] == 2


@pytest.mark.llama
@pytest.mark.anyio
async def test_every_request_the_proxy_makes_itself_carries_the_key(
        keyed: LlamaServerProcess) -> None:
    """Probe (/props, /v1/models, /metrics, the slot-file probe), detection, tokenizer,
    template, /slots and slot save, restore and erase, through the client prefixpin builds
    for the engine; the same client without the key is refused."""
    settings = Settings(upstream=keyed.url, engine_api_key=KEY)
    adapter = LlamaServerAdapter(http_client(settings, keyed.url, None))
    try:
        assert await detect_engine(adapter.http) == "llama-server"
        info = await adapter.probe()
        assert (info.n_slots, info.slot_save_path) == (2, True)
        assert info.start_time is not None  # from /metrics
        assert await adapter.tokenize("hello there", add_special=False)
        prompt = await adapter.apply_template({"messages": [{"role": "user",
                                                             "content": "hello"}]})
        assert "hello" in prompt
        assert len(await adapter.list_slots()) == 2
        warm = await adapter.http.post("/v1/completions", json={
            "prompt": "The sky is", "max_tokens": 1, "id_slot": 0},
            headers={"authorization": f"Bearer {KEY}"})
        assert warm.status_code == 200, warm.text
        saved = await adapter.save_slot(0, "prefixpin-dropin.bin")
        assert saved.n_tokens > 0
        restored = await adapter.restore_slot(1, "prefixpin-dropin.bin")
        assert restored.n_tokens == saved.n_tokens
        await adapter.erase_slot(1)
    finally:
        await adapter.aclose()
    bare = LlamaServerAdapter(http_client(Settings(upstream=keyed.url), keyed.url, None))
    try:
        with pytest.raises(UpstreamStatusError) as refused:
            await bare.probe()
        assert refused.value.status_code == 401
    finally:
        await bare.aclose()


@pytest.mark.llama
def test_doctor_reads_a_server_with_api_key(keyed: LlamaServerProcess) -> None:
    report = doctor.run(keyed.url, probe=False, local=False, api_key=KEY)
    assert report.reachable, report.error
    assert report.server
    refused = doctor.run(keyed.url, probe=False, local=False)
    assert not refused.reachable
    assert "401" in refused.error
    assert "--engine-api-key" in refused.error


def post(url: str, path: str, body: dict[str, Any],
         headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=120)


@pytest.mark.llama
def test_clients_bring_their_own_key(keyed: LlamaServerProcess) -> None:
    """``X-Api-Key`` and ``Authorization: Bearer`` both reach llama-server; no key, or a
    wrong one, gets llama-server's own 401 (status, body), streamed or not, on the
    pipeline's routes and the tenant pass-through alike: the engine key prefixpin holds
    never stands in for a client's."""
    # A first byte long enough that the engine's 401 always keeps its status for a
    # streaming client (an error after the headers would be an error event instead).
    settings = Settings(upstream=keyed.url, engine_api_key=KEY, first_byte_ms=10_000)
    path = "/v1/chat/completions"
    with serve_proxy(create_apps(settings)) as url:
        anthropic_style = post(url, path, CHAT, {"x-api-key": KEY})
        openai_style = post(url, path, CHAT, {"authorization": f"Bearer {KEY}"})
        completion = post(url, "/v1/completions", COMPLETION, {"x-api-key": KEY})
        none = post(url, path, CHAT)
        wrong = post(url, path, CHAT, {"x-api-key": "not-the-key"})
        none_streamed = post(url, path, {**CHAT, "stream": True})
        none_completion = post(url, "/v1/completions", COMPLETION)
        props = httpx.get(f"{url}/props", headers={"x-api-key": KEY}, timeout=30)
        props_none = httpx.get(f"{url}/props", timeout=30)
    direct = post(keyed.url, path, CHAT)
    assert direct.status_code == 401
    assert direct.json() == INVALID_KEY
    for answer in (anthropic_style, openai_style, completion):
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] > 0
    for refused in (none, wrong, none_streamed, none_completion, props_none):
        assert refused.status_code == 401, refused.text
        assert refused.headers["content-type"].startswith("application/json")
        assert refused.json() == INVALID_KEY
    assert props.status_code == 200
    assert props.json()["total_slots"] == 2


@pytest.mark.llama
def test_the_operator_listener_reaches_a_keyed_engine_with_the_engine_key(
        keyed: LlamaServerProcess) -> None:
    """The operator is trusted with the engine: its forwards (/slots here) carry the engine
    key when they bring no credentials; the tenant port never lends it (a keyless /props
    there is the engine's 401)."""
    with serve_proxy(create_apps(Settings(upstream=keyed.url, engine_api_key=KEY))) as url:
        slots = httpx.get(f"{url.admin}/slots", timeout=30)
        tenant = httpx.get(f"{url}/props", timeout=30)
    assert slots.status_code == 200, slots.text
    assert len(slots.json()) == 2
    assert tenant.status_code == 401


# ---------------------------------------------------------------- whole answers

def comparable(body: dict[str, Any]) -> dict[str, Any]:
    kept = {k: v for k, v in body.items() if k not in EXCLUDED}
    if isinstance(kept.get("__verbose"), dict):
        kept["__verbose"] = {k: v for k, v in kept["__verbose"].items() if k != "timings"}
    return kept


def both(run_proxy: ProxyRunner, llama: LlamaServerProcess, path: str,
         body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same non-streamed request through a fresh proxy and to llama-server directly,
    nothing reused from cache on either side; on the proxy's slot when the answer says
    which (``__verbose.id_slot``)."""
    with run_proxy() as url:
        proxied = post(url, path, body)
    assert proxied.status_code == 200, proxied.text
    answer = proxied.json()
    pinned = (answer.get("__verbose") or {}).get("id_slot")
    direct_body = {**body, "cache_prompt": False,
                   **({"id_slot": pinned} if pinned is not None else {})}
    direct = post(llama.url, path, direct_body)
    assert direct.status_code == 200, direct.text
    return answer, direct.json()


CASES = {
    "chat": ("/v1/chat/completions", CHAT),
    "chat-logprobs": ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}),
    "chat-logprobs-verbose": ("/v1/chat/completions",
                              {**CHAT, "logprobs": True, "top_logprobs": 2, "verbose": True}),
    "completions-logprobs": ("/v1/completions", {**COMPLETION, "logprobs": 2}),
    "completions-logprobs-verbose": ("/v1/completions",
                                     {**COMPLETION, "logprobs": 2, "verbose": True}),
}


@pytest.mark.llama
@pytest.mark.parametrize("case", list(CASES))
def test_a_whole_answer_is_llama_servers_own(run_proxy: ProxyRunner, llama: LlamaServerProcess,
                                             case: str) -> None:
    """Every field of llama-server's non-streamed answer, with its value, but ``EXCLUDED``:
    logprobs of every token (chat and completions), ``__verbose`` with the whole text
    and ``completion_probabilities``, ``system_fingerprint``, ``usage``."""
    path, body = CASES[case]
    proxied, direct = both(run_proxy, llama, path, body)
    assert direct["choices"][0]["finish_reason"] == "length"  # max_tokens, not a stop
    if "logprobs" in body:
        assert len(direct["choices"][0]["logprobs"]["content"]) == body["max_tokens"]
    if "verbose" in body:
        assert direct["__verbose"]["content"]
    assert json.dumps(comparable(proxied), sort_keys=True, indent=1) == json.dumps(
        comparable(direct), sort_keys=True, indent=1)


@pytest.mark.llama
def test_what_a_chat_stream_does_not_carry(run_proxy: ProxyRunner,
                                           llama: LlamaServerProcess) -> None:
    """A documented loss (``proxy.pipeline.aggregate``): a chat answer that ends with the
    end-of-generation token lists that token's logprobs last; llama-server streams no delta
    for it, so it has no logprobs in the stream, and the folded answer lacks that one
    entry. Everything else is equal."""
    body = {"messages": [{"role": "user", "content": "Reply with one word: yes"}],
            "max_tokens": 40, "temperature": 0, "logprobs": True, "top_logprobs": 1}
    proxied, direct = both(run_proxy, llama, "/v1/chat/completions", body)
    assert direct["choices"][0]["finish_reason"] == "stop"
    streamed = proxied["choices"][0].pop("logprobs")["content"]
    whole = direct["choices"][0].pop("logprobs")["content"]
    assert streamed == whole[:-1]
    assert whole[-1]["token"] == ""  # the end-of-generation token, rendered as nothing
    assert comparable(proxied) == comparable(direct)


@pytest.mark.llama
def test_what_a_completions_stream_cannot_tell(run_proxy: ProxyRunner,
                                               llama: LlamaServerProcess) -> None:
    """The other documented difference (``proxy.pipeline.aggregate``): a completion ended by a stop
    string. llama-server's direct answer leaves out the logprobs of the stop string's
    tokens (it tokenizes the stop string and drops that many); the stream sends them (with
    empty text and token), and does not say a stop string ended it, so the folded answer keeps them.
    Everything else is equal."""
    body = {"prompt": "1, 2, 3, 4,", "max_tokens": 12, "temperature": 0, "logprobs": 1,
            "stop": [" 7"]}
    proxied, direct = both(run_proxy, llama, "/v1/completions", body)
    assert direct["choices"][0]["finish_reason"] == "stop"
    streamed = proxied["choices"][0].pop("logprobs")["content"]
    whole = direct["choices"][0].pop("logprobs")["content"]
    held = streamed[len(whole):]
    assert streamed[:len(whole)] == whole
    stop_tokens = post(llama.url, "/tokenize", {"content": " 7"}).json()["tokens"]
    assert [entry["id"] for entry in held] == stop_tokens  # the stop string's tokens
    assert {entry["token"] for entry in held} == {""}  # held back: no text sent
    assert comparable(proxied) == comparable(direct)


EMPTY = {
    "chat": ("/v1/chat/completions", {"messages": [], "max_tokens": 4, "temperature": 0}),
    "anthropic": ("/v1/messages", {"model": "smol", "messages": [], "max_tokens": 4,
                                   "temperature": 0}),
}


def answer_text(body: dict[str, Any]) -> str:
    if "choices" in body:
        return str(body["choices"][0]["message"]["content"])
    return "".join(block.get("text", "") for block in body["content"])


@pytest.mark.llama
@pytest.mark.parametrize("case", list(EMPTY))
def test_an_empty_message_list_is_answered_as_llama_server_answers_it(
        run_proxy: ProxyRunner, llama: LlamaServerProcess, case: str) -> None:
    """llama-server generates from an empty conversation (its template's empty prompt, as
    llama.cpp's own test_anthropic_empty_messages pins): so does the proxy in front of it."""
    path, body = EMPTY[case]
    with run_proxy() as url:
        proxied = post(url, path, body)
    direct = post(llama.url, path, {**body, "cache_prompt": False})
    assert direct.status_code == 200, direct.text
    assert proxied.status_code == 200, proxied.text
    assert answer_text(proxied.json()) == answer_text(direct.json())
