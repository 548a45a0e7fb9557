"""Three engine kinds behind one router, end to end: a real llama-server, the embedded
llama.cpp engine in process (``--upstream embedded``), and an Ollama lane. Ollama cannot be
installed on these machines: its lane is the fake Ollama (recorded wire formats,
``tests.fakes.fake_ollama``) on a loopback port. The proxy runs under a real uvicorn.

Each session stays on its lane, and every follow-up turn on a llama.cpp lane (the real
llama-server, the embedded engine) reuses all of its previous prompt, as the engine itself
counts it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.settings import Settings
from tests.e2e.helpers import filler
from tests.fakes.fake_ollama import create_fake_ollama
from tests.fakes.servers import serve_in_thread, serve_proxy
from tests.ollama.conftest import fake_config
from tests.rig.llama_process import LlamaServerProcess, run_llama_server
from tests.rig.models import ensure_model

pytestmark = [pytest.mark.llama, pytest.mark.embedded, pytest.mark.slow]


def chat(url: str, key: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    response = httpx.post(f"{url}/v1/chat/completions", headers={"x-session-id": key},
                          json={"model": "fake-smol", "messages": messages, "max_tokens": 6,
                                "temperature": 0}, timeout=300)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def wait_for_every_lane(admin: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        backends = httpx.get(f"{admin}/sessions", timeout=10).json()["backends"]
        if all(b["up"] for b in backends):
            return
        assert time.monotonic() < deadline, f"lanes not up within {timeout_s:.0f} s: {backends}"
        time.sleep(0.2)


def test_llama_server_embedded_and_ollama_lanes_behind_one_router(tmp_path: Path) -> None:
    with run_llama_server("smollm2", slots=1, ctx_per_slot=4096, threads=1) as llama, \
            serve_in_thread(create_fake_ollama(fake_config())) as ollama:
        _run(llama, ollama, tmp_path)


def _run(llama: LlamaServerProcess, ollama: str, tmp_path: Path) -> None:
    config = Settings(upstream=llama.url, upstreams=["embedded", ollama],
                      model=ensure_model("smollm2"), slots=1, ctx_size=4096, threads=1,
                      park_dir=tmp_path, health_interval_s=1)
    with serve_proxy(create_apps(config)) as url:
        # The proxy serves once its first lane answers; the others come up after (the
        # embedded engine loads its model): each session is placed among the lanes up then.
        wait_for_every_lane(url.admin)
        lanes: dict[str, str] = {}
        for s in range(3):
            key = f"session-{s}"
            history: list[dict[str, Any]] = [
                {"role": "system", "content": f"Session {s}. " + filler(120, seed=s)},
                {"role": "user", "content": "Name a colour."}]
            previous_prompt = 0
            for turn in range(3):
                reply = chat(url, key, history)
                usage = reply["usage"]
                view = httpx.get(f"{url.admin}/sessions", timeout=10).json()
                (session,) = [x for x in view["namespaces"]["anon"] if x["key"] == key]
                lane = lanes.setdefault(key, session["backend"])
                assert session["backend"] == lane, (key, turn, session)
                engine = {b["upstream"]: b["engine"] for b in view["backends"]}[lane]
                if turn and engine != "ollama":  # the fake Ollama counts no real cache
                    cached = usage["prompt_tokens_details"]["cached_tokens"]
                    assert cached >= previous_prompt, (key, turn, lane, usage)
                previous_prompt = usage["prompt_tokens"]
                history += [reply["choices"][0]["message"],
                            {"role": "user", "content": f"Another one, please ({turn})."}]
        engines = {b["upstream"]: b["engine"] for b in view["backends"]}
        print(f"\nsessions per lane: {lanes}; engines: {engines}")
        assert sorted(engines.values()) == ["embedded", "llama-server", "ollama"]
        assert len(set(lanes.values())) == 3, lanes  # one session per one-slot lane
