"""Fixtures: the rig models' real tokenizers, and a real llama-server for parity checks."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from prefixpin.fingerprint.tokenizer import ModelTokenizer, load_tokenizer
from tests.fakes.servers import free_port
from tests.rig.llama_build import ensure_llama_server
from tests.rig.models import ensure_model

RIG_MODELS = ("smollm2", "gemma3")

_loaded: dict[str, ModelTokenizer] = {}


def rig_tokenizer(name: str) -> ModelTokenizer:
    """The tokenizer built from the rig model's GGUF, loaded once per test session."""
    if name not in _loaded:
        _loaded[name] = load_tokenizer(ensure_model(name, quiet=True))
    return _loaded[name]


@pytest.fixture(scope="session", params=RIG_MODELS)
def model_name(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture(scope="session")
def tokenizer(model_name: str) -> ModelTokenizer:
    return rig_tokenizer(model_name)


@pytest.fixture(scope="session")
def smollm() -> ModelTokenizer:
    return rig_tokenizer("smollm2")


@pytest.fixture(scope="session")
def llama_server(model_name: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real llama-server serving the rig model on a free loopback port."""
    log = tmp_path_factory.mktemp("llama-server") / f"{model_name}.log"
    port = free_port()
    model = ensure_model(model_name, quiet=True)
    command = [str(ensure_llama_server(quiet=True)), "-m", str(model), "--host", "127.0.0.1",
               "--port", str(port), "-c", "2048", "-np", "1", "-t", "2"]
    with log.open("wb") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(server, url, log)
            yield url
        finally:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _wait_healthy(server: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"llama-server exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    pytest.fail(f"llama-server not healthy after 180 s:\n{log.read_text()[-3000:]}")
