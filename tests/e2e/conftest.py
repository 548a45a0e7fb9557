"""End-to-end fixtures: a real llama-server (built by the rig) and the proxy under a real
uvicorn in front of it. SmolLM2-135M keeps prompts cheap (~200 tok/s cold on 2 cores)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import httpx
import pytest

from prefixpin.proxy.listen.app import create_apps
from prefixpin.proxy.settings import Settings
from tests.fakes.servers import ServedURL, serve_proxy
from tests.rig.llama_process import LlamaServerProcess, run_llama_server


@pytest.fixture(scope="session")
def llama() -> Iterator[LlamaServerProcess]:
    """llama-server, 2 slots of 8k, --slot-save-path and --metrics, shared by the session."""
    with run_llama_server("smollm2", slots=2, ctx_per_slot=8192) as handle:
        yield handle


@pytest.fixture
def erase_slots(llama: LlamaServerProcess) -> Callable[[], None]:
    def erase() -> None:
        for slot in range(2):
            httpx.post(f"{llama.url}/slots/{slot}", params={"action": "erase"}, json={},
                       timeout=30).raise_for_status()
    erase()
    return erase


ProxyRunner = Callable[..., AbstractContextManager[ServedURL]]


@pytest.fixture
def run_proxy(llama: LlamaServerProcess) -> ProxyRunner:
    """Start the proxy (real uvicorn, free port) in front of the session's llama-server."""

    @contextmanager
    def run(**settings: Any) -> Iterator[ServedURL]:
        config = Settings(upstream=settings.pop("upstream", llama.url), **settings)
        with serve_proxy(create_apps(config)) as url:
            yield url

    return run
