"""llama-server's native completion API through prefixpin, against the real llama-server:
``/completion``, bare ``/completions`` and ``/infill`` answer as llama-server itself does
(greedy, so the same text; timings and the slot aside), a prompt that extends the last one
is served from the slot's cache, and the proxy's metrics count it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import ProxyRunner
from tests.e2e.helpers import filler
from tests.rig.llama_process import LlamaServerProcess

pytestmark = pytest.mark.llama

Json = dict[str, Any]
GREEDY: Json = {"prompt": "The capital of France is", "n_predict": 8, "temperature": 0}
# What differs between two runs of one request: the clock, and the slot llama-server chose
# itself (the proxy pins its own).
RUN_FIELDS = ("timings", "id_slot")
BODIES = [
    pytest.param(GREEDY, id="plain"),
    pytest.param({**GREEDY, "stop": ["United"], "n_probs": 2}, id="stop-word-probs"),
    pytest.param({**GREEDY, "stop": ["The United"], "n_probs": 1, "return_tokens": True},
                 id="two-token-stop-word"),
    pytest.param({"prompt": "def f(x):\n    if x:\n", "n_predict": 40, "temperature": 0,
                  "n_indent": 8}, id="n-indent-cut"),
    pytest.param({**GREEDY, "prompt": ["Once upon", "Hello"], "n_predict": 3}, id="two-prompts"),
]


def without_run_fields(answer: Any) -> Any:
    if isinstance(answer, list):
        return [without_run_fields(item) for item in answer]
    return {k: v for k, v in answer.items() if k not in RUN_FIELDS}


def events(base: str, path: str, body: Json) -> tuple[httpx.Response, list[Json]]:
    """The data events of a streamed answer (comments and pings left out)."""
    out: list[Json] = []
    with httpx.stream("POST", f"{base}{path}", json={**body, "stream": True},
                      timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line.removeprefix("data: ")))
    return response, out


def cached_sum(admin: str) -> float:
    text = httpx.get(f"{admin}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("prefixpin_cached_tokens_sum{"))


@pytest.mark.parametrize("path", ["/completion", "/completions"])
@pytest.mark.parametrize("body", BODIES)
def test_a_whole_answer_is_llama_servers_own(llama: LlamaServerProcess,
                                             run_proxy: ProxyRunner, path: str,
                                             body: Json) -> None:
    """``stream: false`` (llama-server's default here): the proxy folds the engine's stream
    into the body llama-server answers itself, field by field: the text, the stop, the
    counts, the settings (``"stream": false``), the tokens and probabilities asked for, the
    ``n_indent`` cut; one object per prompt."""
    with run_proxy() as url:
        via = httpx.post(f"{url}{path}", json=body, timeout=120)
    direct = httpx.post(f"{llama.url}{path}", json=body, timeout=120)
    assert via.status_code == direct.status_code == 200, via.text
    assert via.headers["content-type"] == direct.headers["content-type"]
    mine, theirs = via.json(), direct.json()
    assert without_run_fields(mine) == without_run_fields(theirs)
    for answer in mine if isinstance(mine, list) else [mine]:
        assert answer["stop"] is True
        assert {"content", "stop_type", "tokens_predicted", "tokens_evaluated",
                "tokens_cached", "timings", "generation_settings"} <= set(answer)


def test_a_stream_is_llama_servers_own(llama: LlamaServerProcess,
                                       run_proxy: ProxyRunner) -> None:
    """``stream: true``: llama-server's events in order, ending with its ``"stop": true``
    event (no ``[DONE]``); no progress event unless the client asked, as direct."""
    with run_proxy() as url:
        via, mine = events(url, "/completion", GREEDY)
        asked, with_progress = events(url, "/completion", {**GREEDY, "return_progress": True})
    direct, theirs = events(llama.url, "/completion", GREEDY)
    assert via.status_code == asked.status_code == direct.status_code == 200
    assert via.headers["content-type"].startswith("text/event-stream")
    assert [without_run_fields(e) for e in mine] == [without_run_fields(e) for e in theirs]
    assert mine[-1]["stop"] is True
    assert mine[-1]["generation_settings"]["stream"] is True
    assert not any("prompt_progress" in e for e in mine)
    progress = [e for e in with_progress if "prompt_progress" in e]
    assert progress
    assert all(e["content"] == "" for e in progress)
    text = [e for e in with_progress if "prompt_progress" not in e]
    assert [without_run_fields(e) for e in text] == [without_run_fields(e) for e in theirs]


@pytest.mark.parametrize("stream", [False, True])
def test_response_fields_are_applied_as_llama_server_applies_them(
        llama: LlamaServerProcess, run_proxy: ProxyRunner, stream: bool) -> None:
    """llama.vim's ``response_fields``: the final answer holds those fields only, a path
    with ``/`` under its own name (the proxy reads the whole final event itself)."""
    fields = ["content", "stop_type", "tokens_cached", "generation_settings/n_predict",
              "timings/no-such-field"]
    body = {**GREEDY, "response_fields": fields}
    with run_proxy() as url:
        if stream:
            _, mine = events(url, "/completion", body)
        else:
            mine = [httpx.post(f"{url}/completion", json=body, timeout=120).json()]
    if stream:
        _, theirs = events(llama.url, "/completion", body)
    else:
        theirs = [httpx.post(f"{llama.url}/completion", json=body, timeout=120).json()]
    assert mine[-1] == theirs[-1]
    assert set(mine[-1]) == {"content", "stop_type", "tokens_cached",
                             "generation_settings/n_predict"}
    assert [without_run_fields(e) for e in mine] == [without_run_fields(e) for e in theirs]


@pytest.mark.parametrize("stream", [False, True])
def test_an_extended_prompt_is_served_from_the_slots_cache(
        run_proxy: ProxyRunner, erase_slots: Callable[[], None], stream: bool) -> None:
    """The second prompt extends the first: its session's slot holds the first, so the
    engine reuses it (``timings.cache_n``), and the proxy's metrics count those tokens."""
    prompt = filler(300)
    with run_proxy() as url:
        before = cached_sum(url.admin)
        first = final(url, {"prompt": prompt, "n_predict": 4, "temperature": 0}, stream)
        second = final(url, {"prompt": prompt + " and then some more words", "n_predict": 4,
                             "temperature": 0}, stream)
        after = cached_sum(url.admin)
    assert first["timings"]["cache_n"] == 0
    assert second["timings"]["cache_n"] >= first["tokens_evaluated"] - 2
    assert second["tokens_evaluated"] > first["tokens_evaluated"]
    assert second["tokens_cached"] >= first["tokens_evaluated"] - 2
    assert after - before == second["timings"]["cache_n"]


def final(url: str, body: Json, stream: bool) -> Json:
    if stream:
        response, out = events(url, "/completion", body)
        assert response.status_code == 200
        return out[-1]
    response = httpx.post(f"{url}/completion", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer: Json = response.json()
    return answer


@pytest.mark.parametrize("stream", [False, True])
def test_infill_is_llama_servers_answer(llama: LlamaServerProcess, run_proxy: ProxyRunner,
                                        stream: bool) -> None:
    """SmolLM2 has no fill-in-the-middle tokens: llama-server refuses ``/infill`` (501
    ``not_supported_error``) and the proxy passes that refusal on as it came; a body
    llama-server's checks refuse is refused with its message before anything is
    forwarded."""
    body = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n",
            "input_extra": [{"filename": "util.py", "text": "import math\n"}],
            "prompt": "a", "n_predict": 8, "temperature": 0, "stream": stream}
    with run_proxy(first_byte_ms=3000) as url:  # the refusal keeps its status, streamed too
        via = httpx.post(f"{url}/infill", json=body, timeout=120)
        bad = httpx.post(f"{url}/infill", json={"input_prefix": "x", "input_suffix": "",
                                                "input_extra": [{"filename": "a.py"}]},
                         timeout=60)
    direct = httpx.post(f"{llama.url}/infill", json=body, timeout=120)
    assert direct.status_code == 501, direct.text
    assert via.status_code == direct.status_code
    assert via.content == direct.content
    assert via.json()["error"]["type"] == "not_supported_error"
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == ("extra_context chunk must contain a \"text\" "
                                              "field with a string value")  # llama-server's
    assert bad.json()["error"]["type"] == "invalid_request_error"


def test_the_openai_completions_api_is_still_served(run_proxy: ProxyRunner) -> None:
    """``/v1/completions`` stays OpenAI's (``choices``, ``usage``); bare ``/completions`` is
    now llama-server's native API (``content``, ``stop``)."""
    with run_proxy() as url:
        openai = httpx.post(f"{url}/v1/completions", json={**GREEDY, "max_tokens": 4},
                            timeout=120)
        native = httpx.post(f"{url}/completions", json=GREEDY, timeout=120)
    assert openai.status_code == native.status_code == 200
    assert openai.json()["choices"][0]["text"]
    assert "cached_tokens" in openai.json()["usage"]["prompt_tokens_details"]
    assert native.json()["stop"] is True
    assert native.json()["content"]
    assert "choices" not in native.json()
